"""A test-only stand-in for a kubelet: runs the pods bound to its Node as local processes.

The control plane of the cluster tier (tests/controlplane) is real: etcd, kube-apiserver, the Job
controller, kube-scheduler, JobSet and the Kubeflow Trainer. This machine has no kubelet and no
container runtime, so this executor registers a Node (not KWOK's), watches the pods bound to it,
and runs each container's ``command``/``args`` for real, with the environment, volumes, user,
hosts file, exit codes, logs and status a kubelet would give them: the Job controller's
podFailurePolicy and JobSet's failure policy see real exit codes.

What it is NOT, and why (no images, no runtime, one loopback address here):
- No images. The command runs on this machine, with its files and the ``--path`` given (the
  project's venv first), so ``python -m tunepack...`` runs the checkout. The image's ENTRYPOINT
  is unknown: a container without ``command`` fails. ``image`` is only reported back. The image's
  ENV lines are approximated by PATH, HOME (a per-container directory), HOSTNAME, LANG and the
  two PYTHON* variables tunepack's Dockerfiles set; workingDir defaults to that directory. Where
  the interpreter or the checkout sit behind a directory others may not enter (/root), each
  container sees an empty stand-in for it with only those paths bound in, read-only, so the
  pod's user can start Python and Python can start Python (torchrun's workers).
- No resource limits, no cgroups, no probes (a running container is ready), no seccomp or
  capabilities beyond what dropping root gives (runAsUser/runAsGroup/fsGroup/supplementalGroups
  via ``setpriv``; allowPrivilegeEscalation: false -> no_new_privs).
- No network namespaces: every pod is 127.0.0.1 and ports are shared. Each container gets its
  own mount, PID and UTS namespace (``unshare``): its volumes are bind-mounted at their
  mountPaths, its hostname is the pod's, and /etc/hosts is a per-pod file mapping the names of
  the pods of its namespace and subdomain (a JobSet's headless Service) to 127.0.0.1, so
  ``<trainjob>-node-0-0.<trainjob>`` resolves; the file is rewritten in place when peers come.
  It also maps the names of the cluster's ClusterIP Services (``<svc>.<ns>.svc``, listed as the
  pod starts) to 127.0.0.1, where the tier's servers listen: with no kube-proxy, a Service's
  port must be its server's own (the Trainer's status server: tests/controlplane/cluster.py).
- Volumes: persistentVolumeClaim (bound to a hostPath or local PV), emptyDir (a directory, or a
  tmpfs per container for ``medium: Memory``: not shared between the containers of a pod),
  secret, configMap, downwardAPI and projected (service account tokens by TokenRequest: every
  pod gets kube-api-access-*), written once and not refreshed, and hostPath. Others fail the pod.
  Missing top-level mount points (``/workspace``) are created on this machine and removed at
  exit when empty and not a mount point of some other process (another executor's container);
  deeper ones (``/var/run/secrets/...``) only in the container, in a private overlay of the
  directory above them, since their presence here would change what other programs see.
- restartPolicy Never is what Jobs with a podFailurePolicy use; OnFailure and Always restart the
  container in place with a short back-off (1, 2, 4 ... 30 s, not the kubelet's 10 s ... 5 min).
  Sidecar init containers (restartPolicy Always on an init container) fail the pod.
- A missing Secret/ConfigMap/key or an unbound PVC is retried for ``--config-wait`` seconds
  (the kubelet retries forever), then the pod fails with the reason in its container status.
- The termination message is the log tail for failed containers (FallbackToLogsOnError);
  terminationMessagePath files are not read. Containers that never ran in a pod that ended are
  reported terminated, exit code 137, reason ContainerStatusUnknown (as the kubelet does).
- A pod deleted before it started is marked Failed, then deleted with grace 0. Pods found
  running when the executor starts (a previous executor's) are lost: marked Failed, exit 137.
- On SIGTERM/SIGINT it SIGTERMs every container, SIGKILLs what is left after 3 s, writes their
  statuses once (the API server may be gone) and exits 0. Nothing survives it, even a SIGKILL of
  the executor (parent-death signals); only its own processes are ever signalled.

Layout under ``--root``: ``logs/<ns>_<pod>_<container>.log`` (stdout+stderr; the one before a
restart is ``.previous.log``), ``pids/<ns>_<pod>_<container>.pid`` (the container's main process,
host PID, while it runs: a test may SIGKILL it), ``pods/<uid>/`` (emptyDirs, volume files, hosts
file), ``scratch/<uid>/<container>`` (HOME). The kube-apiserver reads logs from the HTTPS
endpoint ``/containerLogs/<ns>/<pod>/<container>`` (follow, tailLines, limitBytes, previous) on
127.0.0.1:``--log-port``; exec, attach and port-forward are not served.

Run: ``python -m tests.controlplane.executor --kubeconfig K --node N --root DIR --log-port P
--serving-cert C --serving-key K [--path PATH] [--config-wait S]``.
"""

from __future__ import annotations

import argparse
import http.server
import json
import logging
import os
import shutil
import signal
import ssl
import subprocess
import sys
import tempfile
import threading
import time
import urllib.parse
from datetime import UTC, datetime
from pathlib import Path

from kubernetes import client, config
from kubernetes.client.rest import ApiException
from kubernetes.watch.watch import iter_resp_lines

from tests.controlplane import oci, podspec
from tests.controlplane.podspec import ConfigError, ContainerState

log = logging.getLogger("executor")
KUBELET_VERSION = "v1.36.3-executor"
STOP_GRACE_S = 3  # SIGTERM -> SIGKILL when the executor itself stops
MIN_GRACE_S = 2  # the kubelet's minimum grace period
# Each container: its own mount, UTS and PID namespaces (the init below is PID 1; when it ends,
# the kernel kills every process left in the namespace). setpriv --pdeathsig: when the executor
# thread that started it dies (even by SIGKILL), unshare gets SIGKILL; --kill-child passes it on.
NAMESPACES = (
    "setpriv --pdeathsig KILL -- unshare --mount --uts --pid --fork --kill-child --mount-proc "
    "--propagation private --"
).split()

# PID 1 of a container's namespaces; runs as root with `python -I -S` (standard library only).
INIT_SCRIPT = r'''
"""Container init written by tests/controlplane/executor.py: mounts, then runs the command."""
import ctypes, json, os, signal, socket, subprocess, sys, time

spec = json.load(open(sys.argv[1]))


def at(fd, name=""):
    """A path that reaches what fd names, whatever a later mount puts over its own path."""
    return f"/proc/self/fd/{fd}" + (f"/{name}" if name else "")


def dir_fd(path):
    return os.open(path, os.O_PATH | os.O_DIRECTORY)


# The executor's files: opened first, since an overlay below may cover them (they are under /tmp).
error_dir, started_dir = (dir_fd(os.path.dirname(spec[k])) for k in ("error_file", "started_file"))


def start_failed(message):
    with open(at(error_dir, os.path.basename(spec["error_file"])), "w") as f:
        f.write(message)
    sys.exit(128)


libc = ctypes.CDLL(None, use_errno=True)
MS_RDONLY, MS_REMOUNT, MS_BIND, MS_REC = 1, 32, 4096, 16384


def mount(source, target, fstype, flags, data=None):
    enc = lambda v: None if v is None else v.encode()  # noqa: E731
    if libc.mount(enc(source), enc(target), enc(fstype), flags, enc(data)):
        err = ctypes.get_errno()
        raise OSError(err, f"mount {fstype or 'bind'} on {target}: {os.strerror(err)}")


def missing_chain(path):
    """The missing components of path, outermost first, and the deepest one that exists."""
    chain = []
    while not os.path.lexists(path):
        chain.append(path)
        path = os.path.dirname(path)
    return chain[::-1], path


def run_image(oci):
    """--images: the root is the image's layers under an overlay of this container's own (in
    this mount namespace only), and runc runs the process there (it joins our PID namespace)."""
    bundle = oci["bundle"]
    rootfs = bundle + "/rootfs"
    try:
        for d in (rootfs, bundle + "/upper", bundle + "/work"):
            os.makedirs(d, exist_ok=True)
        mount("overlay", rootfs, "overlay", 0,
              f"lowerdir={oci['image_rootfs']},upperdir={bundle}/upper,workdir={bundle}/work")
    except OSError as e:
        start_failed(f"container setup: {e}")
    try:
        return subprocess.Popen([oci["runc"], "--root", oci["state"], "run", "--bundle", bundle,
                                 "--pid-file", bundle + "/pid", oci["id"]],
                                stdin=subprocess.DEVNULL, cwd=bundle)
    except OSError as e:
        start_failed(f"runc: {e}")


done = []  # mount targets so far: a directory inside one belongs to the container
overlaid = set()
if spec.get("oci"):
    child = run_image(spec["oci"])
    spec["mounts"], spec["reveal"] = [], {}  # runc mounts the volumes, inside the image
try:
    socket.sethostname(spec["hostname"])
    # Sources are opened before any mount: an overlay below may cover a source's path, and the
    # bind must reach the real directory (/proc/self/fd/N names it whatever covers its path).
    fds = [None if m["source"] is None else os.open(m["source"], os.O_PATH)
           for m in spec["mounts"]]
    layers = None  # the overlays' upper and work directories, in the pod's directory
    # The "image": this machine's interpreter and checkout. Where they sit behind a directory the
    # pod's user may not enter (/root here), that directory is replaced, in this container only,
    # by an empty one that others may enter, with just those paths bound in, read-only.
    for hidden, paths in spec.get("reveal", {}).items():
        keep = [(p, os.open(p, os.O_PATH)) for p in paths]
        mount("tmpfs", hidden, "tmpfs", 0, "mode=0755")
        for p, fd in keep:
            os.makedirs(p, exist_ok=True)
            mount(at(fd), p, None, MS_BIND | MS_REC)
            mount(None, p, None, MS_BIND | MS_REMOUNT | MS_RDONLY)
            os.close(fd)
    for m, fd in zip(spec["mounts"], fds):
        target = m["target"]
        is_file = fd is not None and not os.path.isdir(m["source"])
        chain, existing = missing_chain(target)
        if chain:
            inside = any(existing == t or existing.startswith(t.rstrip("/") + "/")
                         for t in [*done, *overlaid])
            if not inside:
                # A missing mount point below an existing system directory (the service-account
                # token's /var/run/secrets/...): made in a writable overlay of that directory
                # that only this container sees, never on the machine, where it would change what
                # other programs find (a Kubernetes client takes it for an in-cluster pod).
                lower = os.path.realpath(existing)
                if lower == "/":
                    start_failed(f"mount point {target} is missing (the executor makes these)")
                if layers is None:
                    os.makedirs(spec["overlay_dir"], exist_ok=True)
                    layers = dir_fd(spec["overlay_dir"])
                layer = at(layers, str(len(overlaid)))
                os.makedirs(layer + "/upper", exist_ok=True)
                os.makedirs(layer + "/work", exist_ok=True)
                mount("overlay", lower, "overlay", 0,
                      f"lowerdir={lower},upperdir={layer}/upper,workdir={layer}/work")
                overlaid.add(lower)
            for p in chain:
                if p == target and is_file:
                    open(p, "a").close()
                else:
                    os.mkdir(p)
        if fd is None:
            size = f",size={m['tmpfs_bytes']}" if m["tmpfs_bytes"] else ""
            mount("tmpfs", target, "tmpfs", 0, "mode=1777" + size)
        else:
            mount(f"/proc/self/fd/{fd}", target, None, MS_BIND | MS_REC)
            if m["read_only"]:
                mount(None, target, None, MS_BIND | MS_REMOUNT | MS_RDONLY)
            os.close(fd)
        done.append(target)
    if not spec.get("oci"):
        os.makedirs(spec["cwd"], exist_ok=True)
except OSError as e:
    start_failed(f"container setup: {e}")


def exec_process():
    """Without an image: this machine's program, as the pod's user."""
    os.umask(0o022)
    command = spec["argv"][0]
    dirs = [spec["cwd"]] if "/" in command else spec["env"].get("PATH", "").split(":")
    found = [os.path.join(d, command) for d in dirs if os.path.isfile(os.path.join(d, command))
             and os.access(os.path.join(d, command), os.X_OK)]
    if not found:
        start_failed(f'exec: "{command}": executable file not found in $PATH')
    # Exec the resolved path: a program looked up in PATH by the pod's user could not be found
    # when its real file is behind a directory only root may enter (the venv's python ->
    # /root/.pyenv here), and Python then would not find its venv either.
    argv = [os.path.abspath(found[0]), *spec["argv"][1:]]
    # setpriv drops to the pod's user at exec time (it keeps root's capabilities until then, so
    # an interpreter behind a directory only root may enter still starts); the pid stays the same.
    user = [spec["setpriv"], "--reuid", str(spec["uid"]), "--regid", str(spec["gid"])]
    user += (["--groups", ",".join(map(str, spec["groups"]))] if spec["groups"]
             else ["--clear-groups"])
    user += ["--nnp"] if spec["no_new_privs"] else []
    try:
        return subprocess.Popen([*user, "--", *argv], env=spec["env"], cwd=spec["cwd"],
                                stdin=subprocess.DEVNULL)
    except OSError as e:
        start_failed(f"exec: {e}")


if spec.get("oci"):
    # Started once runc has created the container (its pid file): the executor then finds the
    # container's process as runc's child.
    pid_file = spec["oci"]["bundle"] + "/pid"
    while not os.path.exists(pid_file) and child.poll() is None:
        time.sleep(0.01)
    if child.returncode is not None:
        start_failed(f"runc could not create the container (exit {child.returncode}): "
                     "its message is in the container's log")
else:
    child = exec_process()
# The executor now looks for the main process.
open(at(started_dir, os.path.basename(spec["started_file"])), "w").close()


def forward(signum, frame):
    try:
        os.kill(child.pid, signum)
    except ProcessLookupError:
        pass


for s in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1,
          signal.SIGUSR2):
    signal.signal(s, forward)
while True:  # reap orphans until the main process ends; the namespace dies with us
    try:
        pid, status = os.wait()
    except ChildProcessError:
        sys.exit(128)
    if pid == child.pid:
        code = os.waitstatus_to_exitcode(status)
        sys.exit(code if code >= 0 else 128 - code)
'''


def now() -> str:
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def proc_stat(pid: int) -> tuple[int, str] | None:
    """(ppid, start time) of a process, or None when it is gone."""
    try:
        raw = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = raw[raw.rindex(")") + 2 :].split()
    return int(fields[1]), fields[19]


def child_of(ppid: int) -> int | None:
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            st = proc_stat(int(entry.name))
            if st and st[0] == ppid:
                return int(entry.name)
    return None


def mount_points_in_use() -> set[str]:
    """Every mount point of every mount namespace on this machine (as its processes see it)."""
    seen, points = set(), set()
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            ns = os.readlink(f"/proc/{entry.name}/ns/mnt")
            if ns in seen:
                continue
            seen.add(ns)
            with open(f"/proc/{entry.name}/mountinfo") as f:
                points.update(line.split()[4] for line in f)
        except OSError:
            continue
    return points


class Proc:
    """One started container: setpriv+unshare (our child, own process group) -> init -> main."""

    def __init__(self, popen: subprocess.Popen):
        self.popen = popen
        self.init: tuple[int, str] | None = None  # (host pid, start time)
        self.main: tuple[int, str] | None = None

    def find(self, started_file: Path, timeout: float = 10, runc: bool = False):
        """Find init and main once init says the main process is started (until then init's
        only children are short ``mount`` runs). From an image, main is runc's child."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and self.popen.poll() is None:
            if started_file.exists():
                self.init = self._identify(child_of(self.popen.pid))
                main = child_of(self.init[0]) if self.init else None
                if runc and main:
                    main = child_of(main)
                self.main = self._identify(main)
                return
            time.sleep(0.02)

    @staticmethod
    def _identify(pid: int | None) -> tuple[int, str] | None:
        st = proc_stat(pid) if pid else None
        return (pid, st[1]) if st else None

    @staticmethod
    def _signal(target: tuple[int, str] | None, sig: int) -> bool:
        """Signal a process we started, only if it is still that process (no PID reuse)."""
        if target is None or (proc_stat(target[0]) or (0, None))[1] != target[1]:
            return False
        try:
            os.kill(target[0], sig)
            return True
        except ProcessLookupError:
            return False

    def terminate(self):
        if not self._signal(self.main, signal.SIGTERM):
            self._signal(self.init, signal.SIGTERM)  # init forwards it

    def kill(self):
        self._signal(self.init, signal.SIGKILL)  # PID namespace init: takes every process along
        if self.popen.poll() is None:
            try:
                os.killpg(self.popen.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


class PodRunner:
    """Runs one pod: volumes, init containers, containers, status, deletion."""

    def __init__(self, ex: Executor, pod: dict, *, lost: bool = False):
        self.ex, self.pod, self.lost = ex, pod, lost
        meta, spec = pod["metadata"], pod["spec"]
        self.uid, self.ns, self.name = meta["uid"], meta["namespace"], meta["name"]
        self.policy = spec.get("restartPolicy", "Always")
        self.init = [
            ContainerState(c["name"], c.get("image", "")) for c in spec.get("initContainers") or []
        ]
        self.main = [ContainerState(c["name"], c.get("image", "")) for c in spec["containers"]]
        self.dir = ex.root / "pods" / self.uid
        self.hosts = self.dir / "hosts"
        self.lock = threading.RLock()
        self.patch_lock = threading.Lock()
        self.deletion = threading.Event()
        self.deadline: float | None = None
        self.procs: dict[str, Proc] = {}
        self.volume_dirs: dict[str, str] = {}
        self.volumes: dict[str, podspec.Volume] = {}
        self.conditions: dict[str, tuple[str, str, str]] = {}  # type -> (status, reason, time)
        self.start_time = now()
        self.message: tuple[str, str] | None = None  # pod-level (reason, message)
        self.phase = "Pending"
        self.gone = False  # the API object is gone: stop writing status
        self.done = threading.Event()
        self.thread = threading.Thread(target=self.run, name=f"pod-{self.name}", daemon=True)

    # ----------------------------------------------------------------------------- lifecycle
    def run(self):
        try:
            self._run()
        except ConfigError as e:
            self._fail_unstarted("StartError", str(e))
        except Exception as e:  # a bug here must not take the executor down
            log.exception("pod %s/%s: executor error", self.ns, self.name)
            self._fail_unstarted("ExecutorError", f"executor error: {e}")
        finally:
            self._finish()

    def _run(self):
        if self.lost:
            self._fail_unstarted(
                "ContainerStatusUnknown",
                "the executor restarted while the container ran: it is lost",
                code=137,
            )
            return
        if self.deletion.is_set():
            return
        if self.policy not in ("Never", "OnFailure", "Always"):
            raise ConfigError(f"unknown restartPolicy {self.policy!r}")
        self.patch_status()
        try:
            self._retry(self.prepare, [*self.init, *self.main], "ContainerCreating")
        except ConfigError as e:
            if not self.deletion.is_set():
                self._fail_unstarted("FailedMount", str(e))
            return
        self._condition("PodReadyToStartContainers", "True")
        spec = self.pod["spec"]
        for c, st in zip(spec.get("initContainers") or [], self.init, strict=True):
            if c.get("restartPolicy") == "Always":
                self._fail_unstarted("StartError", "sidecar init containers are not supported")
                return
            if not self.run_container(c, st):
                return
        threads = [
            threading.Thread(
                target=self.run_container,
                args=(c, st),
                daemon=True,
                name=f"ctr-{self.name}-{st.name}",
            )
            for c, st in zip(spec["containers"], self.main, strict=True)
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join()

    def _finish(self):
        with self.lock:
            for st in [*self.init, *self.main]:
                if st.waiting is not None:  # never started, or waiting to restart
                    why = "the pod failed"
                    if self.deletion.is_set():
                        why = "the executor stopped" if self.ex.stopping.is_set() else "deleted"
                    message = f"The container was not running when the pod ended ({why})."
                    st.terminate(137, "ContainerStatusUnknown", message, now())
            ok = all(c.exit_code == 0 for c in [*self.init, *self.main])
            self.phase = "Succeeded" if ok else "Failed"
        self.patch_status(quick=self.ex.stopping.is_set())
        log.info("pod %s/%s %s", self.ns, self.name, self.phase)
        self.done.set()
        if self.deletion.is_set() and not self.ex.stopping.is_set() and not self.gone:
            self.ex.finalize(self.pod)

    def request_termination(self, grace: int | None):
        grace = max(MIN_GRACE_S, int(grace if grace is not None else 30))
        with self.lock:
            deadline = time.monotonic() + grace
            first = not self.deletion.is_set()
            if self.deadline is None or deadline < self.deadline:
                self.deadline = deadline
            self.deletion.set()
        if first:
            log.info("pod %s/%s deleting (grace %d s)", self.ns, self.name, grace)
            threading.Thread(target=self._terminate, daemon=True).start()

    def _terminate(self):
        with self.lock:
            procs = list(self.procs.values())
        for p in procs:
            p.terminate()
        while not self.done.is_set() and time.monotonic() < (self.deadline or 0):
            if all(p.popen.poll() is not None for p in procs):
                break
            time.sleep(0.1)
        self.kill_all()

    def kill_all(self):
        with self.lock:
            procs = list(self.procs.values())
        for p in procs:
            p.kill()

    def cleanup(self):
        shutil.rmtree(self.dir, ignore_errors=True)
        shutil.rmtree(self.ex.scratch / self.uid, ignore_errors=True)

    # ----------------------------------------------------------------------------- setup
    def _retry(self, fn, states, waiting_reason):
        """Run ``fn``; retriable ConfigErrors are retried for --config-wait seconds while the
        containers show ``waiting_reason`` with the message."""
        deadline = time.monotonic() + self.ex.config_wait
        delay = 1.0
        while True:
            try:
                return fn()
            except ConfigError as e:
                if not e.retriable or time.monotonic() + delay > deadline:
                    raise
                with self.lock:
                    for st in states:
                        st.waiting = (waiting_reason, str(e))
                self.patch_status()
                log.info("pod %s/%s waiting: %s", self.ns, self.name, e)
                if self.deletion.wait(delay):
                    raise ConfigError("pod deleted") from None
                delay = min(delay * 2, 8)

    def prepare(self):
        self.volumes = podspec.classify_volumes(self.pod)
        (self.dir / "volumes").mkdir(parents=True, exist_ok=True)
        self.ex.refresh_services()
        self.ex.write_hosts(self)
        psc = self.pod["spec"].get("securityContext") or {}
        fs_group = psc.get("fsGroup")
        for vol in self.volumes.values():
            if vol.name in self.volume_dirs or vol.memory:
                continue
            path = self._volume_dir(vol, fs_group)
            self.volume_dirs[vol.name] = path

    def _volume_dir(self, vol: podspec.Volume, fs_group) -> str:
        own = self.dir / "volumes" / vol.name
        if vol.kind == "hostPath":
            path, kind = vol.source["path"], vol.source.get("type", "")
            if kind in ("", "DirectoryOrCreate"):
                os.makedirs(path, exist_ok=True)
            elif kind == "FileOrCreate" and not os.path.exists(path):
                Path(path).parent.mkdir(parents=True, exist_ok=True)
                Path(path).touch()
            elif not os.path.exists(path):
                raise ConfigError(f'hostPath volume "{vol.name}": {path} does not exist')
            return path
        if vol.kind == "emptyDir":
            own.mkdir(exist_ok=True)
            own.chmod(0o777)
            set_ownership(own, fs_group)
            return str(own)
        if vol.kind == "persistentVolumeClaim":
            path = self.ex.pvc_path(self.ns, vol.source["claimName"])
            set_ownership(Path(path), fs_group, self.pod["spec"].get("securityContext"))
            return path
        # files: secret, configMap, projected, downwardAPI
        if vol.kind == "projected":
            files = podspec.projected_files(
                self.pod, vol.source, lambda k, n: self.ex.lookup_data(self.ns, k, n), self._token
            )
        elif vol.kind == "downwardAPI":
            mode = vol.source.get("defaultMode", 0o644)
            files = podspec.downward_files(self.pod, vol.source.get("items"), mode)
        else:
            name = vol.source["secretName" if vol.kind == "secret" else "name"]
            data = self.ex.lookup_data(self.ns, vol.kind, name)
            if data is None and not vol.source.get("optional"):
                raise ConfigError(
                    f'{vol.kind} volume "{vol.name}": {vol.kind.lower()} "{name}" not found',
                    retriable=True,
                )
            files = podspec.projection_files(data or {}, vol.source, vol.kind, name)
        shutil.rmtree(own, ignore_errors=True)
        own.mkdir()
        own.chmod(0o755)
        for rel, content, mode in files:
            target = own / rel
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes(content)
            target.chmod(mode)
            if fs_group is not None:
                os.chown(target, -1, int(fs_group))
        return str(own)

    def _token(self, audience: str | None, seconds: int) -> str:
        """A service account token bound to this pod (the kubelet's TokenRequest)."""
        account = self.pod["spec"].get("serviceAccountName") or "default"
        body = {"spec": {"audiences": [audience] if audience else None,
                         "expirationSeconds": max(seconds, 600),
                         "boundObjectRef": {"apiVersion": "v1", "kind": "Pod",
                                            "name": self.name, "uid": self.uid}}}  # fmt: skip
        try:
            made = self.ex.call(
                self.ex.core.create_namespaced_service_account_token,
                account,
                self.ns,
                body,
                _preload_content=False,
            )
        except ApiException as e:
            if e.status == 404:
                raise ConfigError(f'serviceaccount "{account}" not found', retriable=True) from e
            raise
        return json.loads(made.data)["status"]["token"]

    # ----------------------------------------------------------------------------- containers
    def run_container(self, c: dict, st: ContainerState) -> bool:
        """Run one container (restarting it as restartPolicy says); True when it succeeded."""
        if self.ex.images is not None and not self._pull(c, st):
            return False
        delay = 1
        while not self.deletion.is_set() and not self.ex.stopping.is_set():
            try:
                plan = self._retry(lambda: self._plan(c, st), [st], "CreateContainerConfigError")
            except ConfigError as e:
                if self.deletion.is_set():
                    return False
                with self.lock:
                    st.terminate(128, "CreateContainerConfigError", str(e), now())
                self.patch_status()
                log.info("pod %s/%s container %s cannot start: %s", self.ns, self.name, st.name, e)
                return False
            code = self._exec(c, st, plan)
            if self.deletion.is_set() or not podspec.restarts(self.policy, code):
                return code == 0
            with self.lock:
                st.last = st.status()["state"]["terminated"]
                st.restart_count += 1
                st.waiting = ("CrashLoopBackOff", f"back-off {delay}s restarting failed container")
                st.exit_code = None
            self.patch_status()
            if self.deletion.wait(delay):
                return False
            delay = min(delay * 2, 30)
        return False

    def _pull(self, c: dict, st: ContainerState) -> bool:
        """--images: wait for the container's image as a kubelet does for one it cannot pull:
        the container waits (ErrImagePull, then ImagePullBackOff with the kubelet's back-off)
        and the pod stays Pending until the image appears or the pod is deleted."""
        delay, reason = 1.0, "ErrImagePull"
        while True:
            try:
                self.ex.images.get(c.get("image") or "")
                return True
            except oci.ImageMissing as e:
                with self.lock:
                    st.waiting = (reason, str(e))
                self.patch_status()
                log.info("pod %s/%s container %s: %s", self.ns, self.name, st.name, e)
            if self.deletion.wait(delay) or self.ex.stopping.is_set():
                return False
            with self.lock:
                st.waiting = ("ImagePullBackOff", f'Back-off pulling image "{c.get("image")}"')
            self.patch_status()
            if self.deletion.wait(delay) or self.ex.stopping.is_set():
                return False
            delay = min(delay * 2, 10.0)

    def _plan(self, c: dict, st: ContainerState) -> dict:
        env = podspec.resolve_env(
            self.pod, c, lambda kind, name: self.ex.lookup_env(self.ns, kind, name)
        )
        mounts = podspec.mount_plan(c, self.volumes, self.volume_dirs, env)
        mounts.append(podspec.Mount("/etc/hosts", str(self.hosts), True, is_file=True))
        if self.ex.images is not None:
            return self._image_plan(c, st, env, mounts)
        ident = podspec.identity(self.pod, c)
        argv = podspec.expand_command(c, env)
        home = self.ex.scratch / self.uid / st.name
        if not home.exists():
            home.mkdir(parents=True)
            os.chown(home, ident.uid, ident.gid)
        base = {
            "PATH": self.ex.path,
            "HOSTNAME": podspec.pod_hostname(self.pod),
            "HOME": str(home),
            "LANG": "C.UTF-8",
            "PYTHONUNBUFFERED": "1",
            "PYTHONDONTWRITEBYTECODE": "1",
        }
        no_new_privs = (c.get("securityContext") or {}).get("allowPrivilegeEscalation") is False
        return {
            "argv": argv,
            "setpriv": self.ex.setpriv,
            "no_new_privs": no_new_privs,
            "env": {**base, **env},
            "uid": ident.uid,
            "gid": ident.gid,
            "groups": list(ident.groups),
            "cwd": c.get("workingDir") or str(home),
            "hostname": podspec.pod_hostname(self.pod),
            "mounts": [m.__dict__ for m in mounts],
            "overlay_dir": str(self.dir / "overlays" / st.name),
            "reveal": self.ex.reveal,
        }

    def _image_plan(self, c: dict, st: ContainerState, env: dict, mounts: list) -> dict:
        """--images: the container from its image, through runc (tests/controlplane/oci.py)."""
        image = self.ex.images.get(c.get("image") or "")
        st.image_id, st.runtime = image.id, "runc"
        user = oci.image_user(image, image.rootfs)
        ident = podspec.identity(self.pod, c, user)
        gid = ident.gid
        # No runAsGroup: the image USER's group when the image chose the user, else (as
        # containerd does) the group of the uid's entry in the image's /etc/passwd.
        if podspec.run_as_group(self.pod, c) is None and not (
            user[0] == ident.uid and user[1] is not None
        ):
            gid = oci.primary_gid(ident.uid, image.rootfs, default=ident.gid)
        hostname = podspec.pod_hostname(self.pod)
        full_env = {
            **image.env,
            "HOSTNAME": hostname,
            **({} if "HOME" in image.env else {"HOME": oci.home_of(ident.uid, image.rootfs)}),
            **env,
        }
        argv = oci.argv(c, image, lambda a: podspec.expand(a, env))
        sc = c.get("securityContext") or {}
        run_id = f"{self.uid[:13]}-{st.name}-{st.restart_count}"
        bundle = self.dir / "bundles" / run_id
        bundle.mkdir(parents=True, exist_ok=True)
        config = oci.spec(
            args=argv,
            env=full_env,
            cwd=c.get("workingDir") or image.workdir or "/",
            uid=ident.uid,
            gid=gid,
            groups=list(ident.groups),
            hostname=hostname,
            mounts=[m.__dict__ for m in mounts],
            read_only=bool(sc.get("readOnlyRootFilesystem")),
            no_new_privs=sc.get("allowPrivilegeEscalation") is False,
            caps=oci.capabilities(c),
            cgroup=f"/{oci.CGROUP_PARENT}/{run_id}",
        )
        (bundle / "config.json").write_text(json.dumps(config))
        return {  # the mounts are runc's (config.json): the init makes none of its own
            "argv": argv,
            "hostname": hostname,
            "oci": {
                "bundle": str(bundle),
                "image_rootfs": image.rootfs,
                "runc": self.ex.runc,
                "state": str(self.ex.root / "runc"),
                "id": run_id,
            },
        }

    def _exec(self, c: dict, st: ContainerState, plan: dict) -> int:
        key = f"{self.ns}_{self.name}_{st.name}"
        logfile = self.ex.root / "logs" / f"{key}.log"
        pidfile = self.ex.root / "pids" / f"{key}.pid"
        if st.restart_count and logfile.exists():
            logfile.replace(logfile.with_suffix(".previous.log"))
        error_file = self.dir / f"{st.name}.start-error"
        error_file.unlink(missing_ok=True)
        spec_file = self.dir / f"{st.name}.json"
        if "oci" not in plan:
            self.ex.make_mount_points(plan["mounts"])
        argv = [*NAMESPACES, sys.executable, "-I", "-S", str(self.ex.init_script), str(spec_file)]
        started_file = self.dir / f"{st.name}.started"
        started_file.unlink(missing_ok=True)
        plan = {**plan, "error_file": str(error_file), "started_file": str(started_file)}
        spec_file.write_text(json.dumps(plan))
        spec_file.chmod(0o600)
        with self.lock:
            if self.deletion.is_set() or self.ex.stopping.is_set():
                return 137
            with open(logfile, "wb") as out:
                popen = subprocess.Popen(
                    argv,
                    stdin=subprocess.DEVNULL,
                    stdout=out,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,
                    cwd="/",
                    env={"PATH": "/usr/sbin:/usr/bin:/sbin:/bin"},
                )
            proc = Proc(popen)  # visible to a deletion (process group) while we look for PIDs
            self.procs[st.name] = proc
        proc.find(started_file, runc="oci" in plan)
        with self.lock:
            st.pid = (proc.main or proc.init or (popen.pid,))[0]
            st.started_at, st.waiting, st.exit_code = now(), None, None
            if self.deletion.is_set():
                proc.terminate()
        if proc.main:
            pidfile.write_text(f"{proc.main[0]}\n")
        log.info(
            "pod %s/%s container %s started (pid %s): %s",
            self.ns,
            self.name,
            st.name,
            st.pid,
            " ".join(plan["argv"]).replace("\n", "\\n")[:300],
        )
        self.patch_status()
        rc = popen.wait()
        code = rc if rc >= 0 else 128 - rc
        pidfile.unlink(missing_ok=True)
        if error_file.exists():
            reason, message = "StartError", error_file.read_text()[-podspec.MESSAGE_MAX_BYTES :]
        elif code == 0:
            reason, message = "Completed", ""
        else:
            reason = "Error"
            message = podspec.tail_message(logfile.read_bytes()[-65536:].decode(errors="replace"))
        with self.lock:
            st.terminate(code, reason, message, now())
            del self.procs[st.name]
        log.info("pod %s/%s container %s exited %d (%s)", self.ns, self.name, st.name, code, reason)
        if not self.ex.stopping.is_set():
            self.patch_status()
        return code

    def _fail_unstarted(self, reason: str, message: str, code: int = 128):
        with self.lock:
            for st in [*self.init, *self.main]:
                if st.exit_code is None and st.pid is None:
                    st.terminate(code, reason, message, now())
            self.message = (reason, message)
        log.info("pod %s/%s failed: %s", self.ns, self.name, message)

    # ----------------------------------------------------------------------------- status
    def _condition(self, kind: str, status: str, reason: str = ""):
        with self.lock:
            old = self.conditions.get(kind)
            if old is None or old[:2] != (status, reason):
                self.conditions[kind] = (status, reason, now())

    def _status(self) -> dict:
        with self.lock:
            init_done = all(c.terminated and c.exit_code == 0 for c in self.init)
            running = all(c.running for c in self.main)
            terminal = self.phase in ("Succeeded", "Failed")
            if not terminal:
                self.phase = podspec.pod_phase(self.init, self.main, self.policy)
                if self.phase in ("Succeeded", "Failed"):  # only _finish makes it terminal
                    self.phase = "Running"
            self._condition(
                "Initialized",
                "True" if init_done else "False",
                "" if init_done else "ContainersNotInitialized",
            )
            ready = "True" if running and not terminal else "False"
            why = "PodCompleted" if terminal else ("" if running else "ContainersNotReady")
            self._condition("ContainersReady", ready, why)
            self._condition("Ready", ready, why)
            status = {
                "phase": self.phase,
                "hostIP": "127.0.0.1",
                "hostIPs": [{"ip": "127.0.0.1"}],
                "podIP": "127.0.0.1",
                "podIPs": [{"ip": "127.0.0.1"}],
                "startTime": self.start_time,
                "conditions": [
                    {
                        "type": k,
                        "status": s,
                        "reason": r or None,
                        "lastTransitionTime": t,
                        "lastProbeTime": None,
                    }
                    for k, (s, r, t) in self.conditions.items()
                ],
                "containerStatuses": [c.status() for c in self.main],
            }
            if self.init:
                status["initContainerStatuses"] = [c.status() for c in self.init]
            if self.message:
                status["reason"], status["message"] = self.message
            return status

    def patch_status(self, quick: bool = False):
        """PATCH pods/status (strategic merge, as the kubelet does); ``quick``: one short try
        (the executor is stopping and the API server may be gone already)."""
        if self.gone:
            return
        with self.patch_lock:
            body = {"status": self._status()}
            try:
                if quick:
                    self.ex.core.patch_namespaced_pod_status(
                        self.name, self.ns, body, _request_timeout=2
                    )
                else:
                    self.ex.call(self.ex.core.patch_namespaced_pod_status, self.name, self.ns, body)
            except ApiException as e:
                if e.status == 404:
                    self.gone = True
                else:
                    log.warning("pod %s/%s: status patch failed: %s", self.ns, self.name, e.reason)
            except Exception as e:
                log.warning("pod %s/%s: status patch failed: %s", self.ns, self.name, e)


def set_ownership(path: Path, fs_group, security_context: dict | None = None):
    """The kubelet's fsGroup handling: group fsGroup, group rw (+x, setgid on directories)."""
    if fs_group is None:
        return
    gid = int(fs_group)
    policy = (security_context or {}).get("fsGroupChangePolicy")
    st = path.stat()
    if policy == "OnRootMismatch" and st.st_gid == gid and st.st_mode & 0o2070 == 0o2070:
        return

    def fix(p: str, is_dir: bool):
        try:  # another pod may be renaming files in this volume right now
            s = os.lstat(p)
            os.chown(p, -1, gid, follow_symlinks=False)
            os.chmod(p, s.st_mode & 0o7777 | (0o2770 if is_dir else 0o660))
        except FileNotFoundError:
            pass

    fix(str(path), True)
    for top, dirs, files in os.walk(path):
        for d in dirs:
            if not os.path.islink(os.path.join(top, d)):
                fix(os.path.join(top, d), True)
        for f in files:
            if not os.path.islink(os.path.join(top, f)):
                fix(os.path.join(top, f), False)


REPO = str(Path(__file__).resolve().parents[2])


def reveal_map(paths: list[str]) -> dict[str, list[str]]:
    """{a directory others may not enter: [the paths below it a pod's user must reach]}."""
    out: dict[str, set[str]] = {}
    for path in map(Path, paths):
        path = path.resolve()
        for a in [*reversed(path.parents), path]:
            if not a.stat().st_mode & 0o001:
                if a != path:
                    out.setdefault(str(a), set()).add(str(path))
                break
    return {k: sorted(v) for k, v in out.items()}


class Executor:
    def __init__(self, args):
        self.node, self.root, self.path = args.node, Path(args.root).resolve(), args.path
        self.log_port, self.config_wait = args.log_port, args.config_wait
        for sub in ("logs", "pids", "pods"):
            (self.root / sub).mkdir(parents=True, exist_ok=True)
        self.init_script = self.root / "init.py"
        self.init_script.write_text(INIT_SCRIPT)
        self.setpriv = shutil.which("setpriv") or "/usr/bin/setpriv"
        # HOME and working directories must be reachable by runAsUser: under --root when every
        # parent lets others through, else in a directory of our own under /tmp.
        parents = [self.root, *self.root.parents]
        if all(p.stat().st_mode & 0o001 for p in parents):
            self.scratch, self.own_scratch = self.root / "scratch", False
            self.scratch.mkdir(exist_ok=True)
        else:
            self.scratch = Path(tempfile.mkdtemp(prefix=f"executor-{self.node}-", dir="/tmp"))
            self.own_scratch = True
        self.scratch.chmod(0o711)
        self.reveal = reveal_map([sys.prefix, sys.base_prefix, REPO])
        # --images: containers from the images their pods name, through runc (oci.py).
        self.images = oci.Images() if args.images else None
        self.runc = shutil.which("runc") or "/usr/sbin/runc"
        cfg = client.Configuration()
        config.load_kube_config(config_file=args.kubeconfig, client_configuration=cfg)
        cfg.connection_pool_maxsize = 32
        self.core = client.CoreV1Api(client.ApiClient(cfg))
        self.watch_core = client.CoreV1Api(client.ApiClient(cfg))
        self.runners: dict[str, PodRunner] = {}  # pods bound here, until their object is gone
        self.forgetting: set[PodRunner] = set()  # gone from the API, containers still stopping
        self.finalized: set[str] = set()
        self.peers: dict[str, tuple[str, str | None, str]] = {}  # uid -> hosts entry
        self.services: list[str] = []  # ClusterIP Services' DNS names, as of the last pod start
        self.lock = threading.RLock()
        self.created_paths: list[str] = []
        self.stopping = threading.Event()

    # ----------------------------------------------------------------------------- API
    def call(self, fn, *args, **kwargs):
        """An API call, retried with back-off on server errors and lost connections."""
        delay = 0.5
        for attempt in range(8):
            try:
                return fn(*args, **kwargs)
            except ApiException as e:
                if e.status not in (429, 500, 502, 503, 504) and e.status != 0:
                    raise
                err = e
            except Exception as e:  # urllib3 connection errors
                err = e
            if attempt == 7 or self.stopping.wait(delay):
                raise err
            delay = min(delay * 2, 10)

    def _read(self, fn, *args) -> dict | None:
        try:
            return json.loads(self.call(fn, *args, _preload_content=False).data)
        except ApiException as e:
            if e.status == 404:
                return None
            raise

    def lookup_data(self, ns: str, kind: str, name: str) -> dict[str, bytes] | None:
        read = {"secret": self.core.read_namespaced_secret,
                "configMap": self.core.read_namespaced_config_map}[kind]  # fmt: skip
        obj = self._read(read, name, ns)
        return None if obj is None else podspec.decode_data(obj, kind)

    def lookup_env(self, ns: str, kind: str, name: str) -> dict[str, str] | None:
        data = self.lookup_data(ns, kind, name)
        return None if data is None else {k: v.decode(errors="replace") for k, v in data.items()}

    def pvc_path(self, ns: str, claim: str) -> str:
        pvc = self._read(self.core.read_namespaced_persistent_volume_claim, claim, ns)
        if pvc is None:
            raise ConfigError(f'persistentvolumeclaim "{claim}" not found', retriable=True)
        volume = pvc["spec"].get("volumeName")
        if not volume or pvc.get("status", {}).get("phase") != "Bound":
            raise ConfigError(f'volume claim "{claim}" is not bound yet', retriable=True)
        pv = self._read(self.core.read_persistent_volume, volume)
        if pv is None:
            raise ConfigError(f'persistentvolume "{volume}" not found', retriable=True)
        source = pv["spec"].get("hostPath") or pv["spec"].get("local")
        if not source:
            raise ConfigError(
                f'persistentvolume "{volume}" (claim "{claim}") is neither '
                "hostPath nor local: the executor can only mount host paths"
            )
        os.makedirs(source["path"], exist_ok=True)
        return source["path"]

    def finalize(self, pod: dict):
        """Delete a terminated pod for good (grace 0, UID precondition), once."""
        meta = pod["metadata"]
        with self.lock:
            if meta["uid"] in self.finalized:
                return
            self.finalized.add(meta["uid"])
        body = client.V1DeleteOptions(
            grace_period_seconds=0, preconditions=client.V1Preconditions(uid=meta["uid"])
        )
        try:
            self.call(self.core.delete_namespaced_pod, meta["name"], meta["namespace"], body=body)
            log.info("pod %s/%s finalized (deleted, grace 0)", meta["namespace"], meta["name"])
        except ApiException as e:
            if e.status not in (404, 409):
                log.warning(
                    "pod %s/%s: delete failed: %s", meta["namespace"], meta["name"], e.reason
                )

    # ----------------------------------------------------------------------------- node
    def node_status(self) -> dict:
        capacity = dict(podspec.NODE_ALLOCATABLE)
        stamp = now()
        conditions = [
            {
                "type": t,
                "status": s,
                "reason": r,
                "message": m,
                "lastHeartbeatTime": stamp,
                "lastTransitionTime": self.node_started,
            }
            for t, s, r, m in [
                ("MemoryPressure", "False", "KubeletHasSufficientMemory", "no memory pressure"),
                ("DiskPressure", "False", "KubeletHasNoDiskPressure", "no disk pressure"),
                ("PIDPressure", "False", "KubeletHasSufficientPID", "sufficient PID available"),
                ("Ready", "True", "KubeletReady", "tunepack pod executor is ready"),
            ]
        ]
        uname = os.uname()
        return {
            "status": {
                "capacity": capacity,
                "allocatable": capacity,
                "conditions": conditions,
                "addresses": [
                    {"type": "InternalIP", "address": "127.0.0.1"},
                    {"type": "Hostname", "address": self.node},
                ],
                "daemonEndpoints": {"kubeletEndpoint": {"Port": self.log_port}},
                "nodeInfo": {
                    "machineID": "tunepack-executor",
                    "systemUUID": "tunepack-executor",
                    "bootID": self.node_started,
                    "kernelVersion": uname.release,
                    "osImage": "tunepack pod executor (local processes)",
                    "containerRuntimeVersion": "executor://0.1",
                    "kubeletVersion": KUBELET_VERSION,
                    "kubeProxyVersion": "",
                    "operatingSystem": "linux",
                    "architecture": {"x86_64": "amd64", "aarch64": "arm64"}.get(
                        uname.machine, uname.machine
                    ),
                },
            }
        }

    def register_node(self):
        self.node_started = now()
        labels = {
            "kubernetes.io/hostname": self.node,
            "kubernetes.io/os": "linux",
            "kubernetes.io/arch": "amd64",
            "tunepack.dev/executor": "true",
        }
        try:
            self.call(self.core.create_node, {"metadata": {"name": self.node, "labels": labels}})
        except ApiException as e:
            if e.status != 409:
                raise
            patch = {"metadata": {"labels": labels, "annotations": {"kwok.x-k8s.io/node": None}}}
            self.call(self.core.patch_node, self.node, patch)
        self.call(self.core.patch_node_status, self.node, self.node_status())
        log.info("node %s registered (logs on 127.0.0.1:%d)", self.node, self.log_port)

    def heartbeat(self):
        while not self.stopping.wait(30):
            try:
                try:
                    self.call(self.core.patch_node_status, self.node, self.node_status())
                except ApiException as e:
                    if e.status != 404:
                        raise
                    self.register_node()
            except Exception as e:
                log.warning("node heartbeat failed: %s", e)

    # ----------------------------------------------------------------------------- pods
    def watch(self):
        rv, delay = None, 1
        while not self.stopping.is_set():
            try:
                if rv is None:
                    rv = self.relist()
                resp = self.watch_core.list_pod_for_all_namespaces(
                    field_selector=f"spec.nodeName={self.node}",
                    watch=True,
                    resource_version=rv,
                    allow_watch_bookmarks=True,
                    timeout_seconds=300,
                    _preload_content=False,
                    _request_timeout=(10, 330),
                )
                try:
                    for line in iter_resp_lines(resp):
                        event = json.loads(line)
                        obj = event["object"]
                        if event["type"] == "ERROR":
                            if obj.get("code") == 410:
                                rv = None
                                break
                            raise ApiException(status=obj.get("code"), reason=obj.get("message"))
                        rv = obj["metadata"]["resourceVersion"]
                        if event["type"] != "BOOKMARK":
                            self.on_pod(event["type"], obj)
                finally:
                    resp.release_conn()
                delay = 1
            except Exception as e:
                if self.stopping.is_set():
                    return
                log.warning("pod watch failed (%s); retrying in %d s", e, delay)
                if isinstance(e, ApiException) and e.status == 410:
                    rv = None
                self.stopping.wait(delay)
                delay = min(delay * 2, 30)

    def relist(self) -> str:
        resp = self.call(
            self.watch_core.list_pod_for_all_namespaces,
            field_selector=f"spec.nodeName={self.node}",
            _preload_content=False,
        )
        listing = json.loads(resp.data)
        present = {p["metadata"]["uid"] for p in listing["items"]}
        for pod in listing["items"]:
            self.on_pod("ADDED", pod)
        with self.lock:
            missing = [r.pod for uid, r in self.runners.items() if uid not in present]
        for pod in missing:
            self.on_pod("DELETED", pod)
        return listing["metadata"]["resourceVersion"]

    def on_pod(self, kind: str, pod: dict):
        if self.stopping.is_set():
            return
        meta, spec, status = pod["metadata"], pod["spec"], pod.get("status") or {}
        uid, deleting = meta["uid"], meta.get("deletionTimestamp")
        entry = (podspec.pod_hostname(pod), spec.get("subdomain"), meta["namespace"])
        with self.lock:
            runner = self.runners.get(uid)
            if kind == "DELETED":
                self.peers.pop(uid, None)
                self.runners.pop(uid, None)
            elif uid not in self.peers:
                self.peers[uid] = entry
        if kind == "DELETED":
            if runner is not None:
                with self.lock:
                    self.forgetting.add(runner)
                threading.Thread(target=self._forget, args=(runner,), daemon=True).start()
            self.update_hosts(entry)
            return
        if runner is not None:
            if deleting and runner.done.is_set():
                threading.Thread(target=self.finalize, args=(pod,), daemon=True).start()
            elif deleting:
                runner.request_termination(meta.get("deletionGracePeriodSeconds"))
            return
        if status.get("phase") in ("Succeeded", "Failed"):
            if deleting:
                threading.Thread(target=self.finalize, args=(pod,), daemon=True).start()
            return
        started = any(
            (c.get("state") or {}).get(s)
            for c in status.get("containerStatuses") or []
            for s in ("running", "terminated")
        )
        runner = PodRunner(self, pod, lost=started)
        if deleting:
            runner.request_termination(meta.get("deletionGracePeriodSeconds"))
        with self.lock:
            self.runners[uid] = runner
        log.info("pod %s/%s bound here (uid %s)", meta["namespace"], meta["name"], uid)
        runner.thread.start()
        self.update_hosts(entry)

    def _forget(self, runner: PodRunner):
        """The pod object is gone: stop its containers (the kubelet's minimum grace)."""
        runner.gone = True
        if not runner.done.is_set():
            runner.request_termination(0)
            runner.done.wait()
        runner.cleanup()
        with self.lock:
            self.forgetting.discard(runner)

    def write_hosts(self, runner: PodRunner):
        entry = (podspec.pod_hostname(runner.pod), runner.pod["spec"].get("subdomain"), runner.ns)
        with self.lock:
            content = podspec.hosts_file(entry, list(self.peers.values()), self.services).encode()
            runner.dir.mkdir(parents=True, exist_ok=True)
            # Rewritten in place (same inode) so the bind mounts over /etc/hosts see it.
            fd = os.open(runner.hosts, os.O_WRONLY | os.O_CREAT, 0o644)
            try:
                os.write(fd, content)
                os.ftruncate(fd, len(content))
            finally:
                os.close(fd)

    def refresh_services(self):
        """The cluster DNS stand-in for Services: one LIST as each pod starts (a Service made
        later reaches the hosts files of pods started later)."""
        listed = self._read(self.core.list_service_for_all_namespaces) or {}
        names = podspec.service_names(listed.get("items") or [])
        with self.lock:
            self.services = names

    def update_hosts(self, entry):
        _, subdomain, ns = entry
        if not subdomain:
            return
        with self.lock:
            group = [
                r
                for r in self.runners.values()
                if r.ns == ns and r.pod["spec"].get("subdomain") == subdomain and r.hosts.exists()
            ]
            for r in group:
                self.write_hosts(r)

    def make_mount_points(self, mounts: list[dict]):
        """Create missing top-level mount points on this machine (``/workspace``; remembered and
        removed at exit if empty). Deeper ones are the container init's: inside one of the
        container's volumes, or in a private overlay of the existing directory above them."""
        with self.lock:
            for m in mounts:
                missing = []
                p = Path(m["target"].rstrip("/") or "/")
                while not p.exists():
                    missing.append(p)
                    p = p.parent
                if not missing or p != Path("/"):
                    continue
                is_file = m["source"] is not None and not os.path.isdir(m["source"])
                for q in reversed(missing):
                    if q == Path(m["target"]) and is_file:
                        q.touch()
                    else:
                        q.mkdir()
                    self.created_paths.append(str(q))
                    log.info("created mount point %s on this machine", q)

    # ----------------------------------------------------------------------------- logs
    def serve_logs(self, handler, ns: str, pod: str, container: str, query: dict):
        with self.lock:
            runner = next((r for r in self.runners.values() if (r.ns, r.name) == (ns, pod)), None)
        path = self.root / "logs" / f"{ns}_{pod}_{container}.log"
        state = None
        if runner is not None:
            state = next((c for c in [*runner.init, *runner.main] if c.name == container), None)
            if state is None:
                return handler.send_text(
                    404, f'container "{container}" in pod "{pod}" is not available'
                )
        if query.get("previous") in ("true", "1"):
            path = path.with_suffix(".previous.log")
        if not path.exists():
            if state is not None:
                reason = state.waiting[0] if state.waiting else "ContainerCreating"
                return handler.send_text(
                    400, f'container "{container}" in pod "{pod}" is waiting to start: {reason}'
                )
            return handler.send_text(404, f'pod "{ns}/{pod}" not found on node {self.node}')
        follow = query.get("follow") in ("true", "1") and state is not None
        tail = query.get("tailLines")
        limit = int(query["limitBytes"]) if query.get("limitBytes") else None
        handler.send_response(200)
        handler.send_header("Content-Type", "text/plain; charset=utf-8")
        handler.end_headers()
        sent = 0
        with open(path, "rb") as f:
            if tail is not None:
                data = f.read()
                lines = data.splitlines(keepends=True)
                first = b"".join(lines[-int(tail) :]) if int(tail) > 0 else b""
                pending = [first]
            else:
                pending = []
            ended = not follow
            while True:
                chunk = pending.pop() if pending else f.read(65536)
                if chunk:
                    if limit is not None:
                        chunk = chunk[: limit - sent]
                    handler.wfile.write(chunk)
                    handler.wfile.flush()
                    sent += len(chunk)
                    if limit is not None and sent >= limit:
                        return
                elif ended:
                    return
                elif not state.running:
                    ended = True  # one more pass drains what it wrote last
                elif self.stopping.wait(0.2):
                    return

    # ----------------------------------------------------------------------------- stop
    def stop(self):
        self.stopping.set()
        with self.lock:
            runners = [*self.runners.values(), *self.forgetting]
        for r in runners:
            r.deletion.set()  # ends waits and keeps containers from (re)starting
            with r.lock:
                procs = list(r.procs.values())
            for p in procs:
                p.terminate()
        deadline = time.monotonic() + STOP_GRACE_S
        while time.monotonic() < deadline and any(r.procs for r in runners):
            time.sleep(0.1)
        for r in runners:
            r.kill_all()
        for r in runners:
            r.thread.join(timeout=5)
            r.cleanup()
        busy = mount_points_in_use()
        for path in reversed(self.created_paths):
            # e.g. another executor's container has a volume mounted there
            if path in busy or os.path.realpath(path) in busy:
                log.warning("left %s in place: a mount point in another mount namespace", path)
                continue
            try:
                if os.path.isdir(path):
                    os.rmdir(path)  # fails, as it should, when something was put there
                elif os.path.getsize(path) == 0:
                    os.unlink(path)
            except OSError as e:
                log.warning("left %s in place: %s", path, e)
        if self.own_scratch:
            shutil.rmtree(self.scratch, ignore_errors=True)
        if self.images is not None:
            self.images.unmount_all()
            oci.remove_cgroups()


class LogServer(http.server.ThreadingHTTPServer):
    daemon_threads = True

    def handle_error(self, request, client_address):
        log.info("log server: request from %s failed: %s", client_address, sys.exc_info()[1])


class LogHandler(http.server.BaseHTTPRequestHandler):
    executor: Executor

    def setup(self):
        self.request.settimeout(30)
        self.request.do_handshake()  # here, not in the accepting thread
        self.request.settimeout(None)
        super().setup()

    def do_GET(self):
        url = urllib.parse.urlsplit(self.path)
        parts = url.path.split("/")
        if len(parts) != 5 or parts[1] != "containerLogs":
            return self.send_text(404, f"no such endpoint: {url.path}")
        query = {k: v[-1] for k, v in urllib.parse.parse_qs(url.query).items()}
        try:
            self.executor.serve_logs(self, *parts[2:], query)
        except (BrokenPipeError, ConnectionResetError, ssl.SSLError):
            pass

    def send_text(self, code: int, text: str):
        body = (text + "\n").encode()
        self.send_response(code)
        self.send_header("Content-Type", "text/plain; charset=utf-8")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, fmt, *args):
        log.debug("log server: " + fmt, *args)


def serve_logs_forever(ex: Executor, cert: str, key: str) -> http.server.ThreadingHTTPServer:
    handler = type("Handler", (LogHandler,), {"executor": ex})
    server = LogServer(("127.0.0.1", ex.log_port), handler)
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.load_cert_chain(cert, key)
    server.socket = ctx.wrap_socket(server.socket, server_side=True, do_handshake_on_connect=False)
    threading.Thread(target=server.serve_forever, name="log-server", daemon=True).start()
    return server


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--kubeconfig", required=True)
    p.add_argument("--node", required=True)
    p.add_argument("--root", required=True)
    p.add_argument("--log-port", type=int, required=True)
    p.add_argument("--serving-cert", required=True)
    p.add_argument("--serving-key", required=True)
    p.add_argument(
        "--images",
        action="store_true",
        help="run each container from its pod's image (local container storage) through runc",
    )
    p.add_argument("--path", default=f"{Path(sys.executable).parent}:/usr/local/bin:/usr/bin:/bin")
    p.add_argument(
        "--config-wait",
        type=float,
        default=60,
        help="seconds to wait for a missing Secret/ConfigMap/key or an unbound PVC",
    )
    args = p.parse_args(argv)
    logging.basicConfig(
        level=logging.INFO,
        stream=sys.stderr,
        format=f"%(asctime)s executor[{args.node}] %(message)s",
    )
    ex = Executor(args)
    for s in (signal.SIGTERM, signal.SIGINT):
        signal.signal(s, lambda *_: ex.stopping.set())
    server = serve_logs_forever(ex, args.serving_cert, args.serving_key)
    try:
        ex.register_node()
        threading.Thread(target=ex.heartbeat, name="heartbeat", daemon=True).start()
        threading.Thread(target=ex.watch, name="watch", daemon=True).start()
        while not ex.stopping.wait(1):
            pass
    except Exception:
        if not ex.stopping.is_set():  # e.g. no API server: fail loudly
            raise
    finally:
        log.info("stopping: killing every container")
        ex.stop()
        server.shutdown()
        log.info("stopped")
    return 0


if __name__ == "__main__":
    sys.exit(main())
