"""Steps that start together (the gang-scheduled runtimes) hand off through the workspace.

Real processes, as the pods run them: each "step" is a program run through
``tunepack.core.program.run`` with the environment the gang component gives it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tunepack.core import handoff

# A program that, like every tunepack step, runs its body through program.run.
STEP = """
import sys
from tunepack.core import program
sys.exit(program.run(sys.argv[1], lambda: print(sys.argv[1] + ": body ran", flush=True)))
"""


def _env(workspace: Path, uid: str = "uid-1", attempt: str = "0", **extra: str) -> dict:
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in (handoff.WAIT_FOR_ENV, handoff.JOBSET_UID_ENV, handoff.RESTART_ATTEMPT_ENV)
    }
    env.update({"TUNEPACK_WORKSPACE": str(workspace), **extra})
    if uid:
        env[handoff.JOBSET_UID_ENV] = uid
        env[handoff.RESTART_ATTEMPT_ENV] = attempt
    return env


def _run(step: str, env: dict, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", STEP, step], env=env, capture_output=True, text=True, timeout=timeout
    )


def _start(step: str, env: dict) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-c", STEP, step],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def test_the_trainer_waits_for_both_initializers_of_this_run(tmp_path):
    env = _env(tmp_path)
    trainer = _start(
        "trainer", {**env, handoff.WAIT_FOR_ENV: "dataset-initializer,model-initializer"}
    )
    time.sleep(2)
    assert trainer.poll() is None  # nothing marked yet: it waits
    assert _run("dataset-initializer", env).returncode == 0
    time.sleep(2)
    assert trainer.poll() is None  # one of two
    assert _run("model-initializer", env).returncode == 0
    out, err = trainer.communicate(timeout=30)
    assert trainer.returncode == 0, err
    assert "trainer: body ran" in out
    assert "trainer: waiting for dataset-initializer, model-initializer to finish" in err
    assert "trainer: dataset-initializer, model-initializer done; waited" in err
    # The trainer marks itself done in turn, for the exporter.
    assert handoff.marked_run("trainer", tmp_path) == "uid-1/0"
    marker = json.loads((tmp_path / ".steps" / "trainer").read_text())
    assert set(marker) == {"run", "at"}


def test_a_marker_of_another_run_does_not_count(tmp_path):
    """A retained volume holds the markers of an earlier TrainJob of the same name (another
    JobSet uid) or of the attempt before a restart: the waiting step ignores them."""
    for uid, attempt in (("old-uid", "0"), ("uid-1", "0")):
        assert _run("dataset-initializer", _env(tmp_path, uid, attempt)).returncode == 0
    restarted = _env(tmp_path, "uid-1", "1", **{handoff.WAIT_FOR_ENV: "dataset-initializer"})
    waiting = _start("trainer", restarted)
    time.sleep(2)
    assert waiting.poll() is None
    assert _run("dataset-initializer", _env(tmp_path, "uid-1", "1")).returncode == 0
    waiting.communicate(timeout=30)
    assert waiting.returncode == 0


def test_a_failed_step_marks_nothing_and_only_node_0_speaks_for_the_trainer(tmp_path):
    failing = """
import sys
from tunepack.core import program
from tunepack.core.errors import BadInputError
def body():
    raise BadInputError("bad rows")
sys.exit(program.run("dataset-initializer", body))
"""
    done = subprocess.run(
        [sys.executable, "-c", failing], env=_env(tmp_path), capture_output=True, text=True
    )
    assert done.returncode == 65
    assert handoff.marked_run("dataset-initializer", tmp_path) is None
    assert _run("trainer", {**_env(tmp_path), "PET_NODE_RANK": "1"}).returncode == 0
    assert handoff.marked_run("trainer", tmp_path) is None
    assert _run("trainer", {**_env(tmp_path), "PET_NODE_RANK": "0"}).returncode == 0
    assert handoff.marked_run("trainer", tmp_path) == "uid-1/0"


def test_ordered_runtimes_and_the_local_backend_are_untouched(tmp_path):
    """Without the gang component's variables nothing waits and nothing is written."""
    done = _run("trainer", _env(tmp_path, uid=""))
    assert done.returncode == 0 and "trainer: body ran" in done.stdout
    assert not (tmp_path / ".steps").exists()


@pytest.mark.parametrize(
    ("extra", "uid", "message"),
    [
        (
            {handoff.WAIT_FOR_ENV: "dataset,model-initializer"},
            "uid-1",
            "trainer: error: TUNEPACK_WAIT_FOR='dataset,model-initializer' names dataset: "
            "expected steps among dataset-initializer, model-initializer, trainer, exporter",
        ),
        (
            {handoff.WAIT_FOR_ENV: "trainer"},
            "",
            "trainer: error: TUNEPACK_WAIT_FOR is set but TUNEPACK_JOBSET_UID is not: the "
            "runtime must give each step its JobSet's uid",
        ),
    ],
)
def test_a_misconfigured_wait_is_bad_input_not_a_hang(tmp_path, extra, uid, message):
    done = _run("trainer", _env(tmp_path, uid=uid, **extra), timeout=30)
    assert done.returncode == 65
    assert message in done.stderr
    assert "Traceback" not in done.stderr
