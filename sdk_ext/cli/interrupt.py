"""Stopping ``tunepack train --local``: Ctrl-C, SIGTERM or SIGHUP stop every process of the run.

The first signal asks the steps to stop (SIGTERM, as to a Pod); a second one, or the grace period,
kills what is left; nothing outlives the CLI. docs/architecture.md, "Process lifetime"."""

from __future__ import annotations

import os
import signal
import threading
import time

import psutil

from tunepack.core import lifetime

GRACE_S = 45.0  # torchrun gives its workers 30 s to checkpoint


class StopOnInterrupt:
    """Context manager around a local run; ``interrupted`` counts the stop requests, ``signal``
    is the first one's number. ``notice`` is written when the first arrives; ``{cause}`` in it
    becomes ``Ctrl-C`` or the signal's name."""

    def __init__(self, notice: str, grace: float = GRACE_S) -> None:
        self.notice = notice
        self.grace = grace
        self.interrupted = 0
        self.signal: int | None = None
        self._requests = lifetime.StopRequests()
        self._seen: dict[int, psutil.Process] = {}
        self._terminated: set[int] = set()
        self._lock = threading.Lock()
        self._done = threading.Event()
        self._watcher: threading.Thread | None = None
        self._deadline = 0.0
        self._previous: dict[int, object] = {}

    def __enter__(self) -> StopOnInterrupt:
        # Only the main thread may handle signals (``main()`` called from another thread keeps
        # the default: KeyboardInterrupt, which ``main`` turns into exit 130).
        if threading.current_thread() is threading.main_thread():
            for sig in lifetime.STOP_SIGNALS:
                self._previous[sig] = signal.signal(sig, self._on_signal)
        return self

    def __exit__(self, *exc) -> None:
        self._done.set()
        if self._watcher is not None:
            self._watcher.join()
        if self.interrupted:
            self._kill_all(wait=True)
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)

    @property
    def cause(self) -> str:
        """How the run was stopped, for messages: ``Ctrl-C``, ``SIGTERM``, ``SIGHUP``."""
        if self.signal == signal.SIGINT:
            return "Ctrl-C"
        return lifetime.signal_name(self.signal) if self.signal else "nothing"

    @property
    def exit_code(self) -> int:
        """128 + the first signal's number, as a shell reports a command the signal stopped."""
        return 128 + (self.signal or signal.SIGINT)

    def _on_signal(self, signum, _frame) -> None:
        if not self._requests.add(signum):
            return  # the same request again (a group signal and a copy of it)
        self.interrupted += 1
        if self.interrupted > 1:
            self._kill_all()
            return
        self.signal = signum
        try:
            os.write(2, f"{self.notice.format(cause=self.cause)}\n".encode())
        except OSError:
            pass  # the terminal is gone (SIGHUP): stop the run all the same
        if signum == signal.SIGINT and _terminal_delivered():
            # The steps got this SIGINT from the terminal with the CLI: signal only steps
            # that start from now on.
            self._terminated.update(c.pid for c in self._children())
        self._deadline = time.monotonic() + self.grace
        self._watcher = threading.Thread(target=self._watch, name="tunepack-stop", daemon=True)
        self._watcher.start()

    def _children(self, recursive: bool = False) -> list[psutil.Process]:
        try:
            return psutil.Process().children(recursive=recursive)
        except psutil.Error:
            return []

    def _remember(self) -> list[psutil.Process]:
        found = self._children(recursive=True)
        with self._lock:
            for proc in found:
                self._seen.setdefault(proc.pid, proc)
            return list(self._seen.values())

    def _watch(self) -> None:
        while not self._done.is_set():
            self._remember()
            for child in self._children():
                if child.pid not in self._terminated:
                    self._terminated.add(child.pid)
                    _signal(child, signal.SIGTERM)
            if time.monotonic() > self._deadline:
                self._kill_all()
            self._done.wait(0.1)

    def _kill_all(self, wait: bool = False) -> None:
        procs = self._remember()
        for proc in procs:
            _signal(proc, signal.SIGKILL)
        if wait:
            psutil.wait_procs(procs, timeout=5)


def _signal(proc: psutil.Process, sig: int) -> None:
    try:
        proc.send_signal(sig)  # psutil refuses a pid that now names another process
    except psutil.Error:
        pass


def _terminal_delivered() -> bool:
    """Whether this process is in its terminal's foreground process group, where Ctrl-C sends
    SIGINT to every process of the group (the step processes included)."""
    try:
        fd = os.open("/dev/tty", os.O_RDONLY)
    except OSError:
        return False
    try:
        return os.tcgetpgrp(fd) == os.getpgrp()
    except OSError:
        return False
    finally:
        os.close(fd)
