"""Gang scheduling on the real gang scheduler: upstream's way deadlocks, tunepack's completes.

The tier runs scheduler-plugins' scheduler (the version Kubeflow Trainer v2.3.0 pins) with the
Coscheduling plugin as a second scheduler, ``scheduler-plugins-scheduler``, and its PodGroup
controller. With ``podGroupPolicy.coscheduling`` the real Trainer makes a PodGroup whose
``minMember`` counts the pods of every step (initializers, trainer nodes, exporter), and the
scheduler admits a pod only when ``minMember`` pods of its group exist.

- Upstream's layout (``dependsOn``: the trainer pods are created only once both initializers
  completed) can never form that gang: the initializers wait forever.
- tunepack's ``manifests/components/gang-coscheduling`` starts every step together and lets the
  trainer wait for the initializers on the volume (``tunepack.core.handoff``): a 2-node job with
  both initializers is placed whole and completes, for real, on the real node.
- Two such jobs competing for 3 GPU nodes never hold part of their nodes each: one runs whole,
  the other waits whole (not one of its pods bound) and runs once the first has finished.
- A gang that can never fit is not waited on forever: ``tunepack status`` shows the scheduler's
  reason, and ``wait_for_job_status`` ends with it once the PodGroup's schedule timeout passed.

Each test installs the gang runtime as a namespaced TrainingRuntime of the usual name, the way
``kubectl apply -k manifests/overlays/gang-coscheduling`` renders it; a TrainingRuntime in the
job's namespace is used before the ClusterTrainingRuntime of that name.
"""

from __future__ import annotations

import copy
import json
import time
from pathlib import Path

import pytest
import yaml

from tests.cluster import kube
from tests.cluster.test_run import RUN_TIMEOUT, TINY, _client, _volume
from tests.controlplane.cluster import GANG_SCHEDULER, KWOK_COMPLETE_DELAY, KWOK_NODE_ANNOTATION
from tunepack.core import handoff
from tunepack.runtimes.contract import replicated_job
from tunepack.runtimes.store import load_runtime

pytestmark = pytest.mark.controlplane

REPO = Path(__file__).resolve().parents[2]
GANG_OVERLAY = REPO / "manifests/overlays/gang-coscheduling"
PODGROUPS = ("scheduling.x-k8s.io", "v1alpha1", "podgroups")
STEP_LABEL = "jobset.sigs.k8s.io/replicatedjob-name"
# Fake GPU nodes for the contention test: room for 3 trainer pods of 1 GPU each.
GANG_NODES = [f"gang-gpu-{i}" for i in range(3)]
GANG_NODE_LABEL = "tunepack.dev/gang-test"


def _kustomized_gang_runtime(controlplane, name: str) -> dict:
    """The ClusterTrainingRuntime ``name`` as the gang overlay renders it (real kustomize)."""
    done = kube.kubectl("kustomize", str(GANG_OVERLAY), kubeconfig=controlplane.kubeconfig)
    assert done.returncode == 0, done.stderr
    return next(d for d in yaml.safe_load_all(done.stdout) if d["metadata"]["name"] == name)


def _as_namespaced(runtime: dict, namespace: str, name: str | None = None) -> dict:
    runtime = copy.deepcopy(runtime)
    runtime["kind"] = "TrainingRuntime"
    runtime["metadata"] = {
        "name": name or runtime["metadata"]["name"],
        "namespace": namespace,
        "labels": runtime["metadata"].get("labels", {}),
        "annotations": runtime["metadata"].get("annotations", {}),
    }
    return runtime


CPU_PER_POD = "300m"


def _small_pods(runtime: dict) -> dict:
    """The runtime with every step's container asking CPU_PER_POD (memory unchanged)."""
    runtime = copy.deepcopy(runtime)
    for job in runtime["spec"]["template"]["spec"]["replicatedJobs"]:
        for container in job["template"]["spec"]["template"]["spec"]["containers"]:
            container["resources"]["requests"]["cpu"] = CPU_PER_POD
    return runtime


def _on_kwok(runtime: dict) -> dict:
    """The runtime for KWOK's fake nodes, where nothing reads the workspace: an emptyDir named
    ``initializer`` in place of the PVC. A pod the scheduler first refuses for a claim not yet
    bound is, in a gang, retried only at the scheduler's periodic flush (minutes), which would
    hide what these tests look at."""
    runtime = copy.deepcopy(runtime)
    spec = runtime["spec"]["template"]["spec"]
    del spec["volumeClaimPolicies"]
    for job in spec["replicatedJobs"]:
        pod = job["template"]["spec"]["template"]["spec"]
        pod.setdefault("volumes", []).append({"name": "initializer", "emptyDir": {}})
    return runtime


def _apply(controlplane, obj: dict) -> None:
    done = kube.kubectl(
        "apply",
        "--server-side",
        "-f",
        "-",
        input=yaml.safe_dump(obj),
        kubeconfig=controlplane.kubeconfig,
    )
    assert done.returncode == 0, done.stderr


def _podgroup(api, namespace: str, name: str) -> dict | None:
    return kube._get_or_none(
        lambda: api.custom.get_namespaced_custom_object(
            *PODGROUPS[:2], namespace, PODGROUPS[2], name
        )
    )


def _trainjob(name: str, runtime: str, *, nodes: int = 2, resources: dict | None = None) -> dict:
    trainer = {"numNodes": nodes, "numProcPerNode": 1, "args": ["method=lora", "epochs=1"]}
    if resources:
        trainer["resourcesPerNode"] = resources
    return {
        "apiVersion": "trainer.kubeflow.org/v1alpha1",
        "kind": "TrainJob",
        "metadata": {"name": name},
        "spec": {
            "runtimeRef": {"name": runtime, "kind": "TrainingRuntime"},
            "initializer": {
                "dataset": {"storageUri": "file:///data/x.jsonl"},
                "model": {"storageUri": "file:///models/tiny"},
            },
            "trainer": trainer,
        },
    }


def _create(api, obj, namespace):
    from kubernetes.client.exceptions import ApiException

    try:
        return api.create_trainjob(obj, namespace)
    except ApiException as err:
        if "not found" in str(err.body):  # the webhook's runtime cache lags a moment
            return None
        raise


def _bound(pods) -> list:
    return [p for p in pods if p.spec.node_name]


def _job_pods(api, namespace: str, job: str) -> list:
    return api.pods(namespace, f"jobset.sigs.k8s.io/jobset-name={job}")


def _refused_by_scheduler(pod) -> bool:
    """The scheduler looked at ``pod`` and could not place it (its last word, kept on the pod)."""
    cond = next((c for c in pod.status.conditions or [] if c.type == "PodScheduled"), None)
    return cond is not None and cond.status == "False" and cond.reason == "Unschedulable"


def test_upstreams_ordered_steps_never_form_a_gang(api, controlplane, namespace, on_kwok):
    """dependsOn + coscheduling (with the gang scheduler named, as it must be): the PodGroup
    asks for 5 members, only the 2 initializer pods can exist, and the scheduler refuses them
    for it, for as long as one waits. On KWOK they would complete at once if ever placed."""
    runtime = copy.deepcopy(load_runtime("tiny-llama3"))
    runtime["spec"]["podGroupPolicy"] = {"coscheduling": {"scheduleTimeoutSeconds": 30}}
    for job in runtime["spec"]["template"]["spec"]["replicatedJobs"]:
        job["template"]["spec"]["template"]["spec"]["schedulerName"] = GANG_SCHEDULER
    _apply(controlplane, _as_namespaced(_on_kwok(runtime), namespace, "upstream-gang"))
    kube.wait_for(
        lambda: _create(api, _trainjob("ordered", "upstream-gang"), namespace),
        30,
        "the TrainJob to be admitted",
    )
    group = kube.wait_for(
        lambda: _podgroup(api, namespace, "ordered"), 60, "the Trainer's PodGroup"
    )
    # 1 dataset-initializer + 1 model-initializer + 2 trainer pods + 1 exporter.
    assert group["spec"]["minMember"] == 5
    node = replicated_job(api.wait_jobset(namespace, "ordered"), "node")
    assert {d["name"] for d in node["dependsOn"]} == {"dataset-initializer", "model-initializer"}

    def refused():
        return [e for e in api.events(namespace) if "cannot find enough sibling pods" in e]

    events = kube.wait_for(refused, 60, "the gang scheduler's refusal")
    assert "minMember of group: 5" in events[0], events

    # And it stays so, by rule rather than for a while: once the scheduler has looked at every
    # pod there is and refused each, the gang can grow only by the trainer pods, which JobSet
    # creates only once both initializers completed, which they cannot unplaced.
    initializers = {"dataset-initializer", "model-initializer"}

    def initializers_refused():
        pods = _job_pods(api, namespace, "ordered")
        waiting = [p for p in pods if p.metadata.labels[STEP_LABEL] in initializers]
        return pods if len(waiting) == 2 and all(map(_refused_by_scheduler, waiting)) else None

    pods = kube.wait_for(
        initializers_refused,
        60,
        "the scheduler to have refused both initializer pods",
        diagnose=lambda: api.diagnose(namespace, "ordered"),
    )
    # JobSet makes the Jobs of every step whose dependencies are met in one pass: had dependsOn
    # not held the trainer's back, its Job would be here beside the initializers'.
    jobs = api.batch.list_namespaced_job(
        namespace, label_selector="jobset.sigs.k8s.io/jobset-name=ordered"
    ).items
    assert {j.metadata.labels[STEP_LABEL] for j in jobs} == initializers, [
        j.metadata.name for j in jobs
    ]
    assert not any((j.status.succeeded or 0) for j in jobs)
    assert {p.metadata.labels[STEP_LABEL] for p in pods} == initializers
    assert all(p.spec.scheduler_name == GANG_SCHEDULER for p in pods)
    assert not _bound(pods), [(p.metadata.name, p.spec.node_name) for p in pods]


def test_a_two_node_job_with_initializers_is_gang_scheduled_and_completes(
    api,
    controlplane,
    namespace,
    installed_runtimes,
    on_node,
    sources,
):
    """The gang overlay's runtime, through the SDK as a notebook uses it: all five pods are
    created together, placed by the gang scheduler as one group, the trainer waits for the
    initializers' results on the volume, and the job trains for real on two nodes.

    The real node has 2 CPUs and the five pods as the runtime writes them ask 7 together (an
    initializer 1, a trainer 2, the exporter 1): this namespace's copy of the runtime asks
    CPU_PER_POD each, so that the whole gang fits on it at once."""
    gang = _kustomized_gang_runtime(controlplane, TINY)
    assert gang["spec"]["podGroupPolicy"] == {"coscheduling": {"scheduleTimeoutSeconds": 120}}
    _apply(controlplane, _as_namespaced(_small_pods(gang), namespace))

    from tunepack import FineTune, Initializer

    client = _client(namespace)
    name = client.train(
        runtime=TINY,
        initializer=Initializer(dataset=sources["dataset"], model=sources["model"]),
        trainer=FineTune(method="lora", epochs=1, num_nodes=2),
    )
    job = client.wait_for_job_status(name, timeout=RUN_TIMEOUT)
    assert job.status == "Complete", api.diagnose(namespace, name)

    js = api.jobset(namespace, name)
    assert all("dependsOn" not in j for j in js["spec"]["replicatedJobs"])
    pods = _job_pods(api, namespace, name)
    steps = sorted(p.metadata.labels[STEP_LABEL] for p in pods)
    assert steps == ["dataset-initializer", "exporter", "model-initializer", "node", "node"]
    assert all(p.spec.scheduler_name == GANG_SCHEDULER for p in pods)
    group = _podgroup(api, namespace, name)
    assert group["spec"]["minMember"] == 5
    assert group["status"].get("phase") == "Finished", group["status"]

    # Each step marked this run done: the JobSet's uid and restart attempt, from the pod labels.
    volume = _volume(api, namespace, name)
    run = f"{js['metadata']['uid']}/0"
    for step in ("dataset-initializer", "model-initializer", "trainer"):
        assert handoff.marked_run(step, volume) == run, step
    result = json.loads((volume / "output" / "result.json").read_text())
    assert result["world_size"] == 2
    assert result["final_loss"] < result["first_loss"]
    assert (volume / "output" / "adapter" / "adapter_model.safetensors").stat().st_size > 0


@pytest.fixture
def gang_nodes(api, controlplane):
    """Three fake (KWOK) nodes with one GPU each; every other node cordoned meanwhile."""
    nodes = [
        {
            "apiVersion": "v1",
            "kind": "Node",
            "metadata": {
                "name": name,
                "annotations": {KWOK_NODE_ANNOTATION: "fake"},
                "labels": {"kubernetes.io/hostname": name, GANG_NODE_LABEL: "true"},
            },
            "status": {
                "capacity": {"cpu": "16", "memory": "64Gi", "nvidia.com/gpu": "1", "pods": "110"},
                "allocatable": {
                    "cpu": "16",
                    "memory": "64Gi",
                    "nvidia.com/gpu": "1",
                    "pods": "110",
                },
            },
        }
        for name in GANG_NODES
    ]
    done = kube.kubectl(
        "apply", "-f", "-", input=yaml.safe_dump_all(nodes), kubeconfig=controlplane.kubeconfig
    )
    assert done.returncode == 0, done.stderr
    api.cordon(kwok=True, node=True)

    def ready():
        items = api.core.list_node(label_selector=f"{GANG_NODE_LABEL}=true").items
        return len(items) == 3 and all(
            c.status == "True"
            for n in items
            for c in n.status.conditions or []
            if c.type == "Ready"
        )

    kube.wait_for(ready, 60, "the gang test's KWOK nodes to be Ready")
    yield GANG_NODES
    api.cordon(kwok=False, node=False)
    gone = kube.kubectl(
        "delete",
        "node",
        *GANG_NODES,
        "--wait=true",
        "--timeout=60s",
        kubeconfig=controlplane.kubeconfig,
    )
    assert gone.returncode == 0, gone.stderr  # the next test makes nodes of the same names


def test_competing_gangs_never_hold_part_of_their_nodes(api, controlplane, namespace, gang_nodes):
    """Two 2-node jobs, one GPU per trainer pod, three 1-GPU nodes: only one fits at a time. The
    first runs whole; not one pod of the second is bound while the first holds its nodes (a
    default scheduler would bind one of its trainer pods to the free node and leave it waiting);
    the second is placed whole once the first has released a node, and completes too."""
    gang = _as_namespaced(_on_kwok(_kustomized_gang_runtime(controlplane, TINY)), namespace)
    node = replicated_job(gang, "node")
    pod_meta = node["template"]["spec"]["template"].setdefault("metadata", {})
    pod_meta.setdefault("annotations", {})[KWOK_COMPLETE_DELAY] = "20s"  # trains for 20 s
    _apply(controlplane, gang)
    gpu = {"limits": {"nvidia.com/gpu": 1}, "requests": {"cpu": "1", "memory": "1Gi"}}
    for name in ("first", "second"):
        kube.wait_for(
            lambda n=name: _create(api, _trainjob(n, TINY, resources=gpu), namespace),
            30,
            f"TrainJob {name} to be admitted",
        )

    def running_whole():
        for name in ("first", "second"):
            trainers = [
                p
                for p in _job_pods(api, namespace, name)
                if p.metadata.labels[STEP_LABEL] == "node"
            ]
            if len(trainers) == 2 and all(p.status.phase == "Running" for p in trainers):
                return name
        return None

    winner = kube.wait_for(
        running_whole,
        120,
        "one job's trainer pods to run",
        diagnose=lambda: "\n".join(api.events(namespace)[-30:]),
    )
    loser = "second" if winner == "first" else "first"
    # While the winner holds its two GPU nodes, the loser has no pod bound anywhere: its gang
    # waits whole (the third node stays free).
    observed, most = 0, 0
    deadline = time.monotonic() + 300  # bounds a winner that never finishes, nothing else
    while True:
        assert time.monotonic() < deadline, f"{winner}'s trainer pods still run after 300 s"
        # The loser's pods first, then whether the winner still holds its nodes: a loser pod
        # bound then was bound while the winner held them (the other order would race the
        # winner's finish).
        waiting = _job_pods(api, namespace, loser)  # JobSet may still be creating some
        if not any(
            p.status.phase == "Running"
            for p in _job_pods(api, namespace, winner)
            if p.metadata.labels[STEP_LABEL] == "node"
        ):
            break
        assert not _bound(waiting), [(p.metadata.name, p.spec.node_name) for p in waiting]
        most = max(most, len(waiting))
        observed += 1
        time.sleep(1)
    # The rule held at each look while the winner ran (how many looks fit in its run depends on
    # the machine: at least the first, taken while it was running).
    assert observed >= 1
    assert most == 5  # every pod of the loser existed, and none was bound
    for name in (winner, loser):
        assert api.wait_finished(namespace, name, timeout=180) == "Complete", api.diagnose(
            namespace, name
        )

    # The loser's trainer pods were bound only after one of the winner's had finished: that frees
    # its node, and with the third node the loser's gang fits whole. KWOK ends each pod 20 s after
    # its own start, so the winner's two can end a second apart and the loser may start between.
    def times(name, attr):
        out = []
        for p in _job_pods(api, namespace, name):
            if p.metadata.labels[STEP_LABEL] != "node":
                continue
            if attr == "scheduled":
                cond = next(c for c in p.status.conditions if c.type == "PodScheduled")
                out.append(cond.last_transition_time)
            else:
                out.append(p.status.container_statuses[0].state.terminated.finished_at)
        return out

    assert min(times(loser, "scheduled")) >= min(times(winner, "finished")).replace(microsecond=0)
    for name in (winner, loser):
        assert _podgroup(api, namespace, name)["spec"]["minMember"] == 5
    assert all(p.spec.node_name in GANG_NODES for p in _job_pods(api, namespace, loser))


def test_a_gang_that_cannot_fit_is_reported_not_waited_on_forever(
    api, controlplane, namespace, gang_nodes
):
    """Two trainer pods of 2 GPUs each on 1-GPU nodes: the gang scheduler never places it. The
    user sees why (``tunepack status``: no node has the GPUs), and the notebook's wait ends
    with that reason once the
    PodGroup's scheduleTimeoutSeconds (45 s here) has passed, not at the wait's own timeout."""
    from tunepack.core.errors import GangNotPlaced

    gang = _as_namespaced(_on_kwok(_kustomized_gang_runtime(controlplane, TINY)), namespace)
    gang["spec"]["podGroupPolicy"]["coscheduling"]["scheduleTimeoutSeconds"] = 45
    _apply(controlplane, gang)
    two_gpus = {"limits": {"nvidia.com/gpu": 2}, "requests": {"cpu": "1", "memory": "1Gi"}}
    kube.wait_for(
        lambda: _create(api, _trainjob("toobig", TINY, resources=two_gpus), namespace),
        30,
        "the TrainJob to be admitted",
    )
    started = time.monotonic()

    def status_names_the_gpus():
        done = kube.tunepack(
            "status", "toobig", "--namespace", namespace, kubeconfig=controlplane.kubeconfig
        )
        assert done.returncode == 0, done.stderr
        return done.stdout if "nvidia.com/gpu" in done.stdout else None

    status = kube.wait_for(
        status_names_the_gpus,
        180,
        "tunepack status to name the GPUs",
        diagnose=lambda: api.diagnose(namespace, "toobig"),
    )
    assert "message: not scheduled (for " in status, status
    assert "its gang may wait 45 s to be placed whole" in status
    assert "Insufficient nvidia.com/gpu" in status, status

    with pytest.raises(GangNotPlaced) as caught:
        _client(namespace).wait_for_job_status("toobig", timeout=600)
    waited = time.monotonic() - started
    message = str(caught.value)
    assert message.startswith("TrainJob toobig could not be placed whole within its gang's 45 s")
    assert "Insufficient nvidia.com/gpu" in message, message
    assert "delete it" in message
    assert waited < 300, waited  # the gang's deadline ended it, not the wait's 600 s
    assert not _bound(_job_pods(api, namespace, "toobig"))
