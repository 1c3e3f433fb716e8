"""HTTP streaming shared by the hub and https sources: ranges, timeouts, retry classification."""

from __future__ import annotations

import os
from collections.abc import Iterator

import httpx2

from tunepack.core.errors import BadValueError
from tunepack.initializers.transport.retry import Retryable

TIMEOUT_ENV = "TUNEPACK_HTTP_TIMEOUT_SECONDS"
# A server that stops sending for this long is treated as a broken connection (and retried).
DEFAULT_READ_TIMEOUT = 60.0
CONNECT_TIMEOUT = 10.0

# Statuses worth retrying: timeouts, throttling and server-side failures.
RETRYABLE_STATUS = frozenset({408, 425, 429, 500, 502, 503, 504})


def timeout() -> httpx2.Timeout:
    raw = os.environ.get(TIMEOUT_ENV, "").strip()
    try:
        read = float(raw) if raw else DEFAULT_READ_TIMEOUT
    except ValueError:
        raise BadValueError(
            f"{TIMEOUT_ENV}={raw!r} is not valid: expected a number of seconds"
        ) from None
    return httpx2.Timeout(read, connect=min(CONNECT_TIMEOUT, read))


def transport_problem(error: httpx2.TransportError) -> Retryable:
    # The exception text of a transport error names the failure, not the request's headers.
    detail = str(error) or type(error).__name__
    return Retryable(f"{type(error).__name__}: {detail}")


def status_problem(message: str, response: httpx2.Response | None) -> Retryable:
    """A retried status (``RETRYABLE_STATUS``) as a ``Retryable`` that keeps the answer's
    ``Retry-After``, which ``retrying`` waits for instead of its backoff."""
    headers = response.headers if response is not None else {}
    return Retryable(message, retry_after=headers.get("Retry-After"))


def range_headers(offset: int) -> dict[str, str]:
    # identity: a compressed body would make Content-Length and byte ranges meaningless.
    headers = {"Accept-Encoding": "identity"}
    if offset:
        headers["Range"] = f"bytes={offset}-"
    return headers


def body_offset(response: httpx2.Response, offset: int) -> int:
    """Where the response body starts: ``offset`` for a 206 at that offset, else 0."""
    if response.status_code == 206 and offset:
        content_range = response.headers.get("Content-Range", "")
        start = content_range.removeprefix("bytes ").partition("-")[0]
        if start.isdigit() and int(start) == offset:
            return offset
    return 0


def total_size(response: httpx2.Response) -> int | None:
    content_range = response.headers.get("Content-Range", "")
    if "/" in content_range and content_range.rpartition("/")[2].isdigit():
        return int(content_range.rpartition("/")[2])
    length = response.headers.get("Content-Length")
    return int(length) if length and length.isdigit() and response.status_code == 200 else None


def chunks(response: httpx2.Response) -> Iterator[bytes]:
    try:
        # No chunk size: a fixed one would buffer a slow link's bytes, so progress and resumable
        # partial files would lag behind what actually arrived.
        yield from response.iter_bytes()
    except httpx2.TransportError as error:
        raise transport_problem(error) from None
