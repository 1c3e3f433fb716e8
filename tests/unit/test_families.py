"""The model families' one record (runtimes/families.py) and the checklist of
docs/architecture.md, "A new family", held true."""

from __future__ import annotations

import ast
import dataclasses
import importlib
import inspect

import pytest

from tests import REPO
from tests.helpers import checklist
from tunepack.runtimes import catalog, custom, families
from tunepack.runtimes.chat_templates import GROUPS, TEMPLATES
from tunepack.runtimes.families import FAMILIES, PEFT_LAYOUTS, peft_layout
from tunepack.runtimes.shape import DecoderDims
from tunepack.tiny import hf as tiny_hf
from tunepack.tiny import model as tiny_model
from tunepack.trainers.data import prompt_format

FAMILY = sorted(FAMILIES)
SOURCE_ROOTS = ("sdk_ext", "runtimes", "initializers", "trainers")
# tunepack's own builders live in the trainer's models room, one module per family.
OWN_BUILDERS = "tunepack.trainers.models."
# Imported when the module is collected (torchtune's first import looks up libraries in a
# process, which a unit test may not start).
MODULES = {
    path.rsplit(".", 1)[0]: importlib.import_module(path.rsplit(".", 1)[0])
    for family in FAMILIES.values()
    for path in family.component_builders.values()
}


def test_the_catalog_reads_the_one_record():
    assert catalog.FAMILIES is FAMILIES
    assert catalog.Family is families.Family and catalog.Tokenizer is families.Tokenizer
    assert all(e.family is FAMILIES[e.family.name] for e in catalog.CATALOG.values())


@pytest.mark.parametrize("name", FAMILY)
def test_every_familys_chat_format_is_a_template_and_a_renderer(name):
    fmt = FAMILIES[name].chat_format
    assert fmt in TEMPLATES and fmt in prompt_format.FORMATS
    assert any(fmt in group for group in GROUPS)
    assert prompt_format.check_chat_template(name, None) == fmt


@pytest.mark.parametrize("name", FAMILY)
def test_every_familys_peft_layout_is_one_its_model_type_shares(name):
    family = FAMILIES[name]
    assert family.peft_layout in PEFT_LAYOUTS
    assert peft_layout(family.checkpoint_model_type) == family.peft_layout


def test_every_peft_layout_is_used():
    assert {f.peft_layout for f in FAMILIES.values()} == set(PEFT_LAYOUTS)


@pytest.mark.parametrize("name", FAMILY)
def test_every_familys_builders_import_and_a_modules_own_come_from_its_shape_record(name):
    family = FAMILIES[name]
    for method, path in family.component_builders.items():
        module_name, function = path.rsplit(".", 1)
        module = MODULES[module_name]
        builder = getattr(module, function)
        if not module_name.startswith(OWN_BUILDERS):
            continue
        assert (REPO / "trainers" / "models" / f"{module_name.rsplit('.', 1)[1]}.py").is_file()
        shapes = [
            v for v in vars(module).values()
            if dataclasses.is_dataclass(v) and v.__module__ == module_name
        ]  # fmt: skip
        assert len(shapes) == 1, f"{module_name} should declare one shape record"
        assert issubclass(shapes[0], DecoderDims)
        fields = [f.name for f in dataclasses.fields(shapes[0])]
        parameters = inspect.signature(builder).parameters.values()
        keywords = [p.name for p in parameters if p.kind is p.KEYWORD_ONLY]
        # The full builder takes the shape (and, for Llama 3.2 Vision, torchtune's trainable
        # flags); the LoRA builder the shape and then its settings, or passes them on to it.
        if method == "lora" and any(p.kind is p.VAR_KEYWORD for p in parameters):
            assert "shape_keywords(" in inspect.getsource(builder), path
            continue
        assert keywords[: len(fields)] == fields, f"{path} does not take {shapes[0].__name__}"
        if method == "full" and not family.reads_images:
            assert keywords == fields


@pytest.mark.parametrize("name", FAMILY)
def test_every_family_has_a_tiny_variant_and_a_tiny_format(name):
    assert name in catalog.TINY or name in catalog.TINY_VISION
    family = FAMILIES[name]
    if family.reads_images:  # transformers writes it (tunepack.tiny.mllama)
        assert family.tiny_tokenizer is None
        return
    assert family.tiny_tokenizer in tiny_model.TOKENIZERS
    assert family.hf_model_type in tiny_hf.FORMATS
    assert tiny_model.FORMATS[name] == tiny_model.family_format(family)


def test_every_custom_architecture_names_a_family_and_reads_its_model_type_there():
    for arch in custom.ARCHITECTURES.values():
        assert arch.family in FAMILIES
        assert arch.model_type == FAMILIES[arch.family].hf_model_type
        assert "model_type" not in {f.name for f in dataclasses.fields(arch)}


def family_tables(source: str) -> list[str]:
    """Names (or line numbers) of the dict literals in ``source`` keyed by families: three keys
    or more that are family names, one of them neither a chat format's name nor a Hugging Face
    ``model_type`` (the tables of formats, TEMPLATES and the like, share names with families)."""
    names = set(FAMILIES)
    formats = set(TEMPLATES) | {f.hf_model_type for f in FAMILIES.values()}
    found = []
    tree = ast.parse(source)
    for node in ast.walk(tree):
        value = node.value if isinstance(node, (ast.Assign, ast.AnnAssign)) else None
        if not isinstance(value, ast.Dict):
            continue
        keys = {k.value for k in value.keys if isinstance(k, ast.Constant)}
        if len(keys & names) >= 3 and (keys & names) - formats:
            target = node.targets[0] if isinstance(node, ast.Assign) else node.target
            found.append(target.id if isinstance(target, ast.Name) else str(node.lineno))
    return found


def test_the_family_table_finder_finds_one():
    before = 'FAMILY_FORMAT: dict = {"llama2": "llama2", "code_llama2": "llama2", "qwen3": "x"}'
    assert family_tables(before) == ["FAMILY_FORMAT"]
    assert family_tables('TEMPLATES = {"llama2": 1, "gemma": 2, "qwen3": 3}') == []
    assert family_tables('FORMATS = {"gemma2": 1, "qwen3_moe": 2, "qwen2": 3}') == []  # HF's


def test_no_other_module_keeps_a_table_keyed_by_families():
    found = set()
    for root in SOURCE_ROOTS:
        for path in sorted((REPO / root).rglob("*.py")):
            relative = path.relative_to(REPO).as_posix()
            if relative == "runtimes/families.py":
                continue
            found |= {(relative, n) for n in family_tables(path.read_text(encoding="utf-8"))}
    assert found == set()


def test_the_checklist_names_files_that_exist():
    _, paths = checklist("A new family")
    named = {p for p in paths if "<" not in p}
    assert {
        "runtimes/families.py",
        "runtimes/chat_templates.py",
        "trainers/data/prompt_format.py",
        "trainers/outputs/peft_export.py",
        "trainers/models/decoder_parts.py",
        "runtimes/catalog.py",
        "sdk_ext/tiny/model.py",
        "sdk_ext/tiny/hf.py",
        "runtimes/custom.py",
        "tests/unit/test_families.py",
    } <= named
    assert [p for p in sorted(named) if not (REPO / p).is_file()] == []
    assert "trainers/models/<family>.py" in paths


def test_the_checklist_names_every_field_of_the_record_a_family_chooses():
    text, _ = checklist("A new family")
    chosen = (
        "chat_format",
        "peft_layout",
        "tiny_tokenizer",
        "options",
        "no_packing",
        "only_methods",
    )
    assert [f for f in chosen if f"`{f}`" not in text] == []
    assert "`PEFT_LAYOUTS`" in text
