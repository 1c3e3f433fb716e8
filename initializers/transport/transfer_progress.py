"""Download progress: bytes done of total and throughput, as log lines or a terminal bar.

In a Pod or under the local backend stdout is a pipe: a progress bar would be thousands of
carriage returns in the log, so a line is printed every ``TUNEPACK_PROGRESS_SECONDS`` (10 s by
default) instead. On a terminal a tqdm bar is drawn on stderr.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from collections.abc import Callable

INTERVAL_ENV = "TUNEPACK_PROGRESS_SECONDS"
DEFAULT_INTERVAL = 10.0


def human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


class Progress:
    """Thread-safe byte counter shared by parallel downloads of one initializer run."""

    def __init__(self, log: Callable[[str], None], total_bytes: int | None, total_files: int):
        self._log = log
        self._lock = threading.Lock()
        self.total_bytes = total_bytes
        self.total_files = total_files
        self.done_bytes = 0  # downloaded by this run
        self.skipped_bytes = 0  # already complete (earlier run or resumed prefix): no traffic
        self.files_done = 0
        self.files_skipped = 0
        self._start = time.monotonic()
        self._stop = threading.Event()
        self._bar = None
        self._thread = None
        try:
            interval = float(os.environ.get(INTERVAL_ENV, "") or DEFAULT_INTERVAL)
        except ValueError:
            interval = DEFAULT_INTERVAL
        if sys.stderr.isatty():
            from tqdm import tqdm

            self._bar = tqdm(total=total_bytes, unit="B", unit_scale=True, unit_divisor=1024)
        elif interval > 0:
            self._thread = threading.Thread(target=self._report, args=(interval,), daemon=True)
            self._thread.start()

    def add(self, n: int) -> None:
        with self._lock:
            self.done_bytes += n
        if self._bar is not None:
            self._bar.update(n)

    def skip(self, n: int, whole_file: bool = False) -> None:
        """Count bytes that are already on disk (a complete file or a resumed prefix)."""
        with self._lock:
            self.skipped_bytes += n
            if whole_file:
                self.files_skipped += 1
        if self._bar is not None:
            self._bar.update(n)

    def file_done(self) -> None:
        with self._lock:
            self.files_done += 1

    def rollback(self, n: int) -> None:
        """Forget ``n`` bytes of a file that must be downloaded again (changed or corrupt)."""
        with self._lock:
            self.done_bytes -= n
        if self._bar is not None:
            self._bar.update(-n)

    def line(self) -> str:
        with self._lock:
            done, skipped = self.done_bytes, self.skipped_bytes
            files = self.files_done + self.files_skipped
        elapsed = max(time.monotonic() - self._start, 1e-6)
        have = done + skipped
        if self.total_bytes:
            amount = (
                f"{human_bytes(have)} of {human_bytes(self.total_bytes)} "
                f"({100 * have / self.total_bytes:.0f}%)"
            )
        else:
            amount = human_bytes(have)
        return (
            f"downloaded {amount} at {human_bytes(done / elapsed)}/s, "
            f"{files} of {self.total_files} files complete"
        )

    def _report(self, interval: float) -> None:
        while not self._stop.wait(interval):
            self._log(self.line())

    def close(self) -> str:
        """Stop reporting; return the summary line."""
        self._stop.set()
        if self._bar is not None:
            self._bar.close()
        elapsed = max(time.monotonic() - self._start, 1e-6)
        reused = (
            f"; {human_bytes(self.skipped_bytes)} already on disk from an earlier run "
            f"({self.files_skipped} complete files) not downloaded again"
            if self.skipped_bytes
            else ""
        )
        files = f"{self.files_done} file{'' if self.files_done == 1 else 's'}"
        return (
            f"downloaded {human_bytes(self.done_bytes)} in {elapsed:.1f} s "
            f"({human_bytes(self.done_bytes / elapsed)}/s), {files}{reused}"
        )
