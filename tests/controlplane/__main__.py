"""Build, start and stop the control plane (and its real node, as root) by hand.

    python -m tests.controlplane build              # build.sh: build or reuse the binaries
    python -m tests.controlplane up [--dir D]       # start in the background; prints KUBECONFIG
    python -m tests.controlplane shell [--dir D] [CMD]  # CMD (a shell) in the tier's namespaces
    python -m tests.controlplane down [--dir D]     # stop exactly what `up` started
    python -m tests.controlplane serve --dir D      # foreground (what `up` runs)

`up` runs a supervisor that owns every process of the control plane; they die with it, and it
stops by itself after --ttl seconds (default 2 h) so nothing outlives a forgotten session; `up`
in a stopped tier's directory starts afresh (its logs and state are removed). As
root it runs in a network namespace of its own (``netns.py``) with the real node; its servers
and pods are reached from there only: ``shell`` runs a command (or a shell) inside it.
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

from tests.controlplane import netns
from tests.controlplane.cluster import ControlPlane, ControlPlaneError, build
from tests.controlplane.node import NodeError

DEFAULT_DIR = Path(os.environ.get("TMPDIR", "/tmp")) / "tunepack-controlplane"


def serve(root: Path, ttl: float, gates: dict[str, bool], node: bool = True) -> int:
    done = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, lambda *_: done.set())
    cp = ControlPlane(root, feature_gates=gates)
    root.mkdir(parents=True, exist_ok=True)
    if netns.inside():
        (root / "NETNS").write_text(str(os.getpid()))
    try:
        cp.start(node=node)
    except (ControlPlaneError, NodeError) as err:
        print(f"control plane failed to start: {err}", file=sys.stderr)
        return 1
    (root / "READY").write_text(str(cp.kubeconfig) + "\n")
    print(f"control plane up: KUBECONFIG={cp.kubeconfig}", flush=True)
    try:
        done.wait(ttl)
    finally:
        (root / "READY").unlink(missing_ok=True)
        (root / "NETNS").unlink(missing_ok=True)
        cp.stop()
    return 0


def up(root: Path, ttl: float, gates: list[str], node: bool = True) -> int:
    if (root / "serve.pid").exists() and _alive(int((root / "serve.pid").read_text())):
        print(f"already running: KUBECONFIG={root / 'admin.kubeconfig'}")
        return 0
    if root.is_dir() and any(root.iterdir()):
        # A stopped tier's directory: its etcd data, ports and kubeconfigs are stale, and a
        # restart on them fails; nothing in it is reused, so it starts afresh.
        if not (root / "serve.log").exists():
            print(f"--dir {root}: not empty and not a tier's directory; name a new or empty one",
                  file=sys.stderr)  # fmt: skip
            return 2
        print(f"starting afresh in {root} (the tier that ran there has stopped)")
        shutil.rmtree(root)
    root.mkdir(parents=True, exist_ok=True)
    (root / "READY").unlink(missing_ok=True)
    argv = [sys.executable, "-m", "tests.controlplane", "serve", f"--dir={root}", f"--ttl={ttl}"]
    argv += [f"--feature-gate={g}" for g in gates]
    if not node:
        argv.append("--no-node")
    elif os.geteuid() == 0:  # the real node needs the tier's own network namespace
        argv = [sys.executable, "-m", "tests.controlplane.netns", "--", *argv]
    with open(root / "serve.log", "ab") as log:
        proc = subprocess.Popen(
            argv,
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )
    (root / "serve.pid").write_text(str(proc.pid))
    while proc.poll() is None and not (root / "READY").exists():
        time.sleep(0.5)
    if proc.poll() is not None:
        print((root / "serve.log").read_text()[-4000:], file=sys.stderr)
        return 1
    if (root / "NETNS").exists():
        print(f"# in the tier's network namespace: python -m tests.controlplane shell --dir {root}")
    print(f"export KUBECONFIG={root / 'admin.kubeconfig'}")
    return 0


def shell(root: Path, command: list[str]) -> int:
    """Run ``command`` (default: $SHELL) in the running tier's network and mount namespaces,
    with KUBECONFIG set: where its servers, pods and Services can be reached."""
    pidfile = root / "NETNS"
    if not pidfile.exists():
        print(f"no tier with a network namespace runs under {root}", file=sys.stderr)
        return 2
    pid = pidfile.read_text().strip()
    env = {
        "KUBECONFIG": str(root / "admin.kubeconfig"),
        "TUNEPACK_CONTROLPLANE_KUBECONFIG": str(root / "admin.kubeconfig"),
        netns.ENV: "1",
        "TUNEPACK_TIER_IMAGES": "1",  # the node runs tunepack's images
    }
    argv = ["nsenter", f"--target={pid}", "--net", "--mount", f"--wd={os.getcwd()}", "--",
            "env", *(f"{k}={v}" for k, v in env.items()),
            *(command or [os.environ.get("SHELL", "/bin/bash")])]  # fmt: skip
    os.execvp(argv[0], argv)
    return 1


def down(root: Path) -> int:
    pidfile = root / "serve.pid"
    if not pidfile.exists():
        print(f"nothing running under {root}")
        return 0
    pid = int(pidfile.read_text())
    if _alive(pid):
        os.kill(pid, signal.SIGTERM)
        for _ in range(300):
            if not _alive(pid):
                break
            time.sleep(0.1)
    pidfile.unlink()
    print("control plane stopped")
    return 0


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # Our own supervisor, not a recycled PID.
    cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ")
    return b"tests.controlplane" in cmdline and b"serve" in cmdline


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.controlplane", description=__doc__)
    sub = parser.add_subparsers(dest="cmd", required=True)
    sub.add_parser("build")
    for name in ("up", "serve", "down", "shell"):
        p = sub.add_parser(name)
        p.add_argument("--dir", type=Path, default=DEFAULT_DIR)
        if name == "shell":
            p.add_argument("command", nargs="*", help="default: $SHELL")
        if name in ("up", "serve"):
            p.add_argument("--ttl", type=float, default=7200.0)
            p.add_argument("--feature-gate", action="append", default=[], metavar="NAME=BOOL")
            p.add_argument("--no-node", action="store_true", help="KWOK nodes only")
    args = parser.parse_args(argv)
    if args.cmd == "build":
        print(build())
        return 0
    if args.cmd == "shell":
        return shell(args.dir.resolve(), args.command)
    if args.cmd == "down":
        return down(args.dir.resolve())
    if args.cmd == "up":
        return up(args.dir.resolve(), args.ttl, args.feature_gate, not args.no_node)
    gates = {}
    for g in args.feature_gate:
        k, _, v = g.partition("=")
        gates[k] = v.lower() in ("1", "true", "yes")
    return serve(args.dir.resolve(), args.ttl, gates, not args.no_node)


if __name__ == "__main__":
    sys.exit(main())
