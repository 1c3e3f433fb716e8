"""Where the runtimes' images come from (``tunepack install --registry/--tag``) and whether the
cluster can pull them (``tunepack.tools.images.check``, driven here by a fake core API and a fake
clock; the real kubelet's words on the tier's real node: tests/cluster/test_images.py)."""

from __future__ import annotations

import pytest
from kubernetes import client
from kubernetes.client.exceptions import ApiException

from tunepack.core import __version__
from tunepack.core.errors import BadValueError
from tunepack.runtimes.contract import containers, replicated_jobs
from tunepack.tools import images
from tunepack.tools.images import ImageCheck, ImageSource
from tunepack.tools.install import runtime_objects


def _images_of(obj: dict) -> set[str]:
    return {c["image"] for job in replicated_jobs(obj) for c in containers(job)}


def test_the_default_source_is_the_runtimes_own():
    (obj,) = runtime_objects(["tiny-llama3"])
    assert _images_of(obj) == {
        f"ghcr.io/tunepack/{name}:{__version__}"
        for name in ("dataset-initializer", "model-initializer", "trainer")
    }


def test_install_with_a_registry_and_tag_names_them_in_every_container():
    source = ImageSource.parse("registry.example.com:5000/ml/", "0.1.0-rc1")
    (obj,) = runtime_objects(["tiny-llama3"], images=source)
    assert _images_of(obj) == {
        "registry.example.com:5000/ml/dataset-initializer:0.1.0-rc1",
        "registry.example.com:5000/ml/model-initializer:0.1.0-rc1",
        "registry.example.com:5000/ml/trainer:0.1.0-rc1",
    }
    assert images.runtime_images([obj]) == sorted(_images_of(obj))


def test_an_image_that_is_not_tunepacks_is_left_alone():
    (obj,) = runtime_objects(["tiny-llama3"])
    job = replicated_jobs(obj)[0]
    containers(job)[0]["image"] = "my.registry/own/initializer:1"
    images.retarget(obj, ImageSource.parse("r.example/ml", None))
    assert containers(job)[0]["image"] == "my.registry/own/initializer:1"


@pytest.mark.parametrize(
    ("registry", "tag", "message"),
    [
        ("https://registry.example.com/ml", None,
         "--registry 'https://registry.example.com/ml' is not an image registry: expected "
         "host[:port]/path in lower case, such as registry.example.com:5000/ml (no scheme, no "
         "image name, no tag)"),
        ("Registry.example.com/ML", None, "--registry 'Registry.example.com/ML' is not an image"),
        ("registry.example.com/ml:0.1.0", None, "--registry 'registry.example.com/ml:0.1.0' is"),
        (None, "-latest", "--tag '-latest' is not an image tag: letters, digits, '_', '.' and '-'"),
        (None, "a b", "--tag 'a b' is not an image tag"),
    ],
)  # fmt: skip
def test_a_bad_registry_or_tag_is_refused_naming_the_flag(registry, tag, message):
    with pytest.raises(BadValueError) as err:
        ImageSource.parse(registry, tag)
    assert str(err.value).startswith(message)


# --- the pull check ----------------------------------------------------------------------------


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.now += seconds


class Cluster:
    """The core API calls ``check`` makes: nodes (with the images they hold), and probe pods
    whose container state the test sets as a kubelet would, after ``after_reads`` reads."""

    def __init__(self, held=None, states=None, after_reads=1, create_error=None, nodes_error=None):
        self.held, self.states, self.after_reads = held or {}, states or {}, after_reads
        self.create_error, self.nodes_error = create_error, nodes_error
        self.created, self.deleted, self.reads = [], [], {}

    def list_node(self):
        if self.nodes_error:
            raise self.nodes_error
        nodes = [
            client.V1Node(
                metadata=client.V1ObjectMeta(name=node),
                status=client.V1NodeStatus(images=[client.V1ContainerImage(names=names)]),
            )
            for node, names in self.held.items()
        ]
        return client.V1NodeList(items=nodes)

    def create_namespaced_pod(self, namespace, body):
        if self.create_error:
            raise self.create_error
        self.created.append((namespace, body))

    def delete_namespaced_pod(self, name, namespace, grace_period_seconds):
        self.deleted.append(name)

    def read_namespaced_pod(self, name, namespace):
        (body,) = [b for _, b in self.created if b["metadata"]["name"] == name]
        image = body["spec"]["containers"][0]["image"]
        self.reads[image] = self.reads.get(image, 0) + 1
        state, node = None, None
        kind = self.states.get(image)
        if kind and kind != "unschedulable" and self.reads[image] >= self.after_reads:
            node = "gpu-1"
            state = {
                "pull-error": client.V1ContainerState(waiting=client.V1ContainerStateWaiting(
                    reason="ErrImagePull",
                    message=f'failed to pull and unpack image "{image}": not found',
                )),
                "pulling": client.V1ContainerState(
                    waiting=client.V1ContainerStateWaiting(reason="ContainerCreating")
                ),
                "ran": client.V1ContainerState(
                    terminated=client.V1ContainerStateTerminated(exit_code=0)
                ),
            }[kind]  # fmt: skip
        statuses = None
        if state is not None:
            statuses = [client.V1ContainerStatus(
                name="probe", image=image, image_id="", ready=False, restart_count=0, state=state
            )]  # fmt: skip
        conditions = None
        if kind == "unschedulable":
            conditions = [client.V1PodCondition(
                type="PodScheduled", status="False", reason="Unschedulable",
                message="0/2 nodes are available: 2 node(s) had untolerated taint",
            )]  # fmt: skip
        return client.V1Pod(
            metadata=client.V1ObjectMeta(name=name),
            spec=client.V1PodSpec(containers=[], node_name=node),
            status=client.V1PodStatus(
                phase="Pending", container_statuses=statuses, conditions=conditions
            ),
        )


def _check(cluster, refs, timeout=60.0):
    clock = Clock()
    found = images.check(
        cluster, refs, "team", timeout=timeout, poll_interval=2.0, clock=clock, sleep=clock.sleep
    )
    return found, clock


A, B, C = "r.example/ml/dataset-initializer:1", "r.example/ml/trainer:1", "r.example/ml/x:1"


def test_each_image_gets_the_kubelets_verdict_and_the_probes_go():
    cluster = Cluster(
        held={"cpu-1": [A, "r.example/ml/dataset-initializer@sha256:ab"]},
        states={B: "pull-error", C: "ran"},
        after_reads=3,
    )
    found, clock = _check(cluster, [A, B, C])
    assert found == [
        ImageCheck(A, True, "already on node cpu-1"),
        ImageCheck(B, False, f'node gpu-1: ErrImagePull: failed to pull and unpack image "{B}": '
                   "not found"),
        ImageCheck(C, True, "pulled on node gpu-1"),
    ]  # fmt: skip
    assert clock.now == 4.0  # two polls before the kubelet answered, not the whole minute
    probes = [body for _, body in cluster.created]
    assert [p["spec"]["containers"][0]["image"] for p in probes] == [B, C]  # A is held already
    assert sorted(cluster.deleted) == sorted(p["metadata"]["name"] for p in probes)
    (container,) = probes[0]["spec"]["containers"]
    assert container["imagePullPolicy"] == "IfNotPresent"
    assert probes[0]["spec"]["automountServiceAccountToken"] is False
    assert found[1].line() == (
        f'image {B}: NOT PULLABLE (node gpu-1: ErrImagePull: failed to pull and unpack image "{B}"'
        ": not found)"
    )


def test_a_pull_still_going_at_the_deadline_and_an_unplaced_probe_are_said_as_such():
    cluster = Cluster(states={B: "pulling", C: "unschedulable"})
    found, clock = _check(cluster, [B, C], timeout=10.0)
    assert clock.now == 10.0
    assert found == [
        ImageCheck(B, True, "no pull error on node gpu-1 within 10 s (still pulling)"),
        ImageCheck(C, None, "no node took the probe pod within 10 s: 0/2 nodes are available: "
                   "2 node(s) had untolerated taint"),
    ]  # fmt: skip
    assert len(cluster.deleted) == 2


def test_no_permission_for_nodes_or_pods_is_a_check_that_could_not_tell():
    forbidden = ApiException(status=403, reason="Forbidden")
    cluster = Cluster(create_error=forbidden, nodes_error=forbidden)
    (found,), _ = _check(cluster, [B])
    assert found.pullable is None
    assert found.detail.startswith("no probe pod could be created in namespace team: ")
    assert cluster.deleted == []


def test_the_failure_names_each_image_and_the_commands_that_fix_it():
    failed = [ImageCheck(B, False, "node gpu-1: ImagePullBackOff")]
    assert images.failure_message(failed, ImageSource()) == (
        f"the cluster cannot pull 1 of the runtimes' images ({B}: node gpu-1: ImagePullBackOff); "
        "nothing was installed. Push tunepack's images to a registry the nodes pull from (make "
        "push-images REGISTRY=<your registry>) and install naming it (tunepack install "
        "--registry <your registry>; docs/cluster.md, 'Images'), or install anyway with "
        "--no-image-check"
    )
    mine = ImageSource.parse("r.example/ml", None)
    assert "make push-images REGISTRY=r.example/ml)" in images.failure_message(failed, mine)
