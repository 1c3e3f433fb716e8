"""Ctrl-C during ``tunepack train --local``: stop every process of the run, leave none behind.

The local backend runs each step as a child process (the trainer may start torchrun and its
workers below it). While a run is under way the CLI handles SIGINT itself instead of raising
KeyboardInterrupt in the middle of the backend:

- the first SIGINT asks the steps to stop as a Pod is asked to: SIGTERM to each step process
  (the trainer checkpoints after the current step and exits 75; an initializer removes its partial
  download). Where the terminal already delivered the SIGINT to the steps (they share the CLI's
  foreground process group), they are not signalled a second time, which would make the trainer
  die without its checkpoint;
- a second SIGINT, or ``grace`` seconds without the run ending, kills (SIGKILL) every process
  of the run that is still alive;
- when the backend returns, any process of the run still alive is killed, so nothing outlives the
  CLI.

Processes are tracked by ancestry (``psutil``), sampled every 0.1 s from the first SIGINT on.
"""

from __future__ import annotations

import os
import signal
import threading
import time

import psutil

GRACE_S = 45.0  # torchrun gives its workers 30 s to checkpoint


class StopOnInterrupt:
    """Context manager around a local run; ``interrupted`` says whether SIGINT arrived."""

    def __init__(self, notice: str, grace: float = GRACE_S) -> None:
        self.notice = notice
        self.grace = grace
        self.interrupted = 0
        self._seen: dict[int, psutil.Process] = {}
        self._terminated: set[int] = set()
        self._lock = threading.Lock()
        self._done = threading.Event()
        self._watcher: threading.Thread | None = None
        self._deadline = 0.0
        self._previous = None

    def __enter__(self) -> StopOnInterrupt:
        # Only the main thread may handle signals (``main()`` called from another thread keeps
        # the default: KeyboardInterrupt, which ``main`` turns into exit 130).
        if threading.current_thread() is threading.main_thread():
            self._previous = signal.signal(signal.SIGINT, self._on_sigint)
        return self

    def __exit__(self, *exc) -> None:
        self._done.set()
        if self._watcher is not None:
            self._watcher.join()
        if self.interrupted:
            self._kill_all(wait=True)
        if self._previous is not None:
            signal.signal(signal.SIGINT, self._previous)

    def _on_sigint(self, _signum, _frame) -> None:
        self.interrupted += 1
        if self.interrupted > 1:
            self._kill_all()
            return
        os.write(2, f"{self.notice}\n".encode())
        if _terminal_delivered():
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
