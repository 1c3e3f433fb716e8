"""``s3://bucket/prefix``: objects in Amazon S3 or an S3-compatible store (MinIO, Ceph, R2...).

The client and the mapping of its failures are ``tunepack.initializers.transport.s3``'s, shared
with the export sink. A prefix names a "directory" (every object under ``prefix/``) or, failing
that, one object; each transfer is pinned to the listed ETag (``If-Match``), so a resumed file
never mixes two versions (docs/initializers.md, "Robustness")."""

from __future__ import annotations

import re
from collections.abc import Iterator
from contextlib import contextmanager

from tunepack.core.errors import BadValueError, NoObjectsError
from tunepack.initializers.transport import s3
from tunepack.initializers.transport.sources import Body, Listing, RemoteFile, RemoteSource
from tunepack.initializers.transport.uri import StorageUri, redact

_BUCKET_RE = re.compile(r"^[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]$")
_MD5_RE = re.compile(r"^[0-9a-f]{32}$")
_CHUNK = 1 << 20


def parse(raw: str, scheme: str, rest: str) -> StorageUri:
    shown = redact(raw)
    if "?" in rest or "#" in rest:
        raise BadValueError(
            f"S3 URI {shown!r} has a query or fragment, which s3:// does not use; write "
            f"s3://bucket/prefix"
        )
    bucket, _, prefix = rest.partition("/")
    if not _BUCKET_RE.match(bucket) or ".." in bucket:
        raise BadValueError(
            f"S3 URI {shown!r} names bucket {bucket!r}, which is not a valid bucket name "
            f"(3-63 lowercase letters, digits, '.' and '-'); write s3://bucket/prefix"
        )
    return StorageUri(raw=raw, scheme=scheme, location=f"{bucket}/{prefix}")


class Source(RemoteSource):
    concurrency = 8

    def __init__(self, uri: StorageUri, kind: str):
        super().__init__(uri, kind)
        self.bucket, _, self.prefix = uri.location.partition("/")
        self.client = s3.client(read_timeout=60, max_pool_connections=32)

    def list(self) -> Listing:
        directory = self.prefix.rstrip("/") + "/" if self.prefix else ""
        files: list[RemoteFile] = []
        try:
            pages = self.client.get_paginator("list_objects_v2").paginate(
                Bucket=self.bucket, Prefix=directory
            )
            for page in pages:
                for obj in page.get("Contents", []):
                    if obj["Key"].endswith("/"):
                        continue  # a "folder" marker some consoles create
                    files.append(self._file(obj["Key"], obj["Size"], obj["ETag"], directory))
            if not files and self.prefix and not self.prefix.endswith("/"):
                head = self.client.head_object(Bucket=self.bucket, Key=self.prefix)
                parent = self.prefix[: self.prefix.rfind("/") + 1]
                files.append(self._file(self.prefix, head["ContentLength"], head["ETag"], parent))
        except Exception as error:  # noqa: BLE001 - mapped or re-raised below
            raise self._problem(error) from None
        if not files:
            raise NoObjectsError(
                f"S3 URI {self.uri.display!r} matches no objects; check the bucket and prefix",
                what="objects",
                name=self.uri.display,
            )
        return Listing(files, facts={"bucket": self.bucket, "prefix": self.prefix})

    def _file(self, key: str, size: int, etag: str, directory: str) -> RemoteFile:
        etag = etag.strip('"')
        return RemoteFile(
            path=key[len(directory) :],
            size=size,
            ref=key,
            version=etag,
            md5=etag if _MD5_RE.match(etag) else None,
        )

    @contextmanager
    def open(self, file: RemoteFile, offset: int) -> Iterator[Body]:
        request = {"Bucket": self.bucket, "Key": file.ref, "IfMatch": file.version}
        if offset:
            request["Range"] = f"bytes={offset}-"
        try:
            response = self.client.get_object(**request)
        except Exception as error:  # noqa: BLE001
            raise self._problem(error, file.ref) from None
        content_range = response.get("ContentRange", "")
        start = content_range.removeprefix("bytes ").partition("-")[0]
        begin = offset if offset and start.isdigit() and int(start) == offset else 0
        stream = response["Body"]
        try:
            yield Body(begin, self._chunks(stream))
        finally:
            stream.close()

    def _chunks(self, stream) -> Iterator[bytes]:
        try:
            yield from stream.iter_chunks(_CHUNK)
        except s3.STREAM_ERRORS as error:
            raise self._problem(error, streaming=True) from None

    def _problem(
        self, error: Exception, key: str | None = None, *, streaming: bool = False
    ) -> Exception:
        return s3.problem(
            error, shown=self.uri.display, bucket=self.bucket, key=key, streaming=streaming
        )
