"""One real Kubernetes node for the tier: containerd + runc, the kubelet, the bridge CNI plugins,
kube-proxy and CoreDNS, all as processes of the tier in its private network namespace
(``netns.py``).

    containerd (Debian's, CRI)  <-  kubelet (k8s.io/kubernetes, NODE_NAME, node IP on the bridge)
        pod sandboxes: bridge + host-local + loopback CNI plugins -> pod IPs in POD_RANGE
    kube-proxy (nftables): Services' ClusterIPs -> endpoints (the Trainer's status server, DNS)
    CoreDNS (kubernetes plugin): <svc>.<ns>.svc and the JobSet's pod names, at CLUSTER_DNS_IP

tunepack's images reach containerd from this machine's container storage (``podman save`` into
``ctr images import``; no registry), into a containerd root kept in the cache so that an image
is imported again only when its ID changed. The pods' sandbox image is ``pause/main.go``.

``Node(cp).start()`` needs the control plane up (``cp.kubeconfig_for``); ``stop()`` kills what
containerd's shims run (they outlive containerd by design) by the PIDs its task list gives, then
the shims themselves, found by the socket address of this containerd only.
"""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

import yaml

from tests.controlplane import netns

NODE_NAME = "tunepack-node"
# The label the tests select (and cordon) this node by, as KWOK's nodes by theirs.
NODE_LABEL = "tunepack.dev/node"
PAUSE_IMAGE = "localhost/tunepack/pause"
CONTAINERD_NAMESPACE = "k8s.io"  # where the CRI plugin keeps its images
DNS_DOMAIN = "cluster.local"
IMAGES_HINT = "make images-local"


def cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "tunepack" / "node"


class NodeError(RuntimeError):
    pass


class Node:
    def __init__(self, cp, images: list[str]):
        self.cp = cp
        self.images = list(images)
        self.root = cp.root / "node"
        self.socket = self.root / "containerd.sock"
        self.containerd_root = cache_dir() / "containerd"

    # --- lifecycle --------------------------------------------------------------------------

    def start(self) -> None:
        if not netns.inside():
            raise NodeError("the real node runs only in the tier's network namespace (netns.py)")
        self.root.mkdir(parents=True, exist_ok=True)
        self._lock_store()
        for name in ("kubelet", "kubelet_healthz", "proxy_healthz", "proxy_metrics",
                     "coredns_ready", "coredns_health"):  # fmt: skip
            self.cp.ports[name] = next(self.cp.free_ports)
        self._containerd()
        self._import_images()
        self._cluster_services()
        self._coredns()
        self._kube_proxy()
        self._kubelet()

    def stop(self) -> None:
        """The kubelet first (it would start sandboxes again), then every container (their shims
        would outlive containerd), then the shims; the tier stops containerd and the rest."""
        for proc in self.cp.processes:
            if proc.name == "kubelet" and proc.popen.poll() is None:
                proc.popen.terminate()
                try:
                    proc.popen.wait(20)
                except subprocess.TimeoutExpired:
                    proc.popen.kill()
                    proc.popen.wait()
        if not self.socket.exists():
            return
        try:
            tasks = self._ctr("tasks", "list", "-q", check=False).stdout.split()
            for task in tasks:
                self._ctr("tasks", "kill", "-s", "SIGKILL", "--all", task, check=False)
        except (OSError, subprocess.SubprocessError):
            pass
        deadline = time.monotonic() + 10
        for pid in self._shims():
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        while self._shims() and time.monotonic() < deadline:
            time.sleep(0.2)

    def _lock_store(self) -> None:
        """One node at a time on the image store in the cache: two containerds on one root
        would corrupt it. The lock goes with this process."""
        self.containerd_root.mkdir(parents=True, exist_ok=True)
        self._lock = open(self.containerd_root.parent / "containerd.lock", "w")  # noqa: SIM115
        try:
            fcntl.flock(self._lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise NodeError(
                f"another tier's node uses {self.containerd_root}: stop it first "
                "(python -m tests.controlplane down, or wait for its make test-cluster)"
            ) from None

    def _shims(self) -> list[int]:
        """The PIDs of containerd-shim processes started by this node's containerd."""
        mine = str(self.socket).encode()
        pids = []
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit():
                continue
            try:
                argv = (entry / "cmdline").read_bytes().split(b"\0")
            except OSError:
                continue
            if argv and b"containerd-shim" in argv[0] and mine in argv:
                pids.append(int(entry.name))
        return pids

    # --- containerd -------------------------------------------------------------------------

    def _ctr(self, *args: str, check: bool = True, **kw) -> subprocess.CompletedProcess:
        return subprocess.run(
            ["ctr", f"--address={self.socket}", f"--namespace={CONTAINERD_NAMESPACE}", *args],
            capture_output=True, text=True, check=check, **kw,
        )  # fmt: skip

    def _containerd(self) -> None:
        if shutil.which("containerd") is None:
            raise NodeError("containerd is not installed: run make images-local (apt-get)")
        cni_bin = self.cp.binary("cni-plugins", "bridge").parent
        (self.root / "cni").mkdir(exist_ok=True)
        (self.root / "cni" / "10-tunepack.conflist").write_text(json.dumps(self.cni_config()))
        self.containerd_root.mkdir(parents=True, exist_ok=True)
        config = self.root / "containerd.toml"
        config.write_text(
            f"""version = 2
root = "{self.containerd_root}"
state = "{self.root / "containerd-state"}"
disabled_plugins = ["io.containerd.snapshotter.v1.btrfs", "io.containerd.snapshotter.v1.zfs",
  "io.containerd.snapshotter.v1.devmapper", "io.containerd.snapshotter.v1.aufs",
  "io.containerd.tracing.processor.v1.otlp", "io.containerd.internal.v1.tracing"]
[grpc]
  address = "{self.socket}"
[ttrpc]
  address = "{self.socket}.ttrpc"
[debug]
  address = ""
[metrics]
  address = ""
[plugins."io.containerd.internal.v1.opt"]
  path = "{self.root / "opt"}"
[plugins."io.containerd.grpc.v1.cri"]
  sandbox_image = "{self.pause_image}"
  # The host denies lowering oom_score_adj (no CAP_SYS_RESOURCE): without this every sandbox
  # fails in runc ("can't get final child's PID from pipe: EOF").
  restrict_oom_score_adj = true
  enable_selinux = false
  disable_apparmor = true
  [plugins."io.containerd.grpc.v1.cri".containerd]
    snapshotter = "overlayfs"
    default_runtime_name = "runc"
    [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc]
      runtime_type = "io.containerd.runc.v2"
  [plugins."io.containerd.grpc.v1.cri".cni]
    bin_dir = "{cni_bin}"
    conf_dir = "{self.root / "cni"}"
    max_conf_num = 1
"""
        )
        proc = self.cp._spawn("containerd", ["containerd", f"--config={config}"])
        self.cp._wait(
            proc,
            lambda: self._ctr("version", check=False, timeout=5).returncode == 0,
            "containerd answering",
        )

    def cni_config(self) -> dict:
        return {
            "cniVersion": "1.0.0",
            "name": "tunepack",
            "plugins": [
                {
                    "type": "bridge",
                    "bridge": netns.BRIDGE,
                    "isGateway": True,
                    "hairpinMode": True,
                    "ipam": {
                        "type": "host-local",
                        "dataDir": str(self.root / "ipam"),
                        "ranges": [
                            [
                                {
                                    "subnet": netns.POD_SUBNET,
                                    "rangeStart": netns.POD_RANGE[0],
                                    "rangeEnd": netns.POD_RANGE[1],
                                    "gateway": netns.NODE_IP,
                                }
                            ]
                        ],
                        "routes": [{"dst": "0.0.0.0/0"}],
                    },
                }
            ],
        }

    @property
    def pause_image(self) -> str:
        return f"{PAUSE_IMAGE}:{self.cp.binary('pause', 'pause').parent.name.split('@')[1]}"

    def _podman_id(self, image: str) -> str | None:
        done = subprocess.run(
            ["podman", "image", "inspect", "--format", "{{.Id}}", image],
            capture_output=True, text=True, check=False,
        )  # fmt: skip
        return done.stdout.strip() or None

    def _pause_into_podman(self) -> None:
        if self._podman_id(self.pause_image):
            return
        src = self.cp.binary("pause", "pause").parent
        tar = subprocess.Popen(["tar", "-C", str(src), "-c", "pause"], stdout=subprocess.PIPE)
        subprocess.run(
            ["podman", "import", "--change", 'ENTRYPOINT ["/pause"]', "--change", "USER 65535",
             "-", self.pause_image],
            stdin=tar.stdout, capture_output=True, check=True,
        )  # fmt: skip
        tar.wait()

    def _import_images(self) -> None:
        """Each image from podman's storage into containerd's, unless containerd has that ID
        under that name already (a marker per name in its root); images no longer wanted are
        removed, so the root holds one set."""
        self._pause_into_podman()
        marker = self.containerd_root / "tunepack-images.json"
        have = json.loads(marker.read_text()) if marker.exists() else {}
        want = {}
        for image in [self.pause_image, *self.images]:
            image_id = self._podman_id(image)
            if image_id is None:
                missing = f"image {image} is not in this machine's storage"
                raise NodeError(f"{missing}: run {IMAGES_HINT}")
            want[image] = image_id
            listed = self._ctr("images", "list", "-q", f"name=={_full(image)}").stdout.split()
            if have.get(image) == image_id and listed:
                continue
            started = time.monotonic()
            save = subprocess.Popen(
                ["podman", "save", "--format", "docker-archive", image],
                stdout=subprocess.PIPE, stderr=subprocess.PIPE,
            )  # fmt: skip
            done = self._ctr("images", "import", "-", stdin=save.stdout, check=False)
            save.wait()
            if save.returncode or done.returncode:
                raise NodeError(f"importing {image} into containerd failed: {done.stderr}")
            have[image] = image_id
            marker.write_text(json.dumps(have))
            print(f"node: imported {image} in {time.monotonic() - started:.0f} s", flush=True)
        # The CRI names each image also by its ID (sha256:...): an old ID's name would keep the
        # old image's layers (GBs for the trainer) after its tag moved on.
        keep = {_full(i) for i in want} | {f"sha256:{i}" for i in want.values()}
        for name in self._ctr("images", "list", "-q").stdout.split():
            if name not in keep:
                self._ctr("images", "rm", name, check=False)
        marker.write_text(json.dumps(want))

    # --- cluster DNS and Services -----------------------------------------------------------

    def _cluster_services(self) -> None:
        """kube-dns (its ClusterIP is the kubelet's clusterDNS) with CoreDNS's address on the
        bridge as its endpoint; the Trainer's Service gets the Trainer process's address."""
        from tests.controlplane.cluster import TRAINER_NAMESPACE, TRAINER_SERVICE

        dns_ports = [
            {"name": "dns", "port": 53, "protocol": "UDP"},
            {"name": "dns-tcp", "port": 53, "protocol": "TCP"},
        ]
        objects = [
            {
                "apiVersion": "v1",
                "kind": "Service",
                "metadata": {"name": "kube-dns", "namespace": "kube-system"},
                "spec": {"clusterIP": netns.CLUSTER_DNS_IP, "ports": dns_ports},
            },
            _endpoints("kube-system", "kube-dns", dns_ports),
        ]
        trainer = self.cp.kubectl(
            "get", "service", TRAINER_SERVICE, "-n", TRAINER_NAMESPACE, "-o", "json"
        )
        ports = [
            {"name": p["name"], "port": p.get("targetPort", p["port"]), "protocol": "TCP"}
            for p in json.loads(trainer.stdout)["spec"]["ports"]
        ]
        objects.append(_endpoints(TRAINER_NAMESPACE, TRAINER_SERVICE, ports))
        self.cp.kubectl("apply", "--server-side", "-f", "-", input=yaml.safe_dump_all(objects))

    def _coredns(self) -> None:
        corefile = self.root / "Corefile"
        kubeconfig = self.cp.kubeconfig_for("coredns")
        corefile.write_text(
            f""".:53 {{
    bind {netns.NODE_IP}
    ready 127.0.0.1:{self.cp.ports["coredns_ready"]}
    health 127.0.0.1:{self.cp.ports["coredns_health"]}
    errors
    cache 5
    kubernetes {DNS_DOMAIN} in-addr.arpa ip6.arpa {{
        kubeconfig {kubeconfig} tunepack-cp
        pods insecure
        fallthrough in-addr.arpa ip6.arpa
        ttl 5
    }}
}}
"""
        )
        proc = self.cp._spawn("coredns", [self.cp.binary("coredns", "coredns"), "-conf", corefile])
        ready = f"http://127.0.0.1:{self.cp.ports['coredns_ready']}/ready"
        from tests.controlplane.cluster import _http_ok

        self.cp._wait(proc, lambda: _http_ok(ready), "CoreDNS ready")

    def _kube_proxy(self) -> None:
        config = self.root / "kube-proxy.yaml"
        config.write_text(
            yaml.safe_dump(
                {
                    "apiVersion": "kubeproxy.config.k8s.io/v1alpha1",
                    "kind": "KubeProxyConfiguration",
                    "clientConnection": {"kubeconfig": str(self.cp.kubeconfig_for("kube-proxy"))},
                    "hostnameOverride": NODE_NAME,
                    "mode": "nftables",
                    "clusterCIDR": netns.POD_SUBNET,
                    "bindAddress": netns.NODE_IP,
                    "healthzBindAddress": f"127.0.0.1:{self.cp.ports['proxy_healthz']}",
                    "metricsBindAddress": f"127.0.0.1:{self.cp.ports['proxy_metrics']}",
                    # Leave the kernel's conntrack settings alone: they are not this
                    # namespace's to change.
                    "conntrack": {
                        "maxPerCore": 0,
                        "min": 0,
                        "tcpEstablishedTimeout": "0s",
                        "tcpCloseWaitTimeout": "0s",
                    },
                }
            )
        )
        proxy = self.cp.binary("kubernetes", "kube-proxy")
        self.cp._spawn("kube-proxy", [proxy, f"--config={config}", "--v=1"])

    # --- the kubelet ------------------------------------------------------------------------

    def _kubelet(self) -> None:
        resolv = self.root / "resolv.conf"
        resolv.write_text("")  # pods get only the cluster DNS (no upstream is reachable)
        serving = self.cp.ca.issue(
            "kubelet", common_name=NODE_NAME, sans=(netns.NODE_IP, NODE_NAME), server=True
        )
        config = self.root / "kubelet.yaml"
        config.write_text(
            yaml.safe_dump(
                {
                    "apiVersion": "kubelet.config.k8s.io/v1beta1",
                    "kind": "KubeletConfiguration",
                    "containerRuntimeEndpoint": f"unix://{self.socket}",
                    "address": netns.NODE_IP,
                    "port": self.cp.ports["kubelet"],
                    "readOnlyPort": 0,
                    "healthzBindAddress": "127.0.0.1",
                    "healthzPort": self.cp.ports["kubelet_healthz"],
                    "tlsCertFile": str(serving.cert),
                    "tlsPrivateKeyFile": str(serving.key),
                    # The apiserver's client certificate (logs, exec) is the only caller.
                    "authentication": {
                        "anonymous": {"enabled": False},
                        "webhook": {"enabled": False},
                        "x509": {"clientCAFile": str(self.cp.ca.ca.cert)},
                    },
                    "authorization": {"mode": "AlwaysAllow"},
                    "clusterDNS": [netns.CLUSTER_DNS_IP],
                    "clusterDomain": DNS_DOMAIN,
                    "resolvConf": str(resolv),
                    "cgroupDriver": "cgroupfs",
                    # This host mounts cgroups v1 and v2 side by side (hybrid), which the kubelet
                    # refuses unless told; and the tier makes no pod cgroup hierarchy of its own
                    # on this machine (no per-pod limits: the machine is not the tier's).
                    "failCgroupV1": False,
                    "cgroupsPerQOS": False,
                    "enforceNodeAllocatable": [],
                    "failSwapOn": False,
                    "podLogsDir": str(self.root / "pod-logs"),
                    "volumePluginDir": str(self.root / "volume-plugins"),
                    # The disk is shared with the rest of the machine: never evict the tier's
                    # pods or delete tunepack's images for it.
                    "evictionHard": {
                        "memory.available": "100Mi",
                        "nodefs.available": "1%",
                        "imagefs.available": "1%",
                    },
                    "imageGCHighThresholdPercent": 100,
                    "imageGCLowThresholdPercent": 99,
                    "serializeImagePulls": False,
                    "registerNode": True,
                    "nodeStatusUpdateFrequency": "5s",
                    "shutdownGracePeriod": "0s",
                    "syncFrequency": "10s",
                }
            )
        )
        proc = self.cp._spawn(
            "kubelet",
            [
                self.cp.binary("kubernetes", "kubelet"),
                f"--config={config}",
                f"--kubeconfig={self.cp.kubeconfig_for('kubelet')}",
                f"--root-dir={self.root / 'kubelet'}",
                f"--cert-dir={self.root / 'kubelet-pki'}",
                f"--hostname-override={NODE_NAME}",
                f"--node-ip={netns.NODE_IP}",
                f"--node-labels={NODE_LABEL}=kubelet",
                "--v=1",
            ],
        )
        self.cp._wait(proc, self._ready, "the kubelet's node Ready", timeout=180)

    def _ready(self) -> bool:
        out = self.cp.kubectl(
            "get", "node", NODE_NAME, "-o",
            "jsonpath={.status.conditions[?(@.type=='Ready')].status}", check=False,
        )  # fmt: skip
        return out.returncode == 0 and out.stdout.strip() == "True"


def _ctr_at(tier_root: Path, *args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(
        ["ctr", f"--address={tier_root / 'node' / 'containerd.sock'}",
         f"--namespace={CONTAINERD_NAMESPACE}", *args],
        capture_output=True, text=True, check=check, timeout=120,
    )  # fmt: skip


def tag_image(tier_root: Path, image: str, name: str) -> None:
    """Give an image of the node another name (as a push to another registry would)."""
    _ctr_at(tier_root, "images", "tag", "--force", _full(image), _full(name))


def untag_image(tier_root: Path, name: str) -> None:
    """Remove one name of an image of the node (the image stays under its other names)."""
    _ctr_at(tier_root, "images", "rm", _full(name), check=False)


def task_pid(tier_root: Path, container_id: str) -> int:
    """The PID (in this machine's PID namespace) of a container's main process on the node of
    the tier under ``tier_root``, from a pod status's ``containerd://<id>``."""
    cid = container_id.removeprefix("containerd://")
    for line in _ctr_at(tier_root, "tasks", "list").stdout.splitlines()[1:]:
        fields = line.split()
        if fields and fields[0] == cid:
            return int(fields[1])
    raise NodeError(f"container {cid} has no running task on the node")


def _full(image: str) -> str:
    """containerd's name for an image reference (docker.io/library/ for bare names)."""
    first = image.split("/")[0]
    if "/" not in image:
        return f"docker.io/library/{image}"
    if "." not in first and ":" not in first and first != "localhost":
        return f"docker.io/{image}"
    return image


def _endpoints(namespace: str, service: str, ports: list[dict]) -> dict:
    """An EndpointSlice of a selectorless Service: a process of the tier, at the node IP."""
    return {
        "apiVersion": "discovery.k8s.io/v1",
        "kind": "EndpointSlice",
        "metadata": {
            "name": f"{service}-tier",
            "namespace": namespace,
            "labels": {
                "kubernetes.io/service-name": service,
                "endpointslice.kubernetes.io/managed-by": "tier.tunepack.dev",
            },
        },
        "addressType": "IPv4",
        "endpoints": [{"addresses": [netns.NODE_IP], "conditions": {"ready": True}}],
        "ports": ports,
    }
