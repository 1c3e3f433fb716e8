"""The Kubernetes backend end to end against a recording HTTP server on loopback (not a cluster).

The same flow runs against a real cluster in tests/cluster/test_own_cluster.py (opt-in,
``-m cluster``).
"""

from __future__ import annotations

import pytest
import yaml
from kubernetes import client

from tests.fake_apiserver import GROUP_PATH, FakeApiServer
from tests.helpers import run_program, write_kubeconfig
from tunepack import FineTune, Initializer, TrainingClient
from tunepack.backends.api_errors import api_status
from tunepack.core import __version__
from tunepack.core.errors import BadValueError, UnsupportedError
from tunepack.runtimes.contract import containers, pod_spec, replicated_jobs
from tunepack.runtimes.validate import validate_runtime, validate_trainjob
from tunepack.tools.install import (
    SKIPPED,
    admission_objects,
    apply,
    describe,
    install,
    runtime_objects,
)

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


def _fake_pod(fake, pod: str, container: str, labels: dict, phase: str, created: str) -> dict:
    """A pod of the JobSet in the fake server, one container in tunepack's image."""
    fake.objects[("pods", NS, pod)] = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": pod, "namespace": NS, "labels": labels, "creationTimestamp": created},
        "spec": {"containers": [{"name": container, "image": "ghcr.io/tunepack/x:0.1.0"}]},
        "status": {"phase": phase},
    }
    return fake.objects[("pods", NS, pod)]


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
        phase = "Failed" if failed and rjob == "node" else "Succeeded"
        _fake_pod(fake, pod, rjob, labels, phase, "2026-01-01T00:00:00Z")
        if failed and rjob == "node":  # the trainer refused its input (EXIT_BAD_INPUT)
            terminated = {"exitCode": 65, "finishedAt": "2026-01-01T00:09:00Z", "reason": "Error"}
            fake.objects[("pods", NS, pod)]["status"]["containerStatuses"] = [
                {
                    "name": rjob,
                    "image": "ghcr.io/tunepack/x:0.1.0",
                    "imageID": "",
                    "ready": False,
                    "restartCount": 0,
                    "state": {"terminated": terminated},
                }
            ]
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
            "metrics": [
                {"name": "loss", "value": "1.25"},
                {"name": "val_loss", "value": "1.5"},
                {"name": "val_perplexity", "value": "4.4817"},
                {"name": "tokens_per_second", "value": "812.4"},
                {"name": "step", "value": "40"},
            ],
            "lastUpdatedTime": "2026-01-01T00:10:00Z",
        },
    }


def test_install_train_status_logs_delete(server, capsys):
    fake, url = server
    _install(fake, url)
    tc = _client(url)

    runtimes = tc.list_runtimes()
    one_b = next(r for r in runtimes if r.name == RUNTIME)
    assert (one_b.model, one_b.default_gpus, one_b.methods) == (
        "llama3.2-1b",
        1,
        ("full", "grpo_full", "lora", "qlora", "dora", "dpo", "orpo", "kto", "grpo"),
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
    assert post.body["spec"]["runtimeRef"] == {
        "name": RUNTIME,
        "apiGroup": "trainer.kubeflow.org",
        "kind": "ClusterTrainingRuntime",
    }
    assert post.body["spec"]["trainer"]["args"] == ["method=lora", "epochs=3", "lora_rank=16"]
    assert post.body["spec"]["trainer"]["numProcPerNode"] == 1  # the runtime's one GPU
    assert post.body["spec"]["initializer"]["model"]["secretRef"] == {"name": "hf-token"}

    assert tc.get_job(name).status == "Created"
    _controller_runs(fake, name)
    # One GET of the TrainJob per get_job, none per job for list_jobs (the LIST has them all).
    job_path = f"{GROUP_PATH}/namespaces/{NS}/trainjobs/{name}"
    before = len(fake.requests)
    tc.get_job(name)
    assert [r.path for r in fake.requests[before:] if r.path == job_path] == [job_path]
    before = len(fake.requests)
    assert [j.status for j in tc.list_jobs()] == ["Complete"]
    assert not [r for r in fake.requests[before:] if r.path == job_path]
    job = tc.wait_for_job_status(name, timeout=5, polling_interval=1)
    assert job.status == "Complete"
    assert job.progress.percent == 100 and job.progress.loss == 1.25
    assert (job.progress.val_loss, job.progress.val_perplexity) == (1.5, 4.4817)
    assert (job.progress.tokens_per_second, job.progress.step) == (812.4, 40)
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

    # Without the Trainer's TrainJobStatus feature gate no trainerStatus comes: the progress bar
    # has nothing to count, and once the job is complete a line says so, and why.
    del fake.objects[("trainjobs", NS, name)]["status"]["trainerStatus"]
    capsys.readouterr()
    assert (
        tc.wait_for_job_status(name, timeout=5, polling_interval=1, progress=True).progress is None
    )
    assert capsys.readouterr().out == (
        f"{name}: progress unavailable: the TrainJob has no status.trainerStatus (the Kubeflow "
        "Trainer's TrainJobStatus feature gate is off, or the trainer never reached its status "
        "server)\n"
    )

    tc.delete_job(name)
    assert fake.requests[-1].method == "DELETE"
    assert ("trainjobs", NS, name) not in fake.objects


def _exporter_pod(fake, name: str, suffix: str, phase: str, created: str, log: str) -> None:
    """An exporter pod as JobSet makes it (replicatedJob ``exporter``, the runtime's label)."""
    pod = f"{name}-exporter-0-0-{suffix}"
    labels = {
        "jobset.sigs.k8s.io/jobset-name": name,
        "jobset.sigs.k8s.io/replicatedjob-name": "exporter",
        "trainer.kubeflow.org/trainjob-ancestor-step": "exporter",
        "batch.kubernetes.io/job-completion-index": "0",
    }
    _fake_pod(fake, pod, "exporter", labels, phase, created)
    fake.logs[(NS, pod, "exporter")] = log


def test_the_exporter_is_a_step_with_logs(server):
    """Issue 29, 6: the SDK's pod selector knows the initializers, launcher and node only; the
    exporter's pod is a step of get_job() too, and get_job_logs reads it."""
    fake, url = server
    _install(fake, url)
    tc = _client(url)
    name = tc.train(
        runtime=RUNTIME,
        initializer=Initializer(dataset="file:///d.jsonl", model="file:///m"),
        trainer=FineTune(epochs=1, export="s3://bucket/results"),
    )
    _controller_runs(fake, name)
    assert [s.name for s in tc.get_job(name).steps if s.name == "exporter"] == []  # not yet
    _exporter_pod(fake, name, "first", "Failed", "2026-01-01T00:11:00Z", "upload refused\n")
    _exporter_pod(fake, name, "retry", "Succeeded", "2026-01-01T00:12:00Z", "exported to s3\n")
    job = tc.get_job(name)
    steps = {s.name: (s.status, s.pod_name) for s in job.steps}
    assert set(steps) == {"dataset-initializer", "model-initializer", "node-0", "exporter"}
    assert steps["exporter"] == ("Succeeded", f"{name}-exporter-0-0-retry")  # the newest pod
    assert list(tc.get_job_logs(name, step="exporter")) == ["exported to s3"]
    log_req = [r for r in fake.requests if r.path.endswith("/log")][-1]
    assert log_req.path.endswith(f"/pods/{name}-exporter-0-0-retry/log")
    assert log_req.query["container"] == ["exporter"]
    assert "exporter" in {s.name for s in tc.list_jobs()[0].steps}
    # The node's logs are still the default step's.
    assert list(tc.get_job_logs(name)) == ["hello from node", "second line"]


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
    assert job.exit_code == 65  # the failed container's, read from its pod
    with pytest.raises(RuntimeError, match=f"TrainJob {name} is Failed"):
        tc.wait_for_job_status(name, timeout=5, polling_interval=1)


@pytest.mark.parametrize(("container_exit", "status_exit"), [(65, 65), (75, 75), (137, 75)])
def test_status_of_a_failed_job_exits_as_the_readme_s_table_says(
    server, cli, container_exit, status_exit
):
    """65: a step refused its input; any other failure was retried until the retries ran out
    (75, run again); never 1, which says the cluster refused the request."""
    fake, url = server
    _install(fake, url)
    name = _client(url).train(
        runtime=RUNTIME,
        initializer=Initializer(dataset="file:///d.jsonl", model="file:///m"),
        trainer=FineTune(epochs=1),
    )
    _controller_runs(fake, name, failed=True)
    node = fake.objects[("pods", NS, f"{name}-node-0-0-abcde")]
    node["status"]["containerStatuses"][0]["state"]["terminated"]["exitCode"] = container_exit
    done = cli("status", name)
    assert done.returncode == status_exit, done.stderr
    assert done.stdout.splitlines()[0] == f"{name}  Failed  runtime {RUNTIME}"
    assert "  message: jobset failed: node exited 65" in done.stdout.splitlines()


def test_train_refuses_a_runtime_that_is_not_installed(server):
    _, url = server
    with pytest.raises(RuntimeError) as caught:
        _client(url).train(
            runtime=RUNTIME, initializer=Initializer("file:///d", "file:///m"), trainer=FineTune()
        )
    assert str(caught.value) == (
        f"runtime {RUNTIME!r} is not installed on this cluster (no TrainingRuntime in namespace "
        f"{NS!r}, no ClusterTrainingRuntime): run `tunepack install` (or `tunepack install "
        f"--namespace {NS}`) or `kubectl apply --server-side -k manifests/base` first"
    )


def test_other_runtime_lookup_errors_are_not_called_not_installed(server):
    fake, url = server
    fake.fail[("GET", f"{GROUP_PATH}/namespaces/{NS}/trainingruntimes/{RUNTIME}")] = (
        403,
        "trainingruntimes is forbidden: User cannot get resource",
    )
    with pytest.raises(RuntimeError) as caught:
        _client(url).train(
            runtime=RUNTIME, initializer=Initializer("file:///d", "file:///m"), trainer=FineTune()
        )
    # The SDK's own error (its wording), caused by the server's refusal: not "not installed".
    assert str(caught.value).startswith("Failed to get ")
    assert str(caught.value).endswith(f": {NS}/{RUNTIME}")
    assert api_status(caught.value) == 403


def test_a_namespaced_training_runtime_is_referenced_when_there_is_one(server):
    """As the SDK's get_runtime/list_runtimes: the namespace's TrainingRuntime comes first."""
    fake, url = server
    _install(fake, url)
    api = _api_client(url)
    (namespaced,) = runtime_objects([RUNTIME], namespace=NS)
    apply(api, namespaced)
    tc = _client(url)
    listed = {r.name: r.kind.value for r in tc.list_runtimes()}
    assert listed[RUNTIME] == "TrainingRuntime"
    assert listed["tunepack-tiny-llama3"] == "ClusterTrainingRuntime"

    name = tc.train(
        runtime="llama3.2-1b",  # a catalog model name resolves to its runtime
        initializer=Initializer(dataset="file:///d.jsonl", model="file:///m"),
        trainer=FineTune(),
    )
    post = [r for r in fake.requests if r.method == "POST"][-1]
    assert post.body["spec"]["runtimeRef"] == {
        "name": RUNTIME,
        "apiGroup": "trainer.kubeflow.org",
        "kind": "TrainingRuntime",
    }
    validate_trainjob(post.body)
    assert tc.get_job(name).runtime.kind.value == "TrainingRuntime"

    other = tc.train(
        runtime="tunepack-tiny-llama3",
        initializer=Initializer(dataset="file:///d.jsonl", model="file:///m"),
        trainer=FineTune(),
    )
    post = [r for r in fake.requests if r.method == "POST"][-1]
    assert post.body["metadata"]["name"] == other
    assert post.body["spec"]["runtimeRef"]["kind"] == "ClusterTrainingRuntime"


def _other_runtime(name: str, namespace: str | None = None) -> dict:
    """A runtime that is not tunepack's (a plain torch runtime) named ``name``."""
    (obj,) = runtime_objects(["tiny-llama3"], namespace=namespace)
    obj["metadata"]["name"] = name
    obj["metadata"]["labels"] = {"trainer.kubeflow.org/framework": "torch"}
    obj["metadata"].pop("annotations", None)
    return obj


@pytest.mark.parametrize("namespace", [None, NS])
def test_a_runtime_of_the_exact_name_wins_over_the_catalog_short_name(server, namespace, caplog):
    """runtime="llama3.2-1b" is the cluster's runtime of that name when there is one, not
    tunepack-llama3.2-1b: it goes to the SDK unchanged (which takes no FineTune)."""
    fake, url = server
    _install(fake, url)
    apply(_api_client(url), _other_runtime("llama3.2-1b", namespace))
    tc = _client(url)
    caplog.set_level("INFO", logger="tunepack")
    name = tc.train(runtime="llama3.2-1b")  # the SDK's path: a TrainJob with the runtime only
    post = [r for r in fake.requests if r.method == "POST"][-1]
    assert post.body["metadata"]["name"] == name
    assert post.body["spec"]["runtimeRef"]["name"] == "llama3.2-1b"
    kind = "TrainingRuntime" if namespace else "ClusterTrainingRuntime"
    assert post.body["spec"]["runtimeRef"]["kind"] == kind
    assert "using" not in caplog.text
    with pytest.raises(ValueError, match="trainer type .*FineTune.* is not supported"):
        tc.train(runtime="llama3.2-1b", trainer=FineTune())


def test_a_short_name_resolves_only_when_no_runtime_has_it_and_says_so(server, caplog):
    fake, url = server
    _install(fake, url)
    tc = _client(url)
    caplog.set_level("INFO", logger="tunepack")
    tc.train(
        runtime="llama3.2-1b",
        initializer=Initializer(dataset="file:///d.jsonl", model="file:///m"),
        trainer=FineTune(),
    )
    post = [r for r in fake.requests if r.method == "POST"][-1]
    assert post.body["spec"]["runtimeRef"]["name"] == RUNTIME
    assert (
        f"runtime 'llama3.2-1b': no runtime of that name in namespace {NS!r} or the cluster; "
        f"using {RUNTIME!r}" in caplog.messages
    )


def test_a_short_name_with_nothing_installed_names_both(server):
    _, url = server
    with pytest.raises(RuntimeError) as caught:
        _client(url).train(runtime="llama3.2-1b", initializer=Initializer("file:///d", "file:///m"))
    assert str(caught.value).startswith(
        f"runtime {RUNTIME!r} is not installed on this cluster (no TrainingRuntime in namespace "
        f"{NS!r}, no ClusterTrainingRuntime) (nor any runtime named 'llama3.2-1b'): run "
    )
    assert api_status(caught.value) == 404


@pytest.mark.parametrize(
    "name, hint",
    [
        ("tunepack-llama3.2-1bb", "; did you mean 'tunepack-llama3.2-1b'"),
        ("torch-distributed", "; runtimes here: llama3.2-1b"),
    ],
)
def test_an_unknown_runtime_name_lists_close_matches(server, name, hint):
    fake, url = server
    apply(_api_client(url), _other_runtime("llama3.2-1b"))
    with pytest.raises(RuntimeError) as caught:
        _client(url).train(runtime=name, initializer=Initializer("file:///d", "file:///m"))
    assert str(caught.value).startswith(
        f"runtime {name!r} not found: no TrainingRuntime of that name in namespace {NS!r} and "
        f"no ClusterTrainingRuntime{hint}"
    )
    assert api_status(caught.value) == 404
    assert not [r for r in fake.requests if r.method == "POST"]


def test_tunepack_runtimes_report_a_builtin_torchtune_trainer(server):
    """The SDK derives the trainer type from the framework label, which stays ``torch`` (the
    Trainer's torch plugin sets the PET_* variables); tunepack runtimes take BuiltinTrainer /
    FineTune and refuse CustomTrainer, so they are reported as the SDK's torchtune runtimes are."""
    from kubeflow.trainer import BuiltinTrainer, LoraConfig, TorchTuneConfig
    from kubeflow.trainer.types import types as kf

    fake, url = server
    _install(fake, url)
    apply(_api_client(url), _other_runtime("torch-distributed"))
    stored = fake.objects[("clustertrainingruntimes", None, RUNTIME)]
    assert stored["metadata"]["labels"]["trainer.kubeflow.org/framework"] == "torch"
    tc = _client(url)

    runtime = tc.get_runtime(RUNTIME)
    trainer = kf.RuntimeTrainer(
        trainer_type=kf.TrainerType.BUILTIN_TRAINER,
        framework="torchtune",
        image=runtime.trainer.image,
        num_nodes=1,
        device="gpu",
        device_count="1.0",  # the SDK's reading of the runtime's GPU limit
    )
    trainer.set_command(("python", "-m", "tunepack.trainers.launch"))
    expected = kf.Runtime(
        name=RUNTIME, trainer=trainer, kind=kf.RuntimeKind.CLUSTER_TRAINING_RUNTIME
    )
    assert runtime == expected and expected == runtime  # and the catalog's fields besides
    assert runtime.trainer.command == trainer.command and runtime.model == "llama3.2-1b"
    listed = {r.name: r for r in tc.list_runtimes()}
    assert listed[RUNTIME] == expected
    other = listed["torch-distributed"].trainer
    assert (other.trainer_type, other.framework) == (kf.TrainerType.CUSTOM_TRAINER, "torch")

    # The runtime object drives train() as a name does; the job reports the same runtime.
    name = tc.train(
        runtime=runtime,
        initializer=Initializer(dataset="file:///d.jsonl", model="file:///m"),
        trainer=BuiltinTrainer(config=TorchTuneConfig(epochs=1, peft_config=LoraConfig())),
    )
    assert tc.get_job(name).runtime == expected
    with pytest.raises(ValueError, match="CustomTrainer cannot run on a tunepack runtime"):
        tc.train(
            runtime=runtime,
            initializer=Initializer(dataset="file:///d.jsonl", model="file:///m"),
            trainer=kf.CustomTrainer(func=lambda: None),
        )


def test_a_tunepack_runtime_reports_the_command_its_trainer_container_runs(server):
    """The command is read from the runtime object the cluster holds (a namespaced
    TrainingRuntime or a ClusterTrainingRuntime), not the catalog's and not the torch plugin's
    the SDK reports: from get_runtime, list_runtimes and a job's runtime."""
    from tunepack.runtimes.contract import TRAINER_STEP, container, replicated_job

    fake, url = server
    _install(fake, url)
    (namespaced,) = runtime_objects([RUNTIME], namespace=NS)
    container(replicated_job(namespaced, TRAINER_STEP.job))["command"] = ["site-launch", "--x"]
    apply(_api_client(url), namespaced)
    tiny = "tunepack-tiny-llama3"
    container(replicated_job(_stored(fake, tiny), TRAINER_STEP.job))["command"] = ["tiny-launch"]
    tc = _client(url)

    listed = {r.name: r for r in tc.list_runtimes()}
    for name, kind, command in (
        (RUNTIME, "TrainingRuntime", ("site-launch", "--x")),
        (tiny, "ClusterTrainingRuntime", ("tiny-launch",)),
    ):
        for runtime in (listed[name], tc.get_runtime(name)):
            assert (runtime.kind.value, runtime.trainer.command) == (kind, command)
            assert runtime.trainer.framework == "torchtune"
    job = tc.train(
        runtime=RUNTIME,
        initializer=Initializer(dataset="file:///d.jsonl", model="file:///m"),
        trainer=FineTune(),
    )
    assert tc.get_job(job).runtime.trainer.command == ("site-launch", "--x")
    assert [j.runtime.trainer.command for j in tc.list_jobs()] == [("site-launch", "--x")]


def test_other_runtimes_are_exactly_what_the_sdk_returns(server):
    """docs/sdk.md: only tunepack runtimes get the catalog's fields; a torch runtime of the
    cluster comes back as the upstream client returns it (same class, same attributes), from
    get_runtime, list_runtimes and a job's runtime."""
    from kubeflow.common.types import KubernetesBackendConfig
    from kubeflow.trainer import TrainerClient
    from kubeflow.trainer.types import types as kf

    fake, url = server
    _install(fake, url)
    apply(_api_client(url), _other_runtime("torch-distributed"))
    apply(_api_client(url), _other_runtime("runtime-1", NS))
    cfg = client.Configuration()
    cfg.host = url
    upstream = TrainerClient(KubernetesBackendConfig(namespace=NS, client_configuration=cfg))
    tc = _client(url)

    theirs = {r.name: r for r in upstream.list_runtimes()}
    ours = {r.name: r for r in tc.list_runtimes()}
    assert ours.keys() == theirs.keys()
    for name in ("torch-distributed", "runtime-1"):
        for got in (ours[name], tc.get_runtime(name)):
            assert type(got) is type(theirs[name]) is kf.Runtime
            assert vars(got) == vars(theirs[name])
    assert ours[RUNTIME].model == "llama3.2-1b"  # tunepack's keep the catalog's fields
    # The table still lists them, with the catalog's columns empty.
    assert "runtime-1" in str(tc.list_runtimes())

    job = tc.train(runtime="runtime-1")  # the SDK's path
    runtime = tc.get_job(job).runtime
    assert type(runtime) is kf.Runtime and vars(runtime) == vars(theirs["runtime-1"])


def test_sdk_options_set_the_trainjob_fields(server):
    from kubeflow.trainer.options import (
        ActiveDeadlineSeconds,
        Annotations,
        Labels,
        Name,
        PodSpecPatch,
        PodTemplatePatch,
        ReplicatedJobPatch,
        RuntimePatch,
        TrainingRuntimeSpecPatch,
    )
    from kubeflow.trainer.options import (
        JobSetSpecPatch as SetSpec,
    )
    from kubeflow.trainer.options import (
        JobSetTemplatePatch as SetTemplate,
    )
    from kubeflow.trainer.options import (
        JobSpecPatch as JobSpec,
    )
    from kubeflow.trainer.options import (
        JobTemplatePatch as JobTemplate,
    )

    fake, url = server
    _install(fake, url)
    node_pool = ReplicatedJobPatch(
        name="node",
        template=JobTemplate(
            spec=JobSpec(
                template=PodTemplatePatch(spec=PodSpecPatch(node_selector={"pool": "a100"}))
            )
        ),
    )
    name = _client(url).train(
        runtime=RUNTIME,
        initializer=Initializer(dataset="file:///d.jsonl", model="file:///m"),
        trainer=FineTune(),
        options=[
            Name("llama-run-1"),
            Labels({"kueue.x-k8s.io/queue-name": "team-a-queue", "team": "a"}),
            Annotations({"example.com/owner": "jane"}),
            ActiveDeadlineSeconds(7200),
            RuntimePatch(
                training_runtime_spec=TrainingRuntimeSpecPatch(
                    template=SetTemplate(spec=SetSpec(replicated_jobs=[node_pool]))
                )
            ),
        ],
    )
    assert name == "llama-run-1"
    (post,) = [r for r in fake.requests if r.method == "POST"]
    validate_trainjob(post.body)
    assert post.body["metadata"] == {
        "name": "llama-run-1",
        "namespace": NS,
        "labels": {"kueue.x-k8s.io/queue-name": "team-a-queue", "team": "a"},
        "annotations": {"example.com/owner": "jane"},
    }
    assert post.body["spec"]["activeDeadlineSeconds"] == 7200
    (patch,) = post.body["spec"]["runtimePatches"]
    assert patch["manager"] == "trainer.kubeflow.org/kubeflow-sdk"
    job = replicated_jobs(patch)[0]
    assert pod_spec(job)["nodeSelector"] == {"pool": "a100"}


SUPPORTED_OPTIONS = (
    "Supported options: Name, Labels, Annotations, ActiveDeadlineSeconds, RuntimePatch"
)


@pytest.mark.parametrize(
    ("options", "kind", "message"),
    [
        (
            lambda o: [o.TrainerCommand(["python", "x.py"])],
            UnsupportedError,
            "option TrainerCommand cannot be used with tunepack runtimes: the trainer's command "
            f"is tunepack's fine-tuning program, set by the runtime. {SUPPORTED_OPTIONS}",
        ),
        (
            lambda o: [o.TrainerArgs(["epochs=1"])],
            UnsupportedError,
            "option TrainerArgs cannot be used with tunepack runtimes: the trainer's arguments "
            "come from trainer=FineTune(...) (or BuiltinTrainer(config=TorchTuneConfig(...))). "
            f"{SUPPORTED_OPTIONS}",
        ),
        (
            lambda o: [print],
            UnsupportedError,
            "option builtin_function_or_method cannot be used with tunepack runtimes: tunepack "
            f"builds these TrainJobs itself. {SUPPORTED_OPTIONS}",
        ),
        (
            lambda o: o.Labels({"team": "a"}),
            BadValueError,
            "options must be a list, e.g. options=[Labels({...})], got Labels(labels={'team': "
            "'a'})",
        ),
        (
            lambda o: [o.Labels({"kueue.x-k8s.io/queue-name": "Team Queue"})],
            BadValueError,
            "queue 'Team Queue' (label kueue.x-k8s.io/queue-name) is not a valid Kueue "
            "LocalQueue name: use at most 63 lowercase letters, digits, '-' and '.', starting "
            "and ending with a letter or digit",
        ),
        (
            lambda o: [o.Name("Bad_Name")],
            BadValueError,
            "TrainJob name 'Bad_Name' is not a valid DNS-1123 label: use at most 63 lowercase "
            "letters, digits and '-', starting and ending with a letter or digit (e.g. "
            "'llama-lora-1')",
        ),
    ],
)
def test_options_tunepack_cannot_honour_are_refused_by_name(server, options, kind, message):
    import kubeflow.trainer.options as kf_options

    fake, url = server
    _install(fake, url)
    with pytest.raises(kind) as caught:
        _client(url).train(
            runtime=RUNTIME,
            initializer=Initializer(dataset="file:///d.jsonl", model="file:///m"),
            trainer=FineTune(),
            options=options(kf_options),
        )
    assert type(caught.value) is kind
    assert str(caught.value) == message
    assert not [r for r in fake.requests if r.method == "POST"]


def test_get_job_uses_the_sdk_timeout(server, monkeypatch):
    import threading

    from kubeflow.common import constants

    fake, url = server
    path = f"{GROUP_PATH}/namespaces/{NS}/trainjobs/slow"
    gave_up = threading.Event()  # the server answers only once the client has given up
    fake.after.append(lambda req: gave_up.wait(60) if req.path == path else None)
    monkeypatch.setattr(constants, "DEFAULT_TIMEOUT", 0.2)
    try:
        with pytest.raises(TimeoutError, match=f"Timeout to get TrainJob: {NS}/slow"):
            _client(url).get_job("slow")
    finally:
        gave_up.set()


def test_list_jobs_survives_a_job_deleted_while_listing(server):
    fake, url = server
    _install(fake, url)
    tc = _client(url)
    init = Initializer(dataset="file:///d.jsonl", model="file:///m")
    first = tc.train(runtime=RUNTIME, initializer=init, trainer=FineTune())
    second = tc.train(runtime=RUNTIME, initializer=init, trainer=FineTune())
    list_path = f"{GROUP_PATH}/namespaces/{NS}/trainjobs"

    def delete_first(req):
        if req.method == "GET" and req.path == list_path:
            fake.objects.pop(("trainjobs", NS, first), None)

    fake.after.append(delete_first)
    # The job was there when listed; its deletion afterwards does not fail the listing.
    assert sorted(j.name for j in tc.list_jobs()) == sorted([first, second])
    fake.after.clear()
    assert [j.name for j in tc.list_jobs()] == [second]


def _kubeconfig(path, url: str):
    """A kubeconfig whose current context is the fake server, namespace NS."""
    return {"KUBECONFIG": str(write_kubeconfig(path, url, namespace=NS))}


@pytest.fixture
def cli(server, tmp_path):
    """``tunepack ...`` as a subprocess whose kubeconfig points at the fake server."""
    fake, url = server
    # The Trainer control plane's version ConfigMap, which the SDK reads when it connects.
    fake.objects[("configmaps", "kubeflow-system", "kubeflow-trainer-public")] = {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": {"name": "kubeflow-trainer-public", "namespace": "kubeflow-system"},
        "data": {"kubeflow_trainer_version": "v2.3.0"},
    }
    env = _kubeconfig(tmp_path / "kubeconfig", url)

    def tunepack(*args):
        return run_program("tunepack.cli", env, *args, timeout=120)

    return tunepack


def test_cli_install_train_status_logs_against_the_server(server, cli):
    fake, url = server
    tunepack = cli

    done = tunepack("install", "--no-image-check")
    assert done.returncode == 0, done.stderr
    patches = [r for r in fake.requests if r.method == "PATCH"]
    names = [o["metadata"]["name"] for o in runtime_objects()]
    # The admission policy and binding are applied too; this server (as one before Kubernetes
    # 1.30) does not serve their API, so they are skipped, saying why, and the install succeeds.
    policy_paths = [
        f"/apis/admissionregistration.k8s.io/v1/{plural}/tunepack-trainjob-arguments"
        for plural in ("validatingadmissionpolicies", "validatingadmissionpolicybindings")
    ]
    skipped = [f"{describe(o)} {SKIPPED}" for o in admission_objects()]
    assert [r.path for r in patches] == [
        f"{GROUP_PATH}/clustertrainingruntimes/{n}" for n in names
    ] + policy_paths
    for req in patches:
        assert req.content_type == "application/apply-patch+yaml"
        assert req.query == {"fieldManager": ["tunepack"], "force": ["true"]}
    assert (
        done.stdout.splitlines()
        == [f"clustertrainingruntime.trainer.kubeflow.org/{n} created" for n in names] + skipped
    )
    done = tunepack("install", "--no-image-check", "--runtime", "tiny-llama3")
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == [
        "clustertrainingruntime.trainer.kubeflow.org/tunepack-tiny-llama3 unchanged",
        *skipped,
    ]

    done = tunepack(
        "train", "--runtime", "tunepack-tiny-llama3", "--dataset", "file:///d.jsonl",
        "--model", "/m", "--name", "cli-job", "--queue", "team-a-queue", "epochs=1",
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert done.stdout == f"tunepack: submitted TrainJob {NS}/cli-job\n"
    (post,) = [r for r in fake.requests if r.method == "POST"]
    assert post.path == f"{GROUP_PATH}/namespaces/{NS}/trainjobs"
    validate_trainjob(post.body)
    spec = post.body["spec"]
    assert post.body["metadata"] == {
        "name": "cli-job",
        "namespace": NS,
        "labels": {"kueue.x-k8s.io/queue-name": "team-a-queue"},
    }
    assert spec["runtimeRef"] == {
        "name": "tunepack-tiny-llama3",
        "apiGroup": "trainer.kubeflow.org",
        "kind": "ClusterTrainingRuntime",
    }
    assert spec["trainer"] == {"args": ["epochs=1"], "numProcPerNode": 1}
    assert spec["initializer"]["dataset"]["storageUri"] == "file:///d.jsonl"
    assert spec["initializer"]["model"]["storageUri"] == "file:///m"

    done = tunepack("status", "cli-job")
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == [
        "cli-job  Created  runtime tunepack-tiny-llama3",
        "  progress unavailable: no status.trainerStatus yet (the trainer posts it from its "
        "first step where the Kubeflow Trainer runs with its TrainJobStatus feature gate); "
        "see tunepack logs cli-job",
    ]
    # While it runs: the percentage, the latest metrics and the trainer's estimate of the rest.
    fake.objects[("trainjobs", NS, "cli-job")]["status"] = {
        "trainerStatus": {
            "progressPercentage": 40,
            "estimatedRemainingSeconds": 65,
            "metrics": [{"name": "loss", "value": "2.5"}],
        }
    }
    done = tunepack("status", "cli-job")
    assert done.stdout.splitlines()[-1] == "  progress 40%  loss 2.5000  eta 1m05s"

    _controller_runs(fake, "cli-job")
    done = tunepack("status", "cli-job")
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines[0] == "cli-job  Complete  runtime tunepack-tiny-llama3"
    assert ["node-0", "Succeeded"] in [line.split() for line in lines]
    assert "  progress 100%  loss 1.2500  val_loss 1.5000  812 tokens/s" in lines
    header, row = [line.split() for line in tunepack("jobs").stdout.splitlines()]
    assert header[4:] == ["PROGRESS", "WORKSPACE"] and row[5:] == [
        "100%",
        "pvc/initializer-cli-job",
    ]

    # Without the Trainer's TrainJobStatus feature gate a job has no trainerStatus: it still
    # finishes, and status says that progress is unavailable, and why; jobs shows "-".
    del fake.objects[("trainjobs", NS, "cli-job")]["status"]["trainerStatus"]
    done = tunepack("status", "cli-job")
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines()[-1] == (
        "  progress unavailable: the TrainJob has no status.trainerStatus (the Kubeflow "
        "Trainer's TrainJobStatus feature gate is off, or the trainer never reached its status "
        "server); see tunepack logs cli-job"
    )
    header, row = [line.split() for line in tunepack("jobs").stdout.splitlines()]
    assert row[5:] == ["-", "pvc/initializer-cli-job"]

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
    from tunepack.core.errors import NotAvailableError
    from tunepack.types import Result

    _, url = server
    with pytest.raises(NotAvailableError, match="per-step metrics live on the job's workspace"):
        _client(url).plot_loss("any-job")
    remote = Result(job="j", path="/workspace/output/adapter", base_model="org/m", local=False)
    with pytest.raises(NotAvailableError, match="on the cluster volume /workspace/output/adapter"):
        remote.load()


# --- installing over installed runtimes -------------------------------------------------------

IN_USE = "trainer.kubeflow.org/resource-in-use"


def _stored(fake, name: str) -> dict:
    return fake.objects[("clustertrainingruntimes", None, name)]


def _older_failure_policy(fake, name: str) -> None:
    """Make the installed runtime differ in an immutable field, as an older version would."""
    _stored(fake, name)["spec"]["template"]["spec"]["failurePolicy"]["maxRestarts"] = 1


def _installed_but_older(server, *, in_use: bool = False):
    """The tiny runtime installed, then made older in an immutable field (and held by the
    in-use finalizer): the next install must replace it. Its API client and runtime object."""
    fake, url = server
    api = _api_client(url)
    (obj,) = runtime_objects([RUNTIME])
    install(api, obj)
    if in_use:
        _stored(fake, RUNTIME)["metadata"]["finalizers"] = [IN_USE]
    _older_failure_policy(fake, RUNTIME)
    return api, obj


def _trainjob_using(fake, namespace: str, name: str, runtime: str, kind: str | None) -> None:
    ref = {"name": runtime, **({"kind": kind} if kind else {})}
    fake.objects[("trainjobs", namespace, name)] = {
        "apiVersion": "trainer.kubeflow.org/v1alpha1",
        "kind": "TrainJob",
        "metadata": {"name": name, "namespace": namespace},
        "spec": {"runtimeRef": ref},
    }


def test_install_reports_created_unchanged_configured_and_replaced(server):
    fake, url = server
    api = _api_client(url)
    objects = runtime_objects(["tiny-llama3", "llama3.2-1b"])
    assert [install(api, o) for o in objects] == ["created", "created"]
    assert [install(api, o) for o in objects] == ["unchanged", "unchanged"]

    _stored(fake, "tunepack-tiny-llama3")["metadata"]["labels"]["tunepack.dev/model"] = "old"
    _older_failure_policy(fake, RUNTIME)
    uid = _stored(fake, RUNTIME)["metadata"]["uid"]
    before = len(fake.requests)
    assert [install(api, o) for o in objects] == ["configured", "replaced"]
    replaced = _stored(fake, RUNTIME)
    assert replaced["metadata"]["uid"] != uid  # a new object
    assert replaced["spec"] == objects[1]["spec"]
    path = f"{GROUP_PATH}/clustertrainingruntimes/{RUNTIME}"
    calls = [(r.method, r.path) for r in fake.requests[before:] if r.path == path]
    assert calls == [("GET", path), ("PATCH", path), ("DELETE", path), ("GET", path)] + [
        ("PATCH", path)
    ]
    delete = next(r for r in fake.requests[before:] if r.method == "DELETE")
    assert delete.body["preconditions"] == {"uid": uid}  # never someone else's new object


def test_install_stops_when_a_runtime_to_replace_is_in_use(server):
    from tunepack.core.errors import EXIT_TRANSIENT, RuntimeInUseError

    fake, _ = server
    api, obj = _installed_but_older(server, in_use=True)
    _trainjob_using(fake, "team-a", "job-1", RUNTIME, "ClusterTrainingRuntime")
    _trainjob_using(fake, "team-b", "job-2", RUNTIME, None)  # kind defaults to the cluster one
    _trainjob_using(fake, "team-a", "job-3", RUNTIME, "TrainingRuntime")  # not this one
    _trainjob_using(fake, "team-a", "job-4", "tunepack-tiny-llama3", None)

    with pytest.raises(RuntimeInUseError) as caught:
        install(api, obj, delete_timeout=0.3, poll_interval=0.1)
    assert caught.value.exit_code == EXIT_TRANSIENT
    assert str(caught.value) == (
        f"ClusterTrainingRuntime {RUNTIME} is still being deleted after 0.3 s (finalizers: "
        f"{IN_USE}); it is in use by TrainJobs team-a/job-1, team-b/job-2. tunepack deletes a "
        "runtime to re-create it when fields that cannot change in place (failurePolicy, "
        "volumeClaimPolicies, dependsOn, ...) differ from the installed one; the delete "
        "finishes when the runtime is no longer in use. Run `tunepack install` again when "
        f"those TrainJobs have finished (or are deleted) to re-create {RUNTIME}"
    )
    assert _stored(fake, RUNTIME)["metadata"]["deletionTimestamp"]

    # Run again while it is still terminating: install waits for the delete, then creates it.
    path = f"{GROUP_PATH}/clustertrainingruntimes/{RUNTIME}"

    def jobs_finish(req):
        if (
            req.method == "GET"
            and req.path == path
            and ("trainjobs", "team-a", "job-1") in (fake.objects)
        ):
            for key in [k for k in fake.objects if k[0] == "trainjobs"]:
                del fake.objects[key]
            fake.finalize("clustertrainingruntimes", None, RUNTIME)

    fake.after.append(jobs_finish)
    assert install(api, obj, delete_timeout=5, poll_interval=0.1) == "created"
    assert _stored(fake, RUNTIME)["spec"] == obj["spec"]


def test_install_says_when_the_trainjobs_cannot_be_listed(server):
    from tunepack.core.errors import RuntimeInUseError

    fake, _ = server
    api, obj = _installed_but_older(server, in_use=True)
    fake.fail[("GET", f"{GROUP_PATH}/trainjobs")] = (403, "trainjobs is forbidden")
    with pytest.raises(RuntimeInUseError, match=r"the TrainJobs that use it could not be listed"):
        install(api, obj, delete_timeout=0.2, poll_interval=0.1)


@pytest.mark.parametrize(
    ("method", "code", "reason", "message"),
    [
        (
            "PATCH",
            422,
            'admission webhook "validator.clustertrainingruntime.trainer.kubeflow.org" denied '
            "the request: spec.mlPolicy: Invalid value",
            f"Failed to apply ClusterTrainingRuntime {RUNTIME}: admission webhook "
            '"validator.clustertrainingruntime.trainer.kubeflow.org" denied the request: '
            "spec.mlPolicy: Invalid value",
        ),
        (
            "DELETE",
            403,
            "clustertrainingruntimes is forbidden: User cannot delete resource",
            f"Failed to delete ClusterTrainingRuntime {RUNTIME} to re-create it (fields that "
            "cannot change in place differ): clustertrainingruntimes is forbidden: User cannot "
            "delete resource",
        ),
        (
            "GET",
            403,
            "clustertrainingruntimes is forbidden",
            f"Failed to read ClusterTrainingRuntime {RUNTIME}: clustertrainingruntimes is "
            "forbidden",
        ),
    ],
)
def test_install_reports_other_refusals_with_the_server_message(
    server, method, code, reason, message
):
    fake, _ = server
    api, obj = _installed_but_older(server)
    fake.fail[(method, f"{GROUP_PATH}/clustertrainingruntimes/{RUNTIME}")] = (code, reason)
    with pytest.raises(RuntimeError) as caught:
        install(api, obj)
    assert str(caught.value) == message
    assert api_status(caught.value) == code


def test_cli_install_replaces_and_explains_in_use_and_refusals(server, cli):
    fake, url = server
    tiny = "tunepack-tiny-llama3"
    assert cli("install", "--no-image-check", "--runtime", "tiny-llama3").returncode == 0
    _older_failure_policy(fake, tiny)
    done = cli("install", "--no-image-check", "--runtime", "tiny-llama3")
    assert done.returncode == 0, done.stderr
    assert (
        done.stdout.splitlines()[0]
        == f"clustertrainingruntime.trainer.kubeflow.org/{tiny} replaced"
    )
    assert done.stdout.splitlines()[1:] == [f"{describe(o)} {SKIPPED}" for o in admission_objects()]

    _older_failure_policy(fake, tiny)
    _stored(fake, tiny)["metadata"]["finalizers"] = [IN_USE]
    _trainjob_using(fake, NS, "cli-job", tiny, None)
    done = cli("install", "--no-image-check", "--runtime", "tiny-llama3", "--delete-timeout", "0.5")
    assert done.returncode == 75, done.stderr
    assert done.stdout == ""
    assert done.stderr.startswith(
        f"tunepack: error: ClusterTrainingRuntime {tiny} is still being deleted after 0.5 s "
        f"(finalizers: {IN_USE}); it is in use by TrainJobs {NS}/cli-job. "
    )
    assert done.stderr.count("\n") == 1  # one line, no traceback

    fake.finalize("clustertrainingruntimes", None, tiny)
    fake.fail[("PATCH", f"{GROUP_PATH}/clustertrainingruntimes/{tiny}")] = (403, "forbidden")
    done = cli("install", "--no-image-check", "--runtime", "tiny-llama3")
    assert done.returncode == 1
    assert (
        done.stderr
        == f"tunepack: error: Failed to apply ClusterTrainingRuntime {tiny}: forbidden\n"
    )


def test_cli_install_checks_the_images_first_and_installs_nothing_the_nodes_cannot_pull(
    server, cli
):
    """The fake server plays the kubelet for the probe pods: the trainer image cannot be pulled
    (ErrImagePull), the initializers' run. The install stops before any runtime is applied."""
    fake, _ = server
    registry = "r.example/ml"

    def kubelet(req):
        if req.method != "POST" or not req.path.endswith("/pods"):
            return
        pod = fake.objects[("pods", NS, req.body["metadata"]["name"])]
        image = pod["spec"]["containers"][0]["image"]
        state = {"terminated": {"exitCode": 0}}
        if "/trainer:" in image:
            state = {"waiting": {"reason": "ErrImagePull", "message": f'"{image}": not found'}}
        pod["spec"]["nodeName"] = "gpu-1"
        pod["status"] = {
            "phase": "Pending",
            "containerStatuses": [{
                "name": "probe", "image": image, "imageID": "", "ready": False,
                "restartCount": 0, "state": state,
            }],
        }  # fmt: skip

    fake.after.append(kubelet)
    done = cli("install", "--runtime", "tiny-llama3", "--registry", registry)
    assert done.returncode == 65, done.stderr
    trainer = f"{registry}/trainer:{__version__}"
    assert done.stdout.splitlines() == [
        f"image {registry}/dataset-initializer:{__version__}: pullable (pulled on node gpu-1)",
        f"image {registry}/model-initializer:{__version__}: pullable (pulled on node gpu-1)",
        f'image {trainer}: NOT PULLABLE (node gpu-1: ErrImagePull: "{trainer}": not found)',
    ]
    assert done.stderr == (
        "tunepack: error: the cluster cannot pull 1 of the runtimes' images ("
        f'{trainer}: node gpu-1: ErrImagePull: "{trainer}": not found); nothing was installed. '
        f"Push tunepack's images to a registry the nodes pull from (make push-images "
        f"REGISTRY={registry}) and install naming it (tunepack install --registry {registry}; "
        "docs/cluster.md, 'Images'), or install anyway with --no-image-check\n"
    )
    assert not [r for r in fake.requests if r.method == "PATCH"]  # nothing applied
    probes = [r.body["metadata"]["name"] for r in fake.requests if r.method == "POST"]
    assert len(probes) == 3
    assert sorted(r.path.rsplit("/", 1)[1] for r in fake.requests if r.method == "DELETE") == (
        sorted(probes)
    )


def test_cli_status_says_why_a_placed_trainer_pod_does_not_start(server, cli):
    """A trainer pod the scheduler placed whose image the node cannot pull: `tunepack status`
    gives the kubelet's reason and what to do (before, it said nothing: only pods the scheduler
    refused had a reason)."""
    fake, _ = server
    assert cli("install", "--no-image-check", "--runtime", RUNTIME).returncode == 0
    done = cli("train", "--runtime", RUNTIME, "--name", "pull", "--dataset", "/d", "--model", "/m")
    assert done.returncode == 0, done.stderr
    image = "ghcr.io/tunepack/trainer:0.1.0"
    waiting = {"reason": "ImagePullBackOff", "message": f'Back-off pulling image "{image}"'}
    fake.objects[("pods", NS, "pull-node-0-0-abcde")] = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": "pull-node-0-0-abcde",
            "namespace": NS,
            "labels": {"jobset.sigs.k8s.io/jobset-name": "pull"},
        },
        "spec": {"nodeName": "gpu-1", "containers": [{"name": "node", "image": image}]},
        "status": {
            "phase": "Pending",
            "containerStatuses": [{
                "name": "node", "image": image, "imageID": "", "ready": False,
                "restartCount": 0, "state": {"waiting": waiting},
            }],
        },
    }  # fmt: skip
    done = cli("status", "pull")
    assert done.returncode == 0, done.stderr
    assert (
        "  message: not starting: pod pull-node-0-0-abcde, container node: ImagePullBackOff: "
        f'Back-off pulling image "{image}"; the node cannot pull the runtime\'s image: push '
        "tunepack's images to a registry the cluster pulls from (make push-images REGISTRY=...) "
        "and install the runtimes naming it (tunepack install --registry ...; docs/cluster.md, "
        "'Images')\n"
    ) in done.stdout


def test_cli_install_with_a_registry_names_it_in_every_installed_image(server, cli):
    fake, _ = server
    done = cli(
        "install", "--no-image-check", "--runtime", "tiny-llama3",
        "--registry", "registry.example.com:5000/ml", "--tag", "rc1",
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    stored = _stored(fake, "tunepack-tiny-llama3")
    assert {c["image"] for job in replicated_jobs(stored) for c in containers(job)} == {
        f"registry.example.com:5000/ml/{name}:rc1"
        for name in ("dataset-initializer", "model-initializer", "trainer")
    }


def test_cli_train_uses_the_sdk_path_namespaced_runtime_and_planner(server, cli):
    fake, url = server
    args = ["--dataset", "file:///d.jsonl", "--model", "file:///m"]

    # No runtime installed: one line saying what to do, not a traceback.
    done = cli("train", "--runtime", RUNTIME, "--name", "j1", *args)
    assert done.returncode == 1
    assert done.stderr.startswith(f"tunepack: error: runtime {RUNTIME!r} is not installed")
    assert done.stderr.count("\n") == 1

    assert (
        cli("install", "--no-image-check", "--runtime", RUNTIME, "--namespace", NS).returncode == 0
    )
    assert ("trainingruntimes", NS, RUNTIME) in fake.objects
    done = cli("train", "--runtime", RUNTIME, "--name", "j1", *args)
    assert done.returncode == 0, done.stderr
    (post,) = [r for r in fake.requests if r.method == "POST"]
    assert post.body["spec"]["runtimeRef"]["kind"] == "TrainingRuntime"

    # The memory planner applies to the CLI too; --memory-check warn submits anyway.
    big = ["method=full", "max_seq_len=8192", "batch_size=64"]
    done = cli("train", "--runtime", RUNTIME, "--name", "j2", *args, *big)
    assert done.returncode == 65
    assert "tunepack: error: this fine-tune is estimated not to fit in GPU memory" in done.stderr
    done = cli("train", "--runtime", RUNTIME, "--name", "j2", "--memory-check", "warn", *args, *big)
    assert done.returncode == 0, done.stderr
    post = [r for r in fake.requests if r.method == "POST"][-1]
    assert post.body["spec"]["trainer"]["args"] == [
        "method=full",
        "batch_size=64",
        "max_seq_len=8192",
    ]

    # Bad input is refused before anything is sent.
    posts = len([r for r in fake.requests if r.method == "POST"])
    done = cli("train", "--runtime", RUNTIME, "--dataset", "data.jsonl", "--model", "file:///m")
    assert done.returncode == 65
    assert done.stderr == (
        "tunepack: error: dataset storage URI 'data.jsonl' is a relative path: a TrainJob's "
        "storage URI is read inside the dataset initializer container on the cluster, so a path "
        "must be absolute (/abs/path or file:///abs/path), or use a URI such as hf://org/name "
        "or s3://bucket/key\n"
    )
    done = cli("train", "--runtime", RUNTIME, "--queue", "Team Q", *args)
    assert done.returncode == 65
    assert "queue 'Team Q' (label kueue.x-k8s.io/queue-name) is not a valid Kueue" in done.stderr
    done = cli("train", "--runtime", RUNTIME, *args, "lora_rnk=8")
    assert done.returncode == 65
    assert "unknown trainer argument 'lora_rnk'; did you mean 'lora_rank'?" in done.stderr
    assert len([r for r in fake.requests if r.method == "POST"]) == posts


def test_cli_train_gpus_per_node_set_the_pods_gpus_and_processes(server, cli):
    """Issue 49, 2: `train --num-proc-per-node 4` on a one-GPU runtime was submitted (an 8B
    full fine-tune planned on 4 L4s) and refused by the launcher on the node; now it is refused
    before anything is sent, and --gpus-per-node asks for the GPUs."""
    fake, _ = server
    runtime = "tunepack-llama3.1-8b"
    assert cli("install", "--no-image-check", "--runtime", runtime).returncode == 0
    job = ["--runtime", runtime, "--dataset", "s3://bucket/d.jsonl", "--model", "s3://bucket/m"]
    job += ["method=full", "--gpu", "l4"]
    done = cli("train", *job, "--name", "four", "--num-proc-per-node", "4")
    assert (done.returncode, done.stdout) == (65, "")
    assert done.stderr == (
        "tunepack: error: --num-proc-per-node 4 asks for 4 processes a node, but a trainer node "
        "holds 1 GPU (runtime tunepack-llama3.1-8b's) and runs one process per GPU: give "
        "--gpus-per-node 4 for 4 GPUs a node, or leave --num-proc-per-node out\n"
    )
    assert not [r for r in fake.requests if r.method == "POST"]
    done = cli("train", *job, "--name", "four", "--gpus-per-node", "4")
    assert done.returncode == 0, done.stderr
    (post,) = [r for r in fake.requests if r.method == "POST"]
    trainer = post.body["spec"]["trainer"]
    assert trainer["numProcPerNode"] == 4
    assert trainer["resourcesPerNode"]["limits"] == {"nvidia.com/gpu": 4}


# Every flag `train` and `render trainjob` share, each given (issue 49, 4: nothing dropped).
SHARED_FLAGS = [
    "--runtime", "tiny-llama3", "--dataset", "hf://org/questions", "--model", "hf://org/m",
    "--name", "same-job", "--num-nodes", "2", "--gpus-per-node", "0", "--num-proc-per-node", "2",
    "--queue", "team-a-queue", "--dataset-secret", "hf-data", "--model-secret", "hf-model",
    "--column-map", "question:instruction", "--dataset-schema", "instruction",
    "--export", "s3://bucket/out", "--export-secret", "s3-creds", "epochs=1",
]  # fmt: skip


def test_render_trainjob_prints_the_trainjob_train_submits(server, cli):
    """`render trainjob --column-map question:instruction --dataset-schema instruction` printed a
    TrainJob without them, so a user who applied it got a job that ignored both, silently: the
    TrainJob it prints is now the one `train` submits for the same flags, every one of them."""
    fake, _ = server
    assert cli("install", "--no-image-check", "--runtime", "tiny-llama3").returncode == 0
    rendered = cli("render", "trainjob", *SHARED_FLAGS, "--namespace", NS)
    assert (rendered.returncode, rendered.stderr) == (0, "")
    trainjob = yaml.safe_load(rendered.stdout)
    dataset = trainjob["spec"]["initializer"]["dataset"]
    env = {var["name"]: var["value"] for var in dataset["env"]}
    assert env["COLUMN_MAP"] == "question:instruction"
    assert env["DATASET_SCHEMA"] == "instruction"
    done = cli("train", *SHARED_FLAGS)
    assert done.returncode == 0, done.stderr
    (post,) = [r for r in fake.requests if r.method == "POST"]
    assert trainjob == post.body


def test_render_trainjob_refuses_a_method_the_named_schema_does_not_fit_as_train_does(server, cli):
    """`render trainjob method=dpo --dataset-schema instruction` printed the TrainJob (rc 0),
    which failed on the cluster; `train` refused it at submission (issue 49, 6). Now render
    refuses it too: the same one line, exit 65, nothing printed."""
    fake, _ = server
    assert cli("install", "--no-image-check", "--runtime", "tiny-llama3").returncode == 0
    job = ["--runtime", "tiny-llama3", "--dataset", "hf://org/questions", "--model", "hf://org/m"]
    job += ["--name", "dpo-job", "--dataset-schema", "instruction", "method=dpo"]
    rendered = cli("render", "trainjob", *job)
    assert (rendered.returncode, rendered.stdout) == (65, "")
    assert rendered.stderr == (
        "tunepack: error: method=dpo needs a preference dataset (rows with 'prompt', 'chosen' "
        "and 'rejected'), but the dataset's schema is 'instruction'\n"
    )
    train = cli("train", *job)
    assert (train.returncode, train.stdout, train.stderr) == (65, "", rendered.stderr)
    assert not [r for r in fake.requests if r.method == "POST"]


def test_render_serving_reads_a_finished_trainjobs_runtime_and_arguments(
    server, capsys, tmp_path, monkeypatch
):
    """`tunepack render serving --job NAME` on a cluster: the runtime from spec.runtimeRef,
    the arguments from spec.trainer.args, the TrainJob's own PVC; refused until it is Complete
    (issue 41, item 4: before, --runtime, --name and each key=value had to be typed again)."""
    from tunepack.cli import main

    fake, url = server
    _install(fake, url)
    name = _client(url).train(
        runtime=RUNTIME,
        initializer=Initializer(dataset="file:///pvc/data/train.jsonl", model="hf://org/m"),
        trainer=FineTune(method="lora", lora_rank=48, max_seq_len=1024),
    )
    monkeypatch.setenv("KUBECONFIG", str(write_kubeconfig(tmp_path / "config", url)))
    argv = ["render", "serving", "--job", name, "--namespace", NS]
    assert main(argv) == 65
    assert capsys.readouterr().err == (
        f"tunepack: error: TrainJob {name} is Created, not Complete; it has no result to serve "
        "yet (tunepack status)\n"
    )
    _controller_runs(fake, name)
    assert main(argv) == 0
    objects = [o for o in yaml.safe_load_all(capsys.readouterr().out) if o]
    pod = objects[0]["spec"]["template"]["spec"]
    assert pod["volumes"][0]["persistentVolumeClaim"]["claimName"] == f"initializer-{name}"
    args = pod["containers"][0]["args"]
    assert "--max-lora-rank=64" in args and "--max-model-len=1024" in args
