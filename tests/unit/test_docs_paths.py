"""The docs' layout tables name files and modules that exist.

What is checked, and how:

- **Layout tables**: the Markdown tables of README.md, docs/architecture.md and docs/sdk.md whose
  header has a column named ``path``, ``directory``, ``where``, ``room`` or ``file``. In their rows,
  every backticked span that is a relative path (letters, digits, ``_ . - /`` only; not starting
  with ``/`` or ``.``) and contains a ``/`` or ends in ``.py`` must exist: relative to the
  repository root, or to a directory the same row names (``sdk_ext/cli/`` makes ``parser.py``
  mean ``sdk_ext/cli/parser.py``; a directory found that way is a context too). A row that names
  no directory may also mean a path under a package source root (the trainer's rooms:
  ``process/`` is ``trainers/process/``).
- **Module references**, anywhere in those three files: a backticked span that is a dotted name
  under ``tunepack.`` (or, as the docs shorten them, ``trainers.``, ``runtimes.``,
  ``initializers.``) must be a module of the package, or a module followed by one name that
  module defines or imports. The package's modules are mapped to their source roots as setup.py
  maps them (``tunepack.cli`` is ``sdk_ext/cli``, ``tunepack.trainers`` is ``trainers``). A name
  a module defines lazily (its ``__getattr__`` serving the names its string keys list, as
  ``tunepack``'s exports) counts as defined. ``FORMER`` lists the names the docs give on purpose
  as what a moved module was called.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from tests import REPO

DOCS = ("README.md", "docs/architecture.md", "docs/sdk.md")
LAYOUT_COLUMNS = {"path", "directory", "where", "room", "file"}
# import package -> source root, as setup.py's ROOTS
ROOTS = {
    "tunepack": "sdk_ext",
    "tunepack.runtimes": "runtimes",
    "tunepack.initializers": "initializers",
    "tunepack.trainers": "trainers",
}
SHORT = ("trainers", "runtimes", "initializers")  # the docs' shorthand for tunepack.<root>
# name -> why the docs name it though it is gone
FORMER = {
    "tunepack.trainers.qwen3.qwen3_8b": "architecture.md: the name before the rooms, which "
    "run_identity still counts a component as",
}

_SPAN = re.compile(r"`([^`\n]+)`")
_PATH = re.compile(r"[\w][\w.\-/]*")
_DOTTED = re.compile(r"(tunepack|trainers|runtimes|initializers)(\.\w+)+")


def _cells(line: str) -> list[str]:
    return [cell.strip() for cell in line.strip().strip("|").split("|")]


def layout_rows(doc: str) -> list[tuple[int, str]]:
    """(line number, row) of every layout table's body rows in ``doc``."""
    lines = (REPO / doc).read_text(encoding="utf-8").splitlines()
    rows, in_layout = [], False
    for number, line in enumerate(lines, 1):
        if not line.startswith("|"):
            in_layout = False
            continue
        previous = lines[number - 2] if number > 1 else ""
        if not previous.startswith("|"):  # a header row
            in_layout = bool(LAYOUT_COLUMNS & {c.lower() for c in _cells(line)})
            continue
        if in_layout and not set(line) <= set("|-: "):
            rows.append((number, line))
    return rows


def _is_path(span: str) -> bool:
    return bool(_PATH.fullmatch(span)) and ("/" in span or span.endswith(".py"))


def missing_paths(row: str) -> list[str]:
    spans = [s for s in _SPAN.findall(row) if _is_path(s)]
    contexts, directories = [REPO], []
    # directories the row names, resolved against the root and each other, until none is added
    added = True
    while added:
        added = False
        for span in spans:
            if span.endswith("/"):
                for base in list(contexts):
                    found = base / span
                    if found.is_dir() and found not in contexts:
                        contexts.append(found)
                        directories.append(found)
                        added = True
    if not directories:
        contexts += [REPO / root for root in ROOTS.values()]
    return [s for s in spans if not any((base / s).exists() for base in contexts)]


def _module_file(name: str) -> Path | None:
    for package, root in sorted(ROOTS.items(), key=lambda item: -len(item[0])):
        if name == package or name.startswith(package + "."):
            rest = name[len(package) :].lstrip(".").split(".") if name != package else []
            base = REPO / root / Path(*rest) if rest else REPO / root
            if (base / "__init__.py").is_file():
                return base / "__init__.py"
            if base.with_suffix(".py").is_file():
                return base.with_suffix(".py")
            return None
    return None


def _defines(path: Path, attribute: str) -> bool:
    tree = ast.parse(path.read_text(encoding="utf-8"))
    lazy = any(isinstance(n, ast.FunctionDef) and n.name == "__getattr__" for n in tree.body)
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            if node.name == attribute:
                return True
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names = [n for t in targets for n in ast.walk(t) if isinstance(n, ast.Name)]
            if any(n.id == attribute for n in names):
                return True
        elif lazy and isinstance(node, ast.Dict):
            if any(isinstance(k, ast.Constant) and k.value == attribute for k in node.keys):
                return True
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            if any((a.asname or a.name.split(".")[0]) == attribute for a in node.names):
                return True
    return False


def module_exists(dotted: str) -> bool:
    name = "tunepack." + dotted if dotted.startswith(SHORT) else dotted
    if _module_file(name) is not None:
        return True
    module, _, attribute = name.rpartition(".")
    path = _module_file(module)
    return path is not None and _defines(path, attribute)


def test_every_layout_path_exists():
    wrong = [
        f"{doc}:{number}: `{span}`"
        for doc in DOCS
        for number, row in layout_rows(doc)
        for span in missing_paths(row)
    ]
    assert not wrong, "layout tables name paths that do not exist:\n" + "\n".join(wrong)


def test_every_module_reference_exists():
    wrong = []
    for doc in DOCS:
        for number, line in enumerate((REPO / doc).read_text(encoding="utf-8").splitlines(), 1):
            for span in _SPAN.findall(line):
                if span.endswith(".py") or span in FORMER:  # a file; a name it once had
                    continue
                if _DOTTED.fullmatch(span) and not module_exists(span):
                    wrong.append(f"{doc}:{number}: `{span}`")
    assert not wrong, "the docs name modules that do not exist:\n" + "\n".join(wrong)


def test_the_rules_find_what_they_are_for():
    rows = dict(layout_rows("docs/architecture.md"))
    assert any("`sdk_ext/cli/`" in row for row in rows.values())
    assert missing_paths("| Tools | `sdk_ext/tools/` | `serving.py`; `planner.py` |") == [
        "planner.py"
    ]
    assert missing_paths("| `process/` | torchrun |") == []  # trainers/process/
    assert missing_paths("| x | `sdk_ext/` | `backends/`, `nowhere/` |") == ["nowhere/"]
    assert missing_paths("| x | `sdk_ext/backends/` | `local/`: `runner.py` |") == []
    assert module_exists("tunepack.cli") and module_exists("tunepack.core.program.EXIT_DIR_ENV")
    assert module_exists("trainers.recipe") and not module_exists("trainers.builders")
    assert not module_exists("tunepack.core.program.NO_SUCH_NAME")
    assert module_exists("tunepack.TrainingClient")  # a lazy export
    assert not module_exists("tunepack.NoSuchClient")


@pytest.mark.parametrize("doc", DOCS)
def test_each_doc_has_a_layout_table(doc):
    assert layout_rows(doc), f"{doc}: no layout table found; the rule above reads none of it"
