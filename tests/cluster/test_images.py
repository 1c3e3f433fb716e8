"""The runtimes' images from another registry, on the real control plane: ``tunepack install
--registry`` checks with the nodes that the images can be pulled (the real kubelet answers
ErrImagePull, then ImagePullBackOff, for an image no registry it reaches has) and refuses
to install what they cannot pull; a TrainJob on runtimes installed from another registry
completes in those images.

The images get the other registry's name with ``podman tag`` and, on the real node, ``ctr images
tag`` (the tier reaches no registry), so these tests need the
images (``TUNEPACK_TIER_IMAGES=1``, as ``make test-cluster`` runs).
"""

from __future__ import annotations

import os
import subprocess

import pytest

from tests.cluster import kube
from tunepack.core import __version__
from tunepack.runtimes.contract import IMAGE_REGISTRY
from tunepack.tools.images import PROBE_LABEL

pytestmark = [
    pytest.mark.controlplane,
    pytest.mark.skipif(
        os.environ.get("TUNEPACK_TIER_IMAGES") != "1",
        reason="needs tunepack's images in local storage (TUNEPACK_TIER_IMAGES=1)",
    ),
]

IMAGES = ("dataset-initializer", "model-initializer", "trainer")
OTHER, TAG = "registry.tier.test:5000/team", "tier"  # only `podman tag` gives images this name
RUN_TIMEOUT = 600


def _podman(*args: str) -> None:
    subprocess.run(["podman", *args], check=True, capture_output=True, timeout=120)


@pytest.fixture
def other_registry(api, controlplane, on_node):
    """tunepack's images also named ``OTHER/<image>:TAG``, as if pushed there: in the local
    storage and in the real node's containerd (whose kubelet then lists them in the node's
    ``status.images``)."""
    from tests.controlplane import node

    root = kube.tier_root(controlplane)
    for image in IMAGES:
        ours, theirs = f"{IMAGE_REGISTRY}/{image}:{__version__}", f"{OTHER}/{image}:{TAG}"
        _podman("tag", ours, theirs)
        node.tag_image(root, ours, theirs)
    kube.wait_for(
        lambda: _node_holds(api, f"{OTHER}/trainer:{TAG}"), 120, "the kubelet to list them"
    )
    yield
    # Only the names given here go: `podman untag IMAGE` alone would remove every name of the
    # image, the runtimes' own included, from the storage other runs share.
    for image in IMAGES:
        _podman("untag", f"{IMAGE_REGISTRY}/{image}:{__version__}", f"{OTHER}/{image}:{TAG}")
        node.untag_image(root, f"{OTHER}/{image}:{TAG}")


def _node_holds(api, ref: str) -> bool:
    name = api.real_node()
    return any(ref in (i.names or []) for i in api.core.read_node(name).status.images or [])


def _install(controlplane, namespace, *args):
    return kube.tunepack(
        "install", "--namespace", namespace, "--runtime", "tiny-llama3", *args,
        kubeconfig=controlplane.kubeconfig,
    )  # fmt: skip


def test_install_refuses_images_the_nodes_cannot_pull(api, controlplane, namespace, on_node):
    done = _install(controlplane, namespace, "--registry", "registry.invalid/none")
    assert done.returncode == 65, done.stderr
    refs = [f"registry.invalid/none/{image}:{__version__}" for image in IMAGES]
    lines = done.stdout.splitlines()
    assert [line.split(": ", 1)[0] for line in lines] == [f"image {ref}" for ref in refs]
    for line in lines:
        assert ": NOT PULLABLE (node " in line, line
        assert "ErrImagePull" in line or "ImagePullBackOff" in line, line
    assert done.stderr.startswith(
        f"tunepack: error: the cluster cannot pull 3 of the runtimes' images ({refs[0]}: node "
    )
    assert done.stderr.rstrip("\n").endswith(
        "nothing was installed. Push tunepack's images to a registry the nodes pull from (make "
        "push-images REGISTRY=registry.invalid/none) and install naming it (tunepack install "
        "--registry registry.invalid/none; docs/cluster.md, 'Images'), or install anyway with "
        "--no-image-check"
    )
    assert done.stderr.count("\n") == 1  # one line, no traceback
    assert (
        api.custom.list_namespaced_custom_object(
            "trainer.kubeflow.org", "v1alpha1", namespace, "trainingruntimes"
        )["items"]
        == []
    )
    # The probes are gone (deleted with grace 0: the node finalizes them at once).
    kube.wait_for(lambda: not api.pods(namespace, PROBE_LABEL), 60, "the probes to be deleted")


def test_a_trainjob_completes_from_runtimes_installed_from_another_registry(
    api, controlplane, namespace, sources, other_registry
):
    done = _install(controlplane, namespace, "--registry", OTHER, "--tag", TAG)
    assert done.returncode == 0, done.stderr
    refs = [f"{OTHER}/{image}:{TAG}" for image in IMAGES]
    # The kubelet lists its images in the node's status: no probe pod is needed.
    node = api.real_node()
    assert done.stdout.splitlines()[:3] == [
        f"image {ref}: pullable (already on node {node})" for ref in refs
    ]
    assert "trainingruntime.trainer.kubeflow.org/tunepack-tiny-llama3 created" in done.stdout

    from tunepack import FineTune, Initializer

    client = kube.training_client(namespace)
    name = client.train(
        runtime="tunepack-tiny-llama3",  # the namespace's TrainingRuntime comes first
        initializer=Initializer(dataset=sources["dataset"], model=sources["model"]),
        trainer=FineTune(method="lora", epochs=1),
    )
    job = client.wait_for_job_status(name, timeout=RUN_TIMEOUT)
    assert job.status == "Complete", api.diagnose(namespace, name)
    # Each step's pod named the other registry's image and ran that image (by its ID). The
    # status's `image` is not compared: containerd reports one of the image's names, any one.
    ran = {}
    for pod in api.pods(namespace):
        if (pod.metadata.labels or {}).get(PROBE_LABEL):
            continue
        (spec,) = pod.spec.containers
        (status,) = pod.status.container_statuses
        ran[spec.image] = status.image_id
    assert ran == {ref: kube.local_image_id(ref) for ref in refs}
