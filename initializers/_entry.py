"""The entry-point contract every initializer shares: ``tunepack.core.program``'s, with every
line printed passed through ``scrub``, so no credential reaches a log."""

from __future__ import annotations

from collections.abc import Callable

from tunepack.core import program
from tunepack.initializers.redaction import scrub


def log(program_name: str, message: str) -> None:
    # Flushed per line: in a Pod and under the local backend stdout is a pipe, not a terminal.
    print(scrub(f"{program_name}: {message}"), flush=True)


def run(program_name: str, body: Callable[[], None]) -> int:
    """Run ``body`` and return the process exit code (``tunepack.core.program.run``): a
    TunepackError becomes ``<program>: error: <message>`` on stderr and its exit code (65 bad
    input, 75 retriable), so does a full disk (75, naming the path); anything else is a bug (its
    traceback, code 1); SIGTERM, SIGINT and SIGHUP stop the body with a retriable error."""
    return program.run(program_name, body, scrub=scrub)
