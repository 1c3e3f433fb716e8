"""The images tunepack's runtimes run: where they come from, and whether the cluster can pull them.

``retarget`` names a registry of the user's; ``check`` asks the cluster, image by image, since
only a node can pull (a node's ``status.images``, else a short-lived probe Pod, deleted whatever
happens). docs/cluster.md, "Images"."""

from __future__ import annotations

import hashlib
import re
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from tunepack.backends.api_errors import api_message
from tunepack.backends.scheduling import IMAGE_REASONS
from tunepack.core import __version__
from tunepack.core.errors import BadValueError
from tunepack.runtimes.contract import IMAGE_REGISTRY, containers, replicated_jobs

CHECK_TIMEOUT = 60.0  # seconds the probes may take, all together
PROBE_LABEL = "tunepack.dev/image-check"
# A registry as an image reference's prefix: host[:port] then path components (the OCI
# distribution grammar, lower case), no scheme and no tag.
_COMPONENT = r"[a-z0-9]+(?:(?:[._]|__|-+)[a-z0-9]+)*"
_REGISTRY = re.compile(rf"^{_COMPONENT}(?::[0-9]+)?(?:/{_COMPONENT})*$")
_TAG = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.-]{0,127}$")


@dataclass(frozen=True)
class ImageSource:
    """Where the runtimes' images come from: ``<registry>/<image>:<tag>``."""

    registry: str = IMAGE_REGISTRY
    tag: str = __version__

    @classmethod
    def parse(cls, registry: str | None, tag: str | None) -> ImageSource:
        """From ``--registry`` and ``--tag`` (None: the default), each checked once here."""
        if registry is not None:
            registry = registry.rstrip("/")
            if not _REGISTRY.match(registry):
                raise BadValueError(
                    f"--registry {registry!r} is not an image registry: expected "
                    "host[:port]/path in lower case, such as registry.example.com:5000/ml "
                    "(no scheme, no image name, no tag)"
                )
        if tag is not None and not _TAG.match(tag):
            raise BadValueError(
                f"--tag {tag!r} is not an image tag: letters, digits, '_', '.' and '-', "
                "at most 128, not starting with '.' or '-'"
            )
        return cls(registry or IMAGE_REGISTRY, tag or __version__)

    def ref(self, image: str) -> str:
        return f"{self.registry}/{image}:{self.tag}"


def retarget(obj: dict, source: ImageSource) -> dict:
    """``obj`` (a runtime) with each tunepack image taken from ``source``; other images (a
    user's own, from an overlay) are left as they are."""
    prefix = f"{IMAGE_REGISTRY}/"
    for job in replicated_jobs(obj):
        for container in containers(job):
            image = container.get("image") or ""
            if image.startswith(prefix):
                name = image.removeprefix(prefix).split(":", 1)[0]
                container["image"] = source.ref(name)
    return obj


def runtime_images(objects: Iterable[dict]) -> list[str]:
    """Every image the runtimes among ``objects`` run, once each."""
    found = {
        container["image"]
        for obj in objects
        if obj["kind"].endswith("TrainingRuntime")
        for job in replicated_jobs(obj)
        for container in containers(job)
    }
    return sorted(found)


@dataclass(frozen=True)
class ImageCheck:
    image: str
    pullable: bool | None  # None: the check could not tell
    detail: str

    def line(self) -> str:
        verdict = {True: "pullable", False: "NOT PULLABLE", None: "not checked"}[self.pullable]
        return f"image {self.image}: {verdict} ({self.detail})"


def check(
    core_api,
    images: list[str],
    namespace: str,
    *,
    timeout: float = CHECK_TIMEOUT,
    poll_interval: float = 2.0,
    clock: Callable[[], float] = time.monotonic,
    sleep: Callable[[float], None] = time.sleep,
) -> list[ImageCheck]:
    """Whether the cluster's nodes can pull each of ``images`` (see the module's docstring)."""
    results: dict[str, ImageCheck] = {}
    held = _held_by_nodes(core_api)
    for image in images:
        if image in held:
            results[image] = ImageCheck(image, True, f"already on node {held[image]}")
    probes: dict[str, str] = {}  # image -> probe pod
    try:
        for image in images:
            if image in results:
                continue
            try:
                probes[image] = _create_probe(core_api, namespace, image)
            except Exception as err:
                why = api_message(err) or str(err)
                results[image] = ImageCheck(
                    image, None, f"no probe pod could be created in namespace {namespace}: {why}"
                )
        deadline = clock() + timeout
        while probes.keys() - results.keys():
            for image, pod in probes.items():
                if image not in results and (found := _verdict(core_api, namespace, pod, image)):
                    results[image] = found
            if not probes.keys() - results.keys():
                break
            if clock() >= deadline:
                for image, pod in probes.items():
                    if image not in results:
                        results[image] = _undecided(core_api, namespace, pod, image, timeout)
                break
            sleep(poll_interval)
    finally:
        for pod in probes.values():
            _delete_probe(core_api, namespace, pod)
    return [results[image] for image in images]


def failure_message(failed: list[ImageCheck], source: ImageSource) -> str:
    """The one-line error for images the cluster cannot pull, with what to do."""
    shown = "; ".join(f"{c.image}: {c.detail}" for c in failed)
    # The default registry is not published yet: the user needs one of their own.
    registry = "<your registry>" if source.registry == IMAGE_REGISTRY else source.registry
    return (
        f"the cluster cannot pull {len(failed)} of the runtimes' images ({shown}); nothing was "
        f"installed. Push tunepack's images to a registry the nodes pull from (make push-images "
        f"REGISTRY={registry}) and install naming it (tunepack install --registry {registry}; "
        "docs/cluster.md, 'Images'), or install anyway with --no-image-check"
    )


def _held_by_nodes(core_api) -> dict[str, str]:
    """Image reference -> a node that holds it (empty where nodes cannot be listed)."""
    try:
        nodes = core_api.list_node().items
    except Exception:  # no permission to list nodes: the probes decide
        return {}
    held: dict[str, str] = {}
    for node in sorted(nodes, key=lambda n: n.metadata.name):
        for image in (node.status.images if node.status else None) or []:
            for name in image.names or []:
                held.setdefault(name, node.metadata.name)
    return held


def probe_name(image: str) -> str:
    digest = hashlib.sha256(image.encode()).hexdigest()[:10]
    return f"tunepack-image-check-{digest}"


def probe_pod(image: str) -> dict:
    """A Pod that only starts the image's Python, as the runtimes' pods run it."""
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": probe_name(image), "labels": {PROBE_LABEL: "true"}},
        "spec": {
            "restartPolicy": "Never",
            "automountServiceAccountToken": False,
            "terminationGracePeriodSeconds": 0,
            "securityContext": {
                "runAsNonRoot": True,
                "runAsUser": 1000,
                "seccompProfile": {"type": "RuntimeDefault"},
            },
            "containers": [
                {
                    "name": "probe",
                    "image": image,
                    "imagePullPolicy": "IfNotPresent",
                    "command": ["python", "-c", "pass"],
                    "resources": {"requests": {"cpu": "10m", "memory": "64Mi"}},
                    "securityContext": {
                        "allowPrivilegeEscalation": False,
                        "capabilities": {"drop": ["ALL"]},
                    },
                }
            ],
        },
    }


def _create_probe(core_api, namespace: str, image: str) -> str:
    from kubernetes.client.exceptions import ApiException

    name = probe_name(image)
    try:
        core_api.create_namespaced_pod(namespace, probe_pod(image))
    except ApiException as err:
        if err.status != 409:  # 409: left by a check that was interrupted; it tells as well
            raise
    return name


def _delete_probe(core_api, namespace: str, name: str) -> None:
    try:
        core_api.delete_namespaced_pod(name, namespace, grace_period_seconds=0)
    except Exception:  # gone already, or no permission: nothing more to do here
        pass


def _verdict(core_api, namespace: str, pod_name: str, image: str) -> ImageCheck | None:
    """What the probe says so far: None until the kubelet pulled the image or failed to."""
    pod = core_api.read_namespaced_pod(pod_name, namespace)
    status = pod.status
    node = pod.spec.node_name if pod.spec else None
    for container in (status.container_statuses if status else None) or []:
        state = container.state
        if state is None:
            continue
        if state.waiting is not None and state.waiting.reason in IMAGE_REASONS:
            said = (state.waiting.message or "").strip()
            detail = f"node {node}: {state.waiting.reason}" + (f": {said}" if said else "")
            return ImageCheck(image, False, detail)
        if state.running is not None or state.terminated is not None:
            return ImageCheck(image, True, f"pulled on node {node}")
    return None


def _undecided(core_api, namespace: str, pod_name: str, image: str, timeout: float) -> ImageCheck:
    """The verdict when the wait ended first: still pulling, or never placed."""
    try:
        pod = core_api.read_namespaced_pod(pod_name, namespace)
    except Exception as err:
        return ImageCheck(image, None, f"the probe pod could not be read: {api_message(err)}")
    node = pod.spec.node_name if pod.spec else None
    if node:
        return ImageCheck(
            image, True, f"no pull error on node {node} within {timeout:g} s (still pulling)"
        )
    cond = next(
        (
            c
            for c in (pod.status.conditions if pod.status else None) or []
            if c.type == "PodScheduled"
        ),
        None,
    )
    why = f": {cond.message}" if cond is not None and cond.message else ""
    return ImageCheck(image, None, f"no node took the probe pod within {timeout:g} s{why}")
