"""Containers from images for the tier's executor: image lookup and the OCI runtime spec.

With ``--images`` the executor runs each container from the image its pod spec names, through
runc: the image comes from this machine's container storage (``make images-local`` puts
tunepack's images there under the names the runtimes use), its read-only root file system is
the image's merged layers (``podman image mount``) under a per-container overlay, and the
process, user, environment, working directory, mounts and read-only root come from what the
control plane resolved, merged with the image's config the way a kubelet merges them:
``command`` replaces the ENTRYPOINT, ``args`` the CMD, pod env wins over image ENV, and the image's
USER and WORKDIR apply where the pod sets none.

Kept from the process executor, and why: the host network (every pod is 127.0.0.1 here, one
loopback), the PID namespace of the executor's per-container init (runc joins it; when the init
ends, the kernel ends everything in it, so nothing survives the executor). No seccomp profile
(RuntimeDefault is reported, not enforced) and no cgroup limits: runc places the container in a
cgroup of its own, with no limits set.
"""

from __future__ import annotations

import contextlib
import json
import subprocess
import threading
from dataclasses import dataclass, field
from pathlib import Path

from tests.controlplane.podspec import ConfigError

# What runc/containerd give a container by default (capabilities before the pod's add/drop).
DEFAULT_CAPS = (
    "CHOWN DAC_OVERRIDE FSETID FOWNER MKNOD NET_RAW SETGID SETUID SETFCAP SETPCAP "
    "NET_BIND_SERVICE SYS_CHROOT KILL AUDIT_WRITE"
).split()
MASKED = [
    "/proc/acpi", "/proc/kcore", "/proc/keys", "/proc/latency_stats", "/proc/timer_list",
    "/proc/timer_stats", "/proc/sched_debug", "/proc/scsi", "/sys/firmware",
]  # fmt: skip
READONLY = [
    "/proc/asound", "/proc/bus", "/proc/fs", "/proc/irq", "/proc/sys", "/proc/sysrq-trigger",
]  # fmt: skip
CGROUP_PARENT = "tunepack-executor"  # under each hierarchy: /sys/fs/cgroup/<controller>/...
SHM_BYTES = 64 * 1024 * 1024  # the kubelet's /dev/shm when the pod mounts none


@dataclass
class Image:
    name: str
    rootfs: str  # the merged layers, read-only
    id: str = ""  # its image ID (sha256:...), reported as the container's imageID
    entrypoint: list[str] = field(default_factory=list)
    cmd: list[str] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)
    workdir: str = ""
    user: str = ""


class ImageMissing(ConfigError):
    """The pod's image is not here: a kubelet's ErrImagePull / ImagePullBackOff."""


class Images:
    """Images of this machine's container storage, mounted once each, unmounted at stop."""

    def __init__(self, podman: str = "podman"):
        self.podman = podman
        self.lock = threading.Lock()
        self.mounted: dict[str, Image] = {}

    def get(self, name: str) -> Image:
        with self.lock:
            if name not in self.mounted:
                self.mounted[name] = self._mount(name)
            return self.mounted[name]

    def _mount(self, name: str) -> Image:
        found = self._run("image", "inspect", name)
        if found.returncode != 0:
            raise ImageMissing(
                f'failed to pull image "{name}": not in this node\'s container storage (the '
                "tier builds tunepack's images with `make images-local`; nothing is pulled here)"
            )
        inspected = json.loads(found.stdout)[0]
        cfg = inspected.get("Config") or {}
        mounted = self._run("image", "mount", name)
        if mounted.returncode != 0:
            raise ConfigError(f'image "{name}" could not be mounted: {mounted.stderr.strip()}')
        env = dict(e.split("=", 1) for e in cfg.get("Env") or [] if "=" in e)
        return Image(
            name=name,
            rootfs=mounted.stdout.strip(),
            id=f"sha256:{inspected['Id'].removeprefix('sha256:')}",
            entrypoint=list(cfg.get("Entrypoint") or []),
            cmd=list(cfg.get("Cmd") or []),
            env=env,
            workdir=cfg.get("WorkingDir") or "",
            user=cfg.get("User") or "",
        )

    def unmount_all(self):
        with self.lock:
            for name in self.mounted:
                self._run("image", "unmount", name)
            self.mounted.clear()

    def _run(self, *args: str) -> subprocess.CompletedProcess:
        return subprocess.run(
            [self.podman, *args], capture_output=True, text=True, timeout=120, check=False
        )


def image_user(image: Image, rootfs: str) -> tuple[int | None, int | None]:
    """The image's USER as (uid, gid); names are looked up in the image's /etc/passwd."""
    if not image.user:
        return None, None
    user, _, group = image.user.partition(":")
    if user.isdigit():
        return int(user), int(group) if group.isdigit() else None
    for line in _read(f"{rootfs}/etc/passwd").splitlines():
        fields = line.split(":")
        if len(fields) > 3 and fields[0] == user:
            return int(fields[2]), int(group) if group.isdigit() else int(fields[3])
    raise ConfigError(f'image "{image.name}": user {user!r} is not in its /etc/passwd')


def primary_gid(uid: int, rootfs: str, default: int) -> int:
    """The group of uid's entry in the image's /etc/passwd (runAsUser without runAsGroup)."""
    for line in _read(f"{rootfs}/etc/passwd").splitlines():
        fields = line.split(":")
        if len(fields) > 3 and fields[2] == str(uid):
            return int(fields[3])
    return default


def remove_cgroups():
    """The executor's cgroups left by containers killed with their init (empty by then)."""
    for parent in Path("/sys/fs/cgroup").glob(f"*/{CGROUP_PARENT}"):
        for child in sorted(parent.rglob("*"), reverse=True):
            if child.is_dir():
                with contextlib.suppress(OSError):
                    child.rmdir()
        with contextlib.suppress(OSError):
            parent.rmdir()


def home_of(uid: int, rootfs: str) -> str:
    """HOME as runc sets it: the user's entry in the image's /etc/passwd, else /."""
    for line in _read(f"{rootfs}/etc/passwd").splitlines():
        fields = line.split(":")
        if len(fields) > 5 and fields[2] == str(uid):
            return fields[5] or "/"
    return "/"


def _read(path: str) -> str:
    try:
        with open(path) as f:
            return f.read()
    except OSError:
        return ""


def argv(container: dict, image: Image, expand) -> list[str]:
    """The process: command replaces ENTRYPOINT, args replace CMD (and a command drops CMD)."""
    command = [expand(a) for a in container.get("command") or []]
    args = [expand(a) for a in container.get("args") or []]
    if command:
        out = command + args
    else:
        out = image.entrypoint + (args or image.cmd)
    if not out:
        raise ConfigError(f'container "{container["name"]}": no command and the image has none')
    return out


def capabilities(container: dict) -> list[str]:
    sc = (container.get("securityContext") or {}).get("capabilities") or {}
    drop = {c.upper().removeprefix("CAP_") for c in sc.get("drop") or []}
    add = [c.upper().removeprefix("CAP_") for c in sc.get("add") or []]
    caps = [] if "ALL" in drop else [c for c in DEFAULT_CAPS if c not in drop]
    return [f"CAP_{c}" for c in dict.fromkeys(caps + add)]


def spec(
    *,
    args: list[str],
    env: dict[str, str],
    cwd: str,
    uid: int,
    gid: int,
    groups: list[int],
    hostname: str,
    mounts: list[dict],
    read_only: bool,
    no_new_privs: bool,
    caps: list[str],
    cgroup: str,
) -> dict:
    """An OCI runtime spec (config.json) for runc; ``rootfs`` is the bundle's own directory."""
    has_shm = any(m["target"] == "/dev/shm" for m in mounts)
    oci_mounts = [
        {"destination": "/proc", "type": "proc", "source": "proc"},
        {
            "destination": "/dev",
            "type": "tmpfs",
            "source": "tmpfs",
            "options": ["nosuid", "strictatime", "mode=755", "size=65536k"],
        },
        {
            "destination": "/dev/pts",
            "type": "devpts",
            "source": "devpts",
            "options": ["nosuid", "noexec", "newinstance", "ptmxmode=0666", "mode=0620"],
        },
        {
            "destination": "/dev/mqueue",
            "type": "mqueue",
            "source": "mqueue",
            "options": ["nosuid", "noexec", "nodev"],
        },
        {"destination": "/sys", "type": "bind", "source": "/sys",
         "options": ["rbind", "nosuid", "noexec", "nodev", "ro"]},
    ]  # fmt: skip
    if not has_shm:
        oci_mounts.append(
            {
                "destination": "/dev/shm",
                "type": "tmpfs",
                "source": "shm",
                "options": ["nosuid", "noexec", "nodev", "mode=1777", f"size={SHM_BYTES}"],
            }
        )
    for m in mounts:
        if m["source"] is None:
            size = [f"size={m['tmpfs_bytes']}"] if m.get("tmpfs_bytes") else []
            oci_mounts.append(
                {
                    "destination": m["target"],
                    "type": "tmpfs",
                    "source": "tmpfs",
                    "options": ["nosuid", "nodev", "mode=1777", *size],
                }
            )
        else:
            oci_mounts.append(
                {
                    "destination": m["target"],
                    "type": "bind",
                    "source": m["source"],
                    "options": ["rbind", "ro" if m["read_only"] else "rw"],
                }
            )
    bounding = {k: caps for k in ("bounding", "effective", "permitted")}
    if uid != 0:  # a non-root process keeps no effective capabilities (as under containerd)
        bounding = {"bounding": caps, "effective": [], "permitted": []}
    return {
        "ociVersion": "1.0.2",
        "process": {
            "terminal": False,
            "user": {"uid": uid, "gid": gid, "additionalGids": groups, "umask": 0o022},
            "args": args,
            "env": [f"{k}={v}" for k, v in env.items()],
            "cwd": cwd,
            "capabilities": bounding,
            "noNewPrivileges": no_new_privs,
        },
        "root": {"path": "rootfs", "readonly": read_only},
        "hostname": hostname,
        "mounts": oci_mounts,
        "linux": {
            # No pid namespace: the container joins the executor init's (see the module doc);
            # no network namespace: every pod is 127.0.0.1 here.
            "namespaces": [{"type": "mount"}, {"type": "uts"}, {"type": "ipc"}],
            "cgroupsPath": cgroup,
            "maskedPaths": MASKED,
            "readonlyPaths": READONLY,
            "rootfsPropagation": "rprivate",
        },
    }
