"""The local backend running steps as processes: in dependency order, a failing or killed step
named with its exit code, a replica's one name. Its pure parts (order, environment, console
lines, summaries): tests/unit/test_local.py."""

from __future__ import annotations

import copy
import sys

import pytest

from tests.unit.test_local import _trainjob
from tunepack.backends.local.steps import run_trainjob
from tunepack.runtimes.contract import TRAINER_STEP, container, replicated_jobs
from tunepack.runtimes.store import load_runtime


def _recording_runtime(fail: str | None = None) -> dict:
    """The real tiny runtime with each step's program replaced by one that records its turn."""
    runtime = copy.deepcopy(load_runtime("tunepack-tiny-llama3"))
    jobs = replicated_jobs(runtime)
    jobs.reverse()  # list the trainer first: order must come from dependsOn alone
    for job in jobs:
        code = (
            "import os, sys; "
            "open(os.path.join(os.environ['TUNEPACK_WORKSPACE'], 'order'), 'a')"
            f".write('{job['name']}\\n'); print('hello from {job['name']}'); "
            f"sys.exit({65 if job['name'] == fail else 0})"
        )
        container(job)["command"] = ["python", "-c", code]
    return runtime


def test_run_executes_steps_in_dependency_order(tmp_path):
    outcome = run_trainjob(_recording_runtime(), _trainjob(), tmp_path, echo=None)
    assert outcome.failed is None
    order = (tmp_path / "order").read_text().split()
    assert order.index("node") > order.index("dataset-initializer")
    assert order.index("node") > order.index("model-initializer")
    assert "hello from node" in (tmp_path / "logs" / "node.log").read_text()


def test_a_failing_step_stops_the_run_and_is_named(tmp_path):
    outcome = run_trainjob(
        _recording_runtime(fail="model-initializer"), _trainjob(), tmp_path, echo=None
    )
    assert outcome.failed.name == "model-initializer"
    assert outcome.failed.exit_code == 65
    assert "node" not in (tmp_path / "order").read_text().split()


def test_a_step_killed_by_a_signal_reports_128_plus_the_signal(tmp_path):
    """A step the OOM killer or `kill -9` ends: 137 and "killed by SIGKILL", as a shell and the
    kubelet say it, not Python's -9 (which the CLI's exit status would turn into 247)."""
    from tunepack.backends.local.steps import StepProcess, describe_exit, run_step

    kill = [sys.executable, "-c", "import os; os.kill(os.getpid(), 9)"]
    step = StepProcess("node", None, kill, {})
    outcome = run_step(step, tmp_path / "logs", echo=None)
    assert outcome.exit_code == 137
    assert describe_exit(outcome.exit_code).startswith("killed by SIGKILL")


def test_a_replica_has_one_name_on_the_console_in_logs_and_for_step(tmp_path):
    """One node: `node` everywhere (and `node` is node-0 for --step); several: node-0, node-1 on
    the console, as log files and as step names."""
    from tunepack.backends.base import sdk_step

    for nodes, replicas in ((1, ["node"]), (2, ["node-0", "node-1"])):
        lines = []
        workspace = tmp_path / str(nodes)
        with pytest.MonkeyPatch.context() as env:
            env.setenv("TUNEPACK_VERBOSE", "1")  # echo the steps' every line
            outcome = run_trainjob(
                _recording_runtime(), _trainjob(num_nodes=nodes), workspace, echo=lines.append
            )
        assert outcome.failed is None
        logs = sorted(p.stem for p in (workspace / "logs").glob("node*.log"))
        assert logs == replicas
        for replica in replicas:  # its line on the console, prefixed with the same name
            assert f"[{replica}] hello from node" in lines, lines
        steps = ["dataset-initializer", "model-initializer"] + [f"node-{i}" for i in range(nodes)]
        assert sdk_step("node", steps) == ("node-0" if nodes == 1 else "node")


def test_a_failed_steps_error_is_held_back_for_its_summary_and_any_other_is_echoed(tmp_path):
    """Issue 49, item 4: the failed step's last error (with its detail lines) was echoed, then
    said again under the step's failure. It is held back for that summary; an earlier error, a
    succeeding step's, or another replica's is echoed as before."""
    from tunepack.backends.local.steps import StepProcess, run_step

    code = (
        "import os, sys; rank = os.environ.get('PET_NODE_RANK', '0'); "
        "print('trainer: error: not the last'); print('trainer: working'); "
        "print(f'trainer: error: rank {rank}'); print('  its detail'); "
        "sys.exit(int(sys.argv[1]) if rank == '1' else 0)"
    )
    for exit_code in (0, 65):
        lines: list[str] = []
        command = [sys.executable, "-c", code, str(exit_code)]
        step = StepProcess("node", TRAINER_STEP.ancestor, command, {}, replicas=2)
        outcome = run_step(step, tmp_path / f"logs-{exit_code}", echo=lines.append)
        assert outcome.exit_code == exit_code
        for rank in (0, 1):
            said = [x for x in lines if x.startswith(f"[node-{rank}] ")]
            held_back = exit_code and rank == 1
            assert said == [
                f"[node-{rank}] trainer: error: not the last",
                f"[node-{rank}] trainer: working",
                *([] if held_back else [f"[node-{rank}] trainer: error: rank {rank}"]),
                *([] if held_back else [f"[node-{rank}]   its detail"]),
            ]
        if exit_code:
            assert outcome.error_lines() == ["trainer: error: rank 1", "  its detail"]
