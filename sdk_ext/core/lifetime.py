"""Process lifetime: every process of a run dies with the one that started it, and stops cleanly.

The two rules (die with the parent; one burst of stop signals is one stop request) and why:
docs/architecture.md, "Process lifetime"."""

from __future__ import annotations

import os
import signal
import sys
import time

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
REPEAT_WINDOW_S = 2.0
_PR_SET_PDEATHSIG = 1
# Set by the shim to its own pid, which the command it executes keeps: that command's children
# (torchrun's workers) check with it that their parent is still the one that started them.
SHIM_PID_ENV = "TUNEPACK_SHIM_PID"


def die_with_parent(sig: int = signal.SIGTERM, parent: int | None = None) -> bool:
    """Have the kernel send ``sig`` to this process when its parent dies.

    ``parent``: the pid the parent had; if it is already gone (the child was re-parented before
    the request took effect) the signal is sent now. Returns False where the kernel has no such
    request (not Linux): there the parents' own shutdown still signals their children.
    """
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(_PR_SET_PDEATHSIG, int(sig), 0, 0, 0) != 0:
            return False
    except (OSError, AttributeError):
        return False
    if parent is not None and os.getppid() != parent:
        os.kill(os.getpid(), sig)
    return True


def die_with_shimmed_parent(sig: int = signal.SIGKILL) -> bool:
    """``die_with_parent`` for a child of a command the shim started (a torchrun worker): the
    parent it must have is the shim's pid (``SHIM_PID_ENV``), so a worker whose torchrun died
    before this request took effect dies now rather than train on alone."""
    raw = os.environ.get(SHIM_PID_ENV, "")
    return die_with_parent(sig, int(raw) if raw.isdigit() else None)


def shim(command: list[str], parent: int | None = None, sig: int = signal.SIGTERM) -> list[str]:
    """``command`` run through the exec shim, so it gets ``sig`` (SIGTERM: stop cleanly;
    SIGKILL: die now) when ``parent`` (default: the calling process) dies."""
    parent = os.getpid() if parent is None else parent
    return [
        sys.executable, "-m", "tunepack.core.lifetime", "--parent", str(parent),
        "--signal", signal.Signals(sig).name.removeprefix("SIG"), "--", *command,
    ]  # fmt: skip


class StopRequests:
    """Counts stop signals, taking a burst (a group signal and its forwarded copy) as one."""

    def __init__(self, window: float = REPEAT_WINDOW_S) -> None:
        self.window = window
        self.count = 0
        self.first: int | None = None
        self._last = 0.0

    def add(self, signum: int) -> bool:
        """Record ``signum``; True when it is a new request (the first, or one after the window)."""
        now = time.monotonic()
        repeat = self.count > 0 and now - self._last < self.window
        self._last = now
        if repeat:
            return False
        self.count += 1
        if self.first is None:
            self.first = signum
        return True


def signal_name(signum: int) -> str:
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


def _main(argv: list[str]) -> int:
    usage = (
        "usage: python -m tunepack.core.lifetime --parent PID [--signal TERM|KILL] -- COMMAND "
        "[ARG...]"
    )
    sig = signal.SIGTERM
    if argv[2:3] == ["--signal"] and len(argv) > 4 and argv[3] in ("TERM", "KILL"):
        sig = signal.Signals["SIG" + argv[3]]
        argv = argv[:2] + argv[4:]
    if len(argv) < 4 or argv[0] != "--parent" or argv[2] != "--" or not argv[1].isdigit():
        print(usage, file=sys.stderr)
        return 2
    die_with_parent(sig, int(argv[1]))
    os.environ[SHIM_PID_ENV] = str(os.getpid())  # execvp keeps the pid: the command's own
    command = argv[3:]
    try:
        os.execvp(command[0], command)
    except OSError as err:
        print(f"tunepack.core.lifetime: cannot run {command[0]!r}: {err.strerror}", file=sys.stderr)
        return 127


if __name__ == "__main__":
    sys.exit(_main(sys.argv[1:]))
