"""``tunepack.OptimizerClient`` on a cluster against a recording HTTP server on loopback (not a
cluster): the Katib Experiment it makes, how it reads Katib's trials back, and what it refuses
before anything is created. The same search runs on a real Katib in tests/cluster/test_optimize.py.
"""

from __future__ import annotations

import copy
import json

import pytest
from kubernetes import client

from tests.fake_apiserver import KATIB_PATH, FakeApiServer
from tests.helpers import run_program, write_kubeconfig
from tunepack import (
    FineTune,
    Initializer,
    MedianStop,
    Objective,
    OptimizerClient,
    RandomSearch,
    Search,
    TrainJobTemplate,
    TrialConfig,
)
from tunepack.core.errors import ConflictError, NotAvailableError, UnknownKeyError
from tunepack.runtimes.validate import validate_trainjob
from tunepack.tools.install import apply, runtime_objects

NS = "team-a"
RUNTIME = "tunepack-tiny-llama3"
INJECTION = "katib.kubeflow.org/metrics-collector-injection"


@pytest.fixture
def server():
    fake = FakeApiServer()
    url = fake.start()
    cfg = client.Configuration()
    cfg.host = url
    api = client.ApiClient(cfg)
    for obj in runtime_objects():
        apply(api, obj)
    fake.objects[("namespaces", None, NS)] = {
        "apiVersion": "v1",
        "kind": "Namespace",
        "metadata": {"name": NS, "labels": {INJECTION: "enabled"}},
    }
    yield fake, cfg
    fake.stop()


def _client(cfg) -> OptimizerClient:
    from kubeflow.common.types import KubernetesBackendConfig

    return OptimizerClient(KubernetesBackendConfig(namespace=NS, client_configuration=cfg))


def _template(**finetune) -> TrainJobTemplate:
    return TrainJobTemplate(
        runtime=RUNTIME,
        trainer=FineTune(method="lora", epochs=1, val_fraction=0.25, **finetune),
        initializer=Initializer(dataset="s3://sources/data.jsonl", model="s3://sources/tiny"),
    )


SPACE = {"lr": Search.loguniform(1e-5, 1e-3), "lora_rank": Search.choice([8, 16])}


def _experiment(fake) -> dict:
    posts = [r for r in fake.requests if r.method == "POST" and r.path.startswith(KATIB_PATH)]
    assert len(posts) == 1
    return posts[0].body


def test_the_search_is_a_katib_experiment_of_tunepack_trainjobs(server):
    fake, cfg = server
    name = _client(cfg).optimize(
        trial_template=_template(),
        search_space=SPACE,
        trial_config=TrialConfig(num_trials=4, parallel_trials=2, max_failed_trials=1),
        algorithm=RandomSearch(random_state=3),
    )
    body = _experiment(fake)
    assert body["metadata"] == {"name": name, "namespace": NS}
    spec = body["spec"]
    assert (spec["maxTrialCount"], spec["parallelTrialCount"], spec["maxFailedTrialCount"]) == (
        4,
        2,
        1,
    )
    assert spec["algorithm"] == {
        "algorithmName": "random",
        "algorithmSettings": [{"name": "random_state", "value": "3"}],
    }
    # The validation loss, under the name the trainer prints for Katib; its latest value.
    assert spec["objective"] == {
        "type": "minimize",
        "objectiveMetricName": "eval_loss",
        "additionalMetricNames": [],
        "metricStrategies": [{"name": "eval_loss", "value": "latest"}],
    }
    assert spec["parameters"] == [
        {
            "name": "lr",
            "parameterType": "double",
            "feasibleSpace": {"min": "1e-05", "max": "0.001", "distribution": "logUniform"},
        },
        {
            "name": "lora_rank",
            "parameterType": "categorical",
            "feasibleSpace": {"list": ["8", "16"]},
        },
    ]
    template = spec["trialTemplate"]
    assert (template["primaryContainerName"], template["retain"]) == ("node", True)
    assert [p["name"] for p in template["trialParameters"]] == ["lr", "lora_rank"]
    trainjob = template["trialSpec"]
    assert (trainjob["apiVersion"], trainjob["kind"]) == (
        "trainer.kubeflow.org/v1alpha1",
        "TrainJob",
    )
    args = trainjob["spec"]["trainer"]["args"]
    assert args == [
        "method=lora",
        "epochs=1",
        "val_fraction=0.25",
        "lr=${trialParameters.lr}",
        "lora_rank=${trialParameters.lora_rank}",
    ]
    # What a trial gets once Katib substitutes its values is a TrainJob tunepack would submit,
    # its initializers told the same arguments.
    text = json.dumps(trainjob)
    text = text.replace("${trialParameters.lr}", "0.0002").replace(
        "${trialParameters.lora_rank}", "16"
    )
    trial = {**json.loads(text), "metadata": {"name": f"{name}-abcd1234", "namespace": NS}}
    validate_trainjob(copy.deepcopy(trial))
    for step in trial["spec"]["initializer"].values():
        (told,) = [e["value"] for e in step["env"] if e["name"] == "TUNEPACK_TRAINER_ARGS"]
        assert json.loads(told)[-2:] == ["lr=0.0002", "lora_rank=16"]


def _katib_ran(fake, name: str) -> None:
    """Play Katib: two trials ended (one with its metrics, one failed), the Experiment done."""
    metrics = {
        "a": [("eval_loss", "4.51", "4.51", "4.51"), ("loss", "4.7", "4.9", "4.7")],
        "b": [],
    }
    for tail, ended in (("a", "Succeeded"), ("b", "Failed")):
        trial = f"{name}-{tail}"
        fake.objects[("trials", NS, trial)] = {
            "apiVersion": "kubeflow.org/v1beta1",
            "kind": "Trial",
            "metadata": {
                "name": trial,
                "namespace": NS,
                "labels": {"katib.kubeflow.org/experiment": name},
                "creationTimestamp": f"2026-12-02T00:00:0{'ab'.index(tail)}Z",
            },
            "spec": {
                "parameterAssignments": [
                    {"name": "lr", "value": "0.0002"},
                    {"name": "lora_rank", "value": "16" if tail == "a" else "8"},
                ]
            },
            "status": {
                "conditions": [
                    {
                        "type": ended,
                        "status": "True",
                        "message": "Trial has failed. Job message: exit code 65"
                        if tail == "b"
                        else "",
                    }
                ],
                "observation": {
                    "metrics": [
                        {"name": n, "latest": latest, "min": low, "max": high}
                        for n, latest, low, high in metrics[tail]
                    ]
                },
            },
        }
    experiment = fake.objects[("experiments", NS, name)]
    experiment["status"] = {
        "conditions": [{"type": "Succeeded", "status": "True"}],
        "currentOptimalTrial": {
            "bestTrialName": f"{name}-a",
            "parameterAssignments": [
                {"name": "lr", "value": "0.0002"},
                {"name": "lora_rank", "value": "16"},
            ],
            "observation": {
                "metrics": [{"name": "eval_loss", "latest": "4.51", "min": "4.51", "max": "4.51"}]
            },
        },
    }


def test_the_job_its_trials_and_the_best_are_read_from_katib(server):
    fake, cfg = server
    optimizer = _client(cfg)
    name = optimizer.optimize(trial_template=_template(), search_space=SPACE)
    assert optimizer.get_job(name).status == "Created"
    _katib_ran(fake, name)

    job = optimizer.get_job(name)
    assert job.status == "Complete"
    assert job.objectives[0].metric == "eval_loss"
    assert [(t.name, t.state, t.objective) for t in job.trials] == [
        (f"{name}-a", "Complete", 4.51),
        (f"{name}-b", "Failed", None),
    ]
    assert job.trials[1].message == "Trial has failed. Job message: exit code 65"
    assert job.best_trial == f"{name}-a"
    assert f"{name}-a *" in job.table()
    best = optimizer.get_best_results(name)
    assert (best.trial, best.parameters) == (f"{name}-a", {"lr": "0.0002", "lora_rank": "16"})
    assert [(m.name, m.latest) for m in best.metrics] == [("eval_loss", "4.51")]
    assert optimizer.wait_for_job_status(name, timeout=5, polling_interval=1).status == "Complete"
    assert [j.name for j in optimizer.list_jobs()] == [name]

    optimizer.delete_job(name)
    delete = [r for r in fake.requests if r.method == "DELETE"][-1]
    assert delete.path == f"{KATIB_PATH}/namespaces/{NS}/experiments/{name}"
    assert delete.query["propagationPolicy"] == ["Foreground"]  # trials and TrainJobs first
    assert ("experiments", NS, name) not in fake.objects


def _refused(cfg, error, **asked):
    with pytest.raises(error) as caught:
        _client(cfg).optimize(**{"trial_template": _template(), "search_space": SPACE, **asked})
    return str(caught.value)


def test_a_namespace_katib_collects_no_metrics_from_is_refused_first(server):
    fake, cfg = server
    fake.objects[("namespaces", None, NS)]["metadata"]["labels"] = {}
    message = _refused(cfg, ConflictError)
    assert message == (
        f"namespace 'team-a' lacks the label {INJECTION}=enabled, without which Katib collects "
        f"no metric from the trials: kubectl label namespace team-a {INJECTION}=enabled"
    )
    assert not [r for r in fake.requests if r.method == "POST"]


def test_a_cluster_without_katib_is_said_in_one_line(server):
    fake, cfg = server
    fake.fail[("POST", f"{KATIB_PATH}/namespaces/{NS}/experiments")] = (
        404,
        "the server could not find the requested resource",
    )
    assert _refused(cfg, NotAvailableError) == (
        "Katib is not installed in this cluster (no experiments.kubeflow.org/v1beta1): install "
        "Katib v0.19 (docs/optimize.md) or search on this machine (LocalBackendConfig())"
    )


@pytest.mark.parametrize(
    "asked, error, message",
    [
        (
            {"search_space": {"lora_rnak": Search.choice([8, 16])}},
            UnknownKeyError,
            "search_space['lora_rnak']: 'lora_rnak' is not a trainer argument; did you mean "
            "'lora_rank', 'lora_alpha'?",
        ),
        (
            {"objectives": [Objective(metric="reward_accuracy")]},
            Exception,
            "no trial would report 'reward_accuracy'",
        ),
        (
            {"early_stopping": MedianStop()},
            NotAvailableError,
            "early_stopping on a cluster (Katib's medianstop service) is not in this version",
        ),
    ],
    ids=["key", "metric", "early-stopping"],
)
def test_what_the_search_cannot_run_is_refused_before_anything_is_created(
    server, asked, error, message
):
    fake, cfg = server
    assert message in _refused(cfg, error, **asked)
    assert not [r for r in fake.requests if r.path.startswith(KATIB_PATH)]


def test_a_space_whose_largest_point_does_not_fit_the_gpu_is_refused(server):
    fake, cfg = server
    message = _refused(
        cfg,
        Exception,
        trial_template=TrainJobTemplate(
            runtime="tunepack-llama3.1-8b",
            trainer=FineTune(method="full"),
            initializer=Initializer(dataset="s3://sources/data.jsonl", model="s3://sources/m"),
        ),
        search_space={"batch_size": Search.choice([1, 64])},
        objectives=[Objective(metric="loss")],
    )
    assert "does NOT fit" in message or "does not fit" in message, message
    assert not [r for r in fake.requests if r.path.startswith(KATIB_PATH)]


def test_the_command_line_makes_the_experiment_follows_it_and_names_the_best(server, tmp_path):
    fake, cfg = server

    def katib(req):  # Katib, as soon as the Experiment exists: its trials end
        if req.method == "POST" and req.path.startswith(KATIB_PATH):
            _katib_ran(fake, req.body["metadata"]["name"])

    fake.after.append(katib)
    env = {"KUBECONFIG": str(write_kubeconfig(tmp_path / "kubeconfig", cfg.host, namespace=NS))}
    done = run_program(
        "tunepack.cli", env, "optimize", "--runtime", RUNTIME,
        "--dataset", "s3://sources/data.jsonl", "--model", "s3://sources/tiny",
        "--search", "lr=loguniform:1e-5:1e-3", "--search", "lora_rank=choice:8,16",
        "--trials", "2", "--parallel", "2", "method=lora", "epochs=1", "val_fraction=0.25",
        timeout=120,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    name = _experiment(fake)["metadata"]["name"]
    lines = done.stdout.splitlines()
    assert lines[0] == (
        f"tunepack: optimization {name} (Katib Experiment in namespace {NS}): 2 trials of "
        f"{RUNTIME}, 2 at once, eval_loss (min) by random search over "
        "lr=loguniform:1e-05:0.001 lora_rank=choice:8,16"
    )
    assert f"tunepack: trial {name}-a Complete: 4.5100: lr=0.0002 lora_rank=16" in lines
    assert (
        f"tunepack: trial {name}-b Failed: lr=0.0002 lora_rank=8 (Trial has failed. Job "
        "message: exit code 65)" in lines
    )
    assert lines[-1] == (
        f"tunepack: best trial {name}-a: lr=0.0002 lora_rank=16: eval_loss 4.5100; its result: "
        f"tunepack result {name}-a --namespace {NS}"
    )

    status = run_program("tunepack.cli", env, "optimize", "status", name, timeout=120)
    assert status.returncode == 0, status.stderr
    assert status.stdout.splitlines()[0] == f"{name}  Complete  (2 of 2 trials)"


@pytest.mark.parametrize(
    "flag, message",
    [
        (
            ["--name", "mine"],
            "tunepack: error: --name mine: a search names its trials itself (<search>-<n> on this "
            "machine, by Katib on a cluster); leave --name out",
        ),
        (
            ["--queue", "team"],
            "tunepack: error: --queue team: a search's trials are not put in a Kueue queue in "
            "this version of tunepack; leave --queue out",
        ),
    ],
    ids=["name", "queue"],
)
def test_job_flags_a_search_cannot_honour_are_refused_not_dropped(server, tmp_path, flag, message):
    fake, cfg = server
    env = {"KUBECONFIG": str(write_kubeconfig(tmp_path / "kubeconfig", cfg.host, namespace=NS))}
    for where in ([], ["--local", "--jobs-dir", str(tmp_path / "jobs")]):
        done = run_program(
            "tunepack.cli", env, "optimize", *where, *flag, "--runtime", RUNTIME,
            "--dataset", "s3://sources/data.jsonl", "--model", "s3://sources/tiny",
            "--search", "lr=loguniform:1e-5:1e-3", timeout=120,
        )  # fmt: skip
        assert done.returncode == 65, done.stderr
        assert done.stderr.strip().splitlines()[-1] == message
    assert not [r for r in fake.requests if r.path.startswith(KATIB_PATH)]
    assert not (tmp_path / "jobs").exists()
