"""Installing the runtimes on the real control plane: admission by the Trainer's webhook, every
kustomization applied with a real kubectl, and upgrading an installed set."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import yaml

from tests.cluster import kube
from tunepack.runtimes import catalog
from tunepack.runtimes.contract import containers, jobset_spec, replicated_jobs
from tunepack.runtimes.store import load_runtime
from tunepack.tools import admission, install

pytestmark = pytest.mark.controlplane

REPO = Path(__file__).resolve().parents[2]
OVERLAYS = sorted(p.parent.name for p in (REPO / "manifests/overlays").glob("*/kustomization.yaml"))
TUNEPACK = "app.kubernetes.io/part-of=tunepack"


def _delete_all_runtimes(cp) -> None:
    for kind in ("clustertrainingruntimes", "trainingruntimes"):
        done = kube.kubectl(
            "delete", kind, "-A", "-l", TUNEPACK, "--wait=true", kubeconfig=cp.kubeconfig
        )
        assert done.returncode == 0, done.stderr


def test_tunepack_install_registers_every_runtime(api, controlplane, installed_runtimes):
    names = {r["metadata"]["name"] for r in api.cluster_runtimes()}
    assert {e.runtime_name for e in catalog.CATALOG.values()} <= names
    # Every object went through the Trainer's validating webhook and the CRD's CEL rules.
    for entry in catalog.CATALOG.values():
        served = api.runtime(entry.runtime_name)
        assert _contains(served["spec"], load_runtime(entry.runtime_name)["spec"])
    lines = installed_runtimes.stdout.strip().splitlines()
    # and the admission policy with its binding (tests/cluster/test_admission.py)
    assert len(lines) == len(catalog.CATALOG) + len(admission.policy_objects())
    for obj in admission.policy_objects():
        assert _contains(_served(api, obj)["spec"], obj["spec"]), obj["kind"]
    # A second install changes nothing and says so.
    again = kube.tunepack("install", "--no-image-check", kubeconfig=controlplane.kubeconfig)
    assert again.returncode == 0, again.stderr
    assert all(line.endswith(" unchanged") for line in again.stdout.strip().splitlines()), (
        again.stdout
    )


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_overlay_applies_with_kubectl(api, controlplane, overlay):
    """``kubectl apply --server-side -k manifests/overlays/<x>`` as docs/cluster.md says."""
    _delete_all_runtimes(controlplane)
    rendered = kube.kubectl(
        "kustomize", str(REPO / "manifests/overlays" / overlay), kubeconfig=controlplane.kubeconfig
    )
    assert rendered.returncode == 0, rendered.stderr
    objects = [o for o in yaml.safe_load_all(rendered.stdout) if o]
    for ns in {o["metadata"].get("namespace") for o in objects} - {None}:
        kube.kubectl("create", "namespace", ns, kubeconfig=controlplane.kubeconfig)
    done = kube.kubectl(
        "apply",
        "--server-side",
        "-k",
        str(REPO / "manifests/overlays" / overlay),
        kubeconfig=controlplane.kubeconfig,
    )
    assert done.returncode == 0, done.stderr
    for obj in objects:
        served = _served(api, obj)
        # The server kept what the overlay asked for (nothing pruned or defaulted away).
        assert _contains(served["spec"], obj["spec"]), obj["metadata"]["name"]
    _delete_all_runtimes(controlplane)


def test_base_applies_and_an_overlay_over_it_is_refused_as_immutable(controlplane):
    """Why upgrades need a re-create: the runtime CRD forbids changing volumeClaimPolicies."""
    _delete_all_runtimes(controlplane)
    base = kube.kubectl(
        "apply",
        "--server-side",
        "-k",
        str(REPO / "manifests/base"),
        kubeconfig=controlplane.kubeconfig,
    )
    assert base.returncode == 0, base.stderr
    over = kube.kubectl(
        "apply",
        "--server-side",
        "-k",
        str(REPO / "manifests/overlays/storage-rwx"),
        kubeconfig=controlplane.kubeconfig,
    )
    assert over.returncode != 0
    assert "immutable" in over.stderr.lower()
    _delete_all_runtimes(controlplane)


def test_tunepack_install_upgrades_a_changed_runtime(api, controlplane, namespace):
    """An installed runtime from an older release (the 0.1.0 layout: volume ``workspace``,
    podGroupPolicy) is replaced by ``tunepack install``; one in use waits for its jobs."""
    _delete_all_runtimes(controlplane)
    old = _old_release(load_runtime("tiny-llama3"))
    created = kube.kubectl(
        "apply",
        "--server-side",
        "-f",
        "-",
        input=yaml.safe_dump(old),
        kubeconfig=controlplane.kubeconfig,
    )
    assert created.returncode == 0, created.stderr
    done = kube.tunepack("install", "--runtime", "tiny-llama3", kubeconfig=controlplane.kubeconfig)
    assert done.returncode == 0, done.stderr
    assert "tunepack-tiny-llama3 replaced" in done.stdout
    served = api.runtime("tunepack-tiny-llama3")
    assert "podGroupPolicy" not in served["spec"]
    claims = jobset_spec(served)["volumeClaimPolicies"][0]["templates"]
    assert claims[0]["metadata"]["name"] == "initializer"
    _delete_all_runtimes(controlplane)


def _served(api, obj: dict) -> dict:
    """The server's copy of a runtime, or of the admission policy or binding."""
    if obj["apiVersion"] == admission.API_VERSION:
        plural = install.PLURALS[obj["kind"]]
        group, version = obj["apiVersion"].split("/")
        return api.custom.get_cluster_custom_object(group, version, plural, obj["metadata"]["name"])
    return api.runtime(obj["metadata"]["name"], obj["metadata"].get("namespace"))


def _old_release(runtime: dict) -> dict:
    old = copy.deepcopy(runtime)
    spec = old["spec"]
    spec["podGroupPolicy"] = {"coscheduling": {"scheduleTimeoutSeconds": 300}}
    js = jobset_spec(old)
    js["volumeClaimPolicies"] = [
        {"templates": copy.deepcopy(js["volumeClaimPolicies"][0]["templates"])}
    ]
    js["volumeClaimPolicies"][0]["templates"][0]["metadata"]["name"] = "workspace"
    for job in replicated_jobs(old):
        for c in containers(job):
            for m in c.get("volumeMounts", []):
                if m["name"] == "initializer":
                    m["name"] = "workspace"
    return old


def _contains(have, want) -> bool:
    """``want`` is a sub-tree of ``have`` (the server may add defaults, never drop fields)."""
    if isinstance(want, dict):
        return isinstance(have, dict) and all(
            k in have and _contains(have[k], v) for k, v in want.items()
        )
    if isinstance(want, list):
        return (
            isinstance(have, list)
            and len(have) == len(want)
            and all(_contains(h, w) for h, w in zip(have, want, strict=True))
        )
    return have == want
