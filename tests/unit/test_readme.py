"""README's command lines and exit-code table stay in step with the CLI and the Makefile.

Every `tunepack ...` line in README's code blocks names a subcommand the CLI has and options that
subcommand accepts; every `make ...` line a target of the Makefile; the exit-code table lists the
codes the programs return, and they return them."""

from __future__ import annotations

import argparse
import ast
import re
import signal

import pytest

from tests import REPO
from tunepack import cli
from tunepack.cli.parser import build_parser
from tunepack.core.errors import EXIT_BAD_INPUT, EXIT_OK, EXIT_TRANSIENT

ROOT = REPO
README = (ROOT / "README.md").read_text()


def _code_lines() -> list[str]:
    """Lines of README's fenced code blocks, with backslash continuations joined."""
    lines, inside, pending = [], False, ""
    for raw in README.splitlines():
        if raw.startswith("```"):
            inside = not inside
            continue
        if not inside:
            continue
        line = pending + raw.split("  #")[0].strip()
        if line.endswith("\\"):
            pending = line[:-1] + " "
            continue
        pending = ""
        lines.append(line)
    return lines


def _commands(program: str) -> list[list[str]]:
    found = []
    for line in _code_lines():
        for part in line.split(" | "):  # `tunepack status NAME | tunepack logs NAME`
            words = part.split()
            if words and words[0] == program:
                found.append(words[1:])
    return found


def _subparsers(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    (action,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    return action.choices


def test_readme_tunepack_lines_use_commands_and_options_the_cli_has():
    commands = _commands("tunepack")
    assert len(commands) >= 15, commands  # the README's command reference is found
    top = _subparsers(build_parser())
    for words in commands:
        assert words[0] in top, f"README runs `tunepack {words[0]}`, which the CLI does not have"
        parser = top[words[0]]
        if any(isinstance(a, argparse._SubParsersAction) for a in parser._actions):
            assert words[1] in _subparsers(parser), f"`tunepack {' '.join(words[:2])}`"
            parser = _subparsers(parser)[words[1]]
        for word in words:
            option = word.strip("[]").split("=")[0]
            if option.startswith("-"):
                assert option in parser._option_string_actions, (
                    f"README's `tunepack {' '.join(words)}` uses {option}, which "
                    f"`tunepack {words[0]}` does not accept"
                )


def test_readme_make_lines_name_targets_of_the_makefile():
    makefile = (ROOT / "Makefile").read_text()
    targets = set(re.findall(r"^([a-z][a-z-]*):", makefile, re.M))
    commands = _commands("make")
    assert len(commands) >= 5, commands
    for words in commands:
        target = next(w for w in words if "=" not in w)
        assert target in targets, f"README runs `make {target}`, which the Makefile has not"


def _exit_table() -> dict[int, str]:
    section = README.split("### Exit codes", 1)[1].split("\n## ", 1)[0]
    rows = {}
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) >= 2 and re.fullmatch(r"[\d, ]+", cells[0]):
            for code in cells[0].split(","):
                rows[int(code)] = cells[1]
    return rows


def test_the_exit_code_table_lists_the_codes_the_programs_use():
    table = _exit_table()
    expected = {
        EXIT_OK,
        EXIT_BAD_INPUT,
        EXIT_TRANSIENT,
        128 + signal.SIGINT,
        128 + signal.SIGTERM,
        128 + signal.SIGHUP,
        cli.EXIT_BROKEN_PIPE,
        1,
    }
    assert set(table) == expected
    assert cli.EXIT_INTERRUPTED == 128 + signal.SIGINT
    assert "bad input" in table[EXIT_BAD_INPUT] and "transient" in table[EXIT_TRANSIENT]
    assert "plan" in table[1]


@pytest.mark.parametrize(
    ("argv", "code"),
    [
        # A usage mistake is bad input (65), as the table says.
        (["train", "--no-such-flag"], EXIT_BAD_INPUT),
        # `tunepack plan` exits 1 when the job does not fit the GPUs.
        (
            [
                "plan",
                "--model",
                "llama3.1-8b",
                "--method",
                "full",
                "--batch-size",
                "8",
                "--seq-len",
                "8192",
            ],
            1,
        ),  # fmt: skip
        (["plan", "--model", "llama3.1-8b", "--method", "lora"], EXIT_OK),
    ],
)
def test_the_cli_returns_the_tables_codes(argv, code, capsys):
    assert cli.main(argv) == code
    if code == EXIT_BAD_INPUT:
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith("tunepack: error:"), err


def _python_blocks() -> list[tuple[str, str]]:
    """(file, source) of every ```python block of README.md and docs/*.md."""
    blocks = []
    for path in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        for source in re.findall(r"^```python\n(.*?)^```", path.read_text(), re.S | re.M):
            blocks.append((path.name, source))
    return blocks


def test_python_snippets_print_logs_as_a_notebook_would_show_them():
    """`get_job_logs` returns an iterator of lines: a bare `client.get_job_logs(job)` shows
    `<generator object ...>` in a notebook, not the log."""
    bare = [
        f"{name}: {ast.unparse(node)}"
        for name, source in _python_blocks()
        for node in ast.walk(ast.parse(source))
        if isinstance(node, ast.Expr)
        and isinstance(node.value, ast.Call)
        and isinstance(node.value.func, ast.Attribute)
        and node.value.func.attr == "get_job_logs"
    ]
    assert _python_blocks() and not bare, bare
