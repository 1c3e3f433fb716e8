"""The Kubernetes backend end to end against a recording HTTP server on loopback (not a cluster).

The same flow runs against a real cluster in test_cluster.py (opt-in, ``-m cluster``).
"""

from __future__ import annotations

import pytest
import yaml
from kubernetes import client

from tests.helpers import run_program
from tunepack import FineTune, Initializer, TrainingClient
from tunepack.install import apply, runtime_objects
from tunepack.runtimes.validate import validate_runtime, validate_trainjob

from .fake_apiserver import GROUP_PATH, FakeApiServer

NS = "team-a"
RUNTIME = "tunepack-llama3.2-1b"


@pytest.fixture
def server():
    fake = FakeApiServer()
    url = fake.start()
    yield fake, url
    fake.stop()


def _api_client(url: str) -> client.ApiClient:
    cfg = client.Configuration()
    cfg.host = url
    return client.ApiClient(cfg)


def _client(url: str) -> TrainingClient:
    from kubeflow.common.types import KubernetesBackendConfig

    cfg = client.Configuration()
    cfg.host = url
    return TrainingClient(KubernetesBackendConfig(namespace=NS, client_configuration=cfg))


def _install(fake, url):
    api = _api_client(url)
    for obj in runtime_objects():
        apply(api, obj)
    patches = [r for r in fake.requests if r.method == "PATCH"]
    assert len(patches) == len(runtime_objects())
    for req in patches:
        assert req.content_type == "application/apply-patch+yaml"
        assert req.query == {"fieldManager": ["tunepack"], "force": ["true"]}
        validate_runtime(req.body)
    assert (
        patches[0].path
        == f"{GROUP_PATH}/clustertrainingruntimes/{patches[0].body['metadata']['name']}"
    )


def _controller_runs(fake, name: str, failed: bool = False):
    """Play the Trainer controller + JobSet: pods with the platform's labels, status, logs."""
    for rjob, step in (("dataset-initializer", None), ("model-initializer", None), ("node", "0")):
        pod = f"{name}-{rjob}-0-0-abcde"
        labels = {
            "jobset.sigs.k8s.io/jobset-name": name,
            "jobset.sigs.k8s.io/replicatedjob-name": rjob,
        }
        if step is not None:
            labels["batch.kubernetes.io/job-completion-index"] = step
        fake.objects[("pods", NS, pod)] = {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {
                "name": pod,
                "namespace": NS,
                "labels": labels,
                "creationTimestamp": "2026-01-01T00:00:00Z",
            },
            "spec": {"containers": [{"name": rjob, "image": "ghcr.io/tunepack/x:0.1.0"}]},
            "status": {"phase": "Failed" if failed and rjob == "node" else "Succeeded"},
        }
        fake.logs[(NS, pod, rjob)] = f"hello from {rjob}\nsecond line\n"
    job = fake.objects[("trainjobs", NS, name)]
    condition = {
        "type": "Failed" if failed else "Complete",
        "status": "True",
        "reason": "JobsFailed" if failed else "JobsCompleted",
        "message": "jobset failed: node exited 65" if failed else "done",
        "lastTransitionTime": "2026-01-01T00:10:00Z",
    }
    job["status"] = {
        "conditions": [condition],
        "trainerStatus": {
            "progressPercentage": 100,
            "estimatedRemainingSeconds": 0,
            "metrics": [{"name": "loss", "value": "1.25"}],
            "lastUpdatedTime": "2026-01-01T00:10:00Z",
        },
    }


def test_install_train_status_logs_delete(server):
    fake, url = server
    _install(fake, url)
    tc = _client(url)

    runtimes = tc.list_runtimes()
    one_b = next(r for r in runtimes if r.name == RUNTIME)
    assert (one_b.model, one_b.default_gpus, one_b.methods) == (
        "llama3.2-1b",
        1,
        ("full", "lora", "qlora", "dora"),
    )

    name = tc.train(
        runtime=RUNTIME,
        initializer=Initializer(
            dataset="file:///pvc/data/train.jsonl",
            model="file:///pvc/models/1b",
            model_secret="hf-token",
        ),
        trainer=FineTune(method="lora", lora_rank=16, epochs=3),
    )
    post = next(r for r in fake.requests if r.method == "POST")
    assert post.path == f"{GROUP_PATH}/namespaces/{NS}/trainjobs"
    validate_trainjob(post.body)
    assert post.body["metadata"] == {"name": name, "namespace": NS}
    assert post.body["spec"]["runtimeRef"]["name"] == RUNTIME
    assert post.body["spec"]["trainer"]["args"] == ["method=lora", "epochs=3", "lora_rank=16"]
    assert post.body["spec"]["initializer"]["model"]["secretRef"] == {"name": "hf-token"}

    assert tc.get_job(name).status == "Created"
    _controller_runs(fake, name)
    job = tc.wait_for_job_status(name, timeout=5, polling_interval=1)
    assert job.status == "Complete"
    assert job.progress.percent == 100 and job.progress.loss == 1.25
    assert {s.name for s in job.steps} == {"dataset-initializer", "model-initializer", "node-0"}
    assert list(tc.get_job_logs(name)) == ["hello from node", "second line"]
    assert (
        list(tc.get_job_logs(name, step="model-initializer"))[0] == "hello from model-initializer"
    )
    log_req = [r for r in fake.requests if r.path.endswith("/log")][-1]
    assert log_req.query["container"] == ["model-initializer"]
    pod_list = next(r for r in fake.requests if r.path == f"/api/v1/namespaces/{NS}/pods")
    assert f"jobset.sigs.k8s.io/jobset-name={name}" in pod_list.query["labelSelector"][0]
    assert [j.name for j in tc.list_jobs()] == [name]

    tc.delete_job(name)
    assert fake.requests[-1].method == "DELETE"
    assert ("trainjobs", NS, name) not in fake.objects


def test_failed_job_carries_the_condition_message(server):
    fake, url = server
    _install(fake, url)
    tc = _client(url)
    name = tc.train(
        runtime=RUNTIME,
        initializer=Initializer(dataset="file:///d.jsonl", model="file:///m"),
        trainer=FineTune(epochs=1),
    )
    _controller_runs(fake, name, failed=True)
    job = tc.get_job(name)
    assert job.status == "Failed" and job.message == "jobset failed: node exited 65"
    with pytest.raises(RuntimeError, match=f"TrainJob {name} is Failed"):
        tc.wait_for_job_status(name, timeout=5, polling_interval=1)


def test_train_refuses_a_runtime_that_is_not_installed(server):
    _, url = server
    with pytest.raises(
        RuntimeError, match="is not installed on this cluster: run `tunepack install`"
    ):
        _client(url).train(
            runtime=RUNTIME, initializer=Initializer("file:///d", "file:///m"), trainer=FineTune()
        )


def _kubeconfig(path, url: str):
    """A kubeconfig whose current context is the fake server, namespace NS."""
    path.write_text(
        yaml.safe_dump(
            {
                "apiVersion": "v1",
                "kind": "Config",
                "current-context": "fake",
                "clusters": [{"name": "fake", "cluster": {"server": url}}],
                "users": [{"name": "dev", "user": {"token": "not-a-secret"}}],
                "contexts": [
                    {"name": "fake", "context": {"cluster": "fake", "user": "dev", "namespace": NS}}
                ],
            }
        )
    )
    return {"KUBECONFIG": str(path)}


def test_cli_install_train_status_logs_against_the_server(server, tmp_path):
    fake, url = server
    # The Trainer control plane's version ConfigMap, which the SDK reads when it connects.
    fake.objects[("configmaps", "kubeflow-system", "kubeflow-trainer-public")] = {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": {"name": "kubeflow-trainer-public", "namespace": "kubeflow-system"},
        "data": {"kubeflow_trainer_version": "v2.1.0"},
    }
    env = _kubeconfig(tmp_path / "kubeconfig", url)

    def tunepack(*args):
        return run_program("tunepack.cli", env, *args, timeout=120)

    done = tunepack("install")
    assert done.returncode == 0, done.stderr
    patches = [r for r in fake.requests if r.method == "PATCH"]
    names = [o["metadata"]["name"] for o in runtime_objects()]
    assert [r.path for r in patches] == [f"{GROUP_PATH}/clustertrainingruntimes/{n}" for n in names]
    for req in patches:
        assert req.content_type == "application/apply-patch+yaml"
        assert req.query == {"fieldManager": ["tunepack"], "force": ["true"]}
    assert len(done.stdout.splitlines()) == len(names)
    assert "applied ClusterTrainingRuntime tunepack-tiny-llama3 (fieldManager tunepack)" in (
        done.stdout.splitlines()
    )

    done = tunepack(
        "train", "--runtime", "tunepack-tiny-llama3", "--dataset", "file:///d.jsonl",
        "--model", "file:///m", "--name", "cli-job", "epochs=1",
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert done.stdout == f"tunepack: submitted TrainJob {NS}/cli-job\n"
    (post,) = [r for r in fake.requests if r.method == "POST"]
    assert post.path == f"{GROUP_PATH}/namespaces/{NS}/trainjobs"
    validate_trainjob(post.body)
    spec = post.body["spec"]
    assert post.body["metadata"] == {"name": "cli-job", "namespace": NS}
    assert spec["runtimeRef"]["name"] == "tunepack-tiny-llama3"
    assert spec["trainer"]["args"] == ["epochs=1"]
    assert spec["initializer"]["dataset"]["storageUri"] == "file:///d.jsonl"
    assert spec["initializer"]["model"]["storageUri"] == "file:///m"

    done = tunepack("status", "cli-job")
    assert done.returncode == 0, done.stderr
    assert done.stdout == "cli-job  Created  runtime tunepack-tiny-llama3\n"

    _controller_runs(fake, "cli-job")
    done = tunepack("status", "cli-job")
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines[0] == "cli-job  Complete  runtime tunepack-tiny-llama3"
    assert ["node-0", "Succeeded"] in [line.split() for line in lines]
    assert "  progress 100%  loss 1.2500" in lines

    done = tunepack("logs", "cli-job")
    assert done.returncode == 0, done.stderr
    assert done.stdout == "hello from node\nsecond line\n"
    done = tunepack("logs", "cli-job", "--step", "dataset-initializer")
    assert done.stdout.splitlines()[0] == "hello from dataset-initializer"

    # A job that is not there: one line with the API server's reason, not a traceback.
    done = tunepack("status", "nope")
    assert done.returncode == 1
    assert done.stderr == (
        f'tunepack: error: Failed to get TrainJob: {NS}/nope: trainjobs "nope" not found\n'
    )


def test_cluster_only_operations_say_where_the_files_are(server):
    """Per-step metrics and the result's files live on the job's volume on a cluster."""
    from tunepack.errors import NotAvailableError
    from tunepack.result import Result

    _, url = server
    with pytest.raises(NotAvailableError, match="per-step metrics live on the job's workspace"):
        _client(url).plot_loss("any-job")
    remote = Result(job="j", path="/workspace/output/adapter", base_model="org/m", local=False)
    with pytest.raises(NotAvailableError, match="on the cluster volume /workspace/output/adapter"):
        remote.load()
