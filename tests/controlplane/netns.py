"""Run a command (the tier: pytest, or ``python -m tests.controlplane serve``) in a private
network and mount namespace that the tier owns, so its real node can have a pod network.

    python -m tests.controlplane.netns -- COMMAND [ARG...]

re-runs itself under ``unshare --net --mount --propagation private`` and, inside, before it
execs COMMAND:

- brings up ``lo`` (every server of the tier listens on 127.0.0.1, as before) and makes the
  node's bridge ``tunepack0`` with the node IP (``NODE_IP``), on which the CNI bridge plugin
  attaches each pod's veth and the pods get their addresses (``POD_RANGE``); IP forwarding
  on, for this namespace only;
- mounts a tmpfs, seen only in this mount namespace, over the fixed paths that a kubelet,
  containerd and the CNI plugins write to whatever their configuration says (``PRIVATE_DIRS``:
  network namespace handles, CNI's cache, the container log links, containerd's shim sockets),
  so nothing of theirs lands on this machine.

Nothing is added to this machine's own network namespace; the namespace and everything in it
go away when the last process in it exits (every process of the tier dies with the one that
started it). Needs root. Without it (``make test-cluster TIER_NODE=0``) the tier runs on
loopback in the machine's namespace, without the real node (KWOK's nodes only).
"""

from __future__ import annotations

import ctypes
import os
import shutil
import subprocess
import sys

BRIDGE = "tunepack0"
NODE_IP = "10.88.0.1"
NODE_PREFIX = 16
POD_SUBNET = "10.88.0.0/16"
POD_RANGE = ("10.88.1.1", "10.88.255.254")  # 10.88.0.x is the node's
# Services' ClusterIPs: routed to the bridge, where kube-proxy's rules send each to its pods, so
# that the tier's processes (Katib's controller dials each suggestion Service) reach them too.
SERVICE_CIDR = "10.96.0.0/24"
CLUSTER_DNS_IP = "10.96.0.10"  # in SERVICE_CIDR
ENV = "TUNEPACK_TIER_NETNS"  # set inside: the tier may start its real node
PRIVATE_DIRS = ("/run/netns", "/var/lib/cni", "/var/log/containers", "/run/containerd")
MS_NOSUID, MS_NODEV = 2, 4


def inside() -> bool:
    """Whether this process runs in a namespace made by this module."""
    return os.environ.get(ENV) == "1"


def _run(*argv: str) -> None:
    done = subprocess.run(argv, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"netns: {' '.join(argv)} failed: {done.stderr.strip()}")


def _tmpfs(path: str) -> None:
    os.makedirs(path, exist_ok=True)
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.mount(b"tmpfs", path.encode(), b"tmpfs", MS_NOSUID | MS_NODEV, b"mode=0755"):
        err = ctypes.get_errno()
        raise SystemExit(f"netns: mount tmpfs on {path}: {os.strerror(err)}")


def _setup() -> None:
    for path in PRIVATE_DIRS:
        _tmpfs(path)
    _run("ip", "link", "set", "lo", "up")
    _run("ip", "link", "add", BRIDGE, "type", "bridge")
    _run("ip", "addr", "add", f"{NODE_IP}/{NODE_PREFIX}", "dev", BRIDGE)
    _run("ip", "link", "set", BRIDGE, "up")
    _run("ip", "route", "add", SERVICE_CIDR, "dev", BRIDGE, "src", NODE_IP)
    with open("/proc/sys/net/ipv4/ip_forward", "w") as f:
        f.write("1")


def main(argv: list[str]) -> int:
    if argv[:1] == ["--"]:
        argv = argv[1:]
    if not argv:
        print("usage: python -m tests.controlplane.netns -- COMMAND [ARG...]", file=sys.stderr)
        return 2
    if os.geteuid() != 0:
        print("netns: needs root (a network namespace with a bridge)", file=sys.stderr)
        return 2
    if not inside():
        unshare = shutil.which("unshare") or "/usr/bin/unshare"
        os.environ[ENV] = "1"
        os.execv(
            unshare,
            [unshare, "--net", "--mount", "--propagation", "private", "--",
             sys.executable, "-m", "tests.controlplane.netns", "--", *argv],
        )  # fmt: skip
    _setup()
    os.execvp(argv[0], argv)
    return 1  # not reached


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
