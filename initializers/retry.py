"""Retrying transient network failures with exponential backoff.

Sources turn each library failure into either a ``BadInputError`` (permanent: a wrong name, a
missing credential, a 403; retrying cannot help and is not tried) or a ``Retryable`` (timeouts,
resets, 5xx, throttling). ``retrying`` re-runs a ``Retryable`` operation and, when the attempts are
exhausted, raises ``TransientError`` so the process exits 75 and the JobSet may restart the step.
"""

from __future__ import annotations

import os
import random
import time
from collections.abc import Callable
from typing import TypeVar

from tunepack.core.errors import BadValueError, TransientError

T = TypeVar("T")

ATTEMPTS_ENV = "TUNEPACK_RETRIES"
BACKOFF_ENV = "TUNEPACK_RETRY_BACKOFF_SECONDS"
DEFAULT_ATTEMPTS = 5
DEFAULT_BACKOFF = 1.0
MAX_DELAY = 30.0


class Retryable(Exception):
    """A failure that may pass on its own; its message is user-facing and free of secrets."""


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


def retrying(what: str, operation: Callable[[], T], log: Callable[[str], None]) -> T:
    """Run ``operation``; retry it on ``Retryable``; raise ``TransientError`` when exhausted."""
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
            wait = delay(attempt, base)
            log(f"{what} failed ({error}); retry {attempt} of {total - 1} in {wait:.1f} s")
            time.sleep(wait)
    raise AssertionError("unreachable")
