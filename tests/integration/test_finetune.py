"""FineTune is a real dataclass whose field declarations are written from the vocabulary.

``python -m tunepack.finetune --write`` writes them (and the docstring that lists them) into
sdk_ext/finetune.py, so a static tool (an IDE, a type checker) reads every field from the source;
these tests fail while that block is stale, and ask jedi (a static analyser: it reads files, it
imports nothing) what it completes and which signature it reads.
"""

from __future__ import annotations

import dataclasses
import inspect
import pydoc
import subprocess
import sys
from pathlib import Path

import jedi
import pytest

from tunepack import finetune
from tunepack.core.errors import BadValueError, UnknownKeyError
from tunepack.finetune import FineTune
from tunepack.runtimes.args import VOCABULARY
from tunepack.runtimes.args_docs import replace_block

SOURCE = Path(finetune.__file__)


def test_the_generated_fields_are_current():
    source = SOURCE.read_text()
    assert replace_block(source, finetune.COMMAND, finetune.generated_lines()) == source, (
        "sdk_ext/finetune.py's FineTune fields are stale: run python -m tunepack.finetune --write"
    )


def test_the_command_rewrites_a_stale_block(tmp_path):
    stale = SOURCE.read_text().replace("    lora_rank: int | None = None\n", "", 1)
    copy = tmp_path / "finetune.py"
    copy.write_text(stale)
    # The command rewrites the file it runs from: run the copy as the module's __main__.
    done = subprocess.run(
        [sys.executable, str(copy), "--write"], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout == f"{copy}: rewritten\n"
    assert copy.read_text() == SOURCE.read_text()


def _complete(code: str, path: Path) -> tuple[list[str], list[str]]:
    lines = code.splitlines()
    script = jedi.Script(code, path=path, environment=jedi.InterpreterEnvironment())
    at = (len(lines), len(lines[-1]))
    params = [p.name for s in script.get_signatures(*at) for p in s.params]
    return [c.name for c in script.complete(*at)], params


@pytest.mark.parametrize("how", ["source", "import"])
def test_a_static_tool_reads_the_fields(how, tmp_path):
    if how == "source":  # the class as the file declares it
        code = SOURCE.read_text() + "\nFineTune(lora_r"
    else:  # as a notebook imports it
        code = "from tunepack.finetune import FineTune\nFineTune(lora_r"
    completions, params = _complete(code, tmp_path / "notebook.py")
    assert completions == ["lora_rank="]
    assert params == [f.name for f in dataclasses.fields(FineTune)]


def test_help_and_signature_list_every_field():
    names = [f.name for f in dataclasses.fields(FineTune)]
    assert list(inspect.signature(FineTune).parameters) == names
    assert all(p.kind is p.KEYWORD_ONLY for p in inspect.signature(FineTune).parameters.values())
    text = pydoc.render_doc(FineTune, renderer=pydoc.plaintext)
    for arg in VOCABULARY:
        assert f"{arg.name} (" in text
    for name in finetune.PLACEMENT_FIELDS + finetune.EXPORT_FIELDS:
        assert f"{name} (" in text
    assert "lora_rank (int): LoRA rank r (default: catalog)" in text


def test_every_field_defaults_to_none_and_is_frozen():
    trainer = FineTune()
    assert all(getattr(trainer, f.name) is None for f in dataclasses.fields(FineTune))
    assert trainer.to_args() == []
    with pytest.raises(dataclasses.FrozenInstanceError):
        trainer.epochs = 2  # type: ignore[misc]
    with pytest.raises(TypeError, match="takes 1 positional argument"):
        FineTune("lora")  # type: ignore[misc]


@pytest.mark.parametrize(
    ("values", "message"),
    [
        ({"learning_rate": 1e-4}, "FineTune has no field 'learning_rate'; did you mean 'lr'?"),
        (
            {"num_train_epochs": 2},
            "FineTune has no field 'num_train_epochs'; did you mean 'epochs'?",
        ),
        ({"lora_r": 8}, "FineTune has no field 'lora_r'; did you mean 'lora_rank'?"),
        ({"use_dora": True}, "FineTune has no field 'use_dora'; did you mean method='dora'?"),
    ],
)
def test_names_from_other_tools_are_answered_with_the_field(values, message):
    with pytest.raises(UnknownKeyError) as err:
        FineTune(**values)
    assert str(err.value) == message


def test_an_unknown_name_is_refused_before_any_value_is_checked():
    with pytest.raises(UnknownKeyError) as err:
        FineTune(lora_rnk=8, epochs=0)
    assert str(err.value).startswith("FineTune has no field 'lora_rnk': its fields are")
    assert "did you mean 'lora_rank'" in str(err.value)
    # dataclasses.replace goes through the same __init__: its values are checked too.
    with pytest.raises(BadValueError) as err:
        dataclasses.replace(FineTune(epochs=2), epochs=0)
    assert str(err.value) == (
        "FineTune.epochs: epochs='0' is not valid: expected an integer from 1 to 1000"
    )
