"""Steps that start together (the gang-scheduled runtimes) hand off through the workspace.

Real processes, as the pods run them: each "step" is a program run through
``tunepack.core.program.run`` with the environment the gang component gives it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
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


# The same step, its wait driven by the test: where handoff.wait_for_steps would sleep between
# two looks at the markers it says "polled" on stderr and waits for a line on stdin instead. A
# "polled" line is the signal that the step has looked and found a step still pending; the line
# the test sends makes it look again, once the test has written the marker it wanted first.
POLLED = "handoff: polled"
GATED_STEP = f"""
import sys, time, types
from tunepack.core import handoff, program
def _poll(_seconds):
    print("{POLLED}", file=sys.stderr, flush=True)
    if not sys.stdin.readline():
        sys.exit("the test closed stdin")
handoff.time = types.SimpleNamespace(monotonic=time.monotonic, sleep=_poll)
sys.exit(program.run(sys.argv[1], lambda: print(sys.argv[1] + ": body ran", flush=True)))
"""


def _start(step: str, env: dict) -> subprocess.Popen:
    """``step`` waiting as GATED_STEP does: released by ``_look_again``."""
    return subprocess.Popen(
        [sys.executable, "-c", GATED_STEP, step],
        env=env,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def _polled(step: subprocess.Popen, timeout: float = 60) -> list[str]:
    """The step's stderr up to its next "polled" line: it has looked at the markers and waits.
    Fails if the step ends first (it did not wait) or says nothing within ``timeout``."""
    lines: list[str] = []
    timer = threading.Timer(timeout, step.kill)  # a step that hangs ends the read with EOF
    timer.start()
    try:
        for line in step.stderr:
            if line.rstrip("\n") == POLLED:
                return lines
            lines.append(line)
    finally:
        timer.cancel()
    step.wait()
    raise AssertionError(
        f"the step ended (exit {step.returncode}) without waiting, or said nothing within "
        f"{timeout:.0f} s (does handoff.wait_for_steps still sleep through handoff.time.sleep?); "
        f"its stderr:\n{''.join(lines)}"
    )


def _look_again(step: subprocess.Popen) -> None:
    step.stdin.write("\n")
    step.stdin.flush()


def test_the_trainer_waits_for_both_initializers_of_this_run(tmp_path):
    env = _env(tmp_path)
    trainer = _start(
        "trainer", {**env, handoff.WAIT_FOR_ENV: "dataset-initializer,model-initializer"}
    )
    said = _polled(trainer)  # nothing marked yet: it looked, and waits
    assert _run("dataset-initializer", env).returncode == 0
    _look_again(trainer)
    said += _polled(trainer)  # it looked with one of two marked, and waits on
    assert _run("model-initializer", env).returncode == 0
    _look_again(trainer)
    out, err = trainer.communicate(timeout=30)
    err = "".join(said) + err
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
    _polled(waiting)  # it looked, attempt 0's marker there, and waits
    assert _run("dataset-initializer", _env(tmp_path, "uid-1", "1")).returncode == 0
    _look_again(waiting)
    out, err = waiting.communicate(timeout=30)
    assert waiting.returncode == 0, err
    assert "trainer: body ran" in out


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
