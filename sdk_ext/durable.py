"""All-or-nothing, crash-safe writes, shared by the initializers, the trainer and the backends.

A reader (or a restarted Pod) must find either the old content or the complete new one, never a
half-written file: every write goes to a temporary name in the same directory, is flushed to
disk, and is renamed into place; the directory entry is then flushed too.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path


def fsync_dir(directory: Path) -> None:
    """Flush a directory's entries (a rename is durable only once its directory is)."""
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_text(path: Path, text: str) -> None:
    """Replace ``path`` with ``text`` atomically and durably.

    The rename also means a hard-linked file (a model file linked into the workspace) is never
    written through.
    """
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    fsync_dir(path.parent)


def write_json(path: Path, data: object) -> None:
    write_text(path, json.dumps(data, indent=2) + "\n")


def publish_dir(destination: Path, write: Callable[[Path], None]) -> Path:
    """Run ``write(staging_dir)``, then move the result to ``destination`` as a whole.

    An existing ``destination`` is replaced only after ``write`` succeeded; on failure the
    staging directory is removed and ``destination`` is left as it was.
    """
    destination.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{destination.name}.partial-", dir=destination.parent))
    try:
        write(staging)
        if destination.exists():
            old = destination.with_name(f".{destination.name}.old-{os.getpid()}")
            destination.rename(old)
            staging.rename(destination)
            shutil.rmtree(old)
        else:
            staging.rename(destination)
        fsync_dir(destination.parent)
    finally:
        if staging.exists():
            shutil.rmtree(staging)
    return destination
