"""Retrying transient network failures with exponential backoff.

Sources turn each library failure into either a ``BadInputError`` (permanent: a wrong name, a
missing credential, a 403; retrying cannot help and is not tried) or a ``Retryable`` (timeouts,
resets, 5xx, throttling). ``retrying`` re-runs a ``Retryable`` operation and, when the attempts are
exhausted, raises ``TransientError`` so the process exits 75 and the JobSet may restart the step.

A ``Retryable`` made from an HTTP answer carries the answer's ``Retry-After`` header (a 429 or 503
usually, any retried status that sends one). ``retry_after`` is the one parser of it: the wait it
asks for replaces the backoff, capped at ``MAX_RETRY_AFTER``; an unreadable one is ignored.
"""

from __future__ import annotations

import math
import os
import random
import time
from collections.abc import Callable
from datetime import UTC
from email.utils import parsedate_to_datetime
from typing import TypeVar

from tunepack.core.errors import BadValueError, TransientError

T = TypeVar("T")

ATTEMPTS_ENV = "TUNEPACK_RETRIES"
BACKOFF_ENV = "TUNEPACK_RETRY_BACKOFF_SECONDS"
DEFAULT_ATTEMPTS = 5
DEFAULT_BACKOFF = 1.0
MAX_DELAY = 30.0
# The longest wait a server's Retry-After is followed for: a rate limit's window is seconds to a
# few minutes; an hour-long answer would idle the Pod, better exhaust the attempts and exit 75.
MAX_RETRY_AFTER = 300.0


class Retryable(Exception):
    """A failure that may pass on its own; its message is user-facing and free of secrets.

    ``retry_after`` is the raw ``Retry-After`` header of the HTTP answer it stands for, if any.
    """

    def __init__(self, message: str, retry_after: str | None = None):
        super().__init__(message)
        self.retry_after = retry_after


class Clock:
    """The time ``retrying`` reads and waits on; tests put a fake one in ``CLOCK``."""

    def now(self) -> float:
        return time.time()

    def sleep(self, seconds: float) -> None:
        time.sleep(seconds)


CLOCK = Clock()


def retry_after(value: str | None, now: float) -> float | None:
    """Seconds a ``Retry-After`` value asks to wait (RFC 9110 section 10.2.3), uncapped.

    Either delay-seconds (digits) or an HTTP-date, in any of the three forms a recipient must
    accept (IMF-fixdate, RFC 850, asctime; HTTP dates are GMT). A date already past asks for 0.
    ``now`` is the time of the answer, in seconds since the epoch. None when the header is absent
    or is neither form.
    """
    value = (value or "").strip()
    if not value:
        return None
    if value.isascii() and value.isdigit():
        return float(value)
    try:
        when = parsedate_to_datetime(value)
    except (TypeError, ValueError, IndexError, OverflowError):
        return None
    if when.tzinfo is None:
        when = when.replace(tzinfo=UTC)
    return max(0.0, when.timestamp() - now)


def _env_number(name: str, default: float, kind: type) -> float:
    raw = os.environ.get(name, "").strip()
    if not raw:
        return default
    try:
        value = kind(raw)
    except ValueError:
        value = -1
    if value < 0 or (kind is int and value < 1):
        expected = "a positive integer" if kind is int else "a non-negative number"
        raise BadValueError(f"{name}={raw!r} is not valid: expected {expected}")
    return value


def attempts() -> int:
    return int(_env_number(ATTEMPTS_ENV, DEFAULT_ATTEMPTS, int))


def backoff_base() -> float:
    return float(_env_number(BACKOFF_ENV, DEFAULT_BACKOFF, float))


def delay(attempt: int, base: float) -> float:
    """Seconds to wait after failed attempt ``attempt`` (1-based): exponential, jittered."""
    # Full jitter keeps many Pods that failed together from retrying in lockstep.
    return min(MAX_DELAY, base * 2 ** (attempt - 1)) * (0.5 + random.random() / 2)


def _wait(error: Retryable, attempt: int, base: float, now: float) -> tuple[float, str]:
    """The wait after failed attempt ``attempt``, and what the log line says of a Retry-After."""
    if error.retry_after is None:
        return delay(attempt, base), ""
    asked = retry_after(error.retry_after, now)
    if asked is None:
        return delay(attempt, base), (
            "; its Retry-After is neither a number of seconds nor an HTTP date, so backing off "
            "as usual"
        )
    seconds = f"{math.ceil(asked)} s" if asked < 1e12 else "more than 10^12 s"
    shown = f"the server asked to retry after {seconds}"
    if asked > MAX_RETRY_AFTER:
        return MAX_RETRY_AFTER, f"; {shown}, more than the {MAX_RETRY_AFTER:.0f} s waited at most"
    return asked, f"; {shown}"


def retrying(
    what: str, operation: Callable[[], T], log: Callable[[str], None], clock: Clock | None = None
) -> T:
    """Run ``operation``; retry it on ``Retryable``; raise ``TransientError`` when exhausted."""
    clock = clock or CLOCK
    total, base = attempts(), backoff_base()
    for attempt in range(1, total + 1):
        try:
            return operation()
        except Retryable as error:
            if attempt == total:
                raise TransientError(
                    f"{what} failed {total} times, last with: {error}. The network or the storage "
                    f"service may be down; the step exits 75 so it can be retried later"
                ) from None
            wait, asked = _wait(error, attempt, base, clock.now())
            log(f"{what} failed ({error}){asked}; retry {attempt} of {total - 1} in {wait:.1f} s")
            clock.sleep(wait)
    raise AssertionError("unreachable")
