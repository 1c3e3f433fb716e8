"""Why a TrainJob's pods are not running yet, in the scheduler's, the kubelet's or Kueue's words.

``unscheduled`` (and a gang's deadline, ``Unscheduled.overdue``), ``pending`` (a placed pod that
cannot start) and ``queued`` (a Workload Kueue has not admitted) give ``get_job().message`` and
``tunepack status`` a reason for every Pending job; docs/cluster.md, "Gang scheduling and
queues" and "Node shapes"."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import UTC, datetime

from tunepack.jobs.trainjob import QUEUE_LABEL

PODGROUP_API = ("scheduling.x-k8s.io", "v1alpha1", "podgroups")
WORKLOAD_API = ("kueue.x-k8s.io", "v1beta2", "workloads")
JOB_UID_LABEL = "kueue.x-k8s.io/job-uid"  # Kueue's label on a job's Workload
JOBSET_NAME_LABEL = "jobset.sigs.k8s.io/jobset-name"  # the TrainJob's JobSet has its name


@dataclass(frozen=True)
class Unscheduled:
    pod: str
    reason: str  # the scheduler's message, as it wrote it
    seconds: float  # how long the pod has been refused
    gang_timeout: int | None  # the PodGroup's scheduleTimeoutSeconds, if it is a gang

    @property
    def overdue(self) -> bool:
        return self.gang_timeout is not None and self.seconds > self.gang_timeout

    def message(self) -> str:
        waited = f"for {self.seconds:.0f} s"
        if self.gang_timeout is not None:
            waited += f"; its gang may wait {self.gang_timeout} s to be placed whole"
        return f"not scheduled ({waited}): pod {self.pod}: {self.reason}"


# The kubelet's waiting reasons of a container that will not start without a change.
IMAGE_REASONS = ("ErrImagePull", "ImagePullBackOff", "InvalidImageName", "ErrImageNeverPull")
STUCK_REASONS = (*IMAGE_REASONS, "CreateContainerConfigError", "CreateContainerError")
IMAGE_HINT = (
    "the node cannot pull the runtime's image: push tunepack's images to a registry the "
    "cluster pulls from (make push-images REGISTRY=...) and install the runtimes naming it "
    "(tunepack install --registry ...; docs/cluster.md, 'Images')"
)


@dataclass(frozen=True)
class NotStarting:
    """A pod the scheduler placed whose container waits for something that will not come."""

    pod: str
    container: str
    reason: str  # the kubelet's waiting reason
    detail: str  # and its message

    overdue = False  # nothing to stop waiting for: the pod starts once the cause is fixed

    def message(self) -> str:
        said = f"{self.reason}: {self.detail}" if self.detail else self.reason
        hint = f"; {IMAGE_HINT}" if self.reason in IMAGE_REASONS else ""
        return f"not starting: pod {self.pod}, container {self.container}: {said}{hint}"


def pending(core_api, custom_api, namespace: str, name: str) -> Unscheduled | NotStarting | None:
    """Why a pod of TrainJob ``name`` is Pending: the scheduler's refusal first (``Unscheduled``),
    else a placed pod's container that cannot start (``NotStarting``); None if neither."""
    pods = core_api.list_namespaced_pod(namespace, label_selector=f"{JOBSET_NAME_LABEL}={name}")
    return unscheduled(core_api, custom_api, namespace, pods.items) or not_starting(pods.items)


def not_starting(pods) -> NotStarting | None:
    """The first Pending pod (by name) whose container waits for a reason in ``STUCK_REASONS``."""
    for pod in sorted(pods, key=lambda p: p.metadata.name):
        if (pod.status.phase or "Pending") != "Pending":
            continue
        statuses = [
            *(pod.status.init_container_statuses or []),
            *(pod.status.container_statuses or []),
        ]
        for status in statuses:
            waiting = status.state.waiting if status.state else None
            if waiting is not None and waiting.reason in STUCK_REASONS:
                return NotStarting(
                    pod.metadata.name, status.name, waiting.reason, (waiting.message or "").strip()
                )
    return None


def unscheduled(core_api, custom_api, namespace: str, pods) -> Unscheduled | None:
    """The first of ``pods`` (a TrainJob's) that the scheduler refused, or None if none is."""
    refused = []
    for pod in pods:
        if pod.spec.node_name or (pod.status.phase or "Pending") != "Pending":
            continue
        cond = next((c for c in pod.status.conditions or [] if c.type == "PodScheduled"), None)
        if cond is not None and cond.status == "False" and cond.reason == "Unschedulable":
            refused.append((pod, cond))
    if not refused:
        return None
    now = datetime.now(UTC)
    since = min(c.last_transition_time or now for _, c in refused)
    pod, cond = min(refused, key=lambda pc: pc[0].metadata.name)
    # A pod's condition keeps only the scheduler's last word, and in a gang that is mostly "a
    # sibling did not fit" (or "failed recently" while the group backs off). The pod that did not
    # fit said why in a FailedScheduling event: the newest such reason is the one to show.
    names = {p.metadata.name for p, _ in refused}
    events = core_api.list_namespaced_event(namespace, field_selector="reason=FailedScheduling")
    reasons = [
        e for e in events.items if e.involved_object.name in names and not _sibling_only(e.message)
    ]
    if reasons:
        event = max(reasons, key=lambda e: _last_seen(e, now))
        pod_name, reason = event.involved_object.name, event.message
    else:
        pod_name, reason = pod.metadata.name, cond.message
    return Unscheduled(
        pod=pod_name,
        reason=(reason or "no reason given").strip(),
        seconds=max(0.0, (now - since).total_seconds()),
        gang_timeout=_gang_timeout(custom_api, namespace, pod),
    )


def _last_seen(event, default: datetime) -> datetime:
    """When an event last happened: a repeated one (the scheduler's are a series, one object
    per reason and message) keeps its first time in event_time and its last in the series."""
    series = getattr(event, "series", None)
    last = getattr(series, "last_observed_time", None) if series else None
    return (
        last
        or event.last_timestamp
        or event.event_time
        or event.metadata.creation_timestamp
        or default
    )


# scheduler-plugins' words for a pod refused only because of its gang: a sibling did not fit,
# the group backs off, or (pre-filter) not all of its pods exist yet.
_SIBLING_REJECTIONS = (
    "rejection in PostFilter",
    "rejected due to timeout",
    "failed recently",
    "cannot find enough sibling pods",
)


def _sibling_only(message: str | None) -> bool:
    return any(words in (message or "") for words in _SIBLING_REJECTIONS)


def _gang_timeout(custom_api, namespace: str, pod) -> int | None:
    group = (pod.metadata.labels or {}).get("scheduling.x-k8s.io/pod-group")
    if not group:
        return None
    try:
        obj = custom_api.get_namespaced_custom_object(
            *PODGROUP_API[:2], namespace, PODGROUP_API[2], group
        )
    except Exception:  # no PodGroup CRD, or no access: a gang of unknown deadline
        return None
    timeout = (obj.get("spec") or {}).get("scheduleTimeoutSeconds")
    return int(timeout) if timeout else None


def queued(custom_api, namespace: str, trainjob: dict) -> str | None:
    """Kueue's reason for holding a suspended TrainJob of a LocalQueue, or None if Kueue holds
    none (no queue label, not suspended: admitted or never queued)."""
    meta, spec = trainjob.get("metadata") or {}, trainjob.get("spec") or {}
    queue = (meta.get("labels") or {}).get(QUEUE_LABEL)
    if not queue or not spec.get("suspend"):
        return None
    where = f"queued in Kueue LocalQueue {queue}"
    try:
        found = custom_api.list_namespaced_custom_object(
            *WORKLOAD_API[:2], namespace, WORKLOAD_API[2],
            label_selector=f"{JOB_UID_LABEL}={meta.get('uid')}",
        )  # fmt: skip
    except Exception:  # no Kueue CRDs, or no access to Workloads
        return f"{where} (its Workload cannot be read)"
    workloads = found.get("items") or []
    if not workloads:
        return f"{where}: waiting for Kueue to make its Workload"
    conditions = {c["type"]: c for c in (workloads[0].get("status") or {}).get("conditions") or []}
    for kind in ("Evicted", "QuotaReserved", "Admitted"):
        c = conditions.get(kind)
        if c is not None and (c["status"] == "False") == (kind != "Evicted"):
            word = "evicted" if kind == "Evicted" else "waiting"
            return f"{where}: {word} ({c.get('reason', '')}): {c.get('message', '').strip()}"
    return f"{where}: waiting for admission"
