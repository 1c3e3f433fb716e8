"""One local TrainJob's record, ``<root>/<name>/``: the one module that reads and writes its files.

``trainjob.yaml``, ``state.json`` (written whole and atomically: the backend and the runner are
different processes), ``pid`` (the runner's, or the CLI's), ``runner.log`` and ``workspace/``
unless ``state.json`` names another (docs/sdk.md, "Local jobs and the command line")."""

from __future__ import annotations

import json
import os
import shutil
from datetime import UTC, datetime
from pathlib import Path

import yaml
from kubeflow.trainer.constants import constants as kc

from tunepack.backends.local.steps import step_log
from tunepack.core import durable
from tunepack.core.workspace import LOGS_DIR, metrics_file, result_file

STATE_FILE = "state.json"
TRAINJOB_FILE = "trainjob.yaml"
PID_FILE = "pid"
RUNNER_LOG = "runner.log"
WORKSPACE_DIR = "workspace"

RUNNER_CLI = "cli"  # state["runner"]: run in the foreground by `tunepack train --local`
# A local job its user stopped (Ctrl-C, SIGTERM or SIGHUP to `tunepack train --local`): its
# steps stopped cleanly (the trainer after a checkpoint) and running it again resumes it. Not a
# status of the Kubeflow SDK's: a cluster TrainJob stopped so is retried by its failure policy.
TRAINJOB_STOPPED = "Stopped"
TERMINAL = (kc.TRAINJOB_COMPLETE, kc.TRAINJOB_FAILED, TRAINJOB_STOPPED)


def now() -> str:
    return datetime.now(UTC).isoformat()


class JobRecord:
    """The record of the local TrainJob in ``path`` (``<root>/<name>/``)."""

    def __init__(self, path: Path):
        self.path = Path(path)

    def exists(self) -> bool:
        """Whether a job is recorded here (its state file is what makes it one)."""
        return (self.path / STATE_FILE).exists()

    # --- creating -------------------------------------------------------------------------------

    def create(self, trainjob: dict, workspace: Path | None, created: str | None) -> None:
        """Record ``trainjob`` here, status Created, replacing any earlier record (a workspace
        is left as it is). ``workspace``: where its steps run (None: ``workspace/`` here);
        ``created``: the time to keep, for a re-run of the same job (None: now)."""
        self.path.mkdir(parents=True, exist_ok=True)
        for record in (STATE_FILE, TRAINJOB_FILE, PID_FILE, RUNNER_LOG):
            (self.path / record).unlink(missing_ok=True)
        (self.path / TRAINJOB_FILE).write_text(yaml.safe_dump(trainjob, sort_keys=False))
        state = {"status": kc.TRAINJOB_CREATED, "created": created or now(), "steps": {}}
        if workspace is not None and Path(workspace) != self.path / WORKSPACE_DIR:
            state["workspace"] = str(Path(workspace).resolve())
        self.write_state(state)

    # --- state.json -----------------------------------------------------------------------------

    def state(self) -> dict:
        return json.loads((self.path / STATE_FILE).read_text())

    def write_state(self, state: dict) -> None:
        durable.write_json(self.path / STATE_FILE, state)  # readers never see half a file

    def update(self, **fields) -> None:
        """Set top-level fields of the state (e.g. a status and message)."""
        self.write_state({**self.state(), **fields})

    def stopped(self, message: str) -> None:
        """Record the job as Stopped (``TRAINJOB_STOPPED``) with ``message``; the steps the stop
        ended (those recorded Failed) are Stopped too."""
        state = self.state()
        for info in state["steps"].values():
            if info.get("status") == "Failed":
                info["status"] = TRAINJOB_STOPPED
        self.write_state({**state, "status": TRAINJOB_STOPPED, "message": message})

    def created(self) -> str | None:
        """When the job was first created (None: its record cannot say)."""
        try:
            created = self.state()["created"]
            datetime.fromisoformat(created)
            return created
        except (OSError, ValueError, KeyError, TypeError):
            return None

    def status(self, state: dict | None = None) -> tuple[str, str | None]:
        """The job's status and message (from ``state``, when the caller has read it). A job
        recorded as Created or Running whose runner has ended is Failed: nothing will ever
        finish it."""
        state = self.state() if state is None else state
        status, message = state["status"], state.get("message")
        if status in (kc.TRAINJOB_CREATED, kc.TRAINJOB_RUNNING) and not self.alive():
            status = kc.TRAINJOB_FAILED
            message = (
                "the `tunepack train --local` process that ran it ended before the job did"
                if state.get("runner") == RUNNER_CLI
                else "the local runner process ended unexpectedly; see runner.log"
            )
        return status, message

    # --- the TrainJob and its workspace ---------------------------------------------------------

    def trainjob(self) -> dict:
        return yaml.safe_load((self.path / TRAINJOB_FILE).read_text())

    @property
    def workspace(self) -> Path:
        """Where the job's steps run: ``workspace/`` here, or the directory ``tunepack train
        --local --workspace`` was given."""
        state = self.state()
        return Path(state["workspace"]) if "workspace" in state else self.path / WORKSPACE_DIR

    @property
    def workspace_inside(self) -> bool:
        """Whether the workspace is this record's own ``workspace/`` (not one given)."""
        return self.workspace == self.path / WORKSPACE_DIR

    @property
    def logs_dir(self) -> Path:
        return self.workspace / LOGS_DIR

    def step_log(self, step: str, steps: list[str]) -> Path:
        """The log of an SDK step name among the job's ``steps``: ``node-0`` is the node job's
        first replica (``node.log`` with one node, ``node-0.log`` of several), ``node-1`` its
        second (``node-1.log``)."""
        head, _, index = step.rpartition("-")
        if head == kc.NODE and index.isdigit():
            replicas = sum(s.startswith(f"{kc.NODE}-") for s in steps)
            return step_log(self.logs_dir, head, int(index), replicas)
        return step_log(self.logs_dir, step)

    @property
    def metrics_path(self) -> Path:
        return metrics_file(self.workspace)

    @property
    def result_path(self) -> Path:
        return result_file(self.workspace)

    def result(self) -> dict:
        """The trainer's ``result.json`` (FileNotFoundError: the job has not finished)."""
        return json.loads(self.result_path.read_text())

    def delete(self, keep_workspace: bool) -> None:
        """Remove the record, and the workspace unless ``keep_workspace``. A workspace inside
        the record that is kept stays where it is, the rest of the record gone."""
        workspace, inside = self.workspace, self.workspace_inside
        if not keep_workspace and not inside:
            shutil.rmtree(workspace, ignore_errors=True)
        if keep_workspace and inside:
            for path in self.path.iterdir():
                if path.name != WORKSPACE_DIR:
                    shutil.rmtree(path) if path.is_dir() else path.unlink()
        else:
            shutil.rmtree(self.path)

    # --- the runner process ---------------------------------------------------------------------

    @property
    def runner_log(self) -> Path:
        return self.path / RUNNER_LOG

    def pid(self) -> int | None:
        try:
            return int((self.path / PID_FILE).read_text())
        except (FileNotFoundError, ValueError):
            return None

    def write_pid(self, pid: int) -> None:
        (self.path / PID_FILE).write_text(str(pid))

    def alive(self) -> bool:
        """Whether the job's runner process still runs."""
        pid = self.pid()
        return True if pid is None else process_alive(pid)  # None: still being created


def process_alive(pid: int) -> bool:
    """Whether the runner process ``pid`` still runs (reaped here if it is our own child)."""
    try:
        finished, _ = os.waitpid(pid, os.WNOHANG)  # our own child: reap it
        if finished:
            return False
    except ChildProcessError:
        pass  # not our child (another process started it)
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def update_state(job_dir: Path, **fields) -> None:
    """Set top-level fields of the state of the job in ``job_dir`` (``JobRecord.update``)."""
    JobRecord(job_dir).update(**fields)
