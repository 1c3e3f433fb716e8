"""Parallel, resumable, verified downloads into the workspace's download cache.

Under ``<workspace>/.tunepack-downloads/<kind>-<source id>/``: verified files (created only by
rename), ``.incomplete/<key>`` (resumed by range; the key holds the file's version, so versions
are never spliced) and ``.tunepack-verified.json`` (so a re-run neither downloads nor re-hashes).
docs/initializers.md, "Robustness"."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import threading
from collections.abc import Iterator
from concurrent.futures import FIRST_EXCEPTION, ThreadPoolExecutor, wait
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

from tunepack.core import durable
from tunepack.core.errors import BadInputError, BadValueError
from tunepack.initializers.transport import uri
from tunepack.initializers.transport.retry import retrying
from tunepack.initializers.transport.sources import Listing, RemoteFile, RemoteSource
from tunepack.initializers.transport.transfer_progress import Progress

CACHE_ROOT = ".tunepack-downloads"
VERIFIED_FILE = ".tunepack-verified.json"
INCOMPLETE_DIR = ".incomplete"
WORKERS_ENV = "TUNEPACK_DOWNLOAD_WORKERS"
_CHUNK = 1 << 20


@dataclass(frozen=True)
class Verified:
    path: Path
    size: int
    sha256: str


class _Cancelled(Exception):
    """Another file failed: stop this transfer, keep its bytes for the next run."""


def cache_dir(workspace: Path, kind: str, source_id: str) -> Path:
    digest = hashlib.sha256(source_id.encode()).hexdigest()[:16]
    return workspace / CACHE_ROOT / f"{kind}-{digest}"


def prune_other_caches(keep: Path) -> list[Path]:
    """Remove download caches of the same kind left by other sources; return them."""
    kind = keep.name.rsplit("-", 1)[0]
    removed = []
    if keep.parent.is_dir():
        for path in sorted(keep.parent.glob(f"{kind}-*")):
            if path != keep:
                shutil.rmtree(path, ignore_errors=True)
                removed.append(path)
    return removed


def open_listing(
    source_uri: uri.StorageUri, kind: str, cache: Path, log
) -> tuple[RemoteSource, Listing]:
    """Clear other sources' caches, then open ``source_uri`` and list it (with retries)."""
    for stale in prune_other_caches(cache):
        log(f"removed the download cache of another source ({stale.name})")
    source = uri.remote_source(source_uri, kind)
    return source, retrying(f"listing {source_uri.display!r}", source.list, log)


def remove_cache(directory: Path) -> None:
    shutil.rmtree(directory, ignore_errors=True)
    try:
        directory.parent.rmdir()  # only when no other cache is left
    except OSError:
        pass


@contextmanager
def removed_if_refused(directory: Path) -> Iterator[None]:
    """Remove the download cache ``directory`` (and ``.tunepack-downloads/`` when it is left
    empty) if what it holds is refused (``BadInputError``: an archive with a member outside its
    directory, a link, a bad format): a refused source leaves nothing behind. Any other failure
    (network, SIGTERM, a full disk) keeps it, so the next run resumes the download."""
    try:
        yield
    except BadInputError:
        remove_cache(directory)
        raise


def safe_relpath(path: str, source_display: str) -> str:
    """``path`` as a relative POSIX path that stays inside its directory, or BadInputError."""
    pure = PurePosixPath(path)
    if not path or pure.is_absolute() or ".." in pure.parts or "\\" in path or "\0" in path:
        raise BadInputError(
            f"{source_display!r} lists a file named {path!r}, which would be written outside "
            f"the workspace; refusing to download it. Remove or rename that file at the source"
        )
    return str(pure)


def fetch(
    source: RemoteSource,
    files: list[RemoteFile],
    directory: Path,
    log,
) -> dict[str, Verified]:
    """Make every file complete and verified under ``directory``; return them by path."""
    directory.mkdir(parents=True, exist_ok=True)
    display = source.uri.display
    for f in files:
        safe_relpath(f.path, display)
    records = _load_records(directory)
    done: dict[str, Verified] = {}
    todo: list[RemoteFile] = []
    known = [f.size for f in files]
    total = sum(s for s in known if s is not None) if None not in known else None
    progress = Progress(log, total, len(files))
    for f in files:
        reuse = _reusable(directory, f, records.get(f.path))
        if reuse is not None:
            done[f.path] = reuse
            progress.skip(reuse.size, whole_file=True)
        else:
            todo.append(f)

    lock = threading.Lock()
    cancel = threading.Event()

    def one(f: RemoteFile) -> None:
        verified, record = _download(source, f, directory, progress, cancel, log)
        with lock:
            done[f.path] = verified
            records[f.path] = record
            _save_records(directory, records)
        progress.file_done()

    workers = _workers(source)
    pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="download")
    try:
        futures = [pool.submit(one, f) for f in todo]
        finished, _ = wait(futures, return_when=FIRST_EXCEPTION)
        for future in finished:
            if future.exception() is not None:
                raise future.exception()
        wait(futures)
        for future in futures:
            future.result()
    except (OSError, durable.DiskFullError) as error:
        if not isinstance(error, durable.DiskFullError) and not durable.is_disk_full(error):
            raise
        # Whichever write found the disk full, what the download needs is its whole size; the
        # bytes received stay in .incomplete/ for the next run.
        raise durable.disk_full_error(directory, total) from None
    finally:
        # On failure or SIGTERM: stop the other transfers at their next chunk; their bytes stay
        # in .incomplete/ for the next run.
        cancel.set()
        pool.shutdown(wait=True, cancel_futures=True)
        summary = progress.close()
    log(summary)
    return done


def _workers(source: RemoteSource) -> int:
    raw = os.environ.get(WORKERS_ENV, "").strip()
    if not raw:
        return source.concurrency
    if not raw.isdigit() or int(raw) < 1:
        raise BadValueError(f"{WORKERS_ENV}={raw!r} is not valid: expected a positive integer")
    return int(raw)


def _reusable(directory: Path, f: RemoteFile, record: dict | None) -> Verified | None:
    if not isinstance(record, dict):
        return None
    path = directory / f.path
    try:
        stat = path.stat()
    except OSError:
        return None
    if stat.st_size != record.get("size") or stat.st_mtime_ns != record.get("mtime_ns"):
        return None
    if f.size is not None and f.size != stat.st_size:
        return None
    expected = {"sha256": f.sha256, "git_sha1": f.git_sha1, "md5": f.md5}
    published = {k: v for k, v in expected.items() if v}
    if published:
        if any(record.get(k) != v for k, v in published.items()):
            return None
    elif not f.version or record.get("version") != f.version:
        return None
    return Verified(path, stat.st_size, record["sha256"])


def _incomplete_path(directory: Path, f: RemoteFile) -> Path:
    identity = "\0".join([f.path, f.version, f.sha256 or "", f.git_sha1 or "", f.md5 or ""])
    return directory / INCOMPLETE_DIR / hashlib.sha256(identity.encode()).hexdigest()[:32]


class _Hashes:
    """The digests of a growing file, kept across retries while the file on disk matches."""

    def __init__(self, f: RemoteFile):
        self.size = 0
        self.sha256 = hashlib.sha256()
        self.md5 = hashlib.md5(usedforsecurity=False) if f.md5 else None
        self.git = None
        if f.git_sha1 and f.size is not None:
            # git's blob id is sha1 over "blob <size>\0" + content.
            self.git = hashlib.sha1(f"blob {f.size}\0".encode(), usedforsecurity=False)

    def update(self, chunk: bytes) -> None:
        self.size += len(chunk)
        self.sha256.update(chunk)
        if self.md5 is not None:
            self.md5.update(chunk)
        if self.git is not None:
            self.git.update(chunk)


def _download(
    source: RemoteSource,
    f: RemoteFile,
    directory: Path,
    progress: Progress,
    cancel: threading.Event,
    log,
) -> tuple[Verified, dict]:
    display = source.uri.display
    incomplete = _incomplete_path(directory, f)
    incomplete.parent.mkdir(parents=True, exist_ok=True)
    state = {"hashes": _Hashes(f), "counted": 0}

    def rehash_prefix(size: int) -> None:
        hashes = _Hashes(f)
        with open(incomplete, "rb") as fin:
            while hashes.size < size and (chunk := fin.read(min(_CHUNK, size - hashes.size))):
                hashes.update(chunk)
        state["hashes"] = hashes

    def account(on_disk: int) -> None:
        # Keep the progress counter equal to what is on disk for this file.
        if on_disk > state["counted"]:
            progress.skip(on_disk - state["counted"])
        elif on_disk < state["counted"]:
            progress.rollback(state["counted"] - on_disk)
        state["counted"] = on_disk

    def transfer() -> None:
        offset = incomplete.stat().st_size if incomplete.exists() else 0
        if f.size is not None and offset > f.size:
            offset = 0
        if offset != state["hashes"].size:
            rehash_prefix(offset)
        account(offset)
        if f.size is not None and offset == f.size:
            return
        with source.open(f, offset) as body:
            if body.offset != offset:  # the server ignored the range: start over
                offset = 0
                state["hashes"] = _Hashes(f)
                account(0)
            with open(incomplete, "r+b" if incomplete.exists() else "wb") as out:
                out.seek(offset)
                out.truncate()
                # Sources turn network failures while streaming into Retryable; a local disk
                # error (ENOSPC) propagates as the bug-or-environment problem it is.
                for chunk in body.chunks:
                    if cancel.is_set():
                        raise _Cancelled
                    out.write(chunk)
                    state["hashes"].update(chunk)
                    state["counted"] += len(chunk)
                    progress.add(len(chunk))
                out.flush()
                os.fsync(out.fileno())

    for check in (1, 2):
        retrying(f"downloading {f.path} from {display!r}", transfer, log)
        problem = _verify(f, state["hashes"])
        if problem is None:
            break
        incomplete.unlink(missing_ok=True)
        state["hashes"] = _Hashes(f)
        account(0)
        if check == 2:
            raise BadInputError(
                f"{f.path} from {display!r} does not match its published checksum twice in a "
                f"row ({problem}); nothing was published. The copy at the source may be "
                f"corrupt: check it there or pin another revision"
            )
        log(f"{f.path}: {problem}; downloading it again")

    target = directory / f.path
    target.parent.mkdir(parents=True, exist_ok=True)
    os.replace(incomplete, target)
    hashes = state["hashes"]
    record = {
        "size": hashes.size,
        "mtime_ns": target.stat().st_mtime_ns,
        "version": f.version,
        "sha256": hashes.sha256.hexdigest(),
    }
    if hashes.git is not None:
        record["git_sha1"] = hashes.git.hexdigest()
    if hashes.md5 is not None:
        record["md5"] = hashes.md5.hexdigest()
    return Verified(target, hashes.size, record["sha256"]), record


def _verify(f: RemoteFile, hashes: _Hashes) -> str | None:
    if f.size is not None and hashes.size != f.size:
        return f"received {hashes.size} bytes, expected {f.size}"
    if f.sha256 and hashes.sha256.hexdigest() != f.sha256:
        return f"sha256 is {hashes.sha256.hexdigest()}, expected {f.sha256}"
    if hashes.git is not None and hashes.git.hexdigest() != f.git_sha1:
        return f"git blob id is {hashes.git.hexdigest()}, expected {f.git_sha1}"
    if hashes.md5 is not None and hashes.md5.hexdigest() != f.md5:
        return f"md5 is {hashes.md5.hexdigest()}, expected {f.md5}"
    return None


def _load_records(directory: Path) -> dict:
    try:
        data = json.loads((directory / VERIFIED_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def _save_records(directory: Path, records: dict) -> None:
    durable.write_text(directory / VERIFIED_FILE, json.dumps(records, indent=1, sort_keys=True))
