"""What ``tunepack status`` says about a TrainJob Kueue holds (``backends.scheduling.queued``)
and about its Pending pods (``pending``); the real Kueue's words are checked in
tests/cluster/test_queues.py, the real scheduler's in tests/cluster/test_gang.py."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest
from kubernetes import client

from tunepack.backends.scheduling import JOB_UID_LABEL, JOBSET_NAME_LABEL, pending, queued
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


# --- pods that are Pending: the scheduler's reason, or the kubelet's ---------------------------


class Pods:
    """The reads ``pending`` makes of the core API, answered from lists."""

    def __init__(self, pods, events=()):
        self.pods, self.events = list(pods), list(events)

    def list_namespaced_pod(self, namespace, label_selector):
        assert label_selector == f"{JOBSET_NAME_LABEL}=job"
        return client.V1PodList(items=self.pods)

    def list_namespaced_event(self, namespace, field_selector):
        return client.CoreV1EventList(items=self.events)


def _pod(name, *, node=None, condition=None, waiting=None, phase="Pending"):
    conditions = []
    if condition:
        conditions.append(client.V1PodCondition(
            type="PodScheduled", status="False", reason="Unschedulable", message=condition,
            last_transition_time=datetime.now(UTC),
        ))  # fmt: skip
    statuses = None
    if waiting:
        state = client.V1ContainerState(waiting=client.V1ContainerStateWaiting(*waiting))
        statuses = [client.V1ContainerStatus(
            name="node", image="ghcr.io/tunepack/trainer:0.1.0", image_id="", ready=False,
            restart_count=0, state=state,
        )]  # fmt: skip
    return client.V1Pod(
        metadata=client.V1ObjectMeta(name=name, labels={}),
        spec=client.V1PodSpec(containers=[], node_name=node),
        status=client.V1PodStatus(phase=phase, conditions=conditions, container_statuses=statuses),
    )


def test_a_pending_pod_without_a_gang_gets_the_schedulers_reason():
    reason = "0/3 nodes are available: 3 Insufficient memory. preemption: 0/3 nodes are available"
    api = Pods([_pod("job-node-0-0-x", condition=reason)])
    found = pending(api, None, "ns", "job")
    assert found.gang_timeout is None and not found.overdue
    assert found.message().startswith("not scheduled (for ")
    assert found.message().endswith(f" s): pod job-node-0-0-x: {reason}")


def test_a_placed_pod_whose_image_cannot_be_pulled_says_so_and_what_to_do():
    api = Pods([
        _pod("job-dataset-initializer-0-0-a", node="n1", phase="Succeeded"),
        _pod("job-node-0-0-b", node="n1", waiting=(
            'Back-off pulling image "ghcr.io/tunepack/trainer:0.1.0"', "ImagePullBackOff",
        )),
    ])  # fmt: skip
    found = pending(api, None, "ns", "job")
    assert not found.overdue
    assert found.message() == (
        "not starting: pod job-node-0-0-b, container node: ImagePullBackOff: Back-off pulling "
        'image "ghcr.io/tunepack/trainer:0.1.0"; the node cannot pull the runtime\'s image: push '
        "tunepack's images to a registry the cluster pulls from (make push-images REGISTRY=...) "
        "and install the runtimes naming it (tunepack install --registry ...; docs/cluster.md, "
        "'Images')"
    )


def test_a_pod_that_is_only_creating_its_container_is_not_reported():
    api = Pods([_pod("job-node-0-0-b", node="n1", waiting=("", "ContainerCreating"))])
    assert pending(api, None, "ns", "job") is None


def _event(pod, message, seconds_ago):
    when = datetime.now(UTC) - timedelta(seconds=seconds_ago)
    return client.CoreV1Event(
        metadata=client.V1ObjectMeta(name=f"{pod}.{seconds_ago}"),
        involved_object=client.V1ObjectReference(kind="Pod", name=pod),
        reason="FailedScheduling", message=message, last_timestamp=when,
    )  # fmt: skip


def test_a_gang_shows_the_pod_that_did_not_fit_not_its_siblings_words():
    """The scheduler-plugins messages of a 5-pod gang that cannot fit (as a real run wrote them):
    the siblings' refusals are newer, yet the reason shown is the trainer pod's own."""
    gpus = (
        "0/8 nodes are available: 3 Insufficient nvidia.com/gpu, 5 node(s) were unschedulable. "
        "preemption: 0/8 nodes are available: 8 Preemption is not helpful for scheduling."
    )
    siblings = {
        "job-model-initializer-0-0-a": "0/8 nodes are available: pre-filter pod "
        "job-model-initializer-0-0-a cannot find enough sibling pods, current pods number: 3, "
        "minMember of group: 5.",
        "job-exporter-0-0-b": "0/1 nodes are available: 1 optimistic rejection in PostFilter.",
        "job-node-0-1-d": "0/8 nodes are available: podGroup ns/job failed recently.",
    }
    pods = [_pod(name, condition=words) for name, words in siblings.items()]
    pods.append(_pod("job-node-0-0-c", condition=siblings["job-node-0-1-d"]))
    events = [_event(name, words, seconds_ago=1) for name, words in siblings.items()]
    events.append(_event("job-node-0-0-c", gpus, seconds_ago=20))
    found = pending(Pods(pods, events), None, "ns", "job")
    assert found.message().endswith(f" s): pod job-node-0-0-c: {gpus}")
