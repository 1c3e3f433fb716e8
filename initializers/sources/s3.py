"""``s3://bucket/prefix``: objects in Amazon S3 or an S3-compatible store (MinIO, Ceph, R2...).

Configuration comes from the environment, as the AWS SDKs read it: ``AWS_ACCESS_KEY_ID`` /
``AWS_SECRET_ACCESS_KEY`` (/ ``AWS_SESSION_TOKEN``) or a role (IRSA, Pod Identity, instance
profile); ``AWS_REGION``; ``AWS_ENDPOINT_URL`` or ``S3_ENDPOINT`` for another store, which then
defaults to path-style addressing (``S3_ADDRESSING_STYLE`` overrides).

A prefix names a "directory" (every object under ``prefix/``) or, failing that, one object.
Objects are transferred in parallel, each resumable by byte range and pinned to the ETag seen in
the listing (``If-Match``), so a resumed file never mixes two versions. Single-part uploads have
an MD5 ETag, which is verified; multipart ETags are not content hashes, so only sizes are.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterator
from contextlib import contextmanager

import boto3
from botocore.config import Config
from botocore.exceptions import (
    BotoCoreError,
    ClientError,
    EndpointConnectionError,
    HTTPClientError,
    NoCredentialsError,
    PartialCredentialsError,
    ReadTimeoutError,
    ResponseStreamingError,
)
from botocore.exceptions import (
    ConnectionError as BotoConnectionError,
)
from urllib3.exceptions import HTTPError as Urllib3Error

from tunepack.core.errors import BadInputError, TransientError
from tunepack.initializers.retry import Retryable
from tunepack.initializers.sources import Body, Listing, RemoteFile, RemoteSource
from tunepack.initializers.uri import StorageUri, redact

ENDPOINT_ENVS = ("AWS_ENDPOINT_URL", "S3_ENDPOINT")
CREDENTIALS_HINT = (
    "set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY (in a cluster: the Secret "
    "tunepack-s3-credentials) or give the Pod an IAM role"
)
_BUCKET_RE = re.compile(r"^[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]$")
_MD5_RE = re.compile(r"^[0-9a-f]{32}$")
_CHUNK = 1 << 20
_RETRYABLE_CODES = frozenset(
    {
        "SlowDown",
        "InternalError",
        "ServiceUnavailable",
        "RequestTimeout",
        "Throttling",
        "ThrottlingException",
        "RequestTimeTooSkewed",
        "500",
        "502",
        "503",
        "504",
    }
)
_CREDENTIAL_CODES = frozenset(
    {
        "InvalidAccessKeyId",
        "SignatureDoesNotMatch",
        "ExpiredToken",
        "InvalidToken",
        "TokenRefreshRequired",
        "AuthorizationHeaderMalformed",
    }
)


def parse(raw: str, scheme: str, rest: str) -> StorageUri:
    shown = redact(raw)
    if "?" in rest or "#" in rest:
        raise BadInputError(
            f"S3 URI {shown!r} has a query or fragment, which s3:// does not use; write "
            f"s3://bucket/prefix"
        )
    bucket, _, prefix = rest.partition("/")
    if not _BUCKET_RE.match(bucket) or ".." in bucket:
        raise BadInputError(
            f"S3 URI {shown!r} names bucket {bucket!r}, which is not a valid bucket name "
            f"(3-63 lowercase letters, digits, '.' and '-'); write s3://bucket/prefix"
        )
    return StorageUri(raw=raw, scheme=scheme, location=f"{bucket}/{prefix}")


def _endpoint() -> str | None:
    for name in ENDPOINT_ENVS:
        value = os.environ.get(name, "").strip()
        if value:
            return value
    return None


class Source(RemoteSource):
    concurrency = 8

    def __init__(self, uri: StorageUri, kind: str):
        super().__init__(uri, kind)
        self.bucket, _, self.prefix = uri.location.partition("/")
        endpoint = _endpoint()
        style = os.environ.get("S3_ADDRESSING_STYLE", "").strip() or (
            "path" if endpoint else "auto"
        )
        config = Config(
            # tunepack retries (with its own logging and exit code), so botocore must not.
            retries={"total_max_attempts": 1},
            connect_timeout=10,
            read_timeout=60,
            max_pool_connections=32,
            s3={"addressing_style": style},
        )
        region = os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION") or None
        self.client = boto3.session.Session().client(
            "s3", endpoint_url=endpoint, region_name=region, config=config
        )

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
            raise BadInputError(
                f"S3 URI {self.uri.display!r} matches no objects; check the bucket and prefix"
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
        except (BotoCoreError, Urllib3Error, OSError) as error:
            raise Retryable(f"{type(error).__name__}: {error}") from None

    def _problem(self, error: Exception, key: str | None = None) -> Exception:
        shown = self.uri.display
        if isinstance(error, NoCredentialsError | PartialCredentialsError):
            return BadInputError(f"no AWS credentials were found for {shown!r}; {CREDENTIALS_HINT}")
        if isinstance(
            error,
            EndpointConnectionError
            | BotoConnectionError
            | HTTPClientError
            | ReadTimeoutError
            | ResponseStreamingError,
        ):
            return Retryable(f"{type(error).__name__}: {error}")
        if not isinstance(error, ClientError):
            return error  # a bug or an unexpected library failure: keep its traceback
        code = str(error.response.get("Error", {}).get("Code", ""))
        status = error.response.get("ResponseMetadata", {}).get("HTTPStatusCode")
        if code in _RETRYABLE_CODES or (isinstance(status, int) and status >= 500):
            return Retryable(f"S3 answered {code or status}")
        if code in _CREDENTIAL_CODES:
            return BadInputError(
                f"S3 rejected the credentials for {shown!r} ({code}); {CREDENTIALS_HINT}"
            )
        if code == "NoSuchBucket":
            return BadInputError(
                f"bucket {self.bucket!r} of {shown!r} does not exist; check the bucket name "
                f"and AWS_ENDPOINT_URL"
            )
        if code in ("AccessDenied", "403", "AllAccessDisabled") or status == 403:
            return BadInputError(
                f"access to {shown!r} was denied (403); grant the credentials or role "
                f"s3:ListBucket and s3:GetObject on it"
            )
        if code in ("NoSuchKey", "404", "NotFound") or status == 404:
            what = f"object {key!r}" if key else "it"
            return BadInputError(
                f"S3 URI {shown!r} matches no objects ({what} not found); check the bucket "
                f"and prefix"
            )
        if code in ("PreconditionFailed", "412") or status == 412:
            return TransientError(
                f"{key} in {shown!r} changed while it was being downloaded; the step exits 75 "
                f"so a retry downloads the new version"
            )
        return BadInputError(f"S3 answered {code or status} for {shown!r}: {error}")
