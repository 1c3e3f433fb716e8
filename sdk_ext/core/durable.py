"""All-or-nothing, crash-safe writes: the one place staged content is renamed into place.

A reader, or a restarted Pod, finds the old content or the complete new one, never half a file;
a failed write (a full disk included) removes what it staged. Files 0644 and directories 0755
whatever the umask, because a serving Pod may read a result as another user."""

from __future__ import annotations

import errno
import json
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

from tunepack.core.errors import DiskFullError, TunepackError

FILE_MODE = 0o644
DIR_MODE = 0o755
_FULL_ERRNOS = (errno.ENOSPC, errno.EDQUOT)
# How libraries that hide the OSError (safetensors, torch's C++ writers) still say it.
_FULL_MESSAGES = ("No space left on device", "Disk quota exceeded", "os error 28", "os error 122")
_NEARLY_FULL = 1 << 20  # free bytes below which an opaque write failure is taken as disk-full

# The names the writers below stage under or set aside, beside what they write: each is
# ``.<name><mark><suffix>`` (these functions), so that a killed writer's leftovers are known by
# the same marks (``remove_staging_leftovers``).
_TEMP_MARK = ".tmp-"  # write_bytes: the file before its rename
_STAGING_MARK = ".partial-"  # publish_dir: the directory while it is written
_ASIDE_MARK = ".old-"  # publish_dir: the replaced directory, until the new one is in place
LEFTOVER_MARKS = (_TEMP_MARK, _STAGING_MARK, _ASIDE_MARK)


def _temp_name(path: Path) -> Path:
    return path.with_name(f".{path.name}{_TEMP_MARK}{os.getpid()}")


def _staging_prefix(destination: Path) -> str:
    return f".{destination.name}{_STAGING_MARK}"  # mkdtemp adds the random suffix


def _aside_name(destination: Path) -> Path:
    return destination.with_name(f".{destination.name}{_ASIDE_MARK}{os.getpid()}")


def is_leftover(name: str) -> bool:
    """Whether ``name`` is one a writer here stages under or sets aside (``.<name><mark>...``)."""
    # A leading dot, the name, the mark, a suffix: the mark is inside what the dot starts.
    return name.startswith(".") and any(mark in name[1:-1] for mark in LEFTOVER_MARKS)


def is_disk_full(err: BaseException) -> bool:
    """Whether ``err`` (or an exception it was raised from) says the disk or quota is full."""
    seen = set()
    while err is not None and id(err) not in seen:
        seen.add(id(err))
        if isinstance(err, OSError) and err.errno in _FULL_ERRNOS:
            return True
        if any(text in str(err) for text in _FULL_MESSAGES):
            return True
        err = err.__cause__ or err.__context__
    return False


def free_bytes(path: Path) -> int | None:
    """Bytes an unprivileged writer may still use on ``path``'s filesystem (nearest existing
    ancestor), or None when unknown."""
    path = Path(path)
    for candidate in (path, *path.parents):
        try:
            st = os.statvfs(candidate)
        except OSError:
            continue
        return st.f_bavail * st.f_frsize
    return None


def size_text(n: int) -> str:
    """``n`` bytes as people read it: "512 bytes", "1.5 MiB"."""
    for unit in ("bytes", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n} {unit}" if unit == "bytes" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n} bytes"  # pragma: no cover


def disk_full_error(
    path: object | None, needed: int | None = None, *, nothing_kept: bool = False
) -> DiskFullError:
    """The error of a write that failed for want of space, in one line: the path written (when
    known), the space the write needed (when known) and the space free there now;
    ``nothing_kept``: the caller removed what it had written."""
    at = f" writing {path}" if path else ""
    sizes = [f"{size_text(needed)} needed"] if needed else []
    if path:
        free = free_bytes(Path(str(path)))
        sizes.append(f"{size_text(free)} free" if free is not None else "free space unknown")
    detail = f" ({', '.join(sizes)})" if sizes else ""
    kept = "; nothing partial was kept" if nothing_kept else ""
    return DiskFullError(
        f"no space left on the device (or quota){at}{detail}: free space or enlarge the volume, "
        f"then run again{kept}"
    )


@contextmanager
def disk_full_as_error(path: Path, needed: int | None = None) -> Iterator[None]:
    """Turn a disk-full failure while writing ``path`` into one ``DiskFullError`` line, which
    says the space the write needed when the caller knows it (``needed`` bytes: a download's
    size, a checkpoint's or a model's estimate).

    Also catches writers that hide the cause (torch.save reports only "iostream error"): a
    failure that is no ``OSError`` counts as disk-full when the filesystem is (nearly) out of
    space at that moment. Use it inside the code that removes the partial output, so the free
    space is measured before the cleanup releases it.
    """
    try:
        yield
    except (TunepackError, KeyboardInterrupt, SystemExit, GeneratorExit):
        raise
    except BaseException as err:  # torch's CheckpointException is a BaseException
        free = free_bytes(path)
        opaque = not isinstance(err, OSError) and free is not None
        if not is_disk_full(err) and not (opaque and free < max(needed or 0, _NEARLY_FULL)):
            raise
        raise disk_full_error(path, needed, nothing_kept=True) from None


def fsync_dir(directory: Path) -> None:
    """Flush a directory's entries (a rename is durable only once its directory is)."""
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_bytes(path: Path, data: bytes) -> None:
    """Replace ``path`` with ``data`` atomically and durably.

    The rename also means a hard-linked file (a model file linked into the workspace) is never
    written through.
    """
    tmp = _temp_name(path)
    try:
        with disk_full_as_error(path, len(data)):
            with open(tmp, "wb") as f:
                os.fchmod(f.fileno(), FILE_MODE)
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    fsync_dir(path.parent)


def write_text(path: Path, text: str) -> None:
    """Replace ``path`` with ``text`` (UTF-8) atomically and durably (``write_bytes``)."""
    write_bytes(path, text.encode("utf-8"))


def write_json(path: Path, data: object) -> None:
    write_text(path, json.dumps(data, indent=2) + "\n")


def make_readable(directory: Path) -> None:
    """Directories 0755 and files 0644 under ``directory`` (itself included); links are left."""
    os.chmod(directory, DIR_MODE)
    for parent, dirs, files in os.walk(directory):
        for name in dirs:
            if not os.path.islink(os.path.join(parent, name)):
                os.chmod(os.path.join(parent, name), DIR_MODE)
        for name in files:
            if not os.path.islink(os.path.join(parent, name)):
                os.chmod(os.path.join(parent, name), FILE_MODE)


def publish_dir(
    destination: Path, write: Callable[[Path], None], *, needed: int | None = None
) -> Path:
    """Run ``write(staging_dir)``, then move the result to ``destination`` as a whole.

    An existing ``destination`` is replaced only after ``write`` succeeded; on failure the
    staging directory is removed and ``destination`` is left as it was. The published tree is
    world-readable (directories 0755, files 0644): ``mkdtemp`` alone would make it 0700. A full
    disk raises ``DiskFullError`` naming ``destination`` (and ``needed`` bytes, when given).
    """
    with disk_full_as_error(destination, needed):
        destination.parent.mkdir(parents=True, exist_ok=True)
        staging = Path(
            tempfile.mkdtemp(prefix=_staging_prefix(destination), dir=destination.parent)
        )
    try:
        with disk_full_as_error(destination, needed):
            write(staging)
        make_readable(staging)
        rename_dir(
            staging,
            destination,
            aside=_aside_name(destination),
        )
    finally:
        if staging.exists():
            shutil.rmtree(staging)
    return destination


def remove_staging_leftovers(directory: Path) -> list[Path]:
    """Remove what the writers here stage or set aside in ``directory`` and a killed run left
    behind (``is_leftover``: ``write_bytes``' ``.<name>.tmp-*``, ``publish_dir``'s
    ``.<name>.partial-*`` and ``.<name>.old-*``); return it. Only for a caller that holds the
    directory alone (the trainer under the workspace lock)."""
    if not directory.is_dir():
        return []
    left = sorted(p for p in directory.iterdir() if is_leftover(p.name))
    for path in left:
        remove(path)
    return left


def rename_dir(staging: Path, destination: Path, *, aside: Path | None = None) -> None:
    """Put the complete directory ``staging`` in place as ``destination``, durably: the one
    stage-then-rename of a directory.

    With ``aside``, whatever is at ``destination`` is replaced: it is first renamed to ``aside``
    (a name the caller's cleanup of interrupted runs recognises), then removed once the new one
    is in place, so a reader finds the old or the new directory, and a crash leaves at worst the
    old one under ``aside``. Without, the rename replaces only an empty directory and raises
    ``OSError`` over a non-empty one (for callers that never replace another writer's result).
    """
    old = None
    if aside is not None and (destination.exists() or destination.is_symlink()):
        os.rename(destination, aside)
        old = aside
    os.rename(staging, destination)
    fsync_dir(destination.parent)
    if old is not None:
        remove(old)


def remove(path: Path) -> None:
    """Remove a staged or set-aside file or directory (a link is removed, not followed)."""
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)
