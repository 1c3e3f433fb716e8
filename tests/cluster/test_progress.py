"""Live progress through the real Trainer (its ``TrainJobStatus`` feature gate, on in the tier).

The Trainer's trainjobstatus plugin gives the trainer pod the status server's URL (its
Service's name, which cluster DNS and kube-proxy route to the Trainer), a CA and a projected
service-account token of the TrainJob's audience; the trainer posts progress, ETA and metrics
there; the Trainer's status server checks the token against the apiserver's OIDC discovery and
writes ``status.trainerStatus``, from which ``kubectl``, ``tunepack status``, ``tunepack jobs``
and the notebook's progress bar read it. (Without the gate: tests/integration/
test_sdk_kubernetes.py.)
"""

from __future__ import annotations

import json
import threading
import urllib.parse

import pytest
import requests
import yaml

from tests.cluster import kube
from tests.cluster.test_run import RUN_TIMEOUT, TINY, _volume

pytestmark = pytest.mark.controlplane

SERVICE = "kubeflow-trainer-controller-manager.kubeflow-system.svc"


def _watch_trainer_status(api, namespace: str, name: str, timeout: int = RUN_TIMEOUT) -> list:
    """Every distinct ``status.trainerStatus`` of the TrainJob, in order, filled in by a watch
    thread (each status write is one watch event, so no post in between is missed)."""
    from kubernetes import watch

    seen: list[dict] = []

    def run():
        stream = watch.Watch().stream(
            api.custom.list_namespaced_custom_object,
            kube.GROUP,
            kube.VERSION,
            namespace,
            "trainjobs",
            field_selector=f"metadata.name={name}",
            timeout_seconds=timeout,
        )
        for event in stream:
            status = (event["object"].get("status") or {}).get("trainerStatus")
            if status and (not seen or seen[-1] != status):
                seen.append(status)
            if event["type"] == "DELETED":
                return

    threading.Thread(target=run, daemon=True).start()
    return seen


def _metrics(status: dict) -> dict[str, str]:
    return {m["name"]: m["value"] for m in status.get("metrics") or []}


def test_progress_reaches_trainjob_status_and_every_reader(
    api, controlplane, namespace, installed_runtimes, on_node, sources, capsys
):
    from tunepack import FineTune, Initializer

    client = kube.training_client(namespace)
    name = client.train(
        runtime=TINY,
        initializer=Initializer(dataset=sources["dataset"], model=sources["model"]),
        trainer=FineTune(method="lora", epochs=1, val_fraction=0.1, eval_every_steps=10),
    )
    seen = _watch_trainer_status(api, namespace, name)

    # The notebook's way: wait with a progress bar (tqdm on stderr outside Jupyter).
    job = client.wait_for_job_status(name, timeout=RUN_TIMEOUT, progress=True)
    assert job.status == "Complete", api.diagnose(namespace, name)
    bar = capsys.readouterr().err

    # What the Trainer's plugin gave the trainer pod: the status server by its Service's name
    # (cluster DNS gives its ClusterIP, which kube-proxy routes to the Trainer process), with a
    # CA and a token for this TrainJob only.
    (pod,) = api.pods(namespace, "jobset.sigs.k8s.io/replicatedjob-name=node")
    env = {e.name: e.value for e in pod.spec.containers[0].env}
    url = urllib.parse.urlsplit(env["KUBEFLOW_TRAINER_SERVER_URL"])
    assert (url.scheme, url.hostname) == ("https", SERVICE)
    assert (
        url.path
        == f"/apis/trainer.kubeflow.org/v1alpha1/namespaces/{namespace}/trainjobs/{name}/status"
    )
    service = api.core.read_namespaced_service(*SERVICE.split(".")[:2])
    assert service.spec.cluster_ip.startswith("10.96."), service.spec
    assert pod.spec.node_name == api.real_node() and pod.status.pod_ip.startswith("10.88.")
    token_volume = next(v for v in pod.spec.volumes if v.name == "kubeflow-trainer-token")
    (audience,) = {
        s.service_account_token.audience
        for s in token_volume.projected.sources
        if s.service_account_token
    }

    # Progress while it ran (the first post, after step 1) and at the end, as the watch saw it.
    assert len(seen) >= 2, seen
    first, final = seen[0], seen[-1]
    assert 0 < first["progressPercentage"] < 100 and first["estimatedRemainingSeconds"] >= 0
    assert "loss" in _metrics(first) and "tokens_per_second" in _metrics(first)
    percents = [s["progressPercentage"] for s in seen]
    assert percents == sorted(percents)
    assert final["progressPercentage"] == 100 and final["estimatedRemainingSeconds"] == 0
    metrics = _metrics(final)
    assert {"loss", "val_loss", "val_perplexity", "tokens_per_second", "step"} <= set(metrics)
    result = json.loads((_volume(api, namespace, name) / "output" / "result.json").read_text())
    assert int(metrics["step"]) == result["steps"]
    assert float(metrics["loss"]) == pytest.approx(result["final_loss"], abs=1e-6)
    assert float(metrics["val_loss"]) == pytest.approx(result["val_loss"], abs=1e-6)
    assert float(metrics["tokens_per_second"]) > 0

    # kubectl shows it on the TrainJob.
    shown = kube.kubectl(
        "get",
        "trainjob",
        name,
        "--namespace",
        namespace,
        "-o",
        "yaml",
        kubeconfig=controlplane.kubeconfig,
    )
    assert shown.returncode == 0, shown.stderr
    assert yaml.safe_load(shown.stdout)["status"]["trainerStatus"] == final

    # tunepack status and tunepack jobs read it from there.
    status = kube.tunepack(
        "status", name, "--namespace", namespace, kubeconfig=controlplane.kubeconfig
    )
    assert status.returncode == 0, status.stderr
    line = (
        f"  progress 100%  loss {float(metrics['loss']):.4f}  "
        f"val_loss {float(metrics['val_loss']):.4f}  "
        f"{float(metrics['tokens_per_second']):.0f} tokens/s"
    )
    assert line in status.stdout.splitlines(), status.stdout
    jobs = kube.tunepack("jobs", "--namespace", namespace, kubeconfig=controlplane.kubeconfig)
    assert jobs.returncode == 0, jobs.stderr
    header, *rows = [row.split() for row in jobs.stdout.splitlines()]
    assert header[4] == "PROGRESS"
    assert [row[5] for row in rows if row[0] == name] == ["100%"]

    # The notebook: the SDK's job carries it, and the bar ended at 100/100 with both losses.
    progress = client.get_job(name).progress
    assert (progress.percent, progress.step) == (100, result["steps"])
    assert progress.loss == pytest.approx(float(metrics["loss"]))
    assert progress.val_loss == pytest.approx(float(metrics["val_loss"]))
    assert progress.tokens_per_second == pytest.approx(float(metrics["tokens_per_second"]))
    assert " 100/100 [" in bar and f"loss={float(metrics['loss']):.4f}" in bar, bar
    assert f"val_loss={float(metrics['val_loss']):.4f}" in bar, bar

    assert audience.endswith(f"/namespaces/{namespace}/trainjobs/{name}/status"), audience
    # The status server checks who posts (the Trainer's own code, against the apiserver's OIDC
    # discovery): no token, or a token of another audience, is refused; the trainer's own
    # audience is this TrainJob's.
    ca = api.core.read_namespaced_config_map(f"{name}-tls-config", namespace).data["ca.crt"]
    ca_file = kube.tier_root(controlplane) / f"status-ca-{namespace}.crt"
    ca_file.write_text(ca)
    loopback = f"https://127.0.0.1:{url.port}{url.path}"
    body = {"trainerStatus": {"progressPercentage": 1}}
    refused = requests.post(loopback, json=body, verify=str(ca_file), timeout=10)
    assert refused.status_code == 403, refused.text
    other = _token(controlplane, namespace, audience="someone-else")
    refused = requests.post(
        loopback,
        json=body,
        headers={"Authorization": f"Bearer {other}"},
        verify=str(ca_file),
        timeout=10,
    )
    assert refused.status_code == 403, refused.text
    assert api.trainjob(namespace, name)["status"]["trainerStatus"] == final

    # The trainer never failed to post (it would log it and train on).
    logs = "\n".join(client.get_job_logs(name))
    assert "progress update to" not in logs, logs[-3000:]


def _token(controlplane, namespace: str, audience: str) -> str:
    done = kube.kubectl(
        "create", "token", "default", "--namespace", namespace, f"--audience={audience}",
        kubeconfig=controlplane.kubeconfig,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()
