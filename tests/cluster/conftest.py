"""The real-control-plane tier (``make test-cluster``): fixtures.

One control plane per session (``tests/controlplane``): etcd, kube-apiserver, controller-manager,
scheduler, JobSet and the Kubeflow Trainer with their webhooks, KWOK nodes and one real node.
Set ``TUNEPACK_CONTROLPLANE_KUBECONFIG`` to reuse one started with ``python -m tests.controlplane
up`` (faster when iterating on a test).

Pods go to KWOK's fake nodes (they "succeed" at once: admission and rendering tests) or to the
real node (they run for real): the ``on_kwok`` and ``on_node`` fixtures cordon the other kind.
"""

from __future__ import annotations

import os
import shutil
import tempfile
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
    idempotent, and per test because the install tests delete them). Without the image check,
    which would put probe pods on whichever nodes a test left schedulable: it has its own tests
    (tests/cluster/test_images.py)."""
    done = kube.tunepack("install", "--no-image-check", kubeconfig=controlplane.kubeconfig)
    assert done.returncode == 0, done.stderr
    return done


@pytest.fixture
def on_kwok(api):
    """Pods are scheduled to KWOK's fake nodes only (they complete at once)."""
    api.cordon(node=True)
    yield
    api.cordon(node=False)


@pytest.fixture
def on_node(api):
    """Pods are scheduled to the real node only: they run for real, in tunepack's images, under
    its kubelet and containerd. Skipped where the tier has no node because it runs outside a
    network namespace of its own (no root: ``make test-cluster TIER_NODE=0``); inside one, a
    missing node is an error."""
    from tests.controlplane import netns

    if api.real_node() is None:
        if netns.inside():
            pytest.fail("the tier runs in its network namespace but has no real node")
        pytest.skip("needs the tier's real node: make test-cluster, as root")
    api.cordon(kwok=True)
    yield "kubelet"
    api.cordon(kwok=False)


# The tiny model and dataset for the runs executed for real, in S3 (moto, in the tier's network)
# as a cluster's users keep them: the pods read them with the credentials of the runtimes' default
# Secret, from tunepack's images (which see no host files).
SOURCE_KEYS = {"AWS_ACCESS_KEY_ID": "AKIASOURCESTEST", "AWS_SECRET_ACCESS_KEY": "sources/secret/42"}


@pytest.fixture(scope="session")
def s3_sources():
    import boto3
    from moto.server import ThreadedMotoServer

    from tests.controlplane import netns
    from tunepack.tiny import write_tiny_dataset, write_tiny_model

    # On the node IP when the tier has its own network: the real node's pods reach it there.
    server = ThreadedMotoServer(ip_address=netns.NODE_IP if netns.inside() else "127.0.0.1", port=0)
    server.start()
    host, port = server.get_host_and_port()
    url = f"http://{host}:{port}"
    s3 = boto3.client("s3", endpoint_url=url, region_name="us-east-1", **_lower(SOURCE_KEYS))
    s3.create_bucket(Bucket="sources")
    root = Path(tempfile.mkdtemp(prefix="tunepack-sources-"))
    try:
        write_tiny_model(root / "tiny-llama3")
        write_tiny_dataset(root / "data" / "instructions.jsonl")
        for path in root.rglob("*"):
            if path.is_file():
                s3.upload_file(str(path), "sources", path.relative_to(root).as_posix())
    finally:
        shutil.rmtree(root, ignore_errors=True)
    yield {"url": url, "client": s3}
    server.stop()


def _lower(keys: dict) -> dict:
    return {k.lower(): v for k, v in keys.items()}


@pytest.fixture
def sources(api, namespace, s3_sources):
    """URIs of the tiny model and dataset; their credentials in the namespace's
    ``tunepack-s3-credentials`` Secret, which every tunepack runtime reads."""
    from kubernetes import client as k8s

    env = {**SOURCE_KEYS, "AWS_ENDPOINT_URL": s3_sources["url"], "AWS_REGION": "us-east-1"}
    api.core.create_namespaced_secret(
        namespace,
        k8s.V1Secret(metadata=k8s.V1ObjectMeta(name="tunepack-s3-credentials"), string_data=env),
    )
    return {"model": "s3://sources/tiny-llama3", "dataset": "s3://sources/data/instructions.jsonl"}
