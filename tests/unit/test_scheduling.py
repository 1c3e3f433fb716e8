"""What ``tunepack status`` says about a TrainJob Kueue holds (``backends.scheduling.queued``);
the real Kueue's words are checked in tests/cluster/test_queues.py."""

from __future__ import annotations

import pytest

from tunepack.backends.scheduling import JOB_UID_LABEL, queued
from tunepack.jobs.trainjob import QUEUE_LABEL


class Workloads:
    """The one call ``queued`` makes, answered from a list (or by raising)."""

    def __init__(self, items=None, error: Exception | None = None):
        self.items, self.error, self.selectors = items or [], error, []

    def list_namespaced_custom_object(self, group, version, namespace, plural, label_selector):
        self.selectors.append((group, version, namespace, plural, label_selector))
        if self.error:
            raise self.error
        return {"items": self.items}


def _job(queue: str | None = "team", suspend: bool = True) -> dict:
    labels = {QUEUE_LABEL: queue} if queue else {}
    return {"metadata": {"uid": "u-1", "labels": labels}, "spec": {"suspend": suspend}}


def _workload(*conditions) -> dict:
    keys = ("type", "status", "reason", "message")
    return {"status": {"conditions": [dict(zip(keys, c, strict=True)) for c in conditions]}}


@pytest.mark.parametrize(
    "job", [_job(queue=None), _job(suspend=False)], ids=["no-queue", "running"]
)
def test_a_job_kueue_does_not_hold_has_no_queue_message(job):
    api = Workloads([_workload(("QuotaReserved", "False", "Pending", "no quota"))])
    assert queued(api, "ns", job) is None
    assert api.selectors == []  # not even looked up


def test_the_workloads_quota_reason_is_the_message():
    api = Workloads([_workload(
        ("QuotaReserved", "False", "Pending", "couldn't assign flavors to pod set node: "
         "insufficient unused quota for nvidia.com/gpu in flavor f, 8 more needed"),
    )])  # fmt: skip
    assert queued(api, "ns", _job()) == (
        "queued in Kueue LocalQueue team: waiting (Pending): couldn't assign flavors to pod set "
        "node: insufficient unused quota for nvidia.com/gpu in flavor f, 8 more needed"
    )
    assert api.selectors == [
        ("kueue.x-k8s.io", "v1beta2", "ns", "workloads", f"{JOB_UID_LABEL}=u-1")
    ]


def test_an_evicted_job_says_so_before_its_quota():
    api = Workloads([_workload(
        ("QuotaReserved", "False", "Pending", "waiting"),
        ("Evicted", "True", "Preempted", "Preempted to accommodate a workload of higher priority"),
    )])  # fmt: skip
    assert queued(api, "ns", _job()) == (
        "queued in Kueue LocalQueue team: evicted (Preempted): Preempted to accommodate a "
        "workload of higher priority"
    )


def test_no_workload_yet_and_no_access_are_said_plainly():
    assert queued(Workloads([]), "ns", _job()) == (
        "queued in Kueue LocalQueue team: waiting for Kueue to make its Workload"
    )
    denied = Workloads(error=RuntimeError("403"))
    assert queued(denied, "ns", _job()) == (
        "queued in Kueue LocalQueue team (its Workload cannot be read)"
    )
