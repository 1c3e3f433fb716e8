"""retrying's waits: its own backoff, and a server's Retry-After (RFC 9110 section 10.2.3).

Time is a fake clock: it reads a fixed epoch and records each wait instead of sleeping.
"""

from __future__ import annotations

from datetime import UTC, datetime
from email.utils import format_datetime

import httpx2
import pytest

from tunepack.core.errors import TransientError
from tunepack.initializers.transport import retry
from tunepack.initializers.transport.retry import MAX_RETRY_AFTER, Retryable, retry_after, retrying
from tunepack.initializers.transport.sources import _http

NOW = datetime(2026, 3, 2, 12, 0, 0, tzinfo=UTC).timestamp()


class FakeClock:
    def __init__(self, now: float = NOW):
        self.time = now
        self.waits: list[float] = []

    def now(self) -> float:
        return self.time

    def sleep(self, seconds: float) -> None:
        self.waits.append(seconds)
        self.time += seconds


def http_date(seconds_from_now: float) -> str:
    return format_datetime(datetime.fromtimestamp(NOW + seconds_from_now, UTC), usegmt=True)


def failing_then(answers: list[Retryable]):
    """An operation that raises each of ``answers`` in turn, then returns "done"."""
    pending = list(answers)

    def operation():
        if pending:
            raise pending.pop(0)
        return "done"

    return operation


def run(answers: list[Retryable], clock: FakeClock) -> list[str]:
    lines: list[str] = []
    assert retrying("downloading x", failing_then(answers), lines.append, clock) == "done"
    return lines


@pytest.mark.parametrize(
    ("value", "seconds"),
    [
        ("2", 2.0),
        (" 120 ", 120.0),
        ("0", 0.0),
        ("86400", 86400.0),
        (http_date(30), 30.0),  # IMF-fixdate
        ("Monday, 02-Mar-26 12:00:45 GMT", 45.0),  # RFC 850
        ("Mon Mar  2 12:01:00 2026", 60.0),  # asctime (GMT, as all HTTP dates)
        (http_date(-3600), 0.0),  # already past: retry now
        (None, None),
        ("", None),
        ("soon", None),
        ("-5", None),
        ("1.5", None),  # delay-seconds are whole
        ("²", None),  # a digit to str.isdigit, not to HTTP
        ("Mon, 99 Foo 2026 12:00:00 GMT", None),
    ],
)
def test_retry_after_reads_both_forms(value, seconds):
    assert retry_after(value, NOW) == seconds


def test_without_retry_after_the_backoff_is_used(monkeypatch):
    monkeypatch.setattr(retry.random, "random", lambda: 1.0)  # no jitter: 1 s, then 2 s
    clock = FakeClock()
    lines = run([Retryable("the server answered HTTP 503")] * 2, clock)
    assert clock.waits == [1.0, 2.0]
    assert lines == [
        "downloading x failed (the server answered HTTP 503); retry 1 of 4 in 1.0 s",
        "downloading x failed (the server answered HTTP 503); retry 2 of 4 in 2.0 s",
    ]


def test_retry_after_seconds_is_the_wait():
    clock = FakeClock()
    lines = run([Retryable("the server answered HTTP 429", retry_after="7")], clock)
    assert clock.waits == [7.0]
    assert lines == [
        "downloading x failed (the server answered HTTP 429); the server asked to retry after "
        "7 s; retry 1 of 4 in 7.0 s"
    ]


def test_retry_after_http_date_is_the_wait():
    clock = FakeClock()
    lines = run([Retryable("the hub answered HTTP 503", retry_after=http_date(42))], clock)
    assert clock.waits == [42.0]
    assert lines == [
        "downloading x failed (the hub answered HTTP 503); the server asked to retry after "
        "42 s; retry 1 of 4 in 42.0 s"
    ]


@pytest.mark.parametrize("value", ["86400", http_date(7200), "9" * 400])
def test_a_huge_retry_after_is_capped(value):
    clock = FakeClock()
    lines = run([Retryable("the server answered HTTP 429", retry_after=value)], clock)
    assert clock.waits == [MAX_RETRY_AFTER]
    asked = {"86400": "86400 s", "9" * 400: "more than 10^12 s"}.get(value, "7200 s")
    assert lines == [
        f"downloading x failed (the server answered HTTP 429); the server asked to retry after "
        f"{asked}, more than the 300 s waited at most; retry 1 of 4 in 300.0 s"
    ]


def test_an_unreadable_retry_after_falls_back_to_the_backoff(monkeypatch):
    monkeypatch.setattr(retry.random, "random", lambda: 1.0)
    clock = FakeClock()
    lines = run([Retryable("the server answered HTTP 429", retry_after="in a while")], clock)
    assert clock.waits == [1.0]
    assert lines == [
        "downloading x failed (the server answered HTTP 429); its Retry-After is neither a "
        "number of seconds nor an HTTP date, so backing off as usual; retry 1 of 4 in 1.0 s"
    ]


def test_the_last_attempt_does_not_wait(monkeypatch):
    monkeypatch.setenv(retry.ATTEMPTS_ENV, "2")
    clock = FakeClock()
    answers = [Retryable("the server answered HTTP 429", retry_after="5")] * 2
    with pytest.raises(TransientError) as raised:
        retrying("downloading x", failing_then(answers), lambda line: None, clock)
    assert clock.waits == [5.0]
    assert str(raised.value).startswith(
        "downloading x failed 2 times, last with: the server answered HTTP 429. "
    )


def test_the_default_clock_is_the_one_tests_replace(monkeypatch):
    clock = FakeClock()
    monkeypatch.setattr(retry, "CLOCK", clock)
    retrying("x", failing_then([Retryable("503", retry_after="3")]), lambda line: None)
    assert clock.waits == [3.0]


def test_http_status_problem_keeps_the_header():
    asked = httpx2.Response(429, headers={"Retry-After": "2"})
    assert _http.status_problem("the server answered HTTP 429", asked).retry_after == "2"
    plain = httpx2.Response(503)
    assert _http.status_problem("the server answered HTTP 503", plain).retry_after is None
    assert _http.status_problem("the hub answered HTTP 503", None).retry_after is None
