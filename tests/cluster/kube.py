"""Small helpers over the Kubernetes client for the control-plane tier."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import yaml
from kubernetes import client, config
from kubernetes.client.exceptions import ApiException

GROUP, VERSION = "trainer.kubeflow.org", "v1alpha1"
JOBSET_GROUP, JOBSET_VERSION = "jobset.x-k8s.io", "v1alpha2"
NODE_LABEL = "tunepack.dev/node"  # the real kubelet's node (tests/controlplane/node.py)
KWOK_LABEL = "type"


@dataclass
class Attached:
    """A control plane someone else started (``python -m tests.controlplane up``)."""

    kubeconfig: Path

    def stop(self) -> None:
        pass


def tier_root(controlplane) -> Path:
    """The directory of the running control plane (its logs, the node's files)."""
    root = getattr(controlplane, "root", None)
    if root is None:  # attached to one started with `python -m tests.controlplane up`
        root = Path(controlplane.kubeconfig).parent
    return Path(root)


def local_image_id(image: str) -> str:
    """The ID of an image in this machine's container storage, as a kubelet reports it."""
    done = subprocess.run(
        ["podman", "image", "inspect", "--format", "{{.Id}}", image],
        capture_output=True, text=True, check=True, timeout=60,
    )  # fmt: skip
    return f"sha256:{done.stdout.strip()}"


def tunepack(*args: str, kubeconfig: Path, timeout: float = 300, env: dict | None = None):
    """Run the ``tunepack`` CLI as a user would, against this control plane."""
    exe = Path(sys.executable).with_name("tunepack")
    return subprocess.run(
        [str(exe), *args],
        env={**os.environ, "KUBECONFIG": str(kubeconfig), **(env or {})},
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def training_client(namespace: str):
    """tunepack's ``TrainingClient`` on this control plane, as a notebook makes it. The kubeconfig
    is named: the Kubernetes client reads ``$KUBECONFIG`` once, when it is first imported."""
    from kubeflow.common.types import KubernetesBackendConfig

    from tunepack import TrainingClient

    cfg = KubernetesBackendConfig(namespace=namespace, config_file=os.environ["KUBECONFIG"])
    return TrainingClient(cfg)


def kubectl(*args: str, kubeconfig: Path, input: str | None = None, timeout: float = 120):
    exe = shutil.which("kubectl", path=os.path.dirname(sys.executable)) or "kubectl"
    return subprocess.run(
        [exe, f"--kubeconfig={kubeconfig}", *args],
        input=input,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def create(obj: dict, namespace: str, *, kubeconfig: Path, dry_run: bool = False):
    """``kubectl create -f -`` of one object, as a user applies YAML (the CompletedProcess)."""
    extra = ["--dry-run=server"] if dry_run else []
    return kubectl(
        "create", "-n", namespace, *extra, "-f", "-",
        input=yaml.safe_dump(obj), kubeconfig=kubeconfig,
    )  # fmt: skip


class Api:
    def __init__(self, kubeconfig: Path):
        self.kubeconfig = Path(kubeconfig)
        self.client = config.new_client_from_config(str(kubeconfig))
        self.core = client.CoreV1Api(self.client)
        self.batch = client.BatchV1Api(self.client)
        self.custom = client.CustomObjectsApi(self.client)

    # --- namespaces and nodes -------------------------------------------------------------

    def create_namespace(self, name: str) -> None:
        self.core.create_namespace(client.V1Namespace(metadata=client.V1ObjectMeta(name=name)))
        # Pods need the namespace's default ServiceAccount (the controller-manager makes it).
        wait_for(lambda: self._has_default_sa(name), 30, f"ServiceAccount default in {name}")

    def _has_default_sa(self, namespace: str) -> bool:
        try:
            self.core.read_namespaced_service_account("default", namespace)
            return True
        except ApiException as err:
            if err.status == 404:
                return False
            raise

    def delete_namespace(self, name: str) -> None:
        try:
            self.core.delete_namespace(name)
        except ApiException as err:
            if err.status != 404:
                raise

    def cordon(self, *, kwok: bool | None = None, node: bool | None = None) -> None:
        """Mark each kind of node (un)schedulable: KWOK's, the real kubelet's."""
        for item in self.core.list_node().items:
            labels = item.metadata.labels or {}
            for wanted, matches in (
                (kwok, labels.get(KWOK_LABEL) == "kwok"),
                (node, labels.get(NODE_LABEL) == "kubelet"),
            ):
                if wanted is not None and matches:
                    self.core.patch_node(item.metadata.name, {"spec": {"unschedulable": wanted}})

    def real_node(self) -> str | None:
        """The real kubelet's node, if the tier runs one."""
        nodes = self.core.list_node(label_selector=f"{NODE_LABEL}=kubelet").items
        return nodes[0].metadata.name if nodes else None

    # --- Trainer objects --------------------------------------------------------------------

    def create_trainjob(self, obj: dict, namespace: str) -> dict:
        return self.custom.create_namespaced_custom_object(
            GROUP, VERSION, namespace, "trainjobs", obj
        )

    def trainjob(self, namespace: str, name: str) -> dict:
        return self.custom.get_namespaced_custom_object(
            GROUP, VERSION, namespace, "trainjobs", name
        )

    def jobset(self, namespace: str, name: str) -> dict:
        return self.custom.get_namespaced_custom_object(
            JOBSET_GROUP, JOBSET_VERSION, namespace, "jobsets", name
        )

    def runtime(self, name: str, namespace: str | None = None) -> dict:
        if namespace:
            return self.custom.get_namespaced_custom_object(
                GROUP, VERSION, namespace, "trainingruntimes", name
            )
        return self.custom.get_cluster_custom_object(
            GROUP, VERSION, "clustertrainingruntimes", name
        )

    def cluster_runtimes(self) -> list[dict]:
        return self.custom.list_cluster_custom_object(GROUP, VERSION, "clustertrainingruntimes")[
            "items"
        ]

    def wait_jobset(self, namespace: str, name: str, timeout: float = 60) -> dict:
        return wait_for(
            lambda: _get_or_none(lambda: self.jobset(namespace, name)),
            timeout,
            f"JobSet {namespace}/{name}",
            diagnose=lambda: self.diagnose(namespace, name),
        )

    def wait_finished(self, namespace: str, name: str, timeout: float = 120) -> str:
        """Wait until the TrainJob is Complete or Failed; returns which."""

        def finished():
            status = self.trainjob(namespace, name).get("status") or {}
            for cond in status.get("conditions") or []:
                if cond["type"] in ("Complete", "Failed") and cond["status"] == "True":
                    return cond["type"]
            return None

        return wait_for(
            finished,
            timeout,
            f"TrainJob {namespace}/{name} to finish",
            diagnose=lambda: self.diagnose(namespace, name),
        )

    def condition(self, namespace: str, name: str, type_: str) -> dict | None:
        status = self.trainjob(namespace, name).get("status") or {}
        return next((c for c in status.get("conditions") or [] if c["type"] == type_), None)

    # --- pods and events --------------------------------------------------------------------

    def pods(self, namespace: str, selector: str = "") -> list:
        return self.core.list_namespaced_pod(namespace, label_selector=selector).items

    def events(self, namespace: str) -> list[str]:
        return [
            f"{e.involved_object.kind}/{e.involved_object.name}: {e.reason}: {e.message}"
            for e in self.core.list_namespaced_event(namespace).items
        ]

    def diagnose(self, namespace: str, name: str) -> str:
        """What a person would look at when a TrainJob is stuck."""
        lines = []
        for what, get in (
            ("TrainJob status", lambda: self.trainjob(namespace, name).get("status")),
            ("JobSet status", lambda: self.jobset(namespace, name).get("status")),
        ):
            try:
                lines.append(f"{what}: {json.dumps(get(), indent=1)[:3000]}")
            except ApiException as err:
                lines.append(f"{what}: {err.status} {err.reason}")
        for pod in self.pods(namespace):
            statuses = [
                (s.name, s.state.to_dict() if s.state else None)
                for s in pod.status.container_statuses or []
            ]
            lines.append(
                f"pod {pod.metadata.name} on {pod.spec.node_name}: {pod.status.phase} {statuses}"
            )
        lines += self.events(namespace)[-30:]
        return "\n".join(lines)


def watch_exit_codes(api: Api, namespace: str, pod: str, timeout: int = 300) -> dict:
    """Container name -> exit code of ``pod`` as they terminate, filled in by a watch thread
    (a deleted pod's last status is gone once it is, so it must be seen as it happens)."""
    import threading

    from kubernetes import watch

    codes: dict = {}

    def run():
        stream = watch.Watch().stream(
            api.core.list_namespaced_pod,
            namespace,
            field_selector=f"metadata.name={pod}",
            timeout_seconds=timeout,
        )
        for event in stream:
            for status in event["object"].status.container_statuses or []:
                if status.state and status.state.terminated:
                    codes[status.name] = status.state.terminated.exit_code
            if event["type"] == "DELETED":
                return

    threading.Thread(target=run, daemon=True).start()
    return codes


def wait_for(fn, timeout: float, what: str, interval: float = 0.5, diagnose=None):
    """Poll ``fn`` until it returns something truthy; fail with ``diagnose()`` on timeout."""
    deadline = time.monotonic() + timeout
    while True:
        value = fn()
        if value:
            return value
        if time.monotonic() > deadline:
            detail = diagnose() if diagnose else ""
            raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}\n{detail}")
        time.sleep(interval)


def _get_or_none(fn):
    try:
        return fn()
    except ApiException as err:
        if err.status == 404:
            return None
        raise


def env_of(container_: dict) -> dict:
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in container_.get("env") or []}
