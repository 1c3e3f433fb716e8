"""The real-control-plane tier (``make test-cluster``): fixtures.

One control plane per session (``tests/controlplane``): etcd, kube-apiserver, controller-manager,
scheduler, JobSet and the Kubeflow Trainer with their webhooks, KWOK nodes and the pod executor.
Set ``TUNEPACK_CONTROLPLANE_KUBECONFIG`` to reuse one started with ``python -m tests.controlplane
up`` (faster when iterating on a test).

Pods go to KWOK's fake nodes (they "succeed" at once: admission and rendering tests) or to the
executor's node (they run for real): the ``nodes`` fixture cordons one kind or the other.
"""

from __future__ import annotations

import os
import uuid
from pathlib import Path

import pytest

from tests.cluster import kube


@pytest.fixture(scope="session")
def controlplane(tmp_path_factory):
    """A running control plane; KUBECONFIG points at it for the whole session."""
    external = os.environ.get("TUNEPACK_CONTROLPLANE_KUBECONFIG")
    if external:
        cp = kube.Attached(Path(external))
    else:
        from tests.controlplane.cluster import ControlPlane

        root = Path(os.environ.get("TUNEPACK_CONTROLPLANE_DIR") or tmp_path_factory.mktemp("cp"))
        cp = ControlPlane(root).start()
    old = os.environ.get("KUBECONFIG")
    os.environ["KUBECONFIG"] = str(cp.kubeconfig)
    try:
        yield cp
    finally:
        if old is None:
            os.environ.pop("KUBECONFIG", None)
        else:
            os.environ["KUBECONFIG"] = old
        if not external:
            cp.stop()


@pytest.fixture(scope="session")
def api(controlplane):
    return kube.Api(controlplane.kubeconfig)


@pytest.fixture
def namespace(api):
    """A fresh namespace per test (deleted afterwards unless the test failed: kept to look at)."""
    name = f"t-{uuid.uuid4().hex[:8]}"
    api.create_namespace(name)
    yield name
    api.delete_namespace(name)


@pytest.fixture
def installed_runtimes(api, controlplane):
    """Every tunepack runtime, installed with ``tunepack install`` (the CLI, as a user would;
    idempotent, and per test because the install tests delete them)."""
    done = kube.tunepack("install", kubeconfig=controlplane.kubeconfig)
    assert done.returncode == 0, done.stderr
    return done


@pytest.fixture
def on_kwok(api):
    """Pods are scheduled to KWOK's fake nodes only (they complete at once)."""
    api.cordon(executor=True)
    yield
    api.cordon(executor=False)


@pytest.fixture
def on_executor(api):
    """Pods are scheduled to the executor's node only (they run for real)."""
    api.cordon(kwok=True)
    yield
    api.cordon(kwok=False)
