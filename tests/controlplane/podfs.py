"""Start a control-plane program with the files its Deployment's pod would have, and no more.

In a cluster the Kubeflow Trainer runs in a pod: the kubelet mounts its service-account volume
at ``/var/run/secrets/kubernetes.io/serviceaccount`` (``token``, ``ca.crt``, ``namespace``) and
its webhook Secret at ``/tmp/k8s-webhook-server/serving-certs``, and the Trainer reads both from
those fixed paths (its status server finds the OIDC issuer in the token, its operator namespace
in ``namespace``, its serving certificate in the Secret's directory). Here it runs as a process,
so ``wrap`` gives it those files the way a kubelet would, in a mount namespace of its own:

    unshare --mount --propagation private -- python -I -S podfs.py SPEC -> exec the program

Inside, each missing mount point is made in a private overlay of the existing directory above
it (``/run``, ``/tmp``; the overlays' writable layers on a tmpfs only this namespace sees), and
each source directory is bind-mounted there read-only. Nothing is created on this machine: the
service-account path there would make every Kubernetes client on it believe it runs in a pod.
The program is exec'd in place (same PID, the parent-death signal kept), so stopping it is
signalling that PID, as before.

This file runs as the namespace's first program with ``python -I -S``: standard library only.
"""

from __future__ import annotations

import ctypes
import json
import os
import shutil
import sys
from pathlib import Path

MS_RDONLY, MS_REMOUNT, MS_BIND, MS_REC = 1, 32, 4096, 16384


def wrap(argv: list[str], mounts: dict[str, str], workdir: Path) -> list[str]:
    """The command line that runs ``argv`` with each ``mounts`` source directory (value) at its
    target path (key), in a private mount namespace; ``workdir`` holds the spec (and is where
    the overlays' tmpfs is mounted, in that namespace only)."""
    workdir.mkdir(parents=True, exist_ok=True)
    (workdir / "layers").mkdir(exist_ok=True)
    spec = workdir / "podfs.json"
    spec.write_text(
        json.dumps(
            {
                "argv": [str(a) for a in argv],
                "mounts": {str(k): str(v) for k, v in mounts.items()},
                "layers": str(workdir / "layers"),
            }
        )
    )
    unshare = shutil.which("unshare") or "/usr/bin/unshare"
    return [unshare, "--mount", "--propagation", "private", "--",
            sys.executable, "-I", "-S", str(Path(__file__).resolve()), str(spec)]  # fmt: skip


def _mount(source, target, fstype, flags, data=None) -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    enc = lambda v: None if v is None else str(v).encode()  # noqa: E731
    if libc.mount(enc(source), enc(target), enc(fstype), flags, enc(data)):
        err = ctypes.get_errno()
        raise OSError(err, f"mount {fstype or 'bind'} on {target}: {os.strerror(err)}")


def _missing_chain(path: str) -> tuple[list[str], str]:
    """The missing components of ``path``, outermost first, and the deepest one that exists."""
    chain = []
    while not os.path.lexists(path):
        chain.append(path)
        path = os.path.dirname(path)
    return chain[::-1], path


def _setup(spec: dict) -> None:
    # Sources first, as O_PATH descriptors: an overlay below may cover their paths (/tmp).
    sources = {target: os.open(src, os.O_PATH | os.O_DIRECTORY)
               for target, src in spec["mounts"].items()}  # fmt: skip
    _mount("tmpfs", spec["layers"], "tmpfs", 0, "mode=0700")
    layers = os.open(spec["layers"], os.O_PATH | os.O_DIRECTORY)
    overlaid: list[str] = []
    for target, fd in sources.items():
        chain, existing = _missing_chain(target)
        if chain:
            lower = os.path.realpath(existing)
            if lower == "/":
                raise OSError(f"{target}: refusing to overlay / (make {chain[0]} another way)")
            if lower not in overlaid:
                layer = f"/proc/self/fd/{layers}/{len(overlaid)}"
                os.makedirs(layer + "/upper")
                os.makedirs(layer + "/work")
                _mount("overlay", lower, "overlay", 0,
                       f"lowerdir={lower},upperdir={layer}/upper,workdir={layer}/work")  # fmt: skip
                overlaid.append(lower)
            for p in chain:
                os.mkdir(p)
        _mount(f"/proc/self/fd/{fd}", target, None, MS_BIND | MS_REC)
        _mount(None, target, None, MS_BIND | MS_REMOUNT | MS_RDONLY)
        os.close(fd)
    os.close(layers)


def main(spec_path: str) -> None:
    spec = json.loads(Path(spec_path).read_text())
    try:
        _setup(spec)
    except OSError as err:
        print(f"podfs: {err}", file=sys.stderr, flush=True)
        sys.exit(127)
    argv = spec["argv"]
    os.execv(argv[0], argv)


if __name__ == "__main__":
    main(sys.argv[1])
