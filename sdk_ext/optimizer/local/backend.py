"""``LocalOptimizerBackend``: ``tunepack.OptimizerClient``'s backend on this machine, an Optuna
study whose trials are the local backend's TrainJobs (``study.run``).

The same methods and result types as the Kubeflow SDK's optimizer backend
(``kubeflow.optimizer.backends.base.RuntimeBackend``). An optimization job is named after the
call (``hpo-<digest of the template and the search>``): the same call again resumes it."""

from __future__ import annotations

import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from datetime import datetime
from pathlib import Path

from kubeflow.optimizer.types.algorithm_types import GridSearch, RandomSearch
from kubeflow.optimizer.types.optimization_types import Objective, TrialConfig
from kubeflow.optimizer.types.search_types import CategoricalSearchSpace, ContinuousSearchSpace
from kubeflow.trainer.types import types as kf

from tunepack.backends.local import LocalBackend, LocalBackendConfig
from tunepack.core.digest import json_digest
from tunepack.core.errors import (
    NotAvailableError,
    NotFoundError,
    WorkspaceBusyError,
)
from tunepack.optimizer import space as spaces
from tunepack.optimizer.base import OptimizerBackend
from tunepack.optimizer.local import study as studies
from tunepack.optimizer.local.record import (
    COMPLETE,
    CREATED,
    FAILED,
    OPTIMIZATIONS_DIR,
    RUNNING,
    STOPPED,
    TERMINAL,
    OptimizationRecord,
)
from tunepack.optimizer.space import TPESearch
from tunepack.optimizer.template import Template, prepare
from tunepack.optimizer.types import (
    TRIAL_COMPLETE,
    TRIAL_FAILED,
    TRIAL_PRUNED,
    TRIAL_RUNNING,
    TRIAL_STOPPED,
    TRIAL_WAITING,
    Metric,
    OptimizationJob,
    Result,
    Trial,
)

NAME_PREFIX = "hpo-"


class LocalOptimizerBackend(OptimizerBackend):
    """Optimization jobs on this machine, under ``<jobs root>/.optimizations/``."""

    is_local = True
    STATUSES = frozenset({CREATED, RUNNING, COMPLETE, FAILED, STOPPED})
    ENDED = frozenset(TERMINAL)

    def __init__(self, cfg: LocalBackendConfig):
        try:
            import optuna  # noqa: F401 (the studies' engine: said here, before any work)
        except ImportError:
            raise NotAvailableError(
                "the local optimizer runs its trials on Optuna, which is not installed: pip "
                "install 'tunepack[optimize]' (make install has it)"
            ) from None
        self.cfg = cfg
        self.trainer = LocalBackend(cfg)
        self.root = self.trainer.root / OPTIMIZATIONS_DIR

    # --- what the call asks, checked before anything is created --------------------------------

    def prepare(self, trial_template: object, **asked) -> tuple[Template, spaces.Space]:
        """The trial template and the search, parsed and checked (``template.prepare``) against
        this machine's runtimes and memory plan."""
        from tunepack.jobs.submit import local_trainjob

        return prepare(
            trial_template,
            **asked,
            resolve_runtime=lambda name: self.trainer.resolve_runtime(name).name,
            check_job=lambda runtime, initializer, finetune: local_trainjob(
                self.trainer, runtime, initializer, finetune, name="hpo-check"
            ),
        )

    # --- the jobs ------------------------------------------------------------------------------

    def create(self, template: Template, space: spaces.Space) -> OptimizationRecord:
        """The record of this optimization job: a new one, or the one the same call made (to
        resume it). ``WorkspaceBusyError`` while that one runs."""
        import dataclasses

        identity = {
            "template": dataclasses.asdict(template),
            "parameters": [p.to_dict() for p in space.parameters],
            "goals": [dataclasses.asdict(g) for g in space.goals],
            "algorithm": dataclasses.asdict(space.algorithm),
            "early_stopping": dataclasses.asdict(space.early_stopping)
            if space.early_stopping
            else None,
            "trials": [space.num_trials, space.parallel_trials, space.max_failed_trials],
        }
        record = OptimizationRecord(self.root / (NAME_PREFIX + json_digest(identity)[:10]))
        if record.exists():
            status, _ = record.status()
            if status in (CREATED, RUNNING):
                raise WorkspaceBusyError(
                    f"optimization {record.name!r} is running (pid {record.state().get('pid')}); "
                    "wait for it (wait_for_job_status) or delete it first"
                )
            return record
        record.create(template, space)
        return record

    def submit(self, template: Template, space: spaces.Space) -> str:
        """The search's record (a new one, or the one the same search made), and its detached
        runner unless it is complete."""
        record = self.create(template, space)
        if record.status()[0] != COMPLETE:
            self._start(record)
        return record.name

    def _start(self, record: OptimizationRecord) -> None:
        """The detached runner of ``record`` (``python -m tunepack.optimizer.local``), which
        outlives the notebook's kernel."""
        record.update(status=CREATED, pid=None, message=None)
        with record.runner_log.open("a") as log:
            proc = subprocess.Popen(
                [
                    sys.executable, "-m", "tunepack.optimizer.local", str(record.path),
                    str(self.trainer.root), self.cfg.gpu, self.cfg.memory_check,
                ],
                stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
            )  # fmt: skip
        record.update(pid=proc.pid)

    def run(self, record: OptimizationRecord, echo: Callable[[str], None], stop: threading.Event):
        """Run the study in this process (``tunepack optimize --local``)."""
        return studies.run(record, self.trainer, echo, stop)

    def _record(self, name: str) -> OptimizationRecord:
        record = OptimizationRecord(self.root / name)
        if not name or "/" in name or name in (".", "..") or not record.exists():
            raise NotFoundError(
                f"no local optimization job {name!r} under {self.root}; see list_jobs()",
                cli_message=f"no local optimization job {name!r} under {self.root}; "
                "`tunepack optimize jobs --local` lists them",
                what="OptimizationJob",
                name=name,
            )
        return record

    def list_jobs(self) -> list[OptimizationJob]:
        if not self.root.is_dir():
            return []
        jobs = [
            self.get_job(p.name)
            for p in sorted(self.root.iterdir())
            if OptimizationRecord(p).exists()
        ]
        return sorted(jobs, key=lambda j: j.creation_timestamp)

    def get_job(self, name: str) -> OptimizationJob:
        record = self._record(name)
        space = record.space()
        status, message = record.status()
        trials = self._trials(record, space)
        best = _best(trials, space)
        return OptimizationJob(
            name=name,
            search_space={p.name: _sdk_space(p) for p in space.parameters},
            objectives=[Objective(metric=g.metric, direction=g.direction) for g in space.goals],
            algorithm=_sdk_algorithm(space.algorithm),
            trial_config=TrialConfig(
                num_trials=space.num_trials,
                parallel_trials=space.parallel_trials,
                max_failed_trials=space.max_failed_trials,
            ),
            trials=trials,
            creation_timestamp=datetime.fromisoformat(record.state()["created"]),
            status=status,
            message=message,
            best_trial=best.name if best else None,
        )

    def _trials(self, record: OptimizationRecord, space: spaces.Space) -> list[Trial]:
        if not (record.path / "study.db").exists():
            return []
        import optuna

        study = studies.open_study(record, space)
        states = {
            optuna.trial.TrialState.COMPLETE: TRIAL_COMPLETE,
            optuna.trial.TrialState.PRUNED: TRIAL_PRUNED,
            optuna.trial.TrialState.RUNNING: TRIAL_RUNNING,
            optuna.trial.TrialState.WAITING: TRIAL_WAITING,
        }
        running = record.status()[0] == RUNNING
        # One trial per TrainJob: a stopped trial that ran again is shown as its last attempt.
        latest = {}
        for t in study.get_trials(deepcopy=False):
            if t.state is not optuna.trial.TrialState.WAITING:
                latest[t.user_attrs.get(studies.JOB_ATTR) or record.trial_job(t.number)] = t
        out = []
        for t in latest.values():
            if t.state is optuna.trial.TrialState.FAIL:
                state = TRIAL_STOPPED if t.user_attrs.get(studies.STOPPED_ATTR) else TRIAL_FAILED
            else:
                state = states[t.state]
            if state == TRIAL_RUNNING and not running:
                state = TRIAL_STOPPED
            if state == TRIAL_WAITING:
                continue  # enqueued again: shown as the trial it resumes
            job = t.user_attrs.get(studies.JOB_ATTR) or record.trial_job(t.number)
            try:
                trainjob = self.trainer.get_job(job)
                metrics = _metrics(_records(self.trainer.job_dir(job)))
            except (NotFoundError, OSError, ValueError):
                trainjob, metrics = None, []
            params = {
                p.name: studies.spelled(p, t.params[p.name])
                for p in space.parameters
                if p.name in t.params
            }
            out.append(
                Trial(
                    name=job,
                    parameters=params,
                    trainjob=trainjob,
                    metrics=metrics,
                    number=t.number,
                    state=state,
                    objective=t.value if t.state is optuna.trial.TrialState.COMPLETE else None,
                    message=t.user_attrs.get(studies.MESSAGE_ATTR),
                    exit_code=t.user_attrs.get(studies.EXIT_ATTR),
                )
            )
        return out

    def get_best_results(self, name: str) -> Result | None:
        job = self.get_job(name)
        best = next((t for t in job.trials if t.name == job.best_trial), None)
        if best is None:
            return None
        return Result(parameters=dict(best.parameters), metrics=best.metrics, trial=best.name)

    def trial_logs(self, trial: str, follow: bool) -> Iterator[str]:
        return self.trainer.get_job_logs(trial, follow=follow)

    def get_job_events(self, name: str) -> list[kf.Event]:
        events = []
        for trial in self.get_job(name).trials:
            if trial.trainjob is None:
                continue
            for event in self.trainer.get_job_events(trial.name):
                events.append(event)
        return sorted(events, key=lambda e: e.event_time)

    def delete_job(self, name: str) -> None:
        """Stop the job's runner, then delete its trials' TrainJobs (workspaces too) and its
        record."""
        import shutil

        record = self._record(name)
        pid = record.state().get("pid")
        if pid and record.alive() and record.state()["status"] in (CREATED, RUNNING):
            import os

            try:
                os.killpg(pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
            while record.alive():
                time.sleep(0.2)
        for trial in self._trials(record, record.space()):
            try:
                self.trainer.delete_job(trial.name, keep_workspace=False)
            except NotFoundError:
                pass
        shutil.rmtree(record.path)


def _best(trials: list[Trial], space: spaces.Space) -> Trial | None:
    done = [t for t in trials if t.state == TRIAL_COMPLETE and t.objective is not None]
    if not done:
        return None
    pick = min if space.goal.direction == "minimize" else max
    return pick(done, key=lambda t: t.objective)


def _records(job_dir: Path) -> list[dict]:
    """Every record of a trial's metrics.jsonl (steps and evaluations)."""
    import json

    from tunepack.backends.local.job import JobRecord

    try:
        lines = JobRecord(job_dir).metrics_path.read_text().splitlines()
    except FileNotFoundError:
        return []
    out = []
    for line in lines:
        try:
            out.append(json.loads(line))
        except ValueError:
            continue  # a line being written
    return out


def _metrics(records: list[dict]) -> list[Metric]:
    """Each numeric metric of a trial's metrics.jsonl: its min, max and latest value."""
    seen: dict[str, list[float]] = {}
    skip = {
        "step",
        "total_steps",
        "epoch",
        "tokens",
        "elapsed_s",
        "eval_s",
        "val_rows",
        "best_step",
    }
    for record in records:
        for key, value in record.items():
            if (
                key in skip
                or key == "event"
                or not isinstance(value, int | float)
                or isinstance(value, bool)
            ):
                continue
            seen.setdefault(key, []).append(float(value))
    return [
        Metric(name=k, min=repr(min(v)), max=repr(max(v)), latest=repr(v[-1]))
        for k, v in seen.items()
    ]


def _sdk_space(p: spaces.Parameter):
    from kubeflow.optimizer.types.search_types import Distribution

    if p.choices:
        return CategoricalSearchSpace(choices=list(p.choices))
    kind = Distribution.LOG_UNIFORM if p.log else Distribution.UNIFORM
    return ContinuousSearchSpace(min=p.low, max=p.high, distribution=kind)


def _sdk_algorithm(algorithm: spaces.Algorithm):
    if algorithm.name == "grid":
        return GridSearch()
    if algorithm.name == "tpe":
        return TPESearch(random_state=algorithm.seed)
    return RandomSearch(random_state=algorithm.seed)


def runner_main(argv: list[str]) -> int:
    """The detached runner (``python -m tunepack.optimizer.local DIR ROOT GPU MEMORY_CHECK``)."""
    from tunepack.core import program
    from tunepack.core.errors import TunepackError

    path, root, gpu, memory_check = argv
    record = OptimizationRecord(Path(path))
    backend = LocalBackend(LocalBackendConfig(root_dir=root, gpu=gpu, memory_check=memory_check))
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, lambda *_: stop.set())
    try:
        outcome = studies.run(record, backend, lambda line: print(line, flush=True), stop)
    except TunepackError as err:
        record.update(status=FAILED, message=str(err))
        print(program.error_line("tunepack", err), file=sys.stderr, flush=True)
        return err.exit_code
    return {COMPLETE: 0, STOPPED: 75}.get(outcome.status, 1)
