"""Export destinations (``EXPORT_URI``) and fetching an export back.

Each sink uploads a run's files, reads each one back (size and checksum), and writes the export
manifest last; see ``tunepack.initializers.export`` for the contract. ``fetch_export`` does the
reverse for ``tunepack download`` and ``Result.download()``: it reads the manifest first, so only
a complete export is ever fetched, and verifies every file against it.

boto3 and huggingface_hub are imported by the sink that needs them.
"""

from __future__ import annotations

import base64
import dataclasses
import hashlib
import json
import os
import shutil
from collections.abc import Callable
from pathlib import Path
from urllib.parse import unquote

from tunepack.core import durable
from tunepack.core.errors import BadInputError, TransientError
from tunepack.core.workspace import MANIFEST_FILE
from tunepack.initializers import atomic, uri
from tunepack.initializers.export import (
    MANIFEST_KIND,
    PRIVATE_ENV,
    SCHEMES,
    LocalFile,
    manifest_bytes,
    same_export,
)
from tunepack.initializers.retry import Retryable, retrying
from tunepack.initializers.transfer_progress import human_bytes

Log = Callable[[str], None]
PART_SIZE_ENV = "TUNEPACK_EXPORT_PART_SIZE_MB"
DEFAULT_PART_MB = 64
MIN_PART_MB = 5  # S3's smallest part (all but the last)
MAX_PARTS = 10_000  # S3's most parts per upload
_CHUNK = 1 << 20


def parse(raw: str) -> uri.StorageUri:
    """Parse and check an export destination; ``BadInputError`` naming it when unusable."""
    raw = (raw or "").strip()
    shown = uri.redact(raw)
    if not raw:
        raise BadInputError(f"the export destination is empty; expected {SCHEMES}")
    scheme = raw.partition("://")[0].lower() if "://" in raw else "file"
    if scheme not in ("s3", "hf", "file"):
        raise BadInputError(
            f"cannot export to {shown!r}: expected {SCHEMES} (https:// is read-only)"
        )
    parsed = uri.parse(raw)
    if parsed.scheme == "file" and parsed.options:
        raise BadInputError(f"export path {shown!r} has a query; write a plain directory path")
    if parsed.scheme == "hf":
        segments = parsed.location.split("/")
        if segments[0] in ("datasets", "models") or len(segments) != 2 or parsed.options:
            raise BadInputError(
                f"cannot export to {shown!r}: a result goes to a model repository, written "
                "hf://org/name (or hf://org/name@branch), with no sub-path or options"
            )
    if parsed.scheme == "s3" and not parsed.location.partition("/")[2].strip("/"):
        raise BadInputError(
            f"export URI {shown!r} names no prefix; write s3://bucket/prefix so the result "
            "has a directory of its own"
        )
    return parsed


def open_sink(raw: str, log: Log):
    parsed = parse(raw)
    if parsed.scheme == "s3":
        return S3Sink(parsed, log)
    if parsed.scheme == "hf":
        return HubSink(parsed, log)
    return LocalSink(parsed, log)


def _private() -> bool:
    raw = os.environ.get(PRIVATE_ENV, "").strip().lower()
    if raw in ("", "true", "1", "yes"):
        return True
    if raw in ("false", "0", "no"):
        return False
    raise BadInputError(f"{PRIVATE_ENV}={raw!r} is not valid: expected true or false")


def _summary(log: Log, display: str, sent: int, kept: int, sent_bytes: int, where: str) -> None:
    log(
        f"exported to {display}: {sent} files uploaded ({human_bytes(sent_bytes)}), {kept} "
        f"already there and verified; {where}"
    )


# --- a directory (local disk, or a PVC mounted in the Pod) ---------------------------------------


class LocalSink:
    def __init__(self, parsed: uri.StorageUri, log: Log):
        self.dest = Path(parsed.location)
        self.display = parsed.canonical
        self.log = log

    def publish(self, files: list[LocalFile], manifest: dict) -> None:
        for stale in atomic.remove_stale_partials(self.dest):
            self.log(f"removed {stale.name} left by an interrupted export")
        existing = atomic.read_manifest(self.dest)
        hashed = frozenset(f.rel for f in files)
        if same_export(existing, manifest) and not atomic.why_incomplete(
            self.dest, {"kind": MANIFEST_KIND}, hashed
        ):
            self.log(f"{self.dest} already holds this export (every file verified)")
            return
        with atomic.staged(self.dest) as partial:
            for f in files:
                target = partial / f.rel
                target.parent.mkdir(parents=True, exist_ok=True)
                shutil.copyfile(f.path, target)
                with open(target, "rb+") as out:
                    os.fsync(out.fileno())
                # Read back from the destination: what a reader will get.
                size, sha256 = target.stat().st_size, atomic.sha256_file(target)
                if (size, sha256) != (f.size, f.sha256):
                    raise TransientError(
                        f"{f.rel} read back from {self.dest} differs from the result ({size} "
                        f"bytes, sha256 {sha256}; expected {f.size}, {f.sha256}); the step "
                        "exits 75 so a retry writes it again"
                    )
            (partial / MANIFEST_FILE).write_bytes(manifest_bytes(manifest))
            durable.make_readable(partial)
        _summary(
            self.log, self.display, len(files), 0, sum(f.size for f in files), "manifest written"
        )

    def read_manifest(self) -> dict | None:
        return atomic.read_manifest(self.dest)


# --- S3 ------------------------------------------------------------------------------------------


def _part_size() -> int:
    raw = os.environ.get(PART_SIZE_ENV, "").strip()
    if not raw:
        return DEFAULT_PART_MB << 20
    if not raw.isdigit() or int(raw) < MIN_PART_MB:
        raise BadInputError(
            f"{PART_SIZE_ENV}={raw!r} is not valid: expected a whole number of MiB, at least "
            f"{MIN_PART_MB}"
        )
    return int(raw) << 20


def _md5_b64(data: bytes) -> str:
    return base64.b64encode(hashlib.md5(data).digest()).decode()  # noqa: S324 - S3's ETag


class _RemoteCalls:
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


class S3Sink(_RemoteCalls):
    """Objects under ``s3://bucket/prefix/``. Each PUT carries Content-MD5, so the store refuses
    a body damaged on the way; then a HEAD reads back the size and the ETag (the MD5, or for a
    multipart object the MD5 of the parts' MD5s) and compares them with the local file's."""

    def __init__(self, parsed: uri.StorageUri, log: Log):
        from botocore.config import Config

        from tunepack.initializers.sources import s3

        self.s3 = s3
        self.uri = parsed
        self.display = parsed.display
        self.log = log
        self.bucket, _, prefix = parsed.location.partition("/")
        self.prefix = prefix.strip("/")
        self.part_size = _part_size()
        endpoint = s3._endpoint()
        style = os.environ.get("S3_ADDRESSING_STYLE", "").strip() or (
            "path" if endpoint else "auto"
        )
        config = Config(
            retries={"total_max_attempts": 1},  # tunepack retries, with its own logging
            connect_timeout=10,
            read_timeout=120,
            s3={"addressing_style": style},
            # Content-MD5 is the integrity check; no streaming CRC trailers, which some
            # S3-compatible stores refuse.
            request_checksum_calculation="when_required",
            response_checksum_validation="when_required",
        )
        region = os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION") or None
        import boto3

        self.client = boto3.session.Session().client(
            "s3", endpoint_url=endpoint, region_name=region, config=config
        )

    def key(self, rel: str) -> str:
        return f"{self.prefix}/{rel}"

    # The operations below raise BadInputError or Retryable (mapped by _problem); the callers
    # wrap them in retrying().

    @staticmethod
    def _is_missing(error: Exception) -> bool:
        return _status(error) == 404

    def _head(self, rel: str) -> dict | None:
        return self._call(
            f"reading {self.key(rel)!r} back",
            self.client.head_object,
            Bucket=self.bucket,
            Key=self.key(rel),
            missing_ok=True,
        )

    def read_manifest(self) -> dict | None:
        response = self._call(
            f"reading the manifest of {self.display!r}",
            self.client.get_object,
            Bucket=self.bucket,
            Key=self.key(MANIFEST_FILE),
            missing_ok=True,
        )
        if response is None:
            return None
        try:
            manifest = json.loads(response["Body"].read())
        except ValueError:
            return None
        return manifest if isinstance(manifest, dict) else None

    def publish(self, files: list[LocalFile], manifest: dict) -> None:
        existing = self.read_manifest()
        if same_export(existing, manifest) and all(
            self._matches(f, self._head(f.rel)) for f in files
        ):
            self.log(f"{self.display} already holds this export (every file verified)")
            return
        if existing is not None:
            # From here until the new manifest is written the prefix is not a result.
            self._call(
                "removing the earlier manifest",
                self.client.delete_object,
                Bucket=self.bucket,
                Key=self.key(MANIFEST_FILE),
            )
            self.log(f"removed the manifest of an earlier export at {self.display}")
        sent = kept = sent_bytes = 0
        for f in files:
            if self._matches(f, self._head(f.rel)):
                kept += 1
                self.log(f"{f.rel} is already there ({f.size} bytes, verified)")
                continue
            sent_bytes += self._upload(f)
            sent += 1
            self._verify(f)
            self.log(f"uploaded {f.rel} ({f.size} bytes, verified)")
        data = manifest_bytes(manifest)
        self._call(
            "writing the manifest",
            self.client.put_object,
            Bucket=self.bucket,
            Key=self.key(MANIFEST_FILE),
            Body=data,
            ContentMD5=_md5_b64(data),
            ContentType="application/json",
        )
        head = self._head(MANIFEST_FILE)
        if head is None or head["ContentLength"] != len(data):
            raise TransientError(
                f"the manifest written to {self.display!r} did not read back; the step exits "
                "75 so a retry writes it again"
            )
        _summary(self.log, self.display, sent, kept, sent_bytes, "manifest written last")

    # -- verification

    def _etag(self, f: LocalFile) -> str:
        """The ETag S3 gives ``f`` as this sink uploads it (single PUT or multipart)."""
        if f.size <= self.part_size:
            with open(f.path, "rb") as fh:
                return hashlib.file_digest(fh, "md5").hexdigest()
        digests = [hashlib.md5(part).digest() for _, part in self._parts(f)]  # noqa: S324
        return hashlib.md5(b"".join(digests)).hexdigest() + f"-{len(digests)}"  # noqa: S324

    def _matches(self, f: LocalFile, head: dict | None) -> bool:
        if head is None or head.get("ContentLength") != f.size:
            return False
        etag = str(head.get("ETag", "")).strip('"')
        if _looks_like_md5_etag(etag):
            return etag == self._etag(f)
        # Stores whose ETag is not an MD5 (SSE-KMS): the sha256 recorded at upload.
        return (head.get("Metadata") or {}).get("sha256") == f.sha256

    def _verify(self, f: LocalFile) -> None:
        head = self._head(f.rel)
        if not self._matches(f, head):
            got = (
                "nothing"
                if head is None
                else f"{head.get('ContentLength')} bytes, ETag {head.get('ETag')}"
            )
            raise TransientError(
                f"{f.rel} read back from {self.display!r} as {got}, not the {f.size} bytes "
                "uploaded; the step exits 75 so a retry uploads it again"
            )

    # -- uploads

    def _upload(self, f: LocalFile) -> int:
        """Upload ``f``; return the bytes sent (parts already there are not sent again)."""
        if f.size <= self.part_size:
            data = f.path.read_bytes()
            self._call(
                f"uploading {f.rel}",
                self.client.put_object,
                Bucket=self.bucket,
                Key=self.key(f.rel),
                Body=data,
                ContentMD5=_md5_b64(data),
                Metadata={"sha256": f.sha256},
            )
            return len(data)
        return self._multipart(f)

    def _parts(self, f: LocalFile):
        size = max(self.part_size, -(-f.size // MAX_PARTS))
        with open(f.path, "rb") as fh:
            number = 1
            while data := fh.read(size):
                yield number, data
                number += 1

    def _multipart(self, f: LocalFile) -> int:
        key = self.key(f.rel)
        upload_id, done = self._resumable_upload(key)
        if upload_id is None:
            created = self._call(
                f"starting the upload of {f.rel}",
                self.client.create_multipart_upload,
                Bucket=self.bucket,
                Key=key,
                Metadata={"sha256": f.sha256},
            )
            upload_id = created["UploadId"]
        parts, sent, reused = [], 0, 0
        for number, data in self._parts(f):
            md5 = hashlib.md5(data).hexdigest()  # noqa: S324
            if done.get(number) == (md5, len(data)):
                reused += 1
            else:
                answer = self._call(
                    f"uploading part {number} of {f.rel}",
                    self.client.upload_part,
                    Bucket=self.bucket,
                    Key=key,
                    UploadId=upload_id,
                    PartNumber=number,
                    Body=data,
                    ContentMD5=base64.b64encode(bytes.fromhex(md5)).decode(),
                )
                if answer["ETag"].strip('"') != md5:
                    raise TransientError(
                        f"part {number} of {f.rel} was stored with ETag {answer['ETag']}, not its "
                        "MD5; the step exits 75 so a retry uploads it again"
                    )
                sent += len(data)
            parts.append({"PartNumber": number, "ETag": f'"{md5}"'})
        if reused:
            self.log(f"resumed the upload of {f.rel}: {reused} of {len(parts)} parts were there")
        self._call(
            f"completing the upload of {f.rel}",
            self.client.complete_multipart_upload,
            Bucket=self.bucket,
            Key=key,
            UploadId=upload_id,
            MultipartUpload={"Parts": parts},
        )
        return sent

    def _resumable_upload(self, key: str) -> tuple[str | None, dict[int, tuple[str, int]]]:
        """An unfinished multipart upload of ``key`` left by a killed run, and its parts by
        number ((md5, size)); older unfinished ones are aborted (their parts cost storage)."""
        listed = self._call(
            "listing unfinished uploads",
            self.client.list_multipart_uploads,
            Bucket=self.bucket,
            Prefix=key,
        )
        uploads = sorted(
            (u for u in listed.get("Uploads", []) if u["Key"] == key),
            key=lambda u: u["Initiated"],
        )
        for stale in uploads[:-1]:
            self._call(
                "removing an abandoned upload",
                self.client.abort_multipart_upload,
                Bucket=self.bucket,
                Key=key,
                UploadId=stale["UploadId"],
                missing_ok=True,
            )
        if not uploads:
            return None, {}
        upload_id = uploads[-1]["UploadId"]
        done: dict[int, tuple[str, int]] = {}
        marker = 0
        while True:
            page = self._call(
                "listing the parts already uploaded",
                self.client.list_parts,
                Bucket=self.bucket,
                Key=key,
                UploadId=upload_id,
                PartNumberMarker=marker,
                missing_ok=True,
            )
            if page is None:  # completed or aborted meanwhile
                return None, {}
            for part in page.get("Parts", []):
                done[part["PartNumber"]] = (part["ETag"].strip('"'), part["Size"])
            if not page.get("IsTruncated"):
                return upload_id, done
            marker = page["NextPartNumberMarker"]

    def _problem(self, error: Exception) -> Exception:
        from botocore.exceptions import ClientError, NoCredentialsError, PartialCredentialsError

        hint = self.s3.CREDENTIALS_HINT
        if isinstance(error, NoCredentialsError | PartialCredentialsError):
            return BadInputError(f"no AWS credentials were found for {self.display!r}; {hint}")
        if isinstance(error, ClientError):
            code = str(error.response.get("Error", {}).get("Code", ""))
            status = _status(error)
            if code in self.s3._CREDENTIAL_CODES:
                return BadInputError(
                    f"S3 rejected the credentials for {self.display!r} ({code}); {hint}"
                )
            if code == "NoSuchBucket":
                return BadInputError(
                    f"bucket {self.bucket!r} of {self.display!r} does not exist; create it or "
                    "check the bucket name and AWS_ENDPOINT_URL"
                )
            if code in ("AccessDenied", "AllAccessDisabled") or status == 403:
                return BadInputError(
                    f"writing to {self.display!r} was denied (403); grant the credentials or "
                    "role s3:PutObject, s3:GetObject, s3:DeleteObject, s3:ListBucket and "
                    "s3:ListBucketMultipartUploads on it"
                )
        mapped = self.s3.Source._problem(self, error)
        if isinstance(mapped, BadInputError) and mapped.args[0].startswith("S3 answered"):
            return BadInputError(f"S3 answered {_status(error)} writing to {self.display!r}")
        return mapped


def _status(error: Exception) -> int | None:
    response = getattr(error, "response", None)
    if isinstance(response, dict):
        status = response.get("ResponseMetadata", {}).get("HTTPStatusCode")
        return status if isinstance(status, int) else None
    return None


def _looks_like_md5_etag(etag: str) -> bool:
    head, _, count = etag.partition("-")
    hexdigits = set("0123456789abcdef")
    return len(head) == 32 and set(head) <= hexdigits and (not count or count.isdigit())


# --- the Hugging Face Hub ------------------------------------------------------------------------


def hub_endpoint() -> str:
    """``HF_ENDPOINT`` as it is now: huggingface_hub reads it once, at import, which in a notebook
    may be before the user set it."""
    from huggingface_hub import constants

    return os.environ.get("HF_ENDPOINT", "").strip().rstrip("/") or constants.ENDPOINT


def git_blob_id(path: Path) -> str:
    """The git blob id of a file: what the Hub publishes for files not stored in LFS/Xet."""
    digest = hashlib.sha1(f"blob {path.stat().st_size}\0".encode())  # noqa: S324 - git's id
    with open(path, "rb") as fh:
        while chunk := fh.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


class HubSink(_RemoteCalls):
    """A Hub model repository; every file and the manifest in one commit (atomic by nature).
    The repository is created private unless ``EXPORT_PRIVATE=false``; an existing one keeps its
    visibility. Files already uploaded by a killed run are not sent again: the Hub's LFS/Xet
    storage already has them, and the commit only refers to them."""

    def __init__(self, parsed: uri.StorageUri, log: Log):
        from huggingface_hub import HfApi, constants

        from tunepack.initializers.sources import hf

        self.hf = hf
        self.display = parsed.display
        self.log = log
        self.repo_id = parsed.location
        self.revision = unquote(parsed.revision) if parsed.revision else constants.DEFAULT_REVISION
        self.token = hf.token()
        self.endpoint = hub_endpoint()
        self.api = HfApi(endpoint=self.endpoint, token=self.token or False)

    @property
    def what(self) -> str:
        return f"hub model repository {self.repo_id!r}"

    @staticmethod
    def _is_missing(error: Exception) -> bool:
        from huggingface_hub.errors import EntryNotFoundError, RepositoryNotFoundError

        return isinstance(error, EntryNotFoundError | RepositoryNotFoundError)

    def read_manifest(self, revision: str | None = None) -> dict | None:
        from huggingface_hub import hf_hub_url
        from huggingface_hub.utils import build_hf_headers, get_session, hf_raise_for_status

        url = hf_hub_url(
            self.repo_id, MANIFEST_FILE, revision=revision or self.revision, endpoint=self.endpoint
        )

        def get():
            response = get_session().get(
                url, headers=build_hf_headers(token=self.token or False), follow_redirects=True
            )
            if response.status_code == 404:
                return None
            hf_raise_for_status(response)
            return response.content

        data = self._call(f"reading the manifest of {self.display!r}", get, missing_ok=True)
        if data is None:
            return None
        try:
            manifest = json.loads(data)
        except ValueError:
            return None
        return manifest if isinstance(manifest, dict) else None

    def publish(self, files: list[LocalFile], manifest: dict) -> None:
        from huggingface_hub import CommitOperationAdd, CommitOperationDelete
        from huggingface_hub.utils import disable_progress_bars

        disable_progress_bars()  # a Pod's log is a pipe, not a terminal
        if not self.token:
            raise BadInputError(
                f"exporting to {self.display!r} needs a hub token with write access; "
                f"{self.hf.TOKEN_HINT}"
            )
        private = _private()
        url = self._call(
            f"creating {self.what}",
            self.api.create_repo,
            self.repo_id,
            private=private,
            exist_ok=True,
            repo_type="model",
        )
        info = self._call(f"reading {self.what}", self.api.repo_info, self.repo_id)
        visibility = "private" if info.private else "public"
        self.log(f"{url} is {visibility}")
        if self.revision != "main":
            self._call(
                f"creating branch {self.revision!r}",
                self.api.create_branch,
                self.repo_id,
                branch=self.revision,
                exist_ok=True,
            )
        existing = self.read_manifest()
        if same_export(existing, manifest):
            head = self._call(
                f"reading {self.what}", self.api.repo_info, self.repo_id, revision=self.revision
            )
            try:
                self._verify(files, head.sha)
            except TransientError as error:  # changed since: commit the export again
                self.log(f"the export there no longer matches ({error}); committing it again")
            else:
                self.log(f"{self.display} already holds this export (commit {head.sha}, verified)")
                return
        operations = [CommitOperationAdd(f.rel, str(f.path)) for f in files]
        operations.append(CommitOperationAdd(MANIFEST_FILE, manifest_bytes(manifest)))
        previous = set((existing or {}).get("files") or {}) if isinstance(existing, dict) else set()
        operations += [
            CommitOperationDelete(rel) for rel in sorted(previous - {f.rel for f in files})
        ]

        def commit():
            # Fresh operations each attempt: huggingface_hub marks them as used.
            ops = [
                CommitOperationAdd(op.path_in_repo, op.path_or_fileobj)
                if isinstance(op, CommitOperationAdd)
                else op
                for op in operations
            ]
            return self.api.create_commit(
                self.repo_id,
                ops,
                commit_message=f"tunepack export: {manifest.get('model')} "
                f"({manifest.get('method')})",
                revision=self.revision,
            )

        made = self._call(f"committing to {self.what}", commit)
        self._verify(files, made.oid)
        total = sum(f.size for f in files)
        self.log(
            f"exported to {self.display}: {len(files)} files ({human_bytes(total)}) and the "
            f"manifest in commit {made.oid} ({visibility}), verified"
        )

    def _verify(self, files: list[LocalFile], commit: str) -> None:
        """Every file of the export in the tree of ``commit``, with its size and checksum."""
        from huggingface_hub.hf_api import RepoFile

        entries = self._call(
            f"reading the tree of commit {commit}",
            lambda: list(self.api.list_repo_tree(self.repo_id, revision=commit, recursive=True)),
        )
        tree = {e.path: e for e in entries if isinstance(e, RepoFile)}
        for f in files:
            entry = tree.get(f.rel)
            problem = None
            if entry is None:
                problem = "is missing"
            elif entry.size != f.size:
                problem = f"has {entry.size} bytes, not {f.size}"
            elif entry.lfs is not None and entry.lfs.sha256 != f.sha256:
                problem = f"has sha256 {entry.lfs.sha256}, not {f.sha256}"
            elif entry.lfs is None and entry.blob_id != git_blob_id(f.path):
                problem = f"has git blob id {entry.blob_id}, not {git_blob_id(f.path)}"
            if problem:
                raise TransientError(
                    f"{f.rel} in commit {commit} of {self.display!r} {problem}; the step exits "
                    "75 so a retry commits it again"
                )

    def _problem(self, error: Exception | None) -> Exception:
        import httpx2
        from huggingface_hub.errors import HfHubHTTPError, RepositoryNotFoundError

        from tunepack.initializers.sources import _http

        # huggingface_hub wraps a failed LFS upload in a RuntimeError: the cause says what failed.
        cause = error
        while cause is not None and not isinstance(cause, httpx2.TransportError | HfHubHTTPError):
            cause = cause.__cause__ or cause.__context__
        error = cause if cause is not None else error
        if isinstance(error, httpx2.TransportError):
            return _http.transport_problem(error)
        if not isinstance(error, HfHubHTTPError):
            return error  # a bug or an unexpected library failure: keep its traceback
        status = error.response.status_code if error.response is not None else None
        hint = self.hf.TOKEN_HINT
        if status == 401:
            return BadInputError(
                f"the hub rejected the token given for {self.display!r} (401 Unauthorized); "
                f"create a token with write access and {hint}"
            )
        if status == 403:
            return BadInputError(
                f"the hub denied writing to {self.what} (403 Forbidden); give the token write "
                f"access to {self.repo_id.split('/')[0]!r} and {hint}"
            )
        if isinstance(error, RepositoryNotFoundError) or status == 404:
            return BadInputError(
                f"{self.what} was not found and could not be created with the token given; "
                f"check the name in {self.display!r} and the token's permissions"
            )
        if status in _http.RETRYABLE_STATUS:
            return Retryable(f"the hub answered HTTP {status}")
        return BadInputError(
            f"the hub answered HTTP {status} for {self.what}; check {self.display!r}"
        )


# --- fetching an export back ---------------------------------------------------------------------


def fetch_export(raw: str, dest: Path, log: Log) -> dict:
    """Fetch the export at ``raw`` into directory ``dest``, verified against its manifest;
    return the manifest. ``dest`` appears only when complete (staged, then renamed); a fetch
    interrupted midway resumes where it stopped."""
    from tunepack.initializers import download

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
                raise BadInputError(f"{parsed.display!r} lists {rel}, which is missing there")
        known = {}
    else:
        cache = dest.with_name(f".{dest.name}.tunepack-download")
        source = uri.remote_source(parsed, "model")
        if parsed.scheme == "hf":
            from huggingface_hub import HfApi

            source.endpoint = hub_endpoint()
            source.api = HfApi(endpoint=source.endpoint, token=source._auth)
        try:
            listing = retrying(f"listing {parsed.display!r}", source.list, log)
        except BadInputError as error:
            if "matches no objects" not in str(error):
                raise
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
                raise BadInputError(
                    f"{parsed.display!r} lists {rel} in its manifest, but the file is not "
                    "there; export the result again"
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
                raise BadInputError(
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
    from tunepack.initializers.download import safe_relpath

    if manifest is None:
        raise BadInputError(
            f"{shown!r} holds no complete tunepack export (no {MANIFEST_FILE}): the export did "
            "not finish, or it was never made; run the export again"
        )
    files = manifest.get("files")
    if manifest.get("kind") != MANIFEST_KIND or not isinstance(files, dict) or not files:
        raise BadInputError(f"{shown!r} holds a {MANIFEST_FILE} that is not an export's")
    for rel, record in files.items():
        safe_relpath(rel, shown)
        if not isinstance(record, dict) or not {"size", "sha256"} <= set(record):
            raise BadInputError(f"{shown!r}: the manifest entry of {rel} is malformed")


def _already(dest: Path, manifest: dict) -> bool:
    local = atomic.read_manifest(dest)
    return local == manifest and not atomic.why_incomplete(
        dest, {"kind": MANIFEST_KIND}, frozenset(manifest["files"])
    )
