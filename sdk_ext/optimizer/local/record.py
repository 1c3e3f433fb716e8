"""One local optimization job's record, ``<jobs root>/.optimizations/<name>/``: the one module
that reads and writes its files.

``experiment.json`` (what was asked: the trial template and the parsed search, written once),
``state.json`` (status, message, runner pid; written whole and atomically), ``study.db`` (the
Optuna study, SQLite), ``shared/`` (the workspace the dataset and model are initialized in once
for every trial), ``runner.log`` (a detached runner's output). The trials are local TrainJobs of
the same jobs root, named ``<name>-<trial number>``."""

from __future__ import annotations

import json
from dataclasses import asdict
from datetime import UTC, datetime
from pathlib import Path

from tunepack.backends.local.job import process_alive
from tunepack.core import durable
from tunepack.optimizer.space import Algorithm, Goal, MedianStop, Parameter, Space
from tunepack.optimizer.template import Template

OPTIMIZATIONS_DIR = ".optimizations"
EXPERIMENT_FILE = "experiment.json"
STATE_FILE = "state.json"
STUDY_FILE = "study.db"
SHARED_DIR = "shared"
RUNNER_LOG = "runner.log"

CREATED, RUNNING, COMPLETE, FAILED = "Created", "Running", "Complete", "Failed"
# Stopped by a signal (Ctrl-C, SIGTERM): the same optimize() call resumes it.
STOPPED = "Stopped"
TERMINAL = (COMPLETE, FAILED, STOPPED)


def now() -> str:
    return datetime.now(UTC).isoformat()


class OptimizationRecord:
    """The record of the local optimization job in ``path``."""

    def __init__(self, path: Path):
        self.path = Path(path)

    @property
    def name(self) -> str:
        return self.path.name

    def exists(self) -> bool:
        return (self.path / STATE_FILE).exists()

    # --- what was asked ----------------------------------------------------------------------

    def create(self, template: Template, space: Space) -> None:
        self.path.mkdir(parents=True, exist_ok=True)
        experiment = {
            "name": self.name,
            "template": asdict(template),
            "parameters": [p.to_dict() for p in space.parameters],
            "goals": [asdict(g) for g in space.goals],
            "algorithm": asdict(space.algorithm),
            "early_stopping": asdict(space.early_stopping) if space.early_stopping else None,
            "num_trials": space.num_trials,
            "parallel_trials": space.parallel_trials,
            "max_failed_trials": space.max_failed_trials,
        }
        durable.write_json(self.path / EXPERIMENT_FILE, experiment)
        self.write_state({"status": CREATED, "created": now()})

    def experiment(self) -> dict:
        return json.loads((self.path / EXPERIMENT_FILE).read_text())

    def template(self) -> Template:
        return Template(**self.experiment()["template"])

    def space(self) -> Space:
        data = self.experiment()
        stopping = data.get("early_stopping")
        return Space(
            parameters=tuple(Parameter.from_dict(p) for p in data["parameters"]),
            goals=tuple(Goal(**g) for g in data["goals"]),
            algorithm=Algorithm(**data["algorithm"]),
            early_stopping=MedianStop(**stopping) if stopping else None,
            num_trials=data["num_trials"],
            parallel_trials=data["parallel_trials"],
            max_failed_trials=data["max_failed_trials"],
        )

    # --- state -------------------------------------------------------------------------------

    def state(self) -> dict:
        return json.loads((self.path / STATE_FILE).read_text())

    def write_state(self, state: dict) -> None:
        durable.write_json(self.path / STATE_FILE, state)

    def update(self, **fields) -> None:
        self.write_state({**self.state(), **fields})

    def status(self) -> tuple[str, str | None]:
        """The status and message; a job recorded Created or Running whose runner has ended is
        Stopped (the same call resumes it)."""
        state = self.state()
        status, message = state["status"], state.get("message")
        if status in (CREATED, RUNNING) and not self.alive():
            return STOPPED, "its runner ended before it did; the same optimize() call resumes it"
        return status, message

    def alive(self) -> bool:
        pid = self.state().get("pid")
        return True if pid is None else process_alive(pid)  # None: being created

    # --- paths -------------------------------------------------------------------------------

    @property
    def storage(self) -> str:
        return f"sqlite:///{self.path / STUDY_FILE}"

    @property
    def shared(self) -> Path:
        return self.path / SHARED_DIR

    @property
    def runner_log(self) -> Path:
        return self.path / RUNNER_LOG

    def trial_job(self, number: int) -> str:
        return f"{self.name}-{number}"
