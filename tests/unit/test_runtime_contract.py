"""The runtime contract's accessors: the one place that knows where a runtime, a TrainJob's
runtime patch and a JobSet keep their jobs, Pods, containers and environment.

This file spells the Kubernetes paths out on purpose, once, to pin what the accessors walk; every
other test and module goes through the accessors.
"""

from __future__ import annotations

import pytest

from tunepack.runtimes import catalog, contract
from tunepack.runtimes.builder import build_runtime

RUNTIME = build_runtime(catalog.get("tiny-llama3"))


def test_runtime_jobs_pods_and_containers_are_where_the_api_keeps_them():
    jobs = RUNTIME["spec"]["template"]["spec"]["replicatedJobs"]
    assert contract.jobset_spec(RUNTIME) is RUNTIME["spec"]["template"]["spec"]
    assert contract.replicated_jobs(RUNTIME) is jobs
    assert [job["name"] for job in jobs] == [step.job for step in contract.STEPS]
    for job, step in zip(jobs, contract.STEPS, strict=True):
        assert contract.replicated_job(RUNTIME, step.job) is job
        assert contract.job_spec(job) is job["template"]["spec"]
        pod = job["template"]["spec"]["template"]["spec"]
        assert contract.pod_spec(job) is pod
        assert contract.containers(job) is pod["containers"]
        assert contract.container(job) is pod["containers"][0]  # named after the job
        assert contract.container(job, step.job) is pod["containers"][0]
        assert contract.step_label(job) == step.ancestor
        assert job["template"]["metadata"]["labels"][contract.ANCESTOR_LABEL] == step.ancestor


def test_a_jobset_keeps_its_jobs_in_its_own_spec():
    jobset = {"kind": "JobSet", "spec": {"replicatedJobs": [{"name": "node"}]}}
    assert contract.replicated_job(jobset, "node") is jobset["spec"]["replicatedJobs"][0]


def test_runtime_patch_is_what_the_trainjob_api_takes():
    container = {"name": "exporter", "env": [{"name": "EXPORT_URI", "value": "s3://b/p"}]}
    patch = contract.runtime_patch(
        "tunepack.dev/export", [contract.job_patch("exporter", container)]
    )
    assert patch == {
        "manager": "tunepack.dev/export",
        "trainingRuntimeSpec": {
            "template": {
                "spec": {
                    "replicatedJobs": [
                        {
                            "name": "exporter",
                            "template": {
                                "spec": {"template": {"spec": {"containers": [container]}}}
                            },
                        }
                    ]
                }
            }
        },
    }
    (job,) = contract.replicated_jobs(patch)
    assert contract.container(job) is container
    trainjob = {"spec": {"runtimePatches": [{"manager": "someone-else"}, patch]}}
    assert list(contract.runtime_patches(trainjob, "tunepack.dev/export")) == [patch]
    assert len(list(contract.runtime_patches(trainjob))) == 2
    assert list(contract.runtime_patches({"spec": {}})) == []


def test_partial_patches_read_as_empty_only_when_asked():
    patch = {"manager": "m", "trainingRuntimeSpec": {"template": {}}}
    assert contract.replicated_jobs(patch, partial=True) == []
    with pytest.raises(KeyError):
        contract.replicated_jobs(patch)
    job = {"name": "node", "template": {"spec": None}}
    assert contract.containers(job, partial=True) == []
    with pytest.raises(TypeError):
        contract.containers(job)


def test_missing_job_or_container_names_what_is_there():
    with pytest.raises(KeyError, match=r"no replicatedJob 'trainer'.*'node'"):
        contract.replicated_job(RUNTIME, "trainer")
    node = contract.replicated_job(RUNTIME, "node")
    with pytest.raises(KeyError, match=r"no container 'trainer'; there are \['node'\]"):
        contract.container(node, "trainer")


def test_env_splits_plain_values_from_references():
    container = {
        "env": [
            {"name": "A", "value": "1"},
            {"name": "T", "valueFrom": {"secretKeyRef": {"name": "s", "key": "k"}}},
            {"name": "A", "value": "2"},  # a later entry wins, as in Kubernetes
        ]
    }
    assert contract.env(container) == {"A": "2"}
    assert contract.env_refs(container) == {"T": {"secretKeyRef": {"name": "s", "key": "k"}}}
    assert contract.env({}) == {} and contract.env_refs({"env": None}) == {}


def test_api_names_and_workspace_pvc():
    assert (RUNTIME["apiVersion"], RUNTIME["kind"]) == (contract.API_VERSION, contract.KIND)
    assert contract.API_VERSION == "trainer.kubeflow.org/v1alpha1"
    # JobSet names the PVC <claim>-<jobset>; the JobSet is named after the TrainJob.
    assert contract.workspace_pvc("my-job") == "initializer-my-job"
