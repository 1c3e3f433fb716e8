"""``s3://bucket/prefix``: objects under ``prefix/`` in S3 or an S3-compatible store.

The client (endpoint, credentials and addressing from the AWS environment) and the mapping of
its failures are ``tunepack.initializers.transport.s3``'s, shared with the s3:// source. A file
larger than a part (``TUNEPACK_EXPORT_PART_SIZE_MB``) goes up as a multipart upload, which a
re-run resumes at its first missing part.
"""

from __future__ import annotations

import base64
import hashlib
import json
import os

from tunepack.core.errors import BadValueError, TransientError
from tunepack.core.workspace import MANIFEST_FILE
from tunepack.initializers.sinks import (
    LocalFile,
    Log,
    RemoteCalls,
    manifest_bytes,
    same_export,
    summary,
)
from tunepack.initializers.transport import s3, uri

PART_SIZE_ENV = "TUNEPACK_EXPORT_PART_SIZE_MB"
DEFAULT_PART_MB = 64
MIN_PART_MB = 5  # S3's smallest part (all but the last)
MAX_PARTS = 10_000  # S3's most parts per upload


def _part_size() -> int:
    raw = os.environ.get(PART_SIZE_ENV, "").strip()
    if not raw:
        return DEFAULT_PART_MB << 20
    if not raw.isdigit() or int(raw) < MIN_PART_MB:
        raise BadValueError(
            f"{PART_SIZE_ENV}={raw!r} is not valid: expected a whole number of MiB, at least "
            f"{MIN_PART_MB}"
        )
    return int(raw) << 20


def _md5_b64(data: bytes) -> str:
    return base64.b64encode(hashlib.md5(data).digest()).decode()  # noqa: S324 - S3's ETag


class Sink(RemoteCalls):
    """Objects under ``s3://bucket/prefix/``. Each PUT carries Content-MD5, so the store refuses
    a body damaged on the way; then a HEAD reads back the size and the ETag (the MD5, or for a
    multipart object the MD5 of the parts' MD5s) and compares them with the local file's."""

    def __init__(self, parsed: uri.StorageUri, log: Log):
        self.display = parsed.display
        self.log = log
        self.bucket, _, prefix = parsed.location.partition("/")
        self.prefix = prefix.strip("/")
        self.part_size = _part_size()
        self.client = s3.client(
            read_timeout=120,
            # Content-MD5 is the integrity check; no streaming CRC trailers, which some
            # S3-compatible stores refuse.
            request_checksum_calculation="when_required",
            response_checksum_validation="when_required",
        )

    def key(self, rel: str) -> str:
        return f"{self.prefix}/{rel}"

    # The operations below raise BadInputError or Retryable (mapped by _problem); the callers
    # wrap them in retrying().

    @staticmethod
    def _is_missing(error: Exception) -> bool:
        return s3.status(error) == 404

    def _problem(self, error: Exception) -> Exception:
        return s3.problem(error, shown=self.display, bucket=self.bucket, writing=True)

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

    def publish(self, files: list[LocalFile], manifest: dict) -> bool:
        """Send the export; False when the destination held it already (nothing sent)."""
        existing = self.read_manifest()
        if same_export(existing, manifest) and all(
            self._matches(f, self._head(f.rel)) for f in files
        ):
            self.log(f"{self.display} already holds this export (every file verified)")
            return False
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
        summary(self.log, self.display, sent, kept, sent_bytes, "manifest written last")
        return True

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


def _looks_like_md5_etag(etag: str) -> bool:
    head, _, count = etag.partition("-")
    hexdigits = set("0123456789abcdef")
    return len(head) == 32 and set(head) <= hexdigits and (not count or count.isdigit())
