"""The entry-point contract every initializer shares: messages, exit codes, stop signals."""

from __future__ import annotations

import signal
import sys
import threading
import traceback
from collections.abc import Callable

from tunepack.core import durable, lifetime
from tunepack.core.errors import EXIT_OK, TransientError, TunepackError
from tunepack.initializers.redaction import scrub

EXIT_BUG = 1


def log(program: str, message: str) -> None:
    # Flushed per line: in a Pod and under the local backend stdout is a pipe, not a terminal.
    print(scrub(f"{program}: {message}"), flush=True)


def run(program: str, body: Callable[[], None]) -> int:
    """Run ``body`` and return the process exit code.

    A TunepackError becomes ``<program>: error: <message>`` on stderr and its exit code (65 bad
    input, 75 retriable); so does a full disk (75, naming the path). Anything else is a bug: its
    traceback is printed and the code is 1. Everything printed passes through ``scrub``, so no
    credential reaches a log.
    """
    in_main_thread = threading.current_thread() is threading.main_thread()
    previous = {}
    if in_main_thread:
        previous = {sig: signal.signal(sig, _on_stop) for sig in lifetime.STOP_SIGNALS}
    try:
        body()
    except TunepackError as error:
        print(scrub(f"{program}: error: {error}"), file=sys.stderr, flush=True)
        return error.exit_code
    except OSError as error:
        if not durable.is_disk_full(error):
            return _bug()
        where = f" writing {error.filename}" if error.filename else ""
        print(
            scrub(
                f"{program}: error: no space left on the device (or quota){where}: free space or "
                "enlarge the volume, then run again"
            ),
            file=sys.stderr,
            flush=True,
        )
        return durable.DiskFullError.exit_code
    except Exception:
        return _bug()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    return EXIT_OK


def _bug() -> int:
    # Printed here rather than by the interpreter, whose traceback could quote a token.
    print(scrub(traceback.format_exc()), file=sys.stderr, end="", flush=True)
    return EXIT_BUG


def _on_stop(signum: int, frame: object) -> None:
    # Kubernetes sends SIGTERM on preemption or node drain (the local backend on Ctrl-C or when
    # the CLI dies). Raising lets the staging code remove its partial directory, and the
    # retriable exit code lets the failure policy retry the step.
    for sig in lifetime.STOP_SIGNALS:  # a second signal must not abort cleanup
        signal.signal(sig, signal.SIG_IGN)
    raise TransientError(
        f"stopped by {lifetime.signal_name(signum)} (preemption or shutdown); nothing was "
        "published, the step can be retried"
    )
