"""A TrainJob that exports its result, on the real control plane with the pods executed.

The export settings travel in the TrainJob's runtimePatches (accepted by the Trainer's webhook),
the rendered JobSet holds the exporter after `node`, the JobSet completes only after the exporter
ran, the exporter's credentials come from a Secret by reference, and the exported result in S3
(moto on loopback) is the one on the job's volume, which `Result.download()` fetches back.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.cluster import kube
from tunepack.runtimes.contract import container, replicated_job

pytestmark = pytest.mark.controlplane

TINY = "tunepack-tiny-llama3"
KEYS = {"AWS_ACCESS_KEY_ID": "AKIAEXPORTTEST", "AWS_SECRET_ACCESS_KEY": "export/secret/0123456"}


@pytest.fixture(scope="module")
def s3(s3_sources):
    """The tier's S3 (moto on loopback) with a bucket for the results."""
    s3_sources["client"].create_bucket(Bucket="results")
    return s3_sources


def test_a_trainjob_exports_to_s3_after_training(
    api, namespace, installed_runtimes, on_node, sources, s3, tmp_path, monkeypatch
):
    from kubernetes import client as k8s

    from tunepack import FineTune, Initializer

    env = {**KEYS, "AWS_ENDPOINT_URL": s3["url"], "AWS_REGION": "us-east-1"}
    api.core.create_namespaced_secret(
        namespace,
        k8s.V1Secret(metadata=k8s.V1ObjectMeta(name="export-creds"), string_data=env),
    )
    client = kube.training_client(namespace)
    name = client.train(
        runtime=TINY,
        initializer=Initializer(dataset=sources["dataset"], model=sources["model"]),
        trainer=FineTune(
            method="lora",
            max_steps=4,
            export="s3://results/cluster/run",
            export_secret="export-creds",
        ),
    )
    js = api.wait_jobset(namespace, name)
    exporter = replicated_job(js, "exporter")
    assert exporter["dependsOn"] == [{"name": "node", "status": "Complete"}]
    variables = {v["name"]: v for v in container(exporter, "exporter")["env"]}
    assert variables["EXPORT_URI"]["value"] == "s3://results/cluster/run"
    # The patch's Secret reference replaced the runtime's default one; no value in the JobSet.
    assert variables["AWS_SECRET_ACCESS_KEY"]["valueFrom"]["secretKeyRef"]["name"] == (
        "export-creds"
    )
    assert KEYS["AWS_SECRET_ACCESS_KEY"] not in json.dumps(js)

    job = client.wait_for_job_status(name, timeout=600)
    assert job.status == "Complete", api.diagnose(namespace, name)
    # The JobSet (so the TrainJob) completed only once the exporter's Pod had succeeded.
    exporters = [p for p in api.pods(namespace) if p.metadata.name.startswith(f"{name}-exporter")]
    assert exporters and all(p.status.phase == "Succeeded" for p in exporters)

    listed = s3["client"].list_objects_v2(Bucket="results", Prefix="cluster/run/")
    keys = sorted(o["Key"].removeprefix("cluster/run/") for o in listed.get("Contents", []))
    assert "tunepack-manifest.json" in keys and "adapter/adapter_model.safetensors" in keys

    pvc = api.core.read_namespaced_persistent_volume_claim(f"initializer-{name}", namespace)
    output = Path(api.core.read_persistent_volume(pvc.spec.volume_name).spec.host_path.path)
    output /= "output"
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    result = client.result(name)
    assert result.export == "s3://results/cluster/run"
    got = result.download(tmp_path / "got")
    for rel in ("adapter/adapter_model.safetensors", "adapter/adapter_config.json", "result.json"):
        assert (got / rel).read_bytes() == (output / rel).read_bytes(), rel
    loss = json.loads((got / "result.json").read_text())
    assert loss["final_loss"] < loss["first_loss"]
