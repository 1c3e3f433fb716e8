"""The control plane's pod executor starting containers: mounts, the pod's user, a command that
cannot start. What it computes for a pod (env, volumes, identity, hosts, status):
tests/unit/test_executor_units.py."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from tests.controlplane import podspec

needs_root = pytest.mark.skipif(
    os.geteuid() != 0 or not shutil.which("unshare") or not shutil.which("setpriv"),
    reason="the container init needs root, unshare and setpriv",
)


def run_init(tmp_path: Path, spec: dict) -> subprocess.CompletedProcess:
    """The executor's container init as PID 1 of fresh namespaces, as the executor starts it."""
    from tests.controlplane.executor import INIT_SCRIPT, NAMESPACES

    init = tmp_path / "init.py"
    init.write_text(INIT_SCRIPT)
    (tmp_path / "spec.json").write_text(json.dumps(spec))
    argv = [*NAMESPACES, sys.executable, "-I", "-S", str(init), str(tmp_path / "spec.json")]
    return subprocess.run(argv, capture_output=True, text=True, timeout=60)


@needs_root
@pytest.mark.parametrize("uid", [0, 1000])
def test_container_init_mounts_and_runs_as_the_user(tmp_path, uid):
    """The init the executor runs as PID 1 of each container: bind mounts, its own hosts file
    and hostname, the pod's user, the exit code of the command."""
    volume = tmp_path / "volume"
    volume.mkdir(mode=0o777)
    volume.chmod(0o777)
    hosts = tmp_path / "hosts"
    hosts.write_text(podspec.hosts_file(("job-node-0-0", "job", "ns"), []))
    # A mount point inside the volume (made by the init) and one outside (made beforehand).
    target = tmp_path / "mnt"
    target.mkdir()
    script = (
        "import json, os, socket, sys\n"
        "open('../out', 'w').write(str(os.getuid()))\n"  # cwd: <volume>/work
        "print(json.dumps([socket.gethostname(), socket.gethostbyname('job-node-0-0.job'),\n"
        "                  os.getpid(), os.getgroups(), os.environ['X'], sys.prefix]))\n"
        "sys.exit(75)\n"
    )
    spec = {
        # A bare name looked up in PATH, as pods say "python"
        "argv": [os.path.basename(sys.executable), "-c", script],
        "setpriv": shutil.which("setpriv"),
        "no_new_privs": True,
        "env": {"X": "y", "PATH": f"{os.path.dirname(sys.executable)}:/usr/bin:/bin"},
        "uid": uid,
        "gid": uid,
        "groups": [2000] if uid else [],
        "cwd": str(tmp_path / "mnt" / "work"),
        "hostname": "job-node-0-0",
        "mounts": [
            {
                "target": str(target),
                "source": str(volume),
                "read_only": False,
                "tmpfs_bytes": None,
                "is_file": False,
            },
            {
                "target": "/etc/hosts",
                "source": str(hosts),
                "read_only": True,
                "tmpfs_bytes": None,
                "is_file": True,
            },
        ],  # fmt: skip
        "error_file": str(tmp_path / "error"),
        "started_file": str(tmp_path / "started"),
    }
    done = run_init(tmp_path, spec)
    assert not (tmp_path / "error").exists(), (tmp_path / "error").read_text()
    assert done.returncode == 75, done.stdout + done.stderr
    name, address, pid, groups, x, prefix = json.loads(done.stdout)
    assert (name, address, groups, x) == ("job-node-0-0", "127.0.0.1", [2000] if uid else [], "y")
    assert 1 < pid < 10  # its own PID namespace
    assert prefix == sys.prefix  # the venv, even where only root may reach its base interpreter
    assert (volume / "out").read_text() == str(uid)  # written through the bind mount
    assert (volume / "work").is_dir()  # the working directory, made inside the volume
    assert not any(target.iterdir())  # the mount never showed on this machine
    assert Path("/etc/hosts").read_text() != hosts.read_text()
    assert (tmp_path / "started").exists()


@needs_root
def test_container_init_reports_a_command_that_cannot_start(tmp_path):
    spec = {"argv": ["no-such-program"], "setpriv": "setpriv", "no_new_privs": False,
            "env": {"PATH": "/usr/bin"}, "uid": 0, "gid": 0, "groups": [], "cwd": "/",
            "hostname": "h", "mounts": [], "error_file": str(tmp_path / "error"),
            "started_file": str(tmp_path / "s")}  # fmt: skip
    done = run_init(tmp_path, spec)
    assert done.returncode == 128
    assert 'exec: "no-such-program"' in (tmp_path / "error").read_text()


@needs_root
def test_container_init_makes_deep_mount_points_only_inside_the_container(tmp_path):
    """A service-account token's mount point (/var/run/secrets/...) made on this machine would
    turn every Kubernetes client here into an "in-cluster" one: the init makes missing mount
    points below existing system directories in a private overlay, and binds sources it opened
    before (an overlay of /tmp must not hide a volume under /tmp)."""
    import uuid

    volume = tmp_path / "volume"
    volume.mkdir()
    token = tmp_path / "token-volume"
    token.mkdir()
    (token / "token").write_text("secret-token")
    top = Path("/var/run") / f"tunepack-test-{uuid.uuid4().hex[:8]}"
    deep_tmp = Path(tempfile.gettempdir()) / f"tunepack-test-{uuid.uuid4().hex[:8]}" / "scratch"
    script = (
        f"print(open('{top}/serviceaccount/token').read())\n"
        f"open('{deep_tmp}/f', 'w').write('x')\n"
        f"try:\n    open('{top}/serviceaccount/x', 'w')\nexcept OSError as e:\n"
        "    print(e.strerror)\n"
    )
    spec = {
        "argv": [sys.executable, "-c", script], "setpriv": shutil.which("setpriv"),
        "no_new_privs": False, "env": {"PATH": "/usr/bin:/bin"}, "uid": 0, "gid": 0,
        "groups": [], "cwd": "/", "hostname": "h",
        "mounts": [
            {"target": str(deep_tmp), "source": str(volume), "read_only": False,
             "tmpfs_bytes": None, "is_file": False},
            {"target": f"{top}/serviceaccount", "source": str(token), "read_only": True,
             "tmpfs_bytes": None, "is_file": False},
        ],
        "overlay_dir": str(tmp_path / "overlays"),
        "error_file": str(tmp_path / "error"), "started_file": str(tmp_path / "started"),
    }  # fmt: skip
    try:
        done = run_init(tmp_path, spec)
        assert not (tmp_path / "error").exists(), (tmp_path / "error").read_text()
        assert done.returncode == 0, done.stdout + done.stderr
        assert done.stdout.split("\n")[:2] == ["secret-token", "Read-only file system"]
        assert (volume / "f").read_text() == "x"  # the real volume, under the overlaid /tmp
        assert not top.exists() and not deep_tmp.parent.exists()  # nothing left on this machine
    finally:
        shutil.rmtree(top, ignore_errors=True)
        shutil.rmtree(deep_tmp.parent, ignore_errors=True)


@needs_root
def test_container_init_lets_the_pods_user_start_this_interpreter(tmp_path):
    """The pod's user (1000) starts Python, and Python starts Python (torchrun's workers), even
    where the interpreter sits behind a directory only root may enter (/root/.pyenv here)."""
    from tests.controlplane.executor import REPO, reveal_map

    tmp_path.chmod(0o755)
    script = (
        "import subprocess, sys\n"
        "child = [sys.executable, '-c', 'import os, sys; print(sys.base_prefix, os.__file__)']\n"
        "print(subprocess.run(child, capture_output=True, text=True, check=True).stdout)\n"
    )
    spec = {
        "argv": [sys.executable, "-c", script], "setpriv": shutil.which("setpriv"),
        "no_new_privs": True, "env": {"PATH": "/usr/bin:/bin"}, "uid": 1000, "gid": 1000,
        "groups": [], "cwd": "/", "hostname": "h", "mounts": [],
        "reveal": reveal_map([sys.prefix, sys.base_prefix, REPO]),
        "error_file": str(tmp_path / "error"), "started_file": str(tmp_path / "started"),
    }  # fmt: skip
    done = run_init(tmp_path, spec)
    assert not (tmp_path / "error").exists(), (tmp_path / "error").read_text()
    assert done.returncode == 0, done.stdout + done.stderr
    base_prefix, os_file = done.stdout.split()
    # The child found this interpreter's own standard library, not some other Python's.
    assert base_prefix == sys.base_prefix and os_file.startswith(sys.base_prefix), done.stdout
