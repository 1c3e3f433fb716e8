"""The trainer's CPU threads: each process's share of the CPUs it may use, waiting passively."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

from tunepack.trainers.process.threads import cpu_budget, threads_per_process

LAUNCH = "tunepack.trainers.launch"


def _cgroup_v2(tmp_path: Path, own: str, parent: str) -> tuple[Path, Path]:
    root = tmp_path / "cgroup"
    (root / "pod" / "ctr").mkdir(parents=True)
    (root / "pod" / "cpu.max").write_text(parent)
    (root / "pod" / "ctr" / "cpu.max").write_text(own)
    proc = tmp_path / "proc-cgroup"
    proc.write_text("0::/pod/ctr\n")
    return root, proc


def test_a_cgroup_quota_caps_the_affinity(tmp_path):
    cpus = len(os.sched_getaffinity(0))
    # A container limit of 1.5 CPUs: one thread (a second would be throttled half the time).
    assert cpu_budget(*_cgroup_v2(tmp_path, "150000 100000\n", "max 100000\n")) == 1
    # The Pod's limit, on the parent, binds too.
    assert cpu_budget(*_cgroup_v2(tmp_path / "b", "max 100000\n", "100000 100000\n")) == 1
    # No limit anywhere, or no cgroup files: the affinity.
    assert cpu_budget(*_cgroup_v2(tmp_path / "c", "max 100000\n", "max 100000\n")) == cpus
    assert cpu_budget(tmp_path / "none", tmp_path / "none") == cpus
    v1 = tmp_path / "v1"
    (v1 / "cpu,cpuacct").mkdir(parents=True)
    (v1 / "cpu,cpuacct" / "cpu.cfs_quota_us").write_text("50000\n")
    (v1 / "cpu,cpuacct" / "cpu.cfs_period_us").write_text("100000\n")
    (tmp_path / "proc-v1").write_text("3:cpu,cpuacct:/kubepods/x\n")
    assert cpu_budget(v1, tmp_path / "proc-v1") == 1  # half a CPU: still one thread


def test_processes_share_the_budget():
    assert [threads_per_process(n, budget=8) for n in (1, 2, 3, 8, 16)] == [8, 4, 2, 1, 1]


def test_idle_threads_wait_passively_from_before_torch_loads():
    """libgomp reads OMP_WAIT_POLICY once, when torch loads: the trainer program sets it first
    (spinning threads made a 2-core machine under load 5 to 8 times slower)."""
    probe = (
        "import os, sys\n"
        "seen = []\n"
        "class Probe:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name == 'torch' and not seen:\n"
        "            seen.append(os.environ.get('OMP_WAIT_POLICY'))\n"
        "sys.meta_path.insert(0, Probe())\n"
        f"import {LAUNCH}\n"
        "print(seen)\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
    done = subprocess.run(
        [sys.executable, "-c", probe], env=env, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "['PASSIVE']"


def _launch(workspace: Path, env: dict[str, str], cpus: set[int] | None = None):
    return subprocess.run(
        [sys.executable, "-m", LAUNCH, "max_steps=1", "checkpoint_every_minutes=0"],
        env={**env, "TUNEPACK_WORKSPACE": str(workspace), "TUNEPACK_MODEL": "tiny-llama3"},
        capture_output=True,
        text=True,
        timeout=300,
        preexec_fn=(lambda: os.sched_setaffinity(0, cpus)) if cpus else None,
    )


def test_the_trainer_uses_the_cpus_it_may_run_on(initialized_workspace, tmp_path):
    """Pinned to one CPU, the trainer runs one thread (torch alone takes one per core it sees,
    whatever a Pod's limit); OMP_NUM_THREADS, when set, decides. The start line says which."""
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    one = {min(os.sched_getaffinity(0))}
    pinned = _launch(shutil.copytree(initialized_workspace, tmp_path / "a"), env, one)
    assert pinned.returncode == 0, pinned.stderr
    assert "processes/node=1 threads/process=1;" in pinned.stdout

    given = _launch(
        shutil.copytree(initialized_workspace, tmp_path / "b"), {**env, "OMP_NUM_THREADS": "3"}
    )
    assert given.returncode == 0, given.stderr
    assert "processes/node=1 threads/process=3;" in given.stdout
