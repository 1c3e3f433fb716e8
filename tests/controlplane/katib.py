"""Katib v0.19 beside the Trainer, for hyperparameter searches whose trials are TrainJobs.

``start(cp)`` runs, from the binaries ``build.sh`` caches (Katib's own Go programs, no Python):

    PostgreSQL (Debian's, in a data directory of its own) -> katib-db-manager (on the node IP:
    the metrics collector in each trial pod reports there) -> Katib's CRDs -> katib-controller
    with its webhooks (Experiment defaulting and validation, the metrics-collector injection
    into trial pods), registered as URL webhooks with this control plane's CA

with tunepack's component for TrainJob trials over those webhooks (``COMPONENT``), and the
``katib-config`` the controller reads: TrainJob trials, the goptuna suggestion service
for ``random`` and ``tpe`` and the StdOut/File metrics collector, both as images ``images.sh``
builds (``IMAGES``), which the real node runs. Only with the real node: a suggestion service
and a trial's metrics collector are pods.

The controller runs as a process, like the other controllers, with what its pod would have
(``podfs``): its serving certificate at the fixed ``/tmp/cert``, and the cluster's DNS in its
``/etc/resolv.conf``, because it dials each Experiment's suggestion Service by name.
"""

from __future__ import annotations

import os
import pwd
import secrets
import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING

import yaml

from tests.controlplane import netns, podfs

if TYPE_CHECKING:
    from tests.controlplane.cluster import ControlPlane

NAMESPACE = "kubeflow"  # the controller's KATIB_CORE_NAMESPACE: its ConfigMap is read there
CERT_DIR = "/tmp/cert"  # fixed in v0.19.0 (pkg/controller.v1beta1/consts: CertDir)
DATABASE = "katib"
DB_USER = "katib"
# The namespace label under which Katib injects its metrics collector into trial pods.
INJECTION_LABEL = "katib.kubeflow.org/metrics-collector-injection"
# The algorithms the tier's Katib serves, all with the goptuna suggestion service (Go): upstream's
# katib-config maps random and tpe to a Python (hyperopt) image instead.
ALGORITHMS = ("random", "tpe")
COMPONENT = Path(__file__).resolve().parents[2] / "manifests/components/katib-trainjob-trials"


def images(version: str) -> dict[str, str]:
    """The images of Katib the node runs, as ``images.sh`` tags them."""
    return {
        "suggestion": f"localhost/tunepack/katib-suggestion-goptuna:{version}",
        "metrics-collector": f"localhost/tunepack/katib-file-metrics-collector:{version}",
    }


def start(cp: ControlPlane) -> None:
    for name in ("katib_postgres", "katib_db_manager", "katib_webhook", "katib_health"):
        cp.ports[name] = next(cp.free_ports)
    password = secrets.token_urlsafe(18)  # in this process's memory and the children's env only
    _postgres(cp, password)
    _db_manager(cp, password)
    crds = cp.files("katib", "manifests/v1beta1/components/crd")
    for name in ("experiment.yaml", "suggestion.yaml", "trial.yaml"):
        cp.kubectl("apply", "--server-side", "-f", str(crds / name))
    cp.kubectl("wait", "--for=condition=Established", "--timeout=60s", "crd", "--all")
    _controller(cp)


def _postgres(cp: ControlPlane, password: str) -> None:
    """A database of the tier's own: initdb into a fresh directory, served on 127.0.0.1 only.

    PostgreSQL refuses to run as root: it runs as Debian's ``postgres`` user, in a directory
    under /tmp (the tier's root is private to root); removed when the tier stops."""
    bindir = _postgres_bin()
    user = pwd.getpwnam("postgres")
    data = Path(tempfile.mkdtemp(prefix="tunepack-katib-pg-"))
    cp.cleanups.append(lambda: shutil.rmtree(data, ignore_errors=True))
    os.chown(data, user.pw_uid, user.pw_gid)
    pwfile = data / "pw"
    pwfile.write_text(password)
    os.chown(pwfile, user.pw_uid, user.pw_gid)
    as_postgres = ["setpriv", f"--reuid={user.pw_uid}", f"--regid={user.pw_gid}", "--clear-groups"]
    with open(cp.logs / "katib-initdb.log", "w") as log:
        subprocess.run(
            [
                *as_postgres,
                bindir / "initdb",
                "-D",
                data / "db",
                "-U",
                DB_USER,
                f"--pwfile={pwfile}",
                "--auth-host=scram-sha-256",
                "--auth-local=peer",
                "--no-sync",
                "-E",
                "UTF8",
            ],  # fmt: skip
            stdout=log,
            stderr=subprocess.STDOUT,
            check=True,
        )
    pwfile.unlink()
    port = cp.ports["katib_postgres"]
    proc = cp._spawn(
        "katib-postgres",
        [
            *as_postgres,
            "--pdeathsig=TERM",
            bindir / "postgres",
            "-D",
            data / "db",
            "-c",
            "listen_addresses=127.0.0.1",
            "-c",
            f"port={port}",
            "-c",
            f"unix_socket_directories={data}",
            "-c",
            "fsync=off",
        ],  # fmt: skip
    )
    env = {**os.environ, "PGPASSWORD": password}

    def created() -> bool:
        made = subprocess.run(
            [bindir / "createdb", "-h", "127.0.0.1", "-p", str(port), "-U", DB_USER, DATABASE],
            env=env,
            capture_output=True,
            text=True,
        )
        return made.returncode == 0 or "already exists" in made.stderr

    cp._wait(proc, created, f"database {DATABASE!r} created")


def _postgres_bin() -> Path:
    found = sorted(Path("/usr/lib/postgresql").glob("*/bin/postgres"))
    if not found:
        raise FileNotFoundError("PostgreSQL is not installed: run make node-runtime (apt-get)")
    return found[-1].parent


def _db_manager(cp: ControlPlane, password: str) -> None:
    from tests.controlplane.cluster import _tcp_open_at

    port = cp.ports["katib_db_manager"]
    proc = cp._spawn(
        "katib-db-manager",
        [cp.binary("katib", "katib-db-manager"), f"--listen-address={netns.NODE_IP}:{port}"],
        env={
            "DB_NAME": "postgres",
            "DB_USER": DB_USER,
            "DB_PASSWORD": password,
            "KATIB_POSTGRESQL_DB_HOST": "127.0.0.1",
            "KATIB_POSTGRESQL_DB_PORT": str(cp.ports["katib_postgres"]),
            "KATIB_POSTGRESQL_DB_DATABASE": DATABASE,
        },
    )
    cp._wait(proc, lambda: _tcp_open_at(netns.NODE_IP, port), "its gRPC port open")


def config(cp: ControlPlane) -> dict:
    """The KatibConfig: TrainJob trials only, no certificate generator (the tier's CA signs the
    webhook certificate), the tier's images, pulled never (the node has them imported)."""
    from tests.controlplane.cluster import versions

    tagged = images(versions()["KATIB_VERSION"])
    return {
        "apiVersion": "config.kubeflow.org/v1beta1",
        "kind": "KatibConfig",
        "init": {
            "certGenerator": {"enable": False},
            "controller": {
                "webhookPort": cp.ports["katib_webhook"],
                "healthzAddr": f"127.0.0.1:{cp.ports['katib_health']}",
                "metricsAddr": "0",
                "trialResources": ["TrainJob.v1alpha1.trainer.kubeflow.org"],
                "enableLeaderElection": False,
            },
        },
        "runtime": {
            "metricsCollectors": [
                {"kind": kind, "image": tagged["metrics-collector"], "imagePullPolicy": "Never"}
                for kind in ("StdOut", "File")
            ],
            "suggestions": [
                {"algorithmName": name, "image": tagged["suggestion"], "imagePullPolicy": "Never"}
                for name in ALGORITHMS
            ],
        },
    }


def _controller(cp: ControlPlane) -> None:
    from tests.controlplane.cluster import _http_ok, _tcp_open

    katib_config = config(cp)
    text = yaml.safe_dump(katib_config)
    path = cp.root / "katib-config.yaml"
    path.write_text(text)
    cp.kubectl(
        "apply",
        "--server-side",
        "-f",
        "-",
        input=yaml.safe_dump_all(
            [
                {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": NAMESPACE}},
                {
                    "apiVersion": "v1",
                    "kind": "ConfigMap",
                    "metadata": {"name": "katib-config", "namespace": NAMESPACE},
                    "data": {"katib-config.yaml": text},
                },
            ]
        ),
    )
    certdir = cp.root / "katib-certs"
    certdir.mkdir(exist_ok=True)
    shutil.copy(cp.pki_dir / "katib-webhook.crt", certdir / "tls.crt")
    shutil.copy(cp.pki_dir / "katib-webhook.key", certdir / "tls.key")
    # What a pod's /etc holds for a Go program: the cluster's DNS (CoreDNS on the node IP) with
    # the pod search path, so "<suggestion>.<namespace>:6789" resolves as in a pod.
    etc = cp.root / "katib-etc"
    etc.mkdir(exist_ok=True)
    (etc / "resolv.conf").write_text(
        f"nameserver {netns.NODE_IP}\n"
        f"search {NAMESPACE}.svc.cluster.local svc.cluster.local cluster.local\noptions ndots:5\n"
    )
    (etc / "hosts").write_text("127.0.0.1 localhost\n")
    (etc / "nsswitch.conf").write_text("hosts: files dns\n")
    argv = [
        cp.binary("katib", "katib-controller"),
        f"--katib-config={path}",
        f"--kubeconfig={cp.kubeconfig_for('katib')}",
    ]
    proc = cp._spawn(
        "katib-controller",
        podfs.wrap(argv, {CERT_DIR: str(certdir), "/etc": str(etc)}, cp.root / "katib-podfs"),
        env={
            "KATIB_CORE_NAMESPACE": NAMESPACE,
            # Its trial pods' metrics collectors report to the db-manager process on the node IP.
            "KATIB_DB_MANAGER_SERVICE_IP": netns.NODE_IP,
            "KATIB_DB_MANAGER_SERVICE_NAMESPACE": "",
            "KATIB_DB_MANAGER_SERVICE_PORT": str(cp.ports["katib_db_manager"]),
        },
    )
    health = f"http://127.0.0.1:{cp.ports['katib_health']}/readyz"
    cp._wait(
        proc,
        lambda: _http_ok(health) and _tcp_open(cp.ports["katib_webhook"]),
        "readyz (webhook server started)",
    )
    cp._register_webhooks("katib", _webhooks(cp), cp.ports["katib_webhook"])


def _webhooks(cp: ControlPlane) -> str:
    """Katib's webhook configurations with tunepack's component for TrainJob trials over them
    (``manifests/components``), as a real kustomize renders them for an MLOps engineer."""
    work = cp.root / "katib-webhooks"
    work.mkdir(exist_ok=True)
    shutil.copy(cp.files("katib", "manifests/v1beta1/components/webhook/webhooks.yaml"), work)
    kustomization = {
        "apiVersion": "kustomize.config.k8s.io/v1beta1",
        "kind": "Kustomization",
        "resources": ["webhooks.yaml"],
        "components": [os.path.relpath(COMPONENT, work)],
    }
    (work / "kustomization.yaml").write_text(yaml.safe_dump(kustomization))
    return cp.kubectl("kustomize", str(work)).stdout
