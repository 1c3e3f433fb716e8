"""``make generate`` runs every generator of the repository, so a new one cannot be forgotten.

A generator is a module of the package (the source roots of setup.py's ``ROOTS``) whose source
has a ``"--check"`` string: its command line's mode that exits 1 while what it writes is stale.
The Makefile's ``generate`` recipe must run each of them once and nothing else, each one's
``--check`` must pass on this checkout, and every module that the tests' "is stale" messages tell
a contributor to run must be one of them (so a file checked by a test has a generator here).
"""

from __future__ import annotations

import ast
import importlib
import re
from pathlib import Path

import pytest

from tests import REPO

# import package -> source root, as setup.py maps them
ROOTS = {
    "tunepack": "sdk_ext",
    "tunepack.runtimes": "runtimes",
    "tunepack.initializers": "initializers",
    "tunepack.trainers": "trainers",
}


def _module(path: Path) -> str:
    """The import name of a source file, by the longest root holding it."""
    for package, root in sorted(ROOTS.items(), key=lambda item: -len(item[1])):
        base = REPO / root
        if path.is_relative_to(base):
            parts = path.relative_to(base).with_suffix("").parts
            return ".".join((package, *parts))
    raise AssertionError(path)


def _strings(tree: ast.AST) -> list[str]:
    return [n.value for n in ast.walk(tree) if isinstance(n, ast.Constant) and type(n.value) is str]


def generators() -> set[str]:
    found = set()
    roots = [REPO / root for root in ROOTS.values()]
    for path in sorted(p for root in roots for p in root.rglob("*.py")):
        if "--check" in _strings(ast.parse(path.read_text(encoding="utf-8"))):
            found.add(_module(path))
    return found


def recipe() -> list[str]:
    """The modules the Makefile's ``generate`` target runs, in order."""
    lines = (REPO / "Makefile").read_text(encoding="utf-8").splitlines()
    start = next(i for i, line in enumerate(lines) if re.match(r"generate\s*:", line))
    body = []
    for line in lines[start + 1 :]:
        if not line.startswith("\t"):
            break
        body.append(line)
    return [m for line in body for m in re.findall(r"\$\(BIN\)/python -m (\S+)", line)]


def told_to_run() -> set[str]:
    """Modules named by the messages of the tests' "is stale" assertions."""
    named = set()
    for path in sorted((REPO / "tests").rglob("test_*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Assert) and node.msg is not None:
                message = " ".join(_strings(node.msg))
                if "stale" in message or "does not match" in message:
                    named.update(re.findall(r"python -m (tunepack[\w.]+\w)", message))
    return named


def test_the_generate_target_runs_every_generator_once():
    found, runs = generators(), recipe()
    assert len(found) >= 6, found  # the rule still finds the generators it was written for
    assert sorted(runs) == sorted(found), (
        f"the Makefile's generate target runs {runs}, but the modules with a --check mode are "
        f"{sorted(found)}: add the missing ones to it"
    )
    assert len(set(runs)) == len(runs)


def test_the_code_generators_run_before_what_imports_their_output():
    runs = recipe()
    # TrainArgs' and FineTune's fields are source the other generators import.
    code = {"tunepack.runtimes.args_docs", "tunepack.finetune"}
    assert set(runs[:2]) == code, runs


def test_every_file_a_test_checks_has_its_generator_in_make_generate():
    named = told_to_run()
    assert {"tunepack.runtimes.args_docs", "tunepack.tools.admission"} <= named  # the rule works
    assert named <= set(recipe()), f"tests tell contributors to run {sorted(named)}"


@pytest.mark.parametrize("name", sorted(generators()))
def test_each_generator_check_passes_on_the_checkout(name, capsys):
    module = importlib.import_module(name)
    assert module.main(["--check"]) == 0, capsys.readouterr().err
    assert "stale" not in capsys.readouterr().err


def test_a_stale_file_is_named_with_make_generate(tmp_path, monkeypatch, capsys):
    from tunepack.runtimes import models_doc
    from tunepack.tools import serving

    for module, attribute in ((models_doc, "DOC"), (serving, "MANIFEST")):
        stale = tmp_path / f"{attribute}.txt"
        stale.write_text("edited by hand\n")
        monkeypatch.setattr(module, attribute, stale)
        assert module.main(["--check"]) == 1
        assert capsys.readouterr().err == f"{stale} is stale: run `make generate`\n"
        assert module.main([]) == 0
        assert module.main(["--check"]) == 0
        assert module.main(["--chek"]) == 64
        assert "usage:" in capsys.readouterr().err


def test_args_docs_check_names_a_stale_table_and_write_repairs_it(tmp_path, monkeypatch, capsys):
    from tunepack.runtimes import args_docs

    (tmp_path / "docs").mkdir()
    trainer_md = (REPO / "docs" / "trainer.md").read_text(encoding="utf-8")
    (tmp_path / "docs" / "trainer.md").write_text(trainer_md, encoding="utf-8")
    readme = (REPO / "README.md").read_text(encoding="utf-8")
    stale = readme.replace("| `lora` |", "| `lora-by-hand` |", 1)
    assert stale != readme
    (tmp_path / "README.md").write_text(stale, encoding="utf-8")
    monkeypatch.setattr(args_docs, "REPO", tmp_path)
    assert args_docs.main(["--check"]) == 1
    assert capsys.readouterr().err == f"{tmp_path / 'README.md'} is stale: run `make generate`\n"
    assert args_docs.main(["--write"]) == 0
    assert f"{tmp_path / 'README.md'}: rewritten" in capsys.readouterr().out.splitlines()
    assert (tmp_path / "README.md").read_text(encoding="utf-8") == readme
    assert args_docs.main(["--check"]) == 0


def test_finetune_check_names_its_stale_block(tmp_path, capsys):
    from tunepack import finetune

    source = Path(finetune.__file__).read_text(encoding="utf-8")
    copy = tmp_path / "finetune.py"
    copy.write_text(source.replace("    lora_rank: int | None = None\n", "", 1), encoding="utf-8")
    assert finetune.main(["--check"], str(copy)) == 1
    assert capsys.readouterr().err == f"{copy}: FineTune's fields are stale: run `make generate`\n"
    assert finetune.main(["--write"], str(copy)) == 0
    assert copy.read_text(encoding="utf-8") == source
    assert finetune.main(["--check"], str(copy)) == 0
