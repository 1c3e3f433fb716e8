"""What is written from the trainer's argument vocabulary (``tunepack.runtimes.args``): the
tables of docs/trainer.md, README.md and ``tunepack args``, and the generated field blocks of the
typed classes (``TrainArgs``, the SDK's ``FineTune``).

    python -m tunepack.runtimes.args_docs            # the vocabulary table (docs/trainer.md)
    python -m tunepack.runtimes.args_docs methods    # the methods table (README.md)
    python -m tunepack.runtimes.args_docs --write    # rewrite TrainArgs' fields in args.py and
                                                     # both tables in docs/trainer.md, README.md
    python -m tunepack.runtimes.args_docs --check    # exit 1 if any of the three is stale

``make generate`` runs ``--write`` with the repository's other generators.
"""

from __future__ import annotations

import sys
from pathlib import Path

from tunepack.runtimes import args, methods
from tunepack.runtimes.args import VOCABULARY


def vocabulary_table() -> list[tuple[str, str, str]]:
    """(key, default, description) rows for docs and ``tunepack args``."""
    rows = []
    for arg in VOCABULARY:
        default = arg.default
        if isinstance(default, tuple):
            default = ",".join(map(str, default))
        elif isinstance(default, bool):
            default = str(default).lower()
        rows.append((arg.name, "catalog/method" if default is None else str(default), arg.help))
    return rows


def markdown_table() -> str:
    """The vocabulary as the Markdown table in docs/trainer.md (``python -m`` this module)."""
    lines = ["| key | default | meaning |", "| --- | --- | --- |"]
    lines += [f"| `{key}` | {default} | {text} |" for key, default, text in vocabulary_table()]
    return "\n".join(lines) + "\n"


def methods_table() -> str:
    """The methods as the Markdown table in README.md (``python -m`` this module ``methods``)."""
    lines = ["| method | trains | default lr |", "| --- | --- | --- |"]
    lines += [f"| `{m.name}` | {m.help} | {m.lr:g} |" for m in methods.METHODS.values()]
    return "\n".join(lines) + "\n"


# ---------------------------------------------------------------- generated source
# Typed classes of the vocabulary (TrainArgs here, the SDK's FineTune) declare their fields in
# a block of their source file written from VOCABULARY; a test fails while a block is stale.
_BLOCK_BEGIN = "# generated from VOCABULARY by `python -m {command} --write`: begin\n"
_BLOCK_END = "# generated from VOCABULARY: end\n"


def replace_block(source: str, command: str, lines: list[str]) -> str:
    """``source`` with its generated block's body replaced by ``lines`` (indented as the
    block's begin marker is)."""
    begin = _BLOCK_BEGIN.format(command=command)
    head, found, rest = source.partition(begin)
    body, found_end, tail = rest.partition(_BLOCK_END)
    if not found or not found_end:
        raise ValueError(f"no block between {begin.strip()!r} and {_BLOCK_END.strip()!r}")
    indent = head[head.rindex("\n") + 1 :]
    text = "".join(f"{indent}{line}\n" if line else "\n" for line in lines)
    return f"{head}{begin}{text}{indent}{_BLOCK_END}{tail}"


def write_block(path: str | Path, command: str, lines: list[str]) -> bool:
    """Rewrite the generated block of the file ``path``; whether it changed."""
    path = Path(path)
    source = path.read_text(encoding="utf-8")
    updated = replace_block(source, command, lines)
    if updated != source:
        path.write_text(updated, encoding="utf-8")
    return updated != source


def train_args_fields() -> list[str]:
    """TrainArgs' field declarations: every argument, with the type its parser returns."""
    return [
        f"{arg.name}: {arg.annotation}{' | None' if arg.optional else ''}" for arg in VOCABULARY
    ]


# ---------------------------------------------------------------- generated docs
REPO = Path(__file__).resolve().parents[1]  # a checkout: the docs are not in the wheel
COMMAND = "tunepack.runtimes.args_docs"


def replace_doc_block(text: str, name: str, body: str) -> str:
    """``text`` with what lies between ``<!-- name:begin -->`` and ``<!-- name:end -->``
    replaced by ``body``."""
    begin, end = f"<!-- {name}:begin -->\n", f"<!-- {name}:end -->"
    head, found, rest = text.partition(begin)
    _, found_end, tail = rest.partition(end)
    if not found or not found_end:
        raise ValueError(f"no block between {begin.strip()!r} and {end!r}")
    return f"{head}{begin}{body}{end}{tail}"


def generated() -> dict[Path, str]:
    """Each file this module writes -> its content as the vocabulary makes it."""
    source = Path(args.__file__)
    trainer_md, readme = REPO / "docs" / "trainer.md", REPO / "README.md"
    return {
        source: replace_block(source.read_text(encoding="utf-8"), COMMAND, train_args_fields()),
        trainer_md: replace_doc_block(
            trainer_md.read_text(encoding="utf-8"), "vocabulary", markdown_table()
        ),
        readme: replace_doc_block(readme.read_text(encoding="utf-8"), "methods", methods_table()),
    }


def main(argv: list[str]) -> int:
    """Print the vocabulary table (docs/trainer.md) or, with ``methods``, the methods table
    (README.md); with ``--write``, rewrite TrainArgs' generated fields in runtimes/args.py and
    both tables in place; with ``--check``, exit 1 if any of them is stale."""
    if argv in (["--write"], ["--check"]):
        if not (REPO / "docs").is_dir():
            print(f"{COMMAND}: error: {REPO / 'docs'} is not here (run it in a checkout)")
            return 65
        files = generated()
        stale = [p for p, text in files.items() if p.read_text(encoding="utf-8") != text]
        if argv == ["--check"]:
            for path in stale:
                print(f"{path} is stale: run `make generate`", file=sys.stderr)
            if not stale:
                print(f"{', '.join(p.name for p in files)}: up to date")
            return 1 if stale else 0
        for path, text in files.items():
            if path in stale:
                path.write_text(text, encoding="utf-8")
            print(f"{path}: {'rewritten' if path in stale else 'up to date'}")
        return 0
    print(methods_table() if argv == ["methods"] else markdown_table(), end="")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
