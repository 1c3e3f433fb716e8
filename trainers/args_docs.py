"""What is written from the trainer's argument vocabulary (``tunepack.trainers.args``): the
tables of docs/trainer.md, README.md and ``tunepack args``, and the generated field blocks of the
typed classes (``TrainArgs``, the SDK's ``FineTune``).

    python -m tunepack.trainers.args_docs            # the vocabulary table (docs/trainer.md)
    python -m tunepack.trainers.args_docs methods    # the methods table (README.md)
    python -m tunepack.trainers.args_docs --write    # rewrite TrainArgs' fields in args.py
"""

from __future__ import annotations

from pathlib import Path

from tunepack.runtimes import methods
from tunepack.trainers import args
from tunepack.trainers.args import VOCABULARY


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


def main(argv: list[str]) -> int:
    """Print the vocabulary table (docs/trainer.md) or, with ``methods``, the methods table
    (README.md); with ``--write``, rewrite TrainArgs' generated fields in trainers/args.py."""
    if argv == ["--write"]:
        target = args.__file__
        changed = write_block(target, "tunepack.trainers.args_docs", train_args_fields())
        print(f"{target}: {'rewritten' if changed else 'up to date'}")
        return 0
    print(methods_table() if argv == ["methods"] else markdown_table(), end="")
    return 0


if __name__ == "__main__":
    import sys

    sys.exit(main(sys.argv[1:]))
