"""Kueue on the real control plane: TrainJobs queued, admitted whole, made to wait, preempted.

The tier runs Kueue v0.19.2 (``tests/controlplane/kueue.py``) with its TrainJob integration,
built against the Trainer API this tier runs (v2.3.0; versions.env says why). Each test applies
the queues tunepack ships (``manifests/kueue``: a ResourceFlavor, a ClusterQueue that preempts
lower priorities, the LocalQueue ``team``, two WorkloadPriorityClasses) with its ClusterQueue
made its namespace's own and the quota the test needs:

- TrainJobs from YAML (``kubectl``), the SDK (``Labels``) and the CLI (``--queue``) are created
  suspended, admitted as one Workload that counts every step's pods, and complete; a v2.3.0-only
  field (a runtime patch's ``terminationGracePeriodSeconds``) survives Kueue's update;
- with GPU quota for one job, the second waits whole (suspended, no pod) and is admitted when
  the first has finished;
- a higher-priority job preempts a running one on the real node: the trainer gets SIGTERM,
  checkpoints and exits 75, and once re-admitted it resumes and ends bit-identical to a run that
  was never interrupted.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import yaml

from tests.cluster import kube
from tests.cluster.test_gang import STEP_LABEL, _apply, _as_namespaced, _job_pods
from tests.cluster.test_run import RUN_TIMEOUT, TINY, _client, _volume, training_pod
from tests.cluster.test_trainjobs import HUB_DATASET, HUB_MODEL
from tests.controlplane.cluster import KWOK_COMPLETE_DELAY
from tunepack.jobs.trainjob import QUEUE_LABEL
from tunepack.runtimes.contract import replicated_job

pytestmark = pytest.mark.controlplane

KUEUE = ("kueue.x-k8s.io", "v1beta2")
PRIORITY_LABEL = "kueue.x-k8s.io/priority-class"
LOCAL_QUEUE = "team"
KUEUE_MANIFESTS = Path(__file__).resolve().parents[2] / "manifests" / "kueue"
LOW, HIGH = "tunepack-low", "tunepack-high"  # manifests/kueue's WorkloadPriorityClasses
GPU_RUNTIME = "tunepack-llama3.2-1b"
STEPS = ["dataset-initializer", "exporter", "model-initializer", "node"]


def _shipped_queues(controlplane) -> dict[str, dict]:
    """manifests/kueue as a real kustomize renders it, by kind."""
    done = kube.kubectl("kustomize", str(KUEUE_MANIFESTS), kubeconfig=controlplane.kubeconfig)
    assert done.returncode == 0, done.stderr
    out: dict[str, dict] = {}
    for doc in yaml.safe_load_all(done.stdout):
        out[doc["kind"] if doc["kind"] != "WorkloadPriorityClass" else doc["metadata"]["name"]] = (
            doc
        )
    return out


@pytest.fixture
def queue(api, controlplane, namespace):
    """``make(**quota)``: manifests/kueue applied for this test, its ClusterQueue this
    namespace's alone (``cq-<namespace>``) with that nominal quota, the LocalQueue ``team`` here."""
    cluster_queue = f"cq-{namespace}"

    def make(**quota):
        shipped = _shipped_queues(controlplane)
        cq, lq = shipped["ClusterQueue"], shipped["LocalQueue"]
        cq["metadata"]["name"] = cluster_queue
        cq["spec"]["namespaceSelector"] = {
            "matchLabels": {"kubernetes.io/metadata.name": namespace}
        }
        group = cq["spec"]["resourceGroups"][0]
        group["coveredResources"] = list(quota)
        group["flavors"][0]["resources"] = [
            {"name": r, "nominalQuota": q} for r, q in quota.items()
        ]
        lq["metadata"]["namespace"] = namespace
        lq["spec"]["clusterQueue"] = cluster_queue
        assert lq["metadata"]["name"] == LOCAL_QUEUE
        for obj in shipped.values():
            _apply(controlplane, obj)

        def active():
            got = api.custom.get_cluster_custom_object(*KUEUE, "clusterqueues", cluster_queue)
            return _true(got, "Active")

        kube.wait_for(active, 30, f"ClusterQueue {cluster_queue} to be active")
        return LOCAL_QUEUE

    yield make
    kube.kubectl(
        "delete", "clusterqueue", cluster_queue, "--ignore-not-found", "--wait=false",
        kubeconfig=controlplane.kubeconfig,
    )  # fmt: skip


def _true(obj: dict, type_: str) -> bool:
    conditions = (obj.get("status") or {}).get("conditions") or []
    return any(c["type"] == type_ and c["status"] == "True" for c in conditions)


def _condition(obj: dict, type_: str) -> dict | None:
    conditions = (obj.get("status") or {}).get("conditions") or []
    return next((c for c in conditions if c["type"] == type_), None)


def _workload(api, namespace: str, job: str) -> dict | None:
    """The Workload Kueue made for TrainJob ``job`` (owned by it)."""
    items = api.custom.list_namespaced_custom_object(*KUEUE, namespace, "workloads")["items"]
    return next(
        (
            w
            for w in items
            if any(o["name"] == job for o in w["metadata"].get("ownerReferences", []))
        ),
        None,
    )


def _admitted(api, namespace: str, job: str) -> dict | None:
    w = _workload(api, namespace, job)
    return w if w is not None and _true(w, "Admitted") else None


def _suspended(api, namespace: str, job: str) -> bool:
    return bool(api.trainjob(namespace, job)["spec"].get("suspend"))


def _assert_admitted_whole(api, namespace: str, job: str) -> dict:
    """Admitted as one Workload whose pod sets are every step of the job, quota reserved for
    all of them at once."""
    w = kube.wait_for(
        lambda: _admitted(api, namespace, job),
        60,
        f"{job}'s Workload to be admitted",
        diagnose=lambda: json.dumps(_workload(api, namespace, job), indent=1, default=str),
    )
    pod_sets = sorted(p["name"] for p in w["spec"]["podSets"])
    assigned = sorted(a["name"] for a in w["status"]["admission"]["podSetAssignments"])
    assert pod_sets == assigned == STEPS, (pod_sets, assigned)
    assert w["spec"]["queueName"] == LOCAL_QUEUE
    return w


def _gpus(workload: dict) -> int:
    total = 0
    for a in workload["status"]["admission"]["podSetAssignments"]:
        total += int(a.get("resourceUsage", {}).get("nvidia.com/gpu", 0))
    return total


def _yaml_trainjob(name: str, runtime: str, *, gpus: int, grace: int | None = None) -> dict:
    job = {
        "apiVersion": "trainer.kubeflow.org/v1alpha1",
        "kind": "TrainJob",
        "metadata": {"name": name, "labels": {QUEUE_LABEL: LOCAL_QUEUE}},
        "spec": {
            "runtimeRef": {"name": runtime},
            "initializer": {
                "dataset": {"storageUri": HUB_DATASET},
                "model": {"storageUri": HUB_MODEL},
            },
            "trainer": {
                "args": ["method=lora", "epochs=1"],
                "resourcesPerNode": {"limits": {"nvidia.com/gpu": gpus}},
            },
        },
    }
    if grace is not None:
        pod = {"terminationGracePeriodSeconds": grace}
        job["spec"]["runtimePatches"] = [{
            "manager": "tunepack.dev/tests",
            "trainingRuntimeSpec": {"template": {"spec": {"replicatedJobs": [
                {"name": "node", "template": {"spec": {"template": {"spec": pod}}}},
            ]}}},
        }]  # fmt: skip
    return job


def test_trainjobs_from_yaml_sdk_and_cli_are_admitted_whole(
    api, controlplane, namespace, installed_runtimes, on_kwok, queue
):
    """GPU quota over the KWOK GPU nodes; a TrainJob through each door, each admitted whole."""
    from kubeflow.trainer.options import Labels

    from tunepack import FineTune, Initializer

    queue(cpu="200", memory="2000Gi", **{"nvidia.com/gpu": "16"})
    yaml_job = _yaml_trainjob("from-yaml", GPU_RUNTIME, gpus=4, grace=45)
    done = kube.create(yaml_job, namespace, kubeconfig=controlplane.kubeconfig)
    assert done.returncode == 0, done.stderr

    sdk_job = _client(namespace).train(
        runtime=GPU_RUNTIME,
        initializer=Initializer(dataset=HUB_DATASET, model=HUB_MODEL),
        trainer=FineTune(method="lora", epochs=1, resources_per_node={"gpu": 8}),
        options=[Labels({QUEUE_LABEL: LOCAL_QUEUE})],
    )
    cli = kube.tunepack(
        "train", "--runtime", GPU_RUNTIME, "--namespace", namespace, "--name", "from-cli",
        "--queue", LOCAL_QUEUE, "--dataset", HUB_DATASET, "--model", HUB_MODEL, "method=lora",
        kubeconfig=controlplane.kubeconfig,
    )  # fmt: skip
    assert cli.returncode == 0, cli.stderr

    gpus = {"from-yaml": 4, sdk_job: 8, "from-cli": 1}
    for job, want in gpus.items():
        assert api.trainjob(namespace, job)["metadata"]["labels"][QUEUE_LABEL] == LOCAL_QUEUE
        w = _assert_admitted_whole(api, namespace, job)
        assert _gpus(w) == want, w["status"]["admission"]
        assert api.wait_finished(namespace, job, timeout=120) == "Complete", api.diagnose(
            namespace, job
        )
        assert not _suspended(api, namespace, job)

    # Kueue wrote its own runtime patch into the TrainJob (a full update) and kept ours, with
    # the v2.3.0-only field: a Kueue built on the Trainer API v2.2 would have dropped it.
    patches = {
        p["manager"]: p for p in api.trainjob(namespace, "from-yaml")["spec"]["runtimePatches"]
    }
    assert set(patches) == {"tunepack.dev/tests", "kueue.x-k8s.io/manager"}, patches
    ours = patches["tunepack.dev/tests"]["trainingRuntimeSpec"]["template"]["spec"]
    pod = ours["replicatedJobs"][0]["template"]["spec"]["template"]["spec"]
    assert pod["terminationGracePeriodSeconds"] == 45
    trainers = [
        p for p in _job_pods(api, namespace, "from-yaml") if p.metadata.labels[STEP_LABEL] == "node"
    ]
    assert trainers and all(p.spec.termination_grace_period_seconds == 45 for p in trainers)


def test_the_second_job_waits_whole_until_the_first_has_finished(
    api, controlplane, namespace, installed_runtimes, on_kwok, queue
):
    """Quota for 8 GPUs, two jobs of 8 GPUs each (the KWOK nodes would hold both: only the
    queue keeps the second out). Each trainer pod 'trains' for 20 s."""
    queue(cpu="200", memory="2000Gi", **{"nvidia.com/gpu": "8"})
    runtime = _as_namespaced(api.runtime(GPU_RUNTIME), namespace)
    pod_meta = replicated_job(runtime, "node")["template"]["spec"]["template"]
    pod_meta.setdefault("metadata", {}).setdefault("annotations", {})[KWOK_COMPLETE_DELAY] = "20s"
    _apply(controlplane, runtime)
    for name in ("first", "second"):
        job = _yaml_trainjob(name, GPU_RUNTIME, gpus=8)
        job["spec"]["runtimeRef"]["kind"] = "TrainingRuntime"
        kube.wait_for(
            lambda j=job: (
                kube.create(j, namespace, kubeconfig=controlplane.kubeconfig).returncode == 0
            ),
            30,
            f"TrainJob {name} to be created",
        )

    first = _assert_admitted_whole(api, namespace, "first")

    # The second is not admitted while the first runs: quota reserved for none of its pods,
    # the TrainJob suspended, not one pod created.
    def pending_for_quota():
        w = _workload(api, namespace, "second")
        c = w and _condition(w, "QuotaReserved")
        return c if c and c["status"] == "False" and "insufficient" in c["message"] else None

    reason = kube.wait_for(pending_for_quota, 60, "the second Workload to wait for quota")
    assert "insufficient unused quota for nvidia.com/gpu" in reason["message"], reason
    # What the user sees: Kueue's reason, not only "Created".
    status = kube.tunepack(
        "status", "second", "--namespace", namespace, kubeconfig=controlplane.kubeconfig
    )
    assert status.returncode == 0, status.stderr
    assert (
        f"message: queued in Kueue LocalQueue {LOCAL_QUEUE}: waiting (Pending): "
        "couldn't assign flavors to pod set node: insufficient unused quota for nvidia.com/gpu"
    ) in status.stdout, status.stdout
    # The second's state is read first, the first's completion after: what was read counts only
    # if the first was still running then (read the other way round, the first could finish and
    # Kueue admit the second between the two reads: a fresh-clone tier run failed so).
    deadline = time.monotonic() + 300  # bounds a first job that never finishes, nothing else
    while True:
        assert time.monotonic() < deadline, "the first job did not finish in 300 s"
        suspended = _suspended(api, namespace, "second")
        pods = _job_pods(api, namespace, "second")
        admitted = _true(_workload(api, namespace, "second"), "Admitted")
        if api.condition(namespace, "first", "Complete") is not None:
            break
        assert suspended and not pods and not admitted, (suspended, pods, admitted)
        time.sleep(1)
    second = _assert_admitted_whole(api, namespace, "second")
    assert api.wait_finished(namespace, "second", timeout=120) == "Complete"
    # Admitted only once the first had finished (and given its quota back).
    finished = _condition(api.trainjob(namespace, "first"), "Complete")["lastTransitionTime"]
    admitted = _condition(second, "Admitted")["lastTransitionTime"]
    assert admitted >= finished, (admitted, finished)
    assert _condition(first, "Admitted")["lastTransitionTime"] < finished


def _queued_train(namespace: str, sources: dict, priority: str | None = None, **finetune) -> str:
    """A tiny TrainJob through the SDK, queued in ``team`` (at ``priority``, if given)."""
    from kubeflow.trainer.options import Labels

    from tunepack import FineTune, Initializer

    labels = {QUEUE_LABEL: LOCAL_QUEUE, **({PRIORITY_LABEL: priority} if priority else {})}
    return _client(namespace).train(
        runtime=TINY,
        initializer=Initializer(dataset=sources["dataset"], model=sources["model"]),
        trainer=FineTune(**finetune),
        options=[Labels(labels)],
    )


def _adapter(api, namespace: str, job: str) -> dict:
    from safetensors.torch import load_file

    return load_file(
        _volume(api, namespace, job) / "output" / "adapter" / "adapter_model.safetensors"
    )


def _result(api, namespace: str, job: str) -> dict:
    return json.loads((_volume(api, namespace, job) / "output" / "result.json").read_text())


def test_a_preempted_trainer_checkpoints_and_resumes_bit_identical(
    api, controlplane, namespace, installed_runtimes, on_node, sources, queue
):
    """A low-priority job trains on the real node; a high-priority one arrives and the
    quota holds one job. Kueue evicts the first (suspends its TrainJob: the Trainer suspends the
    JobSet, its pods are deleted): the trainer receives SIGTERM, checkpoints and exits 75. The
    high one runs; the low one is re-admitted, resumes from that checkpoint and ends with the
    adapter of a run that was never interrupted, bit for bit."""
    import torch

    queue(cpu="6", memory="16Gi")  # each tiny job counts 5 CPUs over its four steps
    args = {"method": "lora", "epochs": 6, "checkpoint_every_steps": 1000}
    low = _queued_train(namespace, sources, LOW, **args)
    pod = training_pod(api, namespace, low)
    exit_codes = kube.watch_exit_codes(api, namespace, pod.metadata.name)
    high = _queued_train(namespace, sources, HIGH, method="lora", epochs=1)

    def preempted():
        w = _workload(api, namespace, low)
        c = w and _condition(w, "Evicted")
        return c if c and c["status"] == "True" else None

    evicted = kube.wait_for(preempted, 120, "Kueue to evict the low-priority job")
    assert evicted["reason"] == "Preempted", evicted
    assert kube.wait_for(lambda: exit_codes.get("node"), 120, "the trainer's exit code") == 75
    assert _suspended(api, namespace, low)

    client = _client(namespace)
    assert client.wait_for_job_status(high, timeout=RUN_TIMEOUT).status == "Complete"
    job = client.wait_for_job_status(low, timeout=RUN_TIMEOUT)
    assert job.status == "Complete", api.diagnose(namespace, low)
    assert not _suspended(api, namespace, low)  # re-admitted: Kueue let it run again
    interrupted = _result(api, namespace, low)
    assert interrupted["resumed_from_step"] >= 1, interrupted  # the checkpoint taken at SIGTERM

    # The same job never interrupted (alone in the queue now).
    reference = _queued_train(namespace, sources, **args)
    assert client.wait_for_job_status(reference, timeout=RUN_TIMEOUT).status == "Complete"
    expected = _result(api, namespace, reference)
    for key in ("steps", "tokens_seen", "final_loss"):
        assert interrupted[key] == expected[key], key
    want, got = _adapter(api, namespace, reference), _adapter(api, namespace, low)
    assert want.keys() == got.keys()
    assert all(torch.equal(want[k], got[k]) for k in want)
