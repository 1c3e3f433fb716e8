"""The method registry (tunepack.runtimes.methods): the one place a method's facts live."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from tests import REPO
from tunepack.core.errors import BadValueError, ConflictError
from tunepack.initializers.data.schemas import SCHEMAS
from tunepack.runtimes import args as vocab
from tunepack.runtimes import catalog, methods

SOURCE_DIRS = ("sdk_ext", "trainers", "runtimes", "initializers", "benchmarks")
REGISTRY = REPO / "runtimes" / "methods.py"
# A benchmark's choice of workload, not a method's behaviour: gpu_check runs its extra systems
# (compile, plain loss) on the LoRA workload only, to spend fewer device minutes.
ALLOWED = {("benchmarks/gpu_check.py", 'method == "lora"')}


def _names_method(node: ast.AST) -> bool:
    return (isinstance(node, ast.Name) and node.id == "method") or (
        isinstance(node, ast.Attribute) and node.attr == "method"
    )


def _is_literal(node: ast.AST) -> bool:
    if isinstance(node, ast.Constant):
        return isinstance(node.value, str)
    if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
        return bool(node.elts) and all(_is_literal(e) for e in node.elts)
    return False


def method_comparisons(path: Path) -> list[str]:
    """``method == "..."``-like comparisons (==, !=, in, not in a literal) in a source file."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Compare):
            sides = [node.left, *node.comparators]
            if any(map(_names_method, sides)) and any(map(_is_literal, sides)):
                found.append(ast.get_source_segment(path.read_text(), node))
    return found


def test_no_method_is_compared_by_name_outside_the_registry():
    found = {
        (str(path.relative_to(REPO)), segment)
        for directory in SOURCE_DIRS
        for path in sorted((REPO / directory).rglob("*.py"))
        if path != REGISTRY
        for segment in method_comparisons(path)
    }
    assert found - ALLOWED == set()


def test_the_comparison_finder_finds_what_it_looks_for(tmp_path):
    sample = tmp_path / "sample.py"
    sample.write_text(
        'if cfg.method == "dpo" or method in ("lora", "qlora") or args.method != "full":\n'
        "    pass\n"
        'if entry.methods and name == "dpo" or method is None:\n'
        "    pass\n"
    )
    assert method_comparisons(sample) == [
        'cfg.method == "dpo"',
        'method in ("lora", "qlora")',
        'args.method != "full"',
    ]


def test_every_dataset_schema_is_of_exactly_one_kind_of_data():
    kinds = {schema: [d.name for d in methods.DATA if schema in d.schemas] for schema in SCHEMAS}
    assert {schema: len(names) for schema, names in kinds.items()} == dict.fromkeys(SCHEMAS, 1)
    assert {s for d in methods.DATA for s in d.schemas} == set(SCHEMAS)


def test_every_kind_of_data_is_learned_by_some_method():
    assert {m.data.name for m in methods.METHODS.values()} == {d.name for d in methods.DATA}


def test_the_vocabulary_offers_the_registrys_methods_and_keys():
    method_arg = next(a for a in vocab.VOCABULARY if a.name == "method")
    assert method_arg.rule.choices == methods.NAMES
    assert method_arg.default == methods.DEFAULT
    keys = {a.name for a in vocab.VOCABULARY}
    for m in methods.METHODS.values():
        assert set(m.keys) <= keys, m.name
        assert set(m.owns) <= keys, m.name


def test_an_unknown_method_names_the_known_ones():
    with pytest.raises(BadValueError) as err:
        methods.get("sft")
    assert str(err.value) == (
        "method='sft' is not valid: expected one of lora, qlora, dora, full, dpo, orpo, kto, "
        "grpo, grpo_full"
    )


def test_a_catalog_model_offers_each_method_its_builders_build():
    entry = catalog.get("llama3.2-1b")
    assert entry.methods == (
        "full", "grpo_full", "lora", "qlora", "dora", "dpo", "orpo", "kto", "grpo",
    )  # fmt: skip
    built = {vocab.builder_for(entry, methods.get(m)) for m in entry.methods}
    assert built == set(entry.builders.values())
    # A model NF4 cannot quantize offers every LoRA method but qlora, and says why not.
    tiny = catalog.get("tiny-llama3")
    assert "qlora" not in tiny.methods and "dora" in tiny.methods
    assert "method=qlora cannot quantize tiny-llama3" in vocab.unavailable_method_message(
        tiny, "qlora"
    )


def test_a_method_only_key_is_refused_with_another_method_naming_its_owner():
    entry = catalog.get("llama3.2-1b")
    with pytest.raises(ConflictError) as err:
        vocab.parse_trainer_args(["method=lora", "beta=0.2"], entry)
    assert (
        str(err.value)
        == "beta=0.2: only method=dpo, orpo, kto, grpo or grpo_full uses beta, but method=lora"
    )


def test_wrong_data_says_which_method_learns_from_it():
    lora, dpo = methods.get("lora"), methods.get("dpo")
    assert methods.wrong_data_message(lora, "preference") == (
        "the dataset is a preference dataset (chosen/rejected pairs), which method=lora cannot "
        "learn from: use method=dpo or method=orpo"
    )
    assert methods.wrong_data_message(dpo, "unpaired") == (
        "method=dpo needs a preference dataset (rows with 'prompt', 'chosen' and 'rejected'), "
        "but the dataset's schema is 'unpaired'"
    )
    assert methods.wrong_data_message(lora, "unpaired") == (
        "the dataset is an unpaired dataset (answers labelled desirable or undesirable), which "
        "method=lora cannot learn from: use method=kto"
    )
    assert methods.wrong_data_message(dpo, "chat") == (
        "method=dpo needs a preference dataset (rows with 'prompt', 'chosen' and 'rejected'), "
        "but the dataset's schema is 'chat'"
    )
