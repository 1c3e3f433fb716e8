"""``metrics.jsonl``, the run's step and evaluation records: opened once per attempt, one whole
line appended at a time."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import BinaryIO

from tunepack.core import durable


def open_for(path: Path, resumed_from: int | None) -> BinaryIO:
    """The file, opened for appending: empty for a fresh run; a resumed run keeps the records up
    to its checkpoint's step."""
    path.parent.mkdir(parents=True, exist_ok=True)
    if resumed_from is None:
        durable.write_text(path, "")
    else:
        # A resumed run appends: the file keeps the whole history of the run, each step once.
        # The steps after the checkpoint (trained before the interruption, trained again
        # now) and a line cut short by the kill are dropped first, in one atomic rewrite.
        durable.write_text(path, "".join(_lines_up_to(path, resumed_from)))
    return path.open("ab", buffering=0)  # unbuffered: a failed write is undone at once


def append_line(file, path: Path, line: str) -> None:
    """Append one whole line to an unbuffered file, or nothing (a full disk cuts it back)."""
    data = memoryview(line.encode("utf-8"))
    start = os.lseek(file.fileno(), 0, os.SEEK_END)
    try:
        with durable.disk_full_as_error(path, len(data)):
            while data:
                data = data[file.write(data) :]
    except BaseException:
        try:
            os.ftruncate(file.fileno(), start)
        except OSError:
            pass
        raise


def _lines_up_to(path: Path, step: int) -> list[str]:
    """The lines of a metrics file that record ``step`` or earlier (complete lines only)."""
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        return []
    kept = []
    for line in text.splitlines(keepends=True):
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if not line.endswith("\n") or not isinstance(record, dict):
            continue
        recorded = record.get("step")
        if isinstance(recorded, int) and recorded > step:
            continue
        kept.append(line)
    return kept
