"""Hyperparameter search on the cluster: ``tunepack.OptimizerClient`` makes a Katib v0.19
Experiment whose trials are TrainJobs of a tunepack runtime, run for real.

Katib's own programs serve it (tests/controlplane/katib.py): its controller and webhooks, its
db-manager on PostgreSQL, the goptuna suggestion service (a pod on the real node) and the StdOut
metrics collector, which Katib's webhook adds to each trial's trainer pod and which reads the
``name=value`` lines the trainer prints. Each trial's TrainJob runs tunepack's three programs in
their images; its result.json is read from the volume behind its workspace PVC.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from tests.cluster import kube

pytestmark = pytest.mark.controlplane

TINY = "tunepack-tiny-llama3"
TIMEOUT = 1500
INJECTION_LABEL = "katib.kubeflow.org/metrics-collector-injection"


@pytest.fixture
def katib_namespace(api, namespace):
    """The test's namespace, labelled for Katib's metrics-collector injection (what an MLOps
    engineer does once per namespace: docs/optimize.md)."""
    api.core.patch_namespace(namespace, {"metadata": {"labels": {INJECTION_LABEL: "enabled"}}})
    return namespace


def _client(namespace: str):
    """As a notebook makes it; the kubeconfig named (kube.training_client says why)."""
    from kubeflow.common.types import KubernetesBackendConfig

    from tunepack import OptimizerClient

    cfg = KubernetesBackendConfig(namespace=namespace, config_file=os.environ["KUBECONFIG"])
    return OptimizerClient(cfg)


def _template(sources):
    from tunepack import FineTune, Initializer, TrainJobTemplate

    # 900m of the node's 2 CPUs each: two trainers (and Katib's collectors beside them) fit.
    return TrainJobTemplate(
        runtime=TINY,
        trainer=FineTune(
            method="lora", epochs=1, val_fraction=0.25, resources_per_node={"cpu": "900m"}
        ),
        initializer=Initializer(dataset=sources["dataset"], model=sources["model"]),
    )


def _volume(api, namespace: str, name: str) -> Path:
    pvc = api.core.read_namespaced_persistent_volume_claim(f"initializer-{name}", namespace)
    return Path(api.core.read_persistent_volume(pvc.spec.volume_name).spec.host_path.path)


def _trainer_spans(api, namespace: str) -> list[tuple]:
    """When each trial's trainer container ran (the kubelet's started/finished times)."""
    spans = []
    for pod in api.pods(namespace, "jobset.sigs.k8s.io/replicatedjob-name=node"):
        for status in pod.status.container_statuses or []:
            done = status.state.terminated if status.state else None
            if status.name == "node" and done is not None:
                spans.append((done.started_at, done.finished_at))
    return spans


def test_katib_searches_lr_and_lora_rank_over_tunepack_trainjobs(
    api, katib_namespace, installed_runtimes, on_node, sources
):
    from tunepack import RandomSearch, Search, TrialConfig

    ns = katib_namespace
    client = _client(ns)
    name = client.optimize(
        trial_template=_template(sources),
        search_space={"lr": Search.loguniform(1e-4, 1e-2), "lora_rank": Search.choice([4, 8])},
        trial_config=TrialConfig(num_trials=4, parallel_trials=2, max_failed_trials=0),
        algorithm=RandomSearch(random_state=7),
    )
    experiment = api.custom.get_namespaced_custom_object(
        "kubeflow.org", "v1beta1", ns, "experiments", name
    )
    trial_spec = experiment["spec"]["trialTemplate"]["trialSpec"]
    assert trial_spec["kind"] == "TrainJob"
    args = trial_spec["spec"]["trainer"]["args"]
    assert "lr=${trialParameters.lr}" in args and "lora_rank=${trialParameters.lora_rank}" in args
    assert experiment["spec"]["objective"]["objectiveMetricName"] == "eval_loss"

    try:
        job = client.wait_for_job_status(name, timeout=TIMEOUT, polling_interval=5)
    except (RuntimeError, TimeoutError):
        trials = client.get_job(name).trials
        detail = "\n".join(api.diagnose(ns, t.name) for t in trials)
        states = [(t.name, t.state, t.message) for t in trials]
        pytest.fail(f"{name} did not complete: {states}\n{detail}")
    assert job.status == "Complete"
    assert len(job.trials) == 4
    assert all(t.state == "Complete" for t in job.trials), [(t.name, t.message) for t in job.trials]

    # Two trials at once: some two trainer containers ran at the same time.
    spans = sorted(_trainer_spans(api, ns))
    assert len(spans) == 4
    assert any(b[0] < a[1] for a, b in zip(spans, spans[1:], strict=False)), spans

    # Each trial's trainer ran with its own values, and Katib's figure is its result.json's.
    results = {}
    for trial in job.trials:
        result = json.loads((_volume(api, ns, trial.name) / "output" / "result.json").read_text())
        assert result["final_loss"] < result["first_loss"]
        assert float(result["trainer_args"]["lr"]) == float(trial.parameters["lr"])
        assert str(result["trainer_args"]["lora_rank"]) == trial.parameters["lora_rank"]
        assert trial.objective == result["val_loss"]
        results[trial.name] = result
    lowest = min(results, key=lambda n: results[n]["val_loss"])
    best = client.get_best_results(name)
    assert best.trial == lowest
    assert best.parameters == next(t.parameters for t in job.trials if t.name == lowest)
    eval_loss = next(m for m in best.metrics if m.name == "eval_loss")
    assert float(eval_loss.latest) == results[lowest]["val_loss"]

    # The best trial's trainer log, as Katib's collector took it from the trainer.
    logs = list(client.get_job_logs(name))
    assert any(line.startswith("trainer: done: ") for line in logs), logs[-20:]
    assert f"eval_loss={results[lowest]['val_loss']!r}" in "\n".join(logs)

    # delete_job: the Experiment, its trials and their TrainJobs go.
    client.delete_job(name)

    def gone():
        left = [
            api.custom.list_namespaced_custom_object(group, version, ns, plural)["items"]
            for group, version, plural in (
                ("kubeflow.org", "v1beta1", "experiments"),
                ("kubeflow.org", "v1beta1", "trials"),
                ("trainer.kubeflow.org", "v1alpha1", "trainjobs"),
            )
        ]
        return not any(left)

    kube.wait_for(gone, 120, f"{name}, its trials and TrainJobs deleted")


def test_a_trial_the_trainer_refuses_fails_at_once_and_counts_as_failed(
    api, katib_namespace, installed_runtimes, on_node, sources
):
    """A search over ``method`` that draws dpo for instruction rows in S3 (whose schema the SDK
    cannot see before the run): the first program that reads the rows refuses them with exit
    65, nothing is retried, and Katib counts the trial as failed."""
    from tunepack import Objective, Search, TrialConfig

    ns = katib_namespace
    client = _client(ns)
    name = client.optimize(
        trial_template=_template(sources),
        search_space={"method": Search.choice(["dpo"])},
        objectives=[Objective(metric="loss")],
        trial_config=TrialConfig(num_trials=1, max_failed_trials=0),
    )
    job = client.wait_for_job_status(name, status={"Failed"}, timeout=TIMEOUT, polling_interval=5)
    (trial,) = job.trials
    assert trial.state == "Failed", trial
    assert trial.parameters == {"method": "dpo"}
    assert trial.exit_code == 65, api.diagnose(ns, trial.name)
    status = api.custom.get_namespaced_custom_object(
        "kubeflow.org", "v1beta1", ns, "experiments", name
    )["status"]
    assert status["trialsFailed"] == 1
    assert api.jobset(ns, trial.name)["status"].get("restarts", 0) == 0
    ended = {
        (p.metadata.labels.get("jobset.sigs.k8s.io/replicatedjob-name"), s.name): (
            s.state.terminated.exit_code
        )
        for p in api.pods(ns)
        for s in p.status.container_statuses or []
        if s.state and s.state.terminated
    }
    refused = [where for where, code in ended.items() if code == 65]
    assert len(refused) == 1, ended  # one program refused it, once
