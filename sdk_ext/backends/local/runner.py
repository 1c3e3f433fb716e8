"""Running a local TrainJob: the steps one after another in its workspace, each step's state
recorded as it goes.

``train()`` starts a detached runner (``start``: ``python -m tunepack.backends.local <job
dir>``, whose body is ``runner_main``), so the job outlives the notebook kernel;
``tunepack train --local`` runs the same ``run_job`` in the foreground.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Callable
from contextlib import nullcontext
from pathlib import Path

from kubeflow.trainer.constants import constants as kc

from tunepack.backends.local.job import RUNNER_CLI, JobRecord, now
from tunepack.backends.local.steps import (
    LOG_SUFFIX,
    RunOutcome,
    describe_exit,
    keep_previous_logs,
    resolve_steps,
    restore_previous_logs,
    run_step,
    shown_command,
)
from tunepack.core import program
from tunepack.core.errors import TunepackError
from tunepack.core.workspace import WorkspaceLock, export_record_file, lock_workspace
from tunepack.initializers.data.schemas import INHERITED_ENV, SPELLED, SPELLING_ENV
from tunepack.runtimes.contract import EXPORT_STEP
from tunepack.runtimes.store import load_runtime


def start(job: JobRecord) -> None:
    """Start the detached runner of ``job`` and record its pid."""
    with job.runner_log.open("w") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "tunepack.backends.local", str(job.path)],
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # survives the kernel; killed as a group by stop()
        )
    job.write_pid(proc.pid)


def stop(job: JobRecord) -> None:
    """Stop the detached runner of ``job`` and its steps: its session's process group."""
    pid = job.pid()
    if pid is None:
        return
    try:
        os.killpg(pid, signal.SIGTERM)
    except ProcessLookupError:
        pass


def runner_main(job_dir: Path) -> int:
    """The detached runner's body (``python -m tunepack.backends.local <job dir>``): run the
    job, return the failed step's exit code or 0."""
    try:
        failed = run_job(job_dir).failed
    except TunepackError as err:  # e.g. the workspace is in use: the job's state says so
        JobRecord(job_dir).update(status=kc.TRAINJOB_FAILED, message=str(err))
        print(program.error_line("tunepack", err), file=sys.stderr)
        return err.exit_code
    return failed.exit_code if failed else 0


_TAKE_LOCK = object()


def run_job(
    job_dir: Path,
    echo: Callable[[str], None] | None = None,
    *,
    cli: bool = False,
    lock: WorkspaceLock | None | object = _TAKE_LOCK,
) -> RunOutcome:
    """Run the job in ``job_dir`` step by step in its workspace, recording each step's state;
    stop at the first failing step. ``echo`` gets each step's command and output lines.
    ``cli=True``: run by ``tunepack train --local`` in its own process (recorded as the job's
    runner). The workspace is locked for the whole run (``tunepack.core.workspace``): a second run
    on it is refused with ``WorkspaceBusyError`` before anything is touched. ``lock``: the lock
    the caller took before recording the job (None: the file system cannot lock), which it
    releases; by default the lock is taken here."""
    job = JobRecord(job_dir)
    state = job.state()
    trainjob = job.trainjob()
    runtime = load_runtime(trainjob["spec"]["runtimeRef"]["name"])
    workspace, logs, result = job.workspace, job.logs_dir, job.result_path
    workspace.mkdir(parents=True, exist_ok=True)
    if cli:
        job.write_pid(os.getpid())
        state["runner"] = RUNNER_CLI
    name = trainjob["metadata"]["name"]
    held = (
        nullcontext(lock)
        if lock is not _TAKE_LOCK
        else lock_workspace(workspace, f"local TrainJob {name!r}") or nullcontext()
    )
    with held as lock:
        record = export_record_file(workspace)
        before, exported_before = _read_bytes(result), _read_bytes(record)
        kept = keep_previous_logs(logs)
        steps = resolve_steps(runtime, trainjob, workspace.resolve())
        if cli:  # the steps' messages name the settings as the command's flags
            for step in steps:
                step.env[SPELLING_ENV] = "cli"
                # ... but a setting the step inherits from this process's environment (COLUMN_MAP
                # exported in the shell) as that variable: the user passed no flag for it.
                inherited = [n for n in SPELLED if n in os.environ and n not in step.env]
                step.env[INHERITED_ENV] = ",".join(inherited)
        outcome = _run_steps(job, state, steps, logs, echo, lock)
        # The trainer rewrites result.json whenever it trains, the exporter its record whenever
        # it sends files: both unchanged, the run changed nothing.
        if not outcome.failed and before is not None and _read_bytes(result) == before:
            exported = _read_bytes(record) != exported_before
            outcome.nothing_to_do, outcome.exported_only = not exported, exported
            if kept is not None:
                current = (f"{EXPORT_STEP.job}{LOG_SUFFIX}",) if exported else ()
                restore_previous_logs(logs, kept, current)
        return outcome


def _read_bytes(path: Path) -> bytes | None:
    try:
        return path.read_bytes()
    except FileNotFoundError:
        return None


def _run_steps(job: JobRecord, state: dict, steps, logs: Path, echo, lock) -> RunOutcome:
    """Run ``steps`` in order, logging to ``logs``; ``state`` (the job's, as read) is written
    after every change."""
    names = {s.name: _sdk_names(s) for s in steps}
    state["steps"] = {n: {"status": "Pending"} for s in steps for n in names[s.name]}
    state["status"] = kc.TRAINJOB_RUNNING
    job.write_state(state)
    outcomes = []
    for step in steps:
        started = now()
        for n in names[step.name]:
            state["steps"][n] = {"status": "Running", "started": started}
        job.write_state(state)
        if echo:
            echo(f"==> {step.name}: {shown_command(step.command)}")
        outcome = run_step(step, logs, echo=echo, lock=lock)
        outcomes.append(outcome)
        phase = "Succeeded" if outcome.exit_code == 0 else "Failed"
        for n in names[step.name]:
            state["steps"][n] = {
                "status": phase,
                "exit_code": outcome.exit_code,
                "started": started,
                "finished": now(),
            }
        if outcome.exit_code != 0:
            reason = outcome.error_line()
            state["status"] = kc.TRAINJOB_FAILED
            state["message"] = (
                f"step {step.name!r} failed with exit code {outcome.exit_code} "
                f"({describe_exit(outcome.exit_code)})" + (f": {reason}" if reason else "")
            )
            job.write_state(state)
            return RunOutcome(outcomes)
        job.write_state(state)
    state["status"] = kc.TRAINJOB_COMPLETE
    job.write_state(state)
    return RunOutcome(outcomes)


def _sdk_names(step) -> list[str]:
    """The SDK's names of a step: the node step's replicas are ``node-0`` .. ``node-<n-1>``."""
    if step.name == kc.NODE:
        return [f"{kc.NODE}-{i}" for i in range(step.replicas)]
    return [step.name]
