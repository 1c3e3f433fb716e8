"""Export destinations (``EXPORT_URI``) and fetching an export back.

Each sink uploads a run's files, reads each one back (size and checksum), and writes the export
manifest last; see ``tunepack.initializers.export`` for the contract, whose shared pieces (the
files to send, the manifest's kind and bytes) are here, below the exporter that imports them.
``fetch_export`` does the reverse for ``tunepack download`` and ``Result.download()``: it reads
the manifest first, so only a complete export is ever fetched, and verifies every file against
it.

One module per scheme (``files``: a directory; ``s3``; ``hf``), imported on first use by
``open_sink``: checking a URI (``parse``) never pays for boto3 or huggingface_hub.
"""

from __future__ import annotations

import dataclasses
import importlib
import json
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from tunepack.core import durable
from tunepack.core.errors import BadModelError, BadValueError, NoObjectsError, NotFoundError
from tunepack.core.workspace import MANIFEST_FILE
from tunepack.initializers import atomic
from tunepack.initializers.transport import uri
from tunepack.initializers.transport.retry import retrying
from tunepack.initializers.transport.transfer_progress import human_bytes

Log = Callable[[str], None]
# scheme -> the module of this package that writes it
_SINKS = {"file": "files", "s3": "s3", "hf": "hf"}
SCHEMES = "s3://bucket/prefix, hf://org/name, file:///absolute/path or a path"
# The export contract the exporter and every sink share: what is sent, and the manifest
# written last.
MANIFEST_KIND = "export"


@dataclass(frozen=True)
class LocalFile:
    """One file to export: its path in the export, on disk, and what it must be remotely."""

    rel: str
    path: Path
    size: int
    sha256: str


def same_export(existing: dict | None, manifest: dict) -> bool:
    """Whether a destination's manifest records this very export (``created`` aside)."""
    if not isinstance(existing, dict):
        return False
    return {k: v for k, v in existing.items() if k != "created"} == manifest


def manifest_bytes(manifest: dict) -> bytes:
    return (json.dumps({**manifest, "created": atomic.now_iso()}, indent=2) + "\n").encode()


def parse(raw: str) -> uri.StorageUri:
    """Parse and check an export destination; ``BadInputError`` naming it when unusable."""
    raw = (raw or "").strip()
    shown = uri.redact(raw)
    if not raw:
        raise BadValueError(f"the export destination is empty; expected {SCHEMES}")
    scheme = raw.partition("://")[0].lower() if "://" in raw else "file"
    if scheme not in _SINKS:
        raise BadValueError(
            f"cannot export to {shown!r}: expected {SCHEMES} (https:// is read-only)"
        )
    parsed = uri.parse(raw)
    if parsed.scheme == "file" and parsed.options:
        raise BadValueError(f"export path {shown!r} has a query; write a plain directory path")
    if parsed.scheme == "hf":
        segments = parsed.location.split("/")
        if segments[0] in ("datasets", "models") or len(segments) != 2 or parsed.options:
            raise BadValueError(
                f"cannot export to {shown!r}: a result goes to a model repository, written "
                "hf://org/name (or hf://org/name@branch), with no sub-path or options"
            )
    if parsed.scheme == "s3" and not parsed.location.partition("/")[2].strip("/"):
        raise BadValueError(
            f"export URI {shown!r} names no prefix; write s3://bucket/prefix so the result "
            "has a directory of its own"
        )
    return parsed


def open_sink(raw: str, log: Log):
    parsed = parse(raw)
    return importlib.import_module(f"{__name__}.{_SINKS[parsed.scheme]}").Sink(parsed, log)


def summary(log: Log, display: str, sent: int, kept: int, sent_bytes: int, where: str) -> None:
    log(
        f"exported to {display}: {sent} files uploaded ({human_bytes(sent_bytes)}), {kept} "
        f"already there and verified; {where}"
    )


class RemoteCalls:
    """One remote operation, retried while it may pass: a missing object is None when the caller
    allows it, any other error is mapped by the sink's ``_problem`` (BadInputError or
    Retryable)."""

    def _call(self, what: str, operation, *args, missing_ok: bool = False, **kwargs):
        def attempt():
            try:
                return operation(*args, **kwargs)
            except Exception as error:  # noqa: BLE001 - mapped or re-raised below
                if missing_ok and self._is_missing(error):
                    return None
                raise self._problem(error) from None

        return retrying(what, attempt, self.log)


# --- fetching an export back ---------------------------------------------------------------------


def fetch_export(raw: str, dest: Path, log: Log) -> dict:
    """Fetch the export at ``raw`` into directory ``dest``, verified against its manifest;
    return the manifest. ``dest`` appears only when complete (staged, then renamed); a fetch
    interrupted midway resumes where it stopped."""
    from tunepack.initializers.transport import download

    parsed = parse(raw)
    dest = Path(dest).expanduser().absolute()
    if parsed.scheme == "file":
        source_dir = Path(parsed.location)
        manifest = atomic.read_manifest(source_dir)
        _check_manifest(manifest, parsed.display)
        if _already(dest, manifest):
            log(f"{dest} already holds this export")
            return manifest
        files = {rel: source_dir / rel for rel in manifest["files"]}
        for rel, path in files.items():
            if not path.is_file():
                raise NotFoundError(
                    f"{parsed.display!r} lists {rel}, which is missing there", what="file", name=rel
                )
        known = {}
    else:
        cache = dest.with_name(f".{dest.name}.tunepack-download")
        source = uri.remote_source(parsed, "model")
        if parsed.scheme == "hf":
            from huggingface_hub import HfApi

            from tunepack.initializers.sinks.hf import hub_endpoint

            source.endpoint = hub_endpoint()
            source.api = HfApi(endpoint=source.endpoint, token=source._auth)
        try:
            listing = retrying(f"listing {parsed.display!r}", source.list, log)
        except NoObjectsError:
            _check_manifest(None, parsed.display)  # an empty prefix: no export there
        by_path = {f.path: f for f in listing.files}
        if MANIFEST_FILE not in by_path:
            manifest = None
        else:
            got = download.fetch(source, [by_path[MANIFEST_FILE]], cache, log)
            manifest = atomic.read_manifest(got[MANIFEST_FILE].path.parent)
        _check_manifest(manifest, parsed.display)
        if _already(dest, manifest):
            log(f"{dest} already holds this export")
            shutil.rmtree(cache, ignore_errors=True)
            return manifest
        wanted = []
        for rel, record in manifest["files"].items():
            listed = by_path.get(rel)
            if listed is None:
                raise NotFoundError(
                    f"{parsed.display!r} lists {rel} in its manifest, but the file is not "
                    "there; export the result again",
                    what="file",
                    name=rel,
                )
            wanted.append(dataclasses.replace(listed, sha256=record["sha256"]))
        fetched = download.fetch(source, wanted, cache, log)
        files = {rel: v.path for rel, v in fetched.items()}
        known = {rel: v.sha256 for rel, v in fetched.items()}
    for stale in atomic.remove_stale_partials(dest):
        log(f"removed {stale.name} left by an interrupted download")
    with atomic.staged(dest) as partial:
        for rel, src in files.items():
            target = partial / rel
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(src, target)
            record = manifest["files"][rel]
            sha256 = known.get(rel) or atomic.sha256_file(target)
            if target.stat().st_size != record["size"] or sha256 != record["sha256"]:
                raise BadModelError(
                    f"{rel} from {parsed.display!r} does not match its manifest (size or "
                    "sha256); export the result again"
                )
        durable.write_json(partial / MANIFEST_FILE, manifest)
        durable.make_readable(partial)
    if parsed.scheme != "file":
        shutil.rmtree(cache, ignore_errors=True)
    total = sum(r["size"] for r in manifest["files"].values())
    log(f"downloaded {len(files)} files ({human_bytes(total)}) from {parsed.display} to {dest}")
    return manifest


def _check_manifest(manifest: dict | None, shown: str) -> None:
    from tunepack.initializers.transport.download import safe_relpath

    if manifest is None:
        raise NotFoundError(
            f"{shown!r} holds no complete tunepack export (no {MANIFEST_FILE}): the export did "
            "not finish, or it was never made; run the export again",
            what="export",
            name=shown,
        )
    files = manifest.get("files")
    if manifest.get("kind") != MANIFEST_KIND or not isinstance(files, dict) or not files:
        raise BadModelError(f"{shown!r} holds a {MANIFEST_FILE} that is not an export's")
    for rel, record in files.items():
        safe_relpath(rel, shown)
        if not isinstance(record, dict) or not {"size", "sha256"} <= set(record):
            raise BadModelError(f"{shown!r}: the manifest entry of {rel} is malformed")


def _already(dest: Path, manifest: dict) -> bool:
    local = atomic.read_manifest(dest)
    return local == manifest and not atomic.why_incomplete(
        dest, {"kind": MANIFEST_KIND}, frozenset(manifest["files"])
    )
