"""Why tunepack's runtimes carry no ``podGroupPolicy``: the real Trainer's evidence.

With ``podGroupPolicy.coscheduling`` the Trainer makes a scheduler-plugins PodGroup whose
``minMember`` counts the pods of every replicatedJob, initializers and exporter included, while
JobSet creates the trainer (``node``) pods only after both initializers completed.
scheduler-plugins' coscheduling admits a pod only when at least ``minMember`` pods of its group
exist, so the initializer pods would wait forever. This test shows both halves on the real
controllers (with the PodGroup CRD from the very scheduler-plugins version Trainer v2.3.0 pins, and
the default scheduler, which ignores PodGroups).
"""

from __future__ import annotations

import copy

import pytest
import yaml

from tests.cluster import kube
from tests.controlplane.cluster import module_dir
from tunepack.runtimes.contract import replicated_job
from tunepack.runtimes.store import load_runtime

pytestmark = pytest.mark.controlplane

SCHEDULER_PLUGINS = ("sigs.k8s.io/scheduler-plugins", "v0.35.4-devel")  # Trainer v2.3.0's go.mod


def test_a_coscheduling_gang_counts_pods_that_cannot_exist_together(api, controlplane, namespace):
    crd = module_dir(*SCHEDULER_PLUGINS) / "config/crd/bases/scheduling.x-k8s.io_podgroups.yaml"
    done = kube.kubectl(
        "apply", "--server-side", "-f", str(crd), kubeconfig=controlplane.kubeconfig
    )
    assert done.returncode == 0, done.stderr
    kube.kubectl(
        "wait",
        "--for=condition=Established",
        "crd/podgroups.scheduling.x-k8s.io",
        kubeconfig=controlplane.kubeconfig,
    )
    runtime = copy.deepcopy(load_runtime("tiny-llama3"))
    runtime["metadata"]["name"] = "gang-tiny"
    runtime["spec"]["podGroupPolicy"] = {"coscheduling": {"scheduleTimeoutSeconds": 60}}
    applied = kube.kubectl(
        "apply",
        "--server-side",
        "-f",
        "-",
        input=yaml.safe_dump(runtime),
        kubeconfig=controlplane.kubeconfig,
    )
    assert applied.returncode == 0, applied.stderr
    # No node takes pods: the initializers stay Pending, as they would behind an incomplete gang
    # (and cannot race ahead to complete on KWOK before the assertions below).
    api.cordon(executor=True, kwok=True)
    try:
        trainjob = {
            "apiVersion": "trainer.kubeflow.org/v1alpha1",
            "kind": "TrainJob",
            "metadata": {"name": "gang"},
            "spec": {
                "runtimeRef": {"name": "gang-tiny"},
                "initializer": {
                    "dataset": {"storageUri": "file:///data/x.jsonl"},
                    "model": {"storageUri": "file:///models/tiny"},
                },
                "trainer": {"numNodes": 2, "numProcPerNode": 1, "args": ["method=lora"]},
            },
        }
        kube.wait_for(lambda: _create(api, trainjob, namespace), 30, "the TrainJob to be admitted")
        group = kube.wait_for(
            lambda: kube._get_or_none(
                lambda: api.custom.get_namespaced_custom_object(
                    "scheduling.x-k8s.io", "v1alpha1", namespace, "podgroups", "gang"
                )
            ),
            60,
            "the Trainer's PodGroup",
            diagnose=lambda: api.diagnose(namespace, "gang"),
        )
        # 1 dataset-initializer + 1 model-initializer + 2 trainer pods + 1 exporter.
        assert group["spec"]["minMember"] == 5
        # While the initializers run, neither the node Job nor the exporter's (which waits for
        # node) exists: 2 of the 5 pods can exist.
        js = api.wait_jobset(namespace, "gang")
        node = replicated_job(js, "node")
        assert {d["name"] for d in node["dependsOn"]} == {
            "dataset-initializer",
            "model-initializer",
        }
        pods = api.pods(namespace)
        assert {p.metadata.labels["jobset.sigs.k8s.io/replicatedjob-name"] for p in pods} <= {
            "dataset-initializer",
            "model-initializer",
        }
        assert len(pods) == 2
        # The pods carry the PodGroup's label but no schedulerName: the default scheduler, which
        # ignores PodGroups, is the one asked to place them, so the gang is not enforced either.
        assert all(p.spec.scheduler_name == "default-scheduler" for p in pods)
        assert all(p.metadata.labels.get("scheduling.x-k8s.io/pod-group") == "gang" for p in pods)
    finally:
        api.cordon(executor=False, kwok=False)
        kube.kubectl(
            "delete",
            "clustertrainingruntime",
            "gang-tiny",
            "--wait=false",
            kubeconfig=controlplane.kubeconfig,
        )


def _create(api, obj, namespace):
    from kubernetes.client.exceptions import ApiException

    try:
        return api.create_trainjob(obj, namespace)
    except ApiException as err:
        if "not found" in str(err.body):  # the webhook's runtime cache lags a moment
            return None
        raise
