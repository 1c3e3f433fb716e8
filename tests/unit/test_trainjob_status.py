"""The progress reporter's rate limit (trainers/outputs/trainjob_status.py) on a fake clock:
the rule itself, whatever the machine's speed. Its real HTTPS server, token and CA:
tests/integration/test_trainer_methods.py."""

from __future__ import annotations

import threading

import pytest

from tunepack.trainers.outputs.trainjob_status import StatusReporter

INTERVAL = 5.0


class FakeClock:
    """Time that moves only when a test says so."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


class Posts:
    """What the reporter would have posted, in order; a test waits for the n-th one."""

    def __init__(self) -> None:
        self.progress: list[int] = []
        self._arrived = threading.Condition()

    def record(self, payload: dict) -> None:
        with self._arrived:
            self.progress.append(payload["trainerStatus"]["progressPercentage"])
            self._arrived.notify_all()

    def wait_for(self, count: int) -> None:
        # The timeout only bounds a broken reporter; a working one posts long before it.
        with self._arrived:
            assert self._arrived.wait_for(lambda: len(self.progress) >= count, timeout=60)


@pytest.fixture
def clock(monkeypatch):
    fake = FakeClock()
    monkeypatch.setattr(StatusReporter, "clock", fake)
    return fake


@pytest.fixture
def posts():
    return Posts()


@pytest.fixture
def reporter(clock, posts):
    reporter = StatusReporter("https://controller.invalid/status", None, None, interval=INTERVAL)
    reporter._post = posts.record  # no server: the rule decides what is posted, not the network
    yield reporter
    reporter.close()


def _close(reporter: StatusReporter) -> None:
    reporter.close()
    reporter._thread.join()  # every post is in: what a test reads next is final


def test_steps_within_an_interval_post_only_the_first_and_the_final_snapshot(
    reporter, clock, posts
):
    reporter.update(20, 40, {"step": 1})
    posts.wait_for(1)
    for step in range(2, 6):  # four more steps, all within one interval of the first post
        clock.now += INTERVAL / 5
        reporter.update(20 * step, 10 * (5 - step), {"step": step})
    _close(reporter)
    assert posts.progress == [20, 100]


def test_steps_an_interval_apart_post_once_an_interval_and_only_the_newest_snapshot(
    reporter, clock, posts
):
    reporter.update(10, 90, {})
    posts.wait_for(1)
    for n, percent in enumerate((20, 30, 40), start=2):
        clock.now += INTERVAL
        reporter.update(percent, 0, {})
        posts.wait_for(n)
    # Two snapshots within the next interval: neither goes out before it ends, then the newer one.
    clock.now += INTERVAL / 2
    reporter.update(50, 0, {})
    reporter.update(60, 0, {})
    clock.now += INTERVAL / 2
    posts.wait_for(5)
    _close(reporter)
    assert posts.progress == [10, 20, 30, 40, 60]


def test_close_posts_nothing_again_when_the_newest_snapshot_went_out(reporter, posts):
    reporter.update(100, 0, {})
    posts.wait_for(1)
    _close(reporter)
    assert posts.progress == [100]
