"""User mistakes and interruptions on the command line end in one clear line, the documented
exit code and no traceback: no or broken cluster configuration, an API server that cannot be
reached, a closed pipe, a workspace that cannot be one, Ctrl-C during a local run."""

from __future__ import annotations

import fcntl
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import termios
import time
from pathlib import Path

import psutil
import pytest

from tests.helpers import free_port, still_running, write_kubeconfig

EXIT_BAD_INPUT, EXIT_TRANSIENT, EXIT_INTERRUPTED, EXIT_BROKEN_PIPE = 65, 75, 130, 141
CLI = [sys.executable, "-m", "tunepack.cli"]


def tunepack(*args: str, env: dict | None = None, timeout: int = 120, **kw):
    return subprocess.run(
        [*CLI, *args], capture_output=True, text=True, env=env, timeout=timeout, **kw
    )


def assert_one_line_error(done, code: int, *fragments: str) -> str:
    assert done.returncode == code, done.stderr
    assert "Traceback" not in done.stderr + done.stdout
    lines = done.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("tunepack: error: "), done.stderr
    for fragment in fragments:
        assert fragment in lines[0]
    return lines[0]


def _env(home: Path, **extra: str) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("KUBECONFIG",)}
    env.pop("KUBERNETES_SERVICE_HOST", None)
    return {**env, "HOME": str(home), **extra}


CLUSTER_COMMANDS = {
    "status": ["status", "my-job"],
    "logs": ["logs", "my-job"],
    "install": ["install", "--runtime", "tunepack-tiny-llama3"],
    "train": ["train", "--runtime", "tiny-llama3", "--dataset", "hf://o/d", "--model", "hf://o/m"],
}


@pytest.mark.parametrize("command", sorted(CLUSTER_COMMANDS))
def test_no_kubeconfig_says_what_to_do(tmp_path, command):
    missing = tmp_path / "no-such-kubeconfig"
    done = tunepack(*CLUSTER_COMMANDS[command], env=_env(tmp_path, KUBECONFIG=str(missing)))
    line = assert_one_line_error(
        done,
        EXIT_BAD_INPUT,
        f"no Kubernetes configuration: $KUBECONFIG={missing} does not exist",
        "set KUBECONFIG to your cluster's kubeconfig",
    )
    # install has no local backend to offer; the others do.
    assert line.endswith("or add --local to use the local backend") == (command != "install")


def test_no_kubeconfig_and_no_kubeconfig_variable_names_the_default_file(tmp_path):
    done = tunepack("status", "my-job", env=_env(tmp_path))
    assert_one_line_error(
        done,
        EXIT_BAD_INPUT,
        f"~/.kube/config ({tmp_path}/.kube/config) does not exist, KUBECONFIG is not set",
        "or add --local",
    )


def test_training_client_without_a_kubeconfig_raises_tunepacks_line(tmp_path):
    """``TrainingClient()`` (a notebook, no cluster configured): tunepack's one line, a
    ``ValueError`` as the SDK raises for bad input, not the kubernetes library's wording
    (issue 28, item 5)."""
    code = (
        "from tunepack import TrainingClient\n"
        "try:\n"
        "    TrainingClient()\n"
        "except ValueError as err:\n"
        "    print(type(err).__name__, err)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        env=_env(tmp_path),
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout == (
        f"BadValueError no Kubernetes configuration: ~/.kube/config ({tmp_path}/.kube/config) "
        "does not exist, KUBECONFIG is not set, and this is not a Pod in a cluster; set "
        "KUBECONFIG to your cluster's kubeconfig, or pass LocalBackendConfig() to use the local "
        "backend\n"
    )


@pytest.mark.parametrize(
    ("content", "args", "fragments"),
    [
        ("clusters: [oops\n", [], ["not valid YAML at line 2", "fix the file"]),
        ("- a list\n", [], ["not a kubeconfig", "fix the file"]),
        (None, ["--context", "nope"], ["Expected object with name nope", "--context"]),
    ],
    ids=["not-yaml", "not-a-mapping", "unknown-context"],
)
def test_broken_kubeconfig_names_the_file(tmp_path, content, args, fragments):
    kubeconfig = tmp_path / "config"
    if content is None:
        write_kubeconfig(kubeconfig, "https://127.0.0.1:1")
    else:
        kubeconfig.write_text(content)
    done = tunepack("status", "my-job", *args, env=_env(tmp_path, KUBECONFIG=str(kubeconfig)))
    assert_one_line_error(done, EXIT_BAD_INPUT, str(kubeconfig), *fragments)


@pytest.mark.parametrize("command", sorted(CLUSTER_COMMANDS))
def test_unreachable_api_server_is_one_transient_line(tmp_path, command):
    server = f"https://127.0.0.1:{free_port()}"
    kubeconfig = write_kubeconfig(tmp_path / "config", server)
    started = time.monotonic()
    done = tunepack(*CLUSTER_COMMANDS[command], env=_env(tmp_path, KUBECONFIG=str(kubeconfig)))
    assert_one_line_error(
        done,
        EXIT_TRANSIENT,
        f"cannot reach the Kubernetes API server {server} (connection refused)",
        "check that the cluster is running",
    )
    assert time.monotonic() - started < 60  # no retry loop before the answer


def test_connection_lost_after_the_check_is_transient_and_names_the_server():
    """The SDK wraps a refused connection in RuntimeError; that is exit 75, not a bug."""
    from kubernetes.client.exceptions import ApiException
    from urllib3.exceptions import MaxRetryError, NewConnectionError

    from tunepack.cli.cluster import is_connection_error

    refused = NewConnectionError(None, "Failed to establish a new connection: refused")
    lost = RuntimeError("Failed to get TrainJob: default/j")
    lost.__cause__ = MaxRetryError(None, "/apis", refused)
    assert is_connection_error(lost.__cause__)
    assert not is_connection_error(ApiException(status=404, reason="Not Found"))
    assert not is_connection_error(None)


def test_closed_pipe_ends_quietly():
    """`tunepack runtimes | head -1`: the reader is gone before the first write."""
    proc = subprocess.Popen(CLI + ["runtimes"], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    proc.stdout.close()
    assert proc.wait(timeout=120) == EXIT_BROKEN_PIPE
    assert proc.stderr.read() == b""  # no traceback, no "Exception ignored" at exit
    proc.stderr.close()


def test_version_prints_the_package_version():
    from importlib.metadata import version

    done = tunepack("--version")
    assert done.returncode == 0
    assert done.stdout == f"tunepack {version('tunepack')}\n"


# Sources that exist (a file, a directory), so that the workspace is what gets refused; nothing
# reads them: every case here stops before a step runs.
_SOURCES = ("--dataset", __file__, "--model", os.path.dirname(__file__))


def _local_train(workspace: str, *args: str) -> list[str]:
    return [
        "train", "--local", "--runtime", "tiny-llama3", "--workspace", workspace, *_SOURCES, *args,
    ]  # fmt: skip


def test_workspace_that_is_a_file(tmp_path):
    target = tmp_path / "ws"
    target.write_text("not a directory")
    done = tunepack(*_local_train(str(target)))
    assert_one_line_error(
        done, EXIT_BAD_INPUT, f"--workspace {target} is a file, not a directory", "give a directory"
    )
    assert done.stdout == ""  # refused before the run starts


def test_workspace_below_a_file(tmp_path):
    (tmp_path / "file").write_text("")
    target = tmp_path / "file" / "ws"
    done = tunepack(*_local_train(str(target)))
    assert_one_line_error(
        done,
        EXIT_BAD_INPUT,
        f"--workspace {target} cannot be written: {tmp_path / 'file'} is a file",
    )
    assert done.stdout == ""


@pytest.mark.parametrize("inside", [False, True], ids=["read-only-dir", "below-read-only-dir"])
def test_read_only_workspace(inside):
    # root writes anywhere: as root the CLI runs as nobody (setpriv), in a directory nobody reaches.
    prefix = []
    if os.geteuid() == 0:
        setpriv = shutil.which("setpriv")
        if setpriv is None:
            pytest.skip("running as root without setpriv: a read-only directory is writable")
        prefix = [setpriv, "--reuid=65534", "--regid=65534", "--clear-groups"]
    base = Path(tempfile.mkdtemp(prefix="tunepack-ro-"))
    readonly = base / "ro"
    try:
        base.chmod(0o755)
        readonly.mkdir()
        readonly.chmod(0o555)
        target = readonly / "ws" if inside else readonly
        done = subprocess.run(
            [*prefix, *CLI, *_local_train(str(target))],
            capture_output=True,
            text=True,
            env={**os.environ, "HOME": str(base)},
            cwd=base,
            timeout=120,
        )
        assert_one_line_error(
            done,
            EXIT_BAD_INPUT,
            f"--workspace {target} cannot be written: {readonly} is not writable "
            "(permission denied)",
            "give a directory you can write to",
        )
        assert done.stdout == ""
        assert list(readonly.iterdir()) == []
    finally:
        if readonly.exists():
            readonly.chmod(0o755)
        shutil.rmtree(base, ignore_errors=True)


# Ctrl-C during a local run ------------------------------------------------------------------


def _start_training(tmp_path, tiny_model_dir, tiny_dataset_file, *extra: str, **popen):
    workspace = tmp_path / "ws"
    proc = subprocess.Popen(
        [
            *CLI, "train", "--local", "--runtime", "tiny-llama3",
            "--workspace", str(workspace), "--dataset", f"file://{tiny_dataset_file}",
            "--model", f"file://{tiny_model_dir}", *extra, "epochs=50",
        ],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **popen,
    )  # fmt: skip
    return proc, workspace


def _wait_for_training(proc, workspace: Path, seen: dict[int, psutil.Process]) -> None:
    """Until the trainer logged its first step, remembering every process below the CLI."""
    log = workspace / "logs" / "node.log"
    # A bound for a run that never starts, not a speed: a loaded machine takes minutes to get
    # two initializers and torchrun to a first step.
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        assert proc.poll() is None, proc.communicate()
        for child in psutil.Process(proc.pid).children(recursive=True):
            seen.setdefault(child.pid, child)
        if log.exists() and '"event": "step"' in log.read_text():
            return
        time.sleep(0.1)
    proc.kill()
    pytest.fail(f"training did not start within 300 s: {proc.communicate()}")


def _left_running(seen: dict[int, psutil.Process], pgid: int) -> list[int]:
    alive = [p.pid for p in seen.values() if still_running(p)]
    for proc in psutil.process_iter():  # anything else still in the run's process group
        try:
            if os.getpgid(proc.pid) == pgid and still_running(proc):
                alive.append(proc.pid)
        except (OSError, psutil.Error):
            continue
    return alive


def _assert_stopped(proc, workspace: Path, out: str, err: str, seen) -> None:
    assert proc.returncode == EXIT_INTERRUPTED, err
    assert "Traceback" not in out + err
    lines = err.splitlines()
    assert lines[0].startswith("tunepack: interrupted (Ctrl-C): stopping run ")
    assert lines[-1].startswith("tunepack: run ") and "stopped, no process of it left" in lines[-1]
    assert f"run the same command again (it resumes in {workspace})" in lines[-1]
    assert seen, "no step process was seen"
    assert _left_running(seen, proc.pid) == []


def test_ctrl_c_to_the_cli_stops_the_run_after_a_checkpoint(
    tmp_path, tiny_model_dir, tiny_dataset_file
):
    """SIGINT to the CLI alone (`kill -INT`): the steps are asked to stop as a Pod is."""
    proc, workspace = _start_training(
        tmp_path, tiny_model_dir, tiny_dataset_file, start_new_session=True
    )
    seen: dict[int, psutil.Process] = {}
    try:
        _wait_for_training(proc, workspace, seen)
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    _assert_stopped(proc, workspace, out, err, seen)
    assert list((workspace / "checkpoints").glob("step-*")), "the trainer did not checkpoint"
    assert not (workspace / "output" / "result.json").exists()


def _controlling_terminal(slave: int):
    def become_session_leader():
        os.setsid()
        fcntl.ioctl(slave, termios.TIOCSCTTY, 0)

    return become_session_leader


@pytest.mark.parametrize("layout", [(), ("--num-proc-per-node", "2")], ids=["one", "two"])
def test_ctrl_c_at_a_terminal_stops_the_run_after_a_checkpoint(
    tmp_path, tiny_model_dir, tiny_dataset_file, layout
):
    """Ctrl-C typed at a terminal: the terminal signals the CLI and its steps together (with two
    processes, torchrun and its workers too: they are in the CLI's process group); the trainer is
    not signalled twice (which would make it die without its checkpoint)."""
    master, slave = os.openpty()
    try:
        proc, workspace = _start_training(
            tmp_path,
            tiny_model_dir,
            tiny_dataset_file,
            *layout,
            stdin=slave,
            preexec_fn=_controlling_terminal(slave),
        )
        seen: dict[int, psutil.Process] = {}
        try:
            _wait_for_training(proc, workspace, seen)
            os.write(master, termios.tcgetattr(master)[6][termios.VINTR])  # Ctrl-C
            out, err = proc.communicate(timeout=60)
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
    finally:
        os.close(slave)
        os.close(master)
    _assert_stopped(proc, workspace, out, err, seen)
    assert list((workspace / "checkpoints").glob("step-*")), "the trainer did not checkpoint"


def test_a_stopped_local_job_shows_as_stopped_and_resumable(tmp_path, tiny_model_dir):
    """Ctrl-C to `train --local` while the dataset initializer downloads (from a server that
    answers only once the test is over): the job is Stopped, not Failed, in `tunepack status`,
    `tunepack jobs` and `get_job()`, with how to resume it; `wait_for_job_status` says so at
    once rather than wait for a job that will not go on."""
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    from tunepack import LocalBackendConfig, TrainingClient

    asked, over = threading.Event(), threading.Event()

    class Hanging(BaseHTTPRequestHandler):
        def do_GET(self):
            asked.set()
            over.wait(120)

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Hanging)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    jobs, workspace = tmp_path / "jobs", tmp_path / "ws"
    given = ["--local", "--jobs-dir", str(jobs)]
    proc = subprocess.Popen(
        [
            *CLI, "train", *given, "--runtime", "tiny-llama3", "--name", "stopme",
            "--workspace", str(workspace), "--model", f"file://{tiny_model_dir}",
            "--dataset", f"http://127.0.0.1:{server.server_address[1]}/d.jsonl",
        ],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
    )  # fmt: skip
    try:
        assert asked.wait(120), "the dataset initializer never asked the server"
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        over.set()
        server.shutdown()
        server.server_close()
    assert proc.returncode == EXIT_INTERRUPTED, err
    message = (
        "stopped (Ctrl-C) in step 'dataset-initializer'; to resume, run the same command "
        f"again (it resumes in {workspace})"
    )
    status = tunepack("status", "stopme", *given)
    assert status.returncode == EXIT_TRANSIENT, status.stderr
    lines = status.stdout.splitlines()
    assert lines[0] == "stopme  Stopped  runtime tunepack-tiny-llama3"
    assert lines[1] == f"  {'dataset-initializer':<22}Stopped"
    assert lines[-1] == f"  message: {message}"
    listed = tunepack("jobs", *given)
    assert listed.returncode == 0, listed.stderr
    row = listed.stdout.splitlines()[1].split()
    assert row[:3] == ["stopme", "tunepack-tiny-llama3", "Stopped"], listed.stdout
    client = TrainingClient(LocalBackendConfig(root_dir=str(jobs)))
    job = client.get_job("stopme")
    assert (job.status, job.message, job.exit_code) == ("Stopped", message, EXIT_TRANSIENT)
    with pytest.raises(RuntimeError) as raised:
        client.wait_for_job_status("stopme", timeout=600, polling_interval=1)
    assert str(raised.value) == f"TrainJob stopme is Stopped: {message}"


def test_install_dry_run_prints_the_objects_without_a_cluster(tmp_path):
    """`tunepack install --dry-run` with no kubeconfig at all: the objects it would apply, as
    YAML documents (as `kubectl apply --dry-run=client -o yaml` shows them), and one line saying
    nothing was applied."""
    import yaml

    from tunepack.tools.images import ImageSource
    from tunepack.tools.install import admission_objects, runtime_objects

    args = ["--runtime", "tunepack-tiny-llama3", "--registry", "registry.example.com/ml"]
    done = tunepack("install", "--dry-run", *args, env=_env(tmp_path))
    assert done.returncode == 0, done.stderr
    assert done.stderr == (
        "tunepack: dry run: 3 objects, none applied (no cluster was asked; the image check runs "
        "at install)\n"
    )
    expected = (
        runtime_objects(
            ["tunepack-tiny-llama3"], images=ImageSource.parse("registry.example.com/ml", None)
        )
        + admission_objects()
    )
    assert list(yaml.safe_load_all(done.stdout)) == expected
    assert done.stdout.startswith(
        "---\napiVersion: trainer.kubeflow.org/v1alpha1\nkind: ClusterTrainingRuntime\n"
    )
    assert "image: registry.example.com/ml/" in done.stdout
    namespaced = tunepack("install", "--dry-run", *args, "--namespace", "ml", env=_env(tmp_path))
    assert namespaced.returncode == 0, namespaced.stderr
    [runtime] = yaml.safe_load_all(namespaced.stdout)
    assert (runtime["kind"], runtime["metadata"]["namespace"]) == ("TrainingRuntime", "ml")
    assert namespaced.stderr.startswith("tunepack: dry run: 1 object, none applied")
