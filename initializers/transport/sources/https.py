"""``https://``: one file, or a tar/zip archive that is then extracted safely.

The expected checksum and size may ride in the fragment, which is never sent to the server:
``https://host/data.jsonl#sha256=<hex>&size=<bytes>``; ``STORAGE_SHA256`` works as well. Basic
auth comes from ``HTTPS_USERNAME`` and ``HTTPS_PASSWORD`` in the environment (on a cluster, a
Secret); ``https://user:password@host/...`` and presigned URLs still work when a TrainJob written
by hand carries them (tunepack's own writers refuse them: ``uri.refuse_credentials``), and are
redacted in every message. Plain ``http://`` is accepted only for loopback hosts (local test
servers): anything that crosses a network must be encrypted.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterator
from contextlib import contextmanager
from ipaddress import ip_address
from pathlib import PurePosixPath
from urllib.parse import parse_qsl, unquote, urlsplit, urlunsplit

import httpx2

from tunepack.core.errors import (
    BadInputError,
    BadValueError,
    ConflictError,
    DeniedError,
    NotFoundError,
    UnknownKeyError,
)
from tunepack.initializers.transport.sources import Body, Listing, RemoteFile, RemoteSource, _http
from tunepack.initializers.transport.uri import (
    HTTPS_PASSWORD_ENV,
    HTTPS_USERNAME_ENV,
    StorageUri,
    redact,
)

SHA256_ENV = "STORAGE_SHA256"
_HEX64 = re.compile(r"^[0-9a-fA-F]{64}$")
_FRAGMENT_KEYS = {"sha256", "size"}


def parse(raw: str, scheme: str, rest: str) -> StorageUri:
    shown = redact(raw)
    try:
        parts = urlsplit(raw)
        host = parts.hostname
        parts.port  # noqa: B018 - raises ValueError on a malformed port
    except ValueError:
        raise BadValueError(f"URL {shown!r} is malformed; write https://host/path") from None
    if not host:
        raise BadValueError(f"URL {shown!r} has no host; write https://host/path")
    if scheme == "http" and not _is_loopback(host):
        raise BadValueError(
            f"URL {shown!r} uses plain http://, which tunepack accepts only for loopback test "
            f"servers (127.0.0.1, localhost, ::1); use https://"
        )
    options = dict(parse_qsl(parts.fragment, keep_blank_values=True))
    unknown = sorted(set(options) - _FRAGMENT_KEYS)
    if unknown:
        raise UnknownKeyError(
            f"URL {shown!r} has fragment key {unknown[0]!r}; the fragment may only carry "
            f"sha256=<hex> and size=<bytes>",
            key=unknown[0],
            suggestions=("sha256", "size"),
        )
    env_sha = os.environ.get(SHA256_ENV, "").strip()
    if env_sha and "sha256" not in options:
        options["sha256"] = env_sha
    if "sha256" in options and not _HEX64.match(options["sha256"]):
        raise BadValueError(
            f"the sha256 given for {shown!r} is not 64 hexadecimal digits; copy it from "
            f"`sha256sum <file>`"
        )
    if "size" in options and not options["size"].isdigit():
        raise BadValueError(f"the size given for {shown!r} is not a number of bytes")
    return StorageUri(raw=raw, scheme=scheme, location=rest, options=options)


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ip_address(host).is_loopback
    except ValueError:
        return False


class Source(RemoteSource):
    concurrency = 1

    def __init__(self, uri: StorageUri, kind: str):
        super().__init__(uri, kind)
        parts = urlsplit(uri.raw)
        self.url = urlunsplit((parts.scheme, parts.netloc, parts.path, parts.query, ""))
        name = PurePosixPath(unquote(parts.path)).name
        self.name = name if name not in ("", ".", "..") else "download"
        self.sha256 = uri.options.get("sha256", "").lower() or None
        self.size = int(uri.options["size"]) if "size" in uri.options else None
        user = os.environ.get(HTTPS_USERNAME_ENV, "")
        self.auth = (user, os.environ.get(HTTPS_PASSWORD_ENV, "")) if user else None

    def list(self) -> Listing:
        # A one-byte ranged GET rather than HEAD: presigned URLs are often signed for GET only.
        # It fails fast on 401/403/404 and yields the size and the validator for resuming.
        try:
            with httpx2.stream(
                "GET",
                self.url,
                headers=_http.range_headers(0) | {"Range": "bytes=0-0"},
                auth=self.auth,
                timeout=_http.timeout(),
                follow_redirects=True,
            ) as response:
                self._check(response)
                size = _http.total_size(response)
                validator = response.headers.get("ETag") or response.headers.get(
                    "Last-Modified", ""
                )
        except httpx2.TransportError as error:
            raise _http.transport_problem(error) from None
        if self.size is not None and size is not None and size != self.size:
            raise ConflictError(
                f"{self.uri.display!r} is {size} bytes, but size={self.size} was given; check "
                f"the URL or the expected size"
            )
        file = RemoteFile(
            path=self.name,
            size=self.size if self.size is not None else size,
            ref=self.url,
            version=validator,
            sha256=self.sha256,
        )
        return Listing([file], facts={"etag": validator} if validator else {})

    @contextmanager
    def open(self, file: RemoteFile, offset: int) -> Iterator[Body]:
        headers = _http.range_headers(offset)
        if offset and file.version and not file.version.startswith("W/"):
            headers["If-Range"] = file.version  # a changed file comes back whole (200)
        try:
            with httpx2.stream(
                "GET",
                self.url,
                headers=headers,
                auth=self.auth,
                timeout=_http.timeout(),
                follow_redirects=True,
            ) as response:
                self._check(response)
                yield Body(
                    _http.body_offset(response, offset),
                    _http.chunks(response),
                    _http.total_size(response),
                )
        except httpx2.TransportError as error:
            raise _http.transport_problem(error) from None

    def _check(self, response: httpx2.Response) -> None:
        status = response.status_code
        if status < 400:
            return
        shown = self.uri.display
        if status in (401, 403):
            raise DeniedError(
                f"{shown!r} answered {status} ({response.reason_phrase}): access denied; check "
                f"{HTTPS_USERNAME_ENV} and {HTTPS_PASSWORD_ENV} (or the credentials in the URL), "
                "or whether a presigned URL has expired"
            )
        if status in (404, 410):
            raise NotFoundError(
                f"{shown!r} answered {status}: no such file; check the URL", what="file", name=shown
            )
        if status in _http.RETRYABLE_STATUS:
            raise _http.status_problem(f"the server answered HTTP {status}", response)
        raise BadInputError(f"{shown!r} answered HTTP {status}; check the URL")
