"""The admission policy in the kustomizations: every cluster-wide install (the base and each
overlay, rendered by kubectl's kustomize) carries it and a namespaced one does not. The policy
itself (generated, committed, its messages the vocabulary's words): tests/unit/test_admission.py."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from tests import helpers
from tests.unit.test_admission import ROOT
from tunepack.tools import admission

MANIFESTS = ROOT / "manifests"
KUBECTL = helpers.kubectl()


def _rendered(directory: Path) -> list[dict]:
    done = subprocess.run(
        [KUBECTL, "kustomize", str(directory)], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    return helpers.documents(done.stdout)


@pytest.mark.parametrize(
    "directory",
    [
        "base",
        *(f"overlays/{p.parent.name}" for p in MANIFESTS.glob("overlays/*/kustomization.yaml")),
    ],
)
def test_every_cluster_wide_install_carries_the_policy_and_a_namespaced_one_does_not(directory):
    objects = _rendered(MANIFESTS / directory)
    found = [o for o in objects if o["apiVersion"] == admission.API_VERSION]
    if directory == "overlays/namespaced":  # no cluster-scoped objects in a team's namespace
        assert found == []
        assert all(o["metadata"].get("namespace") == "ml-team" for o in objects)
    else:
        assert found == admission.policy_objects()  # unchanged by every component
