"""Kueue beside the Trainer, as its install runs it, out of a cluster like the other controllers.

``start(cp)`` installs Kueue's CRDs, runs its controller manager (the binary ``build.sh`` built
against this tier's Trainer API) with only the TrainJob integration, serving its webhooks on
127.0.0.1 with this control plane's CA, and registers the webhooks that integration and Kueue's
own objects need. Nothing else changes for a TrainJob without ``kueue.x-k8s.io/queue-name``:
Kueue manages only labelled jobs (``manageJobsWithoutQueueName`` stays off).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import yaml

from tests.controlplane import podfs

if TYPE_CHECKING:
    from tests.controlplane.cluster import ControlPlane

NAMESPACE = "kueue-system"
METRICS_CERT_DIR = "/etc/kueue/metrics/certs"  # cmd/kueue/main.go
FRAMEWORK = "trainer.kubeflow.org/trainjob"
# The webhook paths of that integration and of Kueue's own kinds (its manifest also has the
# pod, Job, Deployment, ... hooks: unserved when their integration is off, and failurePolicy
# Fail would then refuse every such object).
_WEBHOOK_PATHS = ("trainer-kubeflow-org-v1alpha1-trainjob", "-kueue-x-k8s-io-")


def start(cp: ControlPlane) -> None:
    from tests.controlplane.cluster import _http_ok, _tcp_open

    for crd in sorted(cp.files("kueue", "config/components/crd/bases").glob("*.yaml")):
        cp.kubectl("apply", "--server-side", "-f", str(crd))
    cp.kubectl("wait", "--for=condition=Established", "--timeout=60s", "crd", "--all")
    cp.kubectl("create", "namespace", NAMESPACE)

    config, certdir = cp.controller_config(
        "kueue",
        "config.kueue.x-k8s.io/v1beta2",
        namespace=NAMESPACE,
        integrations={"frameworks": [FRAMEWORK]},
        # The on-demand visibility API is an aggregated apiserver on every interface.
        featureGates={"VisibilityOnDemand": False},
    )
    argv = [
        cp.binary("kueue", "kueue"),
        f"--config={config}",
        f"--kubeconfig={cp.kubeconfig_for('kueue')}",
        "--zap-log-level=info",
    ]
    # Without its own certificate management Kueue reads a metrics certificate from a fixed
    # path, even with metrics off: its pod mounts one there, and so does podfs (privately).
    proc = cp._spawn(
        "kueue", podfs.wrap(argv, {METRICS_CERT_DIR: certdir}, cp.root / "kueue-podfs")
    )
    health = f"http://127.0.0.1:{cp.ports['kueue_health']}/readyz"
    cp._wait(
        proc,
        lambda: _http_ok(health) and _tcp_open(cp.ports["kueue_webhook"]),
        "readyz (webhook server started)",
    )
    hooks = cp.files("kueue", "config/components/webhook/manifests.yaml").read_text()
    cp._register_webhooks("kueue", _only_served(hooks), cp.ports["kueue_webhook"])


def _only_served(rendered: str) -> str:
    docs = []
    for doc in yaml.load_all(rendered, Loader=yaml.CSafeLoader):
        if not doc:
            continue
        doc["webhooks"] = [
            h
            for h in doc.get("webhooks", [])
            if any(p in h["clientConfig"]["service"]["path"] for p in _WEBHOOK_PATHS)
        ]
        docs.append(doc)
    return yaml.safe_dump_all(docs)
