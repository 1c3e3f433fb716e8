"""A run owns its processes and its workspace (issue 14, items 2, 3 and 5).

- one run per workspace: a second run, by the CLI or the trainer program on its own, is refused
  with who holds it (exit 75), and the first run's checkpoints and result are untouched;
- the lock is held by every process of the run, so it outlives no process of it;
- the CLI's process group hung up (SIGHUP) or terminated (SIGTERM, as a timeout or systemd sends
  it): no process of the run is left, the trainer checkpoints first (two processes, torchrun),
  and the same command resumes;
- the CLI's process group killed outright (SIGKILL: ``timeout -s KILL``, a CI runner): every
  process of the run is gone and none writes anything after it (issue 28, 4).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from tests.helpers import still_running
from tunepack.core.errors import WorkspaceBusyError
from tunepack.core.workspace import LOCK_FD_ENV, LOCK_FILE, lock_workspace

CLI = [sys.executable, "-m", "tunepack.cli"]

# --- the lock itself -----------------------------------------------------------------------------


def test_a_second_lock_is_refused_with_who_holds_it(tmp_path):
    with lock_workspace(tmp_path, "local TrainJob 'first'") as held:
        assert held.owned
        with pytest.raises(WorkspaceBusyError) as caught:
            lock_workspace(tmp_path, "local TrainJob 'second'")
    message = str(caught.value)
    assert message.startswith(f"workspace {tmp_path} is in use by local TrainJob 'first' (pid ")
    assert f"pid {os.getpid()} on host " in message
    assert "wait for that run to end (or stop it), or use another workspace" in message
    assert caught.value.exit_code == 75
    with lock_workspace(tmp_path, "local TrainJob 'second'"):  # free once released
        pass


def test_the_lock_is_held_until_the_last_process_that_inherited_it_exits(tmp_path):
    """The holder hands the lock down; killing the holder does not free it while a child lives."""
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import os, subprocess, sys, time\n"
            "from pathlib import Path\n"
            "from tunepack.core.workspace import lock_workspace\n"
            f"lock = lock_workspace(Path({str(tmp_path)!r}), 'holder')\n"
            "child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'],\n"
            "                         env={**os.environ, **lock.env()}, pass_fds=(lock.fd,))\n"
            "print(child.pid, flush=True)\n"
            "time.sleep(60)\n",
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    child = psutil.Process(int(holder.stdout.readline()))
    try:
        holder.kill()
        holder.wait()
        with pytest.raises(WorkspaceBusyError, match=r"in use by holder \(pid \d+"):
            lock_workspace(tmp_path, "next run")
        child.kill()
        child.wait(10)
        with lock_workspace(tmp_path, "next run") as lock:
            assert lock.owned
    finally:
        for proc in (holder, child):
            try:
                proc.kill()
            except (ProcessLookupError, psutil.Error):
                pass


def test_a_process_holds_the_lock_until_its_last_thread_has_exited(tmp_path):
    """A process whose main thread has exited is a zombie to psutil while its other threads run
    on, with the lock still held: the kill tests wait for ``still_running`` to be False, not for
    the zombie state (a SIGKILLed trainer's threads exit one by one on a loaded machine)."""
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import ctypes, sys, threading\n"
            "from pathlib import Path\n"
            "from tunepack.core.workspace import lock_workspace\n"
            f"lock = lock_workspace(Path({str(tmp_path)!r}), 'holder')\n"
            "threading.Thread(target=sys.stdin.read).start()  # until the test closes stdin\n"
            "print('locked', flush=True)\n"
            "ctypes.CDLL(None).pthread_exit(None)  # the main thread only\n",
        ],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout.readline() == "locked\n"
        proc = psutil.Process(holder.pid)
        deadline = time.monotonic() + 60  # guards a hang only: the main thread exits at once
        while proc.status() != psutil.STATUS_ZOMBIE and time.monotonic() < deadline:
            time.sleep(0.01)
        assert proc.status() == psutil.STATUS_ZOMBIE and still_running(proc)
        with pytest.raises(WorkspaceBusyError, match=r"in use by holder \(pid \d+"):
            lock_workspace(tmp_path, "next run")
        holder.stdin.close()  # the last thread returns
        holder.wait(60)
        assert not still_running(proc)
        with lock_workspace(tmp_path, "next run") as lock:
            assert lock.owned
    finally:
        holder.kill()
        holder.wait()


def test_a_process_that_inherited_the_lock_takes_it_as_its_own(tmp_path, monkeypatch):
    with lock_workspace(tmp_path, "runner") as held:
        monkeypatch.setenv(LOCK_FD_ENV, str(held.fd))
        inherited = lock_workspace(tmp_path, "trainer")
        assert inherited is not None and not inherited.owned
        inherited.release()  # does not release the holder's
        monkeypatch.delenv(LOCK_FD_ENV)
        with pytest.raises(WorkspaceBusyError):
            lock_workspace(tmp_path, "other")
    # An inherited number that is open on another file is not the lock.
    with (tmp_path / "other-file").open("w") as other:
        monkeypatch.setenv(LOCK_FD_ENV, str(other.fileno()))
        with lock_workspace(tmp_path, "trainer") as own:
            assert own.owned


# --- runs --------------------------------------------------------------------------------------


def _train_command(workspace: Path, model: Path, dataset: Path, *args: str) -> list[str]:
    return [
        *CLI, "train", "--local", "--runtime", "tiny-llama3", "--workspace", str(workspace),
        "--dataset", f"file://{dataset}", "--model", f"file://{model}", *args,
    ]  # fmt: skip


def _start(command: list[str], tmp_path: Path, name: str) -> subprocess.Popen:
    env = {**os.environ, "TUNEPACK_HOME": str(tmp_path / "home")}
    return subprocess.Popen(
        command,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        start_new_session=True,  # its own process group, as a shell job is
    )


def _wait_for_steps(proc, workspace: Path, seen: dict[int, psutil.Process], steps: int = 1):
    """Until the trainer logged ``steps`` steps, remembering every process below the CLI."""
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        assert proc.poll() is None, proc.communicate()
        try:
            for child in psutil.Process(proc.pid).children(recursive=True):
                seen.setdefault(child.pid, child)
        except psutil.Error:
            pass
        log = _trainer_log(workspace)
        if log.exists() and log.read_text().count('"event": "step"') >= steps:
            return
        time.sleep(0.1)
    os.killpg(proc.pid, signal.SIGKILL)
    pytest.fail(f"training did not reach step {steps} within 120 s: {proc.communicate()}")


def _trainer_log(workspace: Path, under: str = "") -> Path:
    """The (first) trainer node's log: node.log, or node-0.log where there are several nodes."""
    logs = workspace / "logs" / under
    several = logs / "node-0.log"
    return several if several.exists() else logs / "node.log"


def _wait_all_gone(seen: dict[int, psutil.Process], timeout: float = 90) -> list[str]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not any(still_running(p) for p in seen.values()):
            return []
        time.sleep(0.2)
    left = []
    for proc in seen.values():
        try:
            if still_running(proc):
                left.append(" ".join(proc.cmdline()[:6]))
                proc.kill()
        except psutil.Error:
            continue
    return left


def _files(root: Path) -> dict[Path, float]:
    """Every file under ``root`` and its modification time."""
    found = {}
    for path in root.rglob("*"):
        try:
            if path.is_file():
                found[path] = path.stat().st_mtime
        except OSError:
            continue  # removed while listed
    return found


def _torchrun_seen(seen: dict[int, psutil.Process]) -> bool:
    for proc in seen.values():
        try:
            if "tunepack.trainers.process.torchrun" in " ".join(proc.cmdline()):
                return True
        except psutil.Error:
            continue
    return False


def test_a_second_run_on_a_busy_workspace_is_refused_and_the_first_finishes(
    tmp_path, tiny_model_dir, tiny_dataset_file
):
    workspace = tmp_path / "ws"
    first = _start(
        _train_command(workspace, tiny_model_dir, tiny_dataset_file, "--name", "first", "epochs=2"),
        tmp_path,
        "first",
    )
    seen: dict[int, psutil.Process] = {}
    try:
        _wait_for_steps(first, workspace, seen)
        # Held still while the two refusals are tried (it keeps its lock), so that on a loaded
        # machine it cannot finish first and leave the workspace free (seen once in CI).
        os.killpg(first.pid, signal.SIGSTOP)
        # Another job, other arguments, same workspace: it would have deleted the first's
        # checkpoints ("starting fresh"). It is refused before any step runs.
        second = subprocess.run(
            _train_command(
                workspace, tiny_model_dir, tiny_dataset_file, "--name", "second", "lora_rank=4"
            ),
            capture_output=True,
            text=True,
            env={**os.environ, "TUNEPACK_HOME": str(tmp_path / "home")},
            timeout=120,
        )
        assert second.returncode == 75, second.stderr
        assert "Traceback" not in second.stdout + second.stderr
        error = second.stderr.strip().splitlines()[-1]
        assert error.startswith(f"tunepack: error: workspace {workspace} is in use by local ")
        assert "TrainJob 'first' (pid " in error
        # The trainer program on its own (as a user or a second Pod might start it) is refused too.
        alone = subprocess.run(
            [sys.executable, "-m", "tunepack.trainers.launch", "epochs=1"],
            capture_output=True,
            text=True,
            env={
                **os.environ,
                "TUNEPACK_WORKSPACE": str(workspace),
                "TUNEPACK_MODEL": "tiny-llama3",
            },
            timeout=120,
        )
        assert alone.returncode == 75, alone.stderr
        assert alone.stderr.strip().startswith(
            f"trainer: error: workspace {workspace} is in use by local TrainJob 'first'"
        )
        os.killpg(first.pid, signal.SIGCONT)
        out, err = first.communicate(timeout=600)
    finally:
        if first.poll() is None:
            os.killpg(first.pid, signal.SIGCONT)
            os.killpg(first.pid, signal.SIGKILL)
    assert first.returncode == 0, err
    result = json.loads((workspace / "output" / "result.json").read_text())
    assert result["final_loss"] < result["first_loss"]
    config = (workspace / "output" / "config.yaml").read_text()
    assert "lora_rank: 4" not in config  # the refused run changed nothing
    assert (workspace / LOCK_FILE).exists()


TWO_PROCESSES = ("--num-proc-per-node", "2")
TWO_NODES = ("--num-nodes", "2", "--num-proc-per-node", "1")


@pytest.mark.slow
@pytest.mark.parametrize(
    ("how", "expected_cli_code", "layout"),
    [
        pytest.param(signal.SIGKILL, -signal.SIGKILL, TWO_PROCESSES, id="SIGKILL-to-the-group"),
        pytest.param(signal.SIGHUP, 128 + signal.SIGHUP, TWO_PROCESSES, id="SIGHUP-to-the-group"),
        pytest.param(
            signal.SIGTERM, 128 + signal.SIGTERM, TWO_PROCESSES, id="SIGTERM-to-the-group"
        ),
        pytest.param(signal.SIGKILL, -signal.SIGKILL, TWO_NODES, id="SIGKILL-two-nodes"),
    ],
)
def test_signals_to_the_cli_process_group_leave_nothing_running_and_the_run_resumes(
    tmp_path, tiny_model_dir, tiny_dataset_file, how, expected_cli_code, layout
):
    """Two processes under torchrun, or two nodes (two launchers, each with torchrun, sharing
    the workspace and its lock). SIGHUP (the terminal closed) and SIGTERM (``kill -- -PGID``, a
    timeout, systemd): every process gets the signal directly and from its parent, taken as one
    request; the trainer checkpoints. SIGKILL (``timeout -s KILL``, a CI runner): no process of
    the run outlives it, and no checkpoint or result is written after it (torchrun and its
    workers are in the CLI's process group). Each way nothing is left running, the
    workspace is free, and the same command resumes (from the checkpoint, where one was
    written)."""
    workspace = tmp_path / "ws"
    command = _train_command(
        workspace, tiny_model_dir, tiny_dataset_file, "--name", "job", *layout,
        "epochs=5", "max_steps=30",
    )  # fmt: skip
    proc = _start(command, tmp_path, "job")
    seen: dict[int, psutil.Process] = {}
    try:
        _wait_for_steps(proc, workspace, seen, steps=2)
        assert _torchrun_seen(seen), "the run did not start torchrun"
        before = _files(workspace)
        os.killpg(proc.pid, how)
        if how == signal.SIGKILL:
            # Every process ends (the workers, in torchrun's sessions, die with their parents:
            # tunepack.core.lifetime). How long the kernel takes to tear them down depends on the
            # machine, so no deadline is the rule (90 s only guards a hang): a process that
            # outlived the kill would train on to max_steps and write its result and checkpoint;
            # one that was dying can write neither.
            survivors = _wait_all_gone(seen)
            created = sorted(
                str(p.relative_to(workspace))
                for p in set(_files(workspace)) - set(before)
                if p.is_relative_to(workspace / "checkpoints")
                or p.is_relative_to(workspace / "output")
            )
        out, err = proc.communicate(timeout=120)
        left = _wait_all_gone(seen)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert left == [], f"still running after {how.name}: {left}"
    assert proc.returncode == expected_cli_code, err
    assert "Traceback" not in out + err
    log_name = _trainer_log(workspace).name
    log = _trainer_log(workspace).read_text()
    assert "Traceback" not in log and "BrokenPipeError" not in log
    assert not list(workspace.rglob("*.partial")), "a partial checkpoint was left visible"
    with lock_workspace(workspace, "the test"):  # free: no process of the run holds it
        pass
    checkpoints = sorted(
        int(p.name.split("-")[1]) for p in (workspace / "checkpoints").glob("step-*")
    )
    if how != signal.SIGKILL:
        assert f"stopped, no process of it left ({how.name})" in err.splitlines()[-1]
        assert "stopping after this step" in log
        assert checkpoints, "the trainer did not checkpoint before stopping"
        return  # resuming after each of them is the same; once (below) is enough

    assert survivors == [], f"still running after the group SIGKILL: {survivors}"
    assert created == [], f"written after the kill: {created}"
    assert "stopping after this step" not in log
    assert checkpoints == []  # none by time (10 minutes) yet, none on the way out

    again = subprocess.run(
        command, capture_output=True, text=True, timeout=900,
        env={**os.environ, "TUNEPACK_HOME": str(tmp_path / "home")},
    )  # fmt: skip
    assert again.returncode == 0, again.stderr
    result = json.loads((workspace / "output" / "result.json").read_text())
    assert result["final_loss"] < result["first_loss"]
    # The killed run's logs were kept, not overwritten.
    assert (workspace / "logs" / "previous" / "1" / log_name).read_text() == log


@pytest.mark.slow
def test_the_kill_and_resume_soak_ends_bit_identical(tmp_path):
    """A short run of benchmarks/kill_resume_soak.py (the long one: ``--kills 10 --nproc 2``):
    SIGKILLed twice at random moments, resumed each time, identical to an uninterrupted run."""
    report_path = tmp_path / "report.json"
    done = subprocess.run(
        [
            sys.executable, "benchmarks/kill_resume_soak.py", "--kills", "2", "--max-steps", "6",
            "--seed", "3", "--json", str(report_path),
        ],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    report = json.loads(report_path.read_text())
    assert report["kills"] == 2 and report["attempts"] == 3
    assert report["adapter_identical"] and report["each_step_once_in_metrics"]
    assert report["steps"] == 6


_PF_EXITING = 0x4  # include/linux/sched.h: the process is in do_exit
_SIGKILL_BIT = 1 << (signal.SIGKILL - 1)


def _reached_by_a_kill(pid: int) -> bool:
    """Whether ``pid`` can run no more code of its own: gone, a zombie, exiting, or with SIGKILL
    pending (what ``kill(2)`` leaves in every process it reached, before the kernel tears it down,
    however loaded the machine). Pending signals are read before the flags: a process that has
    taken SIGKILL off its queue is marked exiting by then."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return True  # gone (and reaped)
    pending = 0
    for line in status.splitlines():
        if line.startswith(("SigPnd:", "ShdPnd:")):
            pending |= int(line.split(":", 1)[1], 16)
    return fields[0] in "ZX" or bool(int(fields[6]) & _PF_EXITING) or bool(pending & _SIGKILL_BIT)


def _run_processes(proc: subprocess.Popen) -> dict[int, str]:
    """Every process below the CLI now, with its command line."""
    found = {}
    for child in psutil.Process(proc.pid).children(recursive=True):
        try:
            found[child.pid] = " ".join(child.cmdline()[:6])
        except psutil.Error:
            continue
    return found


@pytest.mark.slow
def test_a_sigkill_to_the_cli_process_group_reaches_every_process_of_the_run_at_once(
    tmp_path, tiny_model_dir, tiny_dataset_file
):
    """``kill -9 -- -PGID`` (``timeout -s KILL``, a CI runner) of a two-process run: torchrun and
    its workers are in the CLI's process group, so the one kill reaches each of them; none lives
    on to die later of its parent's death. Checked once the CLI itself is reaped, with no wait."""
    workspace = tmp_path / "ws"
    command = _train_command(
        workspace, tiny_model_dir, tiny_dataset_file, "--name", "job", *TWO_PROCESSES,
        "epochs=5", "max_steps=30",
    )  # fmt: skip
    proc = _start(command, tmp_path, "job")
    seen: dict[int, psutil.Process] = {}
    try:
        _wait_for_steps(proc, workspace, seen)
        run = _run_processes(proc)
        groups = {pid: os.getpgid(pid) for pid in run}
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()  # waitpid: the CLI is gone; nothing else was waited for
        left = {pid: run[pid] for pid in run if not _reached_by_a_kill(pid)}
        proc.communicate()
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        gone = _wait_all_gone(seen)  # the orphans' teardown, before the workspace goes
    assert sum("tunepack.trainers.worker" in c for c in run.values()) == 2, run
    assert any("tunepack.trainers.process.torchrun" in c for c in run.values()), run
    assert left == {}, f"not reached by the group's SIGKILL: {left}"
    elsewhere = {f"{pid} {run[pid]}": pgid for pid, pgid in groups.items() if pgid != proc.pid}
    assert elsewhere == {}, f"not in the CLI's process group {proc.pid}: {elsewhere}"
    assert gone == []


def _worker_of_rank(proc: subprocess.Popen, rank: int) -> int:
    for child in psutil.Process(proc.pid).children(recursive=True):
        try:
            if "tunepack.trainers.worker" in child.cmdline() and (
                child.environ().get("RANK") == str(rank)
            ):
                return child.pid
        except psutil.Error:
            continue
    raise AssertionError(f"no worker of rank {rank} below the CLI")


@pytest.mark.slow
def test_a_worker_killed_by_a_signal_is_named_and_the_run_resumes(
    tmp_path, tiny_model_dir, tiny_dataset_file
):
    """One worker of a two-process run killed (``kill -9``, the OOM killer): the CLI says which
    process died of which signal and exits 128 + N, as when the one process of a run is killed:
    running the same command again resumes."""
    workspace = tmp_path / "ws"
    command = _train_command(
        workspace, tiny_model_dir, tiny_dataset_file, "--name", "job", *TWO_PROCESSES,
        "epochs=5", "max_steps=30",
    )  # fmt: skip
    proc = _start(command, tmp_path, "job")
    seen: dict[int, psutil.Process] = {}
    try:
        _wait_for_steps(proc, workspace, seen)
        victim = _worker_of_rank(proc, 1)
        os.kill(victim, signal.SIGKILL)
        out, err = proc.communicate(timeout=300)
        left = _wait_all_gone(seen)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert left == []
    assert proc.returncode == 128 + signal.SIGKILL, out + err
    assert "Traceback" not in out + err
    lines = err.strip().splitlines()
    log = workspace / "logs" / "node.log"
    assert lines[-2:] == [
        "tunepack: step 'node' failed with exit code 137 (killed by SIGKILL: running it again "
        f"resumes from the newest checkpoint); log: {log}",
        f"  trainer: error: rank 1 (pid {victim}) was killed by SIGKILL",
    ], err
    assert "its error is above" not in out + err  # the line that followed it says no such thing

    again = subprocess.run(
        command, capture_output=True, text=True, timeout=900,
        env={**os.environ, "TUNEPACK_HOME": str(tmp_path / "home")},
    )  # fmt: skip
    assert again.returncode == 0, again.stderr
    assert "ran before (" in again.stdout and "): resuming it" in again.stdout
    assert json.loads((workspace / "output" / "result.json").read_text())["steps"] == 30
