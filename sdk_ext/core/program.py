"""The entry/exit contract every tunepack program shares: the error line and the exit code.

``error_line`` writes ``<program>: error: <message>`` and ``last_error`` reads it back from a log
(the local backend's reason for a failed step), here together so the two cannot drift apart.
``run`` wraps a program's body, ``leave`` ends a torch program's process, ``defer_collection``
and ``imports_done`` bracket its imports: docs/architecture.md, "The contract: tunepack.core"."""

from __future__ import annotations

import atexit
import gc
import os
import signal
import sys
import threading
import traceback
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import NoReturn

from tunepack.core import durable, handoff, lifetime
from tunepack.core.errors import EXIT_OK, StoppedError, TunepackError

EXIT_BUG = 1  # an unexpected failure: a bug, with its traceback in the log
ERROR_MARK = ": error: "
DETAIL_INDENT = "  "  # lines detailing an error line start with it
# Where the trainer's launcher asks each torchrun worker to leave its exit code and pid (torchrun
# itself reports only "failed"); the worker writes ``rank-<rank>`` and ``pid-<rank>`` there, and
# tunepack's torchrun ``killed-<rank>`` for a worker that died of a signal.
EXIT_DIR_ENV = "TUNEPACK_EXIT_DIR"


def error_line(program: str, message: object) -> str:
    """The line a failing program prints: ``<program>: error: <message>``."""
    return f"{program}{ERROR_MARK}{message}"


def last_error(lines: Iterable[str], max_detail: int) -> list[str]:
    """The last error line among a program's output ``lines``, with the (at most
    ``max_detail``) indented lines after it that detail it; empty if there is none."""
    lines = list(lines)
    at = next((i for i in reversed(range(len(lines))) if ERROR_MARK in lines[i]), None)
    if at is None:
        return []
    detail = []
    for line in lines[at + 1 :]:
        if not line.startswith(DETAIL_INDENT) or len(detail) == max_detail:
            break
        detail.append(line)
    return [lines[at], *detail]


def last_error_in(log: Path, max_detail: int) -> list[str]:
    """``last_error`` of a log file; empty if it cannot be read."""
    try:
        return last_error(log.read_text(errors="replace").splitlines(), max_detail)
    except OSError:
        return []


_deferred = False


def defer_collection(module_name: str) -> None:
    """No cyclic garbage collection until ``imports_done()``, when ``module_name`` is
    ``"__main__"`` (called at the top of a program's module, before it imports torch; imported
    by another program or a test, it changes nothing).

    Importing torch and torchtune makes millions of objects that live as long as the process,
    and the collector, run every few hundred allocations, scans them again and again while they
    are made (about 1,000 times in a worker's import). Measured once, A/B, on a two-step
    tiny-llama3 run of the launcher: 5.3 user CPU-s with it, 3.6 without, for 10 MB more
    resident memory (issue 48's note).
    """
    global _deferred
    if module_name == "__main__" and gc.isenabled():
        gc.disable()
        _deferred = True


def imports_done() -> None:
    """Collection back on after ``defer_collection``, with every object made so far frozen
    (``gc.freeze``: the modules' objects are never scanned again, as they could never be
    garbage). Does nothing where collection was not deferred."""
    global _deferred
    if _deferred:
        gc.freeze()
        gc.enable()
        _deferred = False


def _same(text: str) -> str:
    return text


def run(
    program: str,
    body: Callable[[], int | None],
    *,
    scrub: Callable[[str], str] = _same,
    stop_signals: bool = True,
    disk_full_at: Callable[[], object] | None = None,
) -> int:
    """Run ``body`` and return the process exit code (``body``'s own, or 0 when it returns None).

    A ``TunepackError`` becomes ``<program>: error: <message>`` on stderr and its exit code;
    so does a full disk (75, naming the path: the error's file name, else ``disk_full_at()``).
    Anything else is a bug: its traceback is printed and the code is 1. Everything printed
    passes through ``scrub`` (the initializers' keeps credentials out of the log).
    ``stop_signals``: turn SIGTERM, SIGINT and SIGHUP into a ``TransientError`` while ``body``
    runs (in the main thread only); off for a body that handles them itself.
    """

    def say(line: str, end: str = "\n") -> None:
        print(scrub(line), file=sys.stderr, end=end, flush=True)

    in_main_thread = threading.current_thread() is threading.main_thread()
    previous = {}
    if stop_signals and in_main_thread:
        previous = {sig: signal.signal(sig, _on_stop) for sig in lifetime.STOP_SIGNALS}
    try:
        handoff.wait_for_steps(program)  # a gang-scheduled runtime's steps start together
        code = body()
        if code in (None, EXIT_OK):
            handoff.mark_done(program)
    except TunepackError as error:
        say(error_line(program, error))
        return error.exit_code
    except OSError as error:
        if not durable.is_disk_full(error):
            return _bug(say)
        full = durable.disk_full_error(error.filename or (disk_full_at() if disk_full_at else None))
        say(error_line(program, full))
        return full.exit_code
    except Exception:
        return _bug(say)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    return EXIT_OK if code is None else code


def _bug(say: Callable[..., None]) -> int:
    # Printed here rather than by the interpreter, whose traceback could quote a token.
    say(traceback.format_exc(), end="")
    return EXIT_BUG


def _on_stop(signum: int, frame: object) -> None:
    # Kubernetes sends SIGTERM on preemption or node drain (the local backend on Ctrl-C or when
    # the CLI dies). Raising lets the staging code remove its partial directory, and the
    # retriable exit code lets the failure policy retry the step.
    for sig in lifetime.STOP_SIGNALS:  # a second signal must not abort cleanup
        signal.signal(sig, signal.SIG_IGN)
    raise StoppedError(
        f"stopped by {lifetime.signal_name(signum)} (preemption or shutdown); nothing was "
        "published, the step can be retried"
    )


def leave(code: int) -> NoReturn:
    """End this process with ``code``, its work done, without the interpreter's teardown.

    A process that imported torch and torchtune (a worker, a launcher that trained in-process)
    holds some 3,400 modules; finalizing them took 1.5 of the 7.5 CPU-s such a process spent on
    2 cores, for nothing (one that imported torch alone, a torchrun, pays far less), and in
    torch's distributed objects it was seen to abort a finished worker of a two-node run
    (SIGABRT, "terminate called without an active exception"), failing a run that succeeded.
    What of the teardown matters is done here: threads that are not daemons are waited for (as
    at any exit), the ``atexit`` handlers run (logging's, registered when it was imported,
    closes its files; a tracker's ends its run), and stdout and stderr are flushed.
    """
    main = threading.main_thread()
    for thread in threading.enumerate():
        if thread is not main and not thread.daemon:
            thread.join()
    atexit._run_exitfuncs()  # as the interpreter's own exit runs them
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a closed or broken pipe: nothing more can be said
            pass
    os._exit(code)
