"""Atomic, verifiable workspace directories.

An initializer builds its output in a sibling ``<dest>.partial-<random>`` directory and renames it
into place only when complete, so a reader of ``<dest>`` never sees half-written files. The
manifest (``tunepack-manifest.json``) is written last, inside the partial directory: a destination
is complete when its manifest matches the current request and the files it records are intact.
A process killed mid-build leaves only a partial directory, which the next run removes.
"""

from __future__ import annotations

import glob
import hashlib
import json
import os
import secrets
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from datetime import UTC, datetime
from pathlib import Path

from tunepack.core import durable
from tunepack.core.errors import BadValueError, ConflictError, DeniedError
from tunepack.core.workspace import MANIFEST_FILE, WORKSPACE_ENV

PARTIAL_MARK = ".partial-"


def now_iso() -> str:
    """The manifest's ``created`` time: UTC, ISO 8601, seconds."""
    return datetime.now(UTC).isoformat(timespec="seconds").replace("+00:00", "Z")


def sha256_file(path: Path) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def source_fingerprint(files: Mapping[str, Path]) -> str:
    """A cheap identity of local source files (names, sizes, mtimes), to notice edited sources.

    Stat-only on purpose: re-hashing a multi-GiB source on every run would make the "already
    complete" check slow.
    """
    digest = hashlib.sha256()
    for name in sorted(files):
        stat = files[name].stat()
        digest.update(f"{name}\0{stat.st_size}\0{stat.st_mtime_ns}\n".encode())
    return digest.hexdigest()


def read_manifest(directory: Path) -> dict | None:
    try:
        manifest = json.loads((directory / MANIFEST_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return manifest if isinstance(manifest, dict) else None


def write_manifest(directory: Path, manifest: Mapping[str, object]) -> None:
    """Write the manifest durably, through a rename so it never writes into a hard-linked file."""
    durable.write_json(directory / MANIFEST_FILE, dict(manifest))


def why_incomplete(
    dest: Path, expect: Mapping[str, object], hashed: frozenset[str] = frozenset()
) -> str | None:
    """None when ``dest`` is complete for this request; otherwise why it must be (re)built.

    ``expect`` holds manifest fields that must match (kind, source, ...). Every recorded file must
    exist with its recorded size; files named in ``hashed`` are re-hashed as well.
    """
    if not dest.exists():
        return "not built yet"
    manifest = read_manifest(dest)
    if manifest is None:
        return f"{MANIFEST_FILE} is missing or unreadable"
    for key, value in expect.items():
        if manifest.get(key) == value:
            continue
        if key == "source_fingerprint":
            return "the source files changed since the last run"
        return f"{key} changed (was {manifest.get(key)!r})"
    files = manifest.get("files")
    if not isinstance(files, dict) or not files:
        return f"{MANIFEST_FILE} lists no files"
    for name, record in files.items():
        path = dest / name
        if not path.is_file():
            return f"{name} is missing"
        if not isinstance(record, dict) or path.stat().st_size != record.get("size"):
            return f"{name} has changed size"
        if name in hashed and sha256_file(path) != record.get("sha256"):
            return f"{name} has changed content"
    return None


def files_size(files: dict[str, Path]) -> int:
    """The bytes of ``files`` together: what copying them into a staged directory needs."""
    return sum(path.stat().st_size for path in files.values())


def remove_stale_partials(dest: Path) -> list[Path]:
    """Remove ``<dest>.partial-*`` left by interrupted runs; return what was removed."""
    stale = sorted(Path(p) for p in glob.glob(glob.escape(str(dest)) + PARTIAL_MARK + "*"))
    for path in stale:
        durable.remove(path)
    return stale


@contextmanager
def staged(dest: Path, needed: int | None = None) -> Iterator[Path]:
    """Yield an empty partial directory beside ``dest``; publish it as ``dest`` on success.

    The caller fills the directory and writes the manifest last. On any exception (including the
    SIGTERM the entry point turns into one) the partial directory is removed and ``dest`` is left
    exactly as it was. A full disk is one line naming ``dest`` and the space the content needs
    (``needed`` bytes: what the caller knows or estimates of it).
    """
    _check_replaceable(dest)
    partial = dest.with_name(dest.name + PARTIAL_MARK + secrets.token_hex(4))
    try:
        partial.mkdir(parents=True)
    except PermissionError:
        raise DeniedError(
            f"cannot create {partial.parent}: permission denied; set {WORKSPACE_ENV} to a "
            f"writable directory"
        ) from None
    try:
        with durable.disk_full_as_error(dest, needed):  # one line naming dest, exit 75
            yield partial
            _publish(partial, dest)
    except BaseException:
        durable.remove(partial)
        raise


def _check_replaceable(dest: Path) -> None:
    if os.path.ismount(dest):
        # A rename cannot replace a mount point; the workspace volume belongs one level up.
        raise BadValueError(
            f"{dest} is a mount point, so it cannot be replaced atomically; mount the workspace "
            f"volume at {dest.parent} instead"
        )
    if dest.is_dir() and not (dest / MANIFEST_FILE).exists() and any(dest.iterdir()):
        # Never delete content tunepack did not write.
        raise ConflictError(
            f"{dest} holds files that tunepack did not write (no {MANIFEST_FILE}); move them "
            f"away or point {WORKSPACE_ENV} at another directory"
        )


def _publish(partial: Path, dest: Path) -> None:
    if not (partial / MANIFEST_FILE).is_file():
        raise RuntimeError(f"refusing to publish {partial} without its {MANIFEST_FILE}")
    # What was there is moved aside under a partial name, so a crash right then leaves it for
    # the next run's cleanup rather than a stray directory.
    aside = dest.with_name(dest.name + PARTIAL_MARK + "old-" + secrets.token_hex(4))
    durable.rename_dir(partial, dest, aside=aside)
