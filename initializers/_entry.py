"""The entry-point contract every initializer shares: messages, exit codes, SIGTERM."""

from __future__ import annotations

import signal
import sys
import threading
import traceback
from collections.abc import Callable

from tunepack.errors import EXIT_OK, TransientError, TunepackError
from tunepack.initializers.redaction import scrub

EXIT_BUG = 1


def log(program: str, message: str) -> None:
    # Flushed per line: in a Pod and under the local backend stdout is a pipe, not a terminal.
    print(scrub(f"{program}: {message}"), flush=True)


def run(program: str, body: Callable[[], None]) -> int:
    """Run ``body`` and return the process exit code.

    A TunepackError becomes ``<program>: error: <message>`` on stderr and its exit code (65 bad
    input, 75 retriable). Anything else is a bug: its traceback is printed and the code is 1.
    Everything printed passes through ``scrub``, so no credential reaches a log.
    """
    in_main_thread = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGTERM, _on_sigterm) if in_main_thread else None
    try:
        body()
    except TunepackError as error:
        print(scrub(f"{program}: error: {error}"), file=sys.stderr, flush=True)
        return error.exit_code
    except Exception:
        # Printed here rather than by the interpreter, whose traceback could quote a token.
        print(scrub(traceback.format_exc()), file=sys.stderr, end="", flush=True)
        return EXIT_BUG
    finally:
        if in_main_thread:
            signal.signal(signal.SIGTERM, previous)
    return EXIT_OK


def _on_sigterm(signum: int, frame: object) -> None:
    # Kubernetes sends SIGTERM on preemption or node drain. Raising lets the staging code remove
    # its partial directory, and the retriable exit code lets the failure policy retry the step.
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # a second SIGTERM must not abort cleanup
    raise TransientError(
        "stopped by SIGTERM (preemption or shutdown); nothing was published, the step can be "
        "retried"
    )
