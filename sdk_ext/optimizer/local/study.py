"""Running a local optimization job: an Optuna study whose trials are local TrainJobs.

Read it top to bottom: ``run`` initializes the dataset and model once (``_initialize``), settles
what an earlier run left (``_settle``), then keeps up to ``slots`` trials running (``_launch``)
and follows each (``_follow``: its intermediate values for early stopping, its end) until the
trials asked for are done. Each trial is the local backend's own job (``runner.start``, the same
programs as ``TrainingClient.train``) in a workspace of its own whose dataset and model are links
to the ones initialized once, so its initializers find them complete.

Ctrl-C or SIGTERM stops the running trials (each checkpoints first); the same call resumes: a
trial that was running is enqueued again under its own job, which resumes from its checkpoint,
and no finished trial runs again."""

from __future__ import annotations

import json
import math
import os
import shutil
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from kubeflow.trainer.constants import constants as kc

from tunepack.backends.local import runner
from tunepack.backends.local.job import TERMINAL, JobRecord
from tunepack.backends.local.steps import INITIALIZER_SOURCES, resolve_steps, run_step
from tunepack.core.errors import TunepackError
from tunepack.core.workspace import DATASET_DIR, LOGS_DIR, MODEL_DIR, lock_workspace
from tunepack.optimizer import space as spaces
from tunepack.optimizer.local.record import (
    COMPLETE,
    FAILED,
    RUNNING,
    STOPPED,
    OptimizationRecord,
)
from tunepack.optimizer.space import VAL_LOSS, Goal, Parameter, Space
from tunepack.runtimes import methods
from tunepack.runtimes.store import load_runtime

POLL_S = 0.5  # how often running trials are looked at

# Optuna's user attributes of a trial: its TrainJob, and why it ended.
JOB_ATTR, STOPPED_ATTR, MESSAGE_ATTR, EXIT_ATTR = "job", "stopped", "message", "exit_code"
PRUNED_AT_ATTR = "pruned_at_step"


@dataclass
class Outcome:
    status: str
    message: str | None = None


@dataclass
class _Active:
    trial: object  # optuna.Trial
    job: JobRecord
    values: dict[str, str]
    offset: int = 0  # how far metrics.jsonl has been read
    reported: set[int] = field(default_factory=set)
    pruned_at: int | None = None


def open_study(record: OptimizationRecord, space: Space, *, create: bool = True):
    """The record's Optuna study (created on first use)."""
    import optuna

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    return optuna.create_study(
        storage=record.storage,
        study_name=record.name,
        direction=space.goal.direction,
        sampler=_sampler(space),
        pruner=_pruner(space),
        load_if_exists=True,
    )


def _sampler(space: Space):
    import optuna

    seed = space.algorithm.seed
    # A grid's points are enqueued in order (_enqueue_grid), which every sampler takes as given:
    # Optuna's GridSampler stops its study from a callback, which asking and telling cannot do.
    if space.algorithm.name == "tpe":
        return optuna.samplers.TPESampler(seed=seed)
    return optuna.samplers.RandomSampler(seed=seed)


def _pruner(space: Space):
    import optuna

    stop = space.early_stopping
    if stop is None:
        return optuna.pruners.NopPruner()
    return optuna.pruners.MedianPruner(
        n_startup_trials=stop.min_trials_required, n_warmup_steps=stop.start_step
    )


def distributions(space: Space) -> dict:
    from optuna.distributions import (
        CategoricalDistribution,
        FloatDistribution,
        IntDistribution,
    )

    out = {}
    for p in space.parameters:
        if p.choices:
            out[p.name] = CategoricalDistribution(list(p.choices))
        elif p.integer:
            out[p.name] = IntDistribution(math.ceil(p.low), math.floor(p.high), log=p.log)
        else:
            out[p.name] = FloatDistribution(p.low, p.high, log=p.log)
    return out


def spelled(param: Parameter, value: object) -> str:
    """A drawn value as the trainer argument spells it."""
    if param.choices:
        return str(value)
    return str(int(value)) if param.integer else repr(float(value))


def shown_number(job: str) -> int | str:
    """A trial as the console numbers it: by its TrainJob (``<search>-<n>``), which a stopped
    trial keeps when it runs again under a new Optuna number."""
    tail = job.rpartition("-")[2]
    return int(tail) if tail.isdigit() else job


def counted(trial) -> bool:
    """Whether a finished trial counts towards the trials asked for (a stopped one does not)."""
    import optuna

    state = trial.state
    if state in (optuna.trial.TrialState.COMPLETE, optuna.trial.TrialState.PRUNED):
        return True
    return state is optuna.trial.TrialState.FAIL and not trial.user_attrs.get(STOPPED_ATTR)


def failed(trial) -> bool:
    import optuna

    return trial.state is optuna.trial.TrialState.FAIL and not trial.user_attrs.get(STOPPED_ATTR)


def objective_value(result: dict, goal: Goal) -> float | None:
    """The trial's objective from its own ``result.json`` (``methods.result_metrics``: what the
    trainer also prints last for Katib), None where the run did not report it."""
    return methods.result_metrics(result).get(goal.metric)


def slots_for(space: Space, echo: Callable[[str], None]) -> int:
    """How many trials run at once: ``parallel_trials`` where this machine has a GPU for each,
    one on a machine without GPUs (trials on one CPU only slow each other down)."""
    gpus = _gpu_count()
    wanted = space.parallel_trials
    if gpus == 0:
        if wanted > 1:
            echo(
                f"tunepack: parallel_trials={wanted}: this machine has no GPU, so the trials run "
                "one at a time (on one CPU they would only slow each other down)"
            )
        return 1
    if wanted > gpus:
        echo(f"tunepack: parallel_trials={wanted}, but this machine has {gpus} GPU(s): {gpus}")
    return max(1, min(wanted, gpus))


def _gpu_count() -> int:
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        return len([d for d in visible.split(",") if d.strip() and d.strip() != "-1"])
    try:
        return len([d for d in os.listdir("/dev") if d.startswith("nvidia") and d[6:].isdigit()])
    except OSError:
        return 0


def run(
    record: OptimizationRecord,
    backend,
    echo: Callable[[str], None],
    stop: threading.Event,
) -> Outcome:
    """Run the study of ``record`` on the local ``backend`` until its trials are done, or
    ``stop`` is set (then every running trial is stopped, checkpointing, and the outcome is
    Stopped). ``echo`` gets a line per trial started and finished."""
    space = record.space()
    template = record.template()
    record.update(status=RUNNING, pid=os.getpid(), message=None)
    study = open_study(record, space)
    _settle(study, echo)
    if space.algorithm.name == "grid" and not study.get_trials(deepcopy=False):
        _enqueue_grid(study, space)
    shared = _initialize(record, backend, template, echo)
    if isinstance(shared, Outcome):
        record.update(status=shared.status, message=shared.message)
        return shared
    slots = slots_for(space, echo)
    gpus = list(range(_gpu_count())) if slots > 1 else []
    active: list[_Active] = []
    outcome = None
    while outcome is None:
        if stop.is_set():
            for trial in active:
                runner.stop(trial.job)
            for trial in active:
                _wait_ended(trial.job)
                echo(
                    f"tunepack: trial {shown_number(trial.job.path.name)} stopped; it resumes "
                    "from its checkpoint"
                )
            outcome = Outcome(STOPPED, "stopped; the same optimize() call resumes it")
            break
        done = [t for t in study.get_trials(deepcopy=False) if counted(t)]
        todo = space.num_trials - len(done) - len(active)
        if (space.max_failed_trials is not None) and (
            sum(failed(t) for t in done) > space.max_failed_trials
        ):
            last = next(t for t in reversed(done) if failed(t))
            outcome = Outcome(
                FAILED,
                f"{sum(failed(t) for t in done)} trials failed, more than max_failed_trials="
                f"{space.max_failed_trials}; the last: {last.user_attrs.get(MESSAGE_ATTR)}",
            )
            break
        while todo > 0 and len(active) < slots and not _grid_exhausted(study, space):
            free_gpu = [g for g in gpus if g not in {_gpu_of(a) for a in active}]
            started = _launch(record, backend, study, space, template, shared, free_gpu, echo)
            if started is not None:
                active.append(started)
            todo -= 1
        for trial in list(active):
            if _follow(trial, study, space, template, echo):
                active.remove(trial)
        if not active and (todo <= 0 or _grid_exhausted(study, space)):
            done = [t for t in study.get_trials(deepcopy=False) if counted(t)]
            if done and all(failed(t) for t in done):
                outcome = Outcome(
                    FAILED,
                    f"every trial failed; the last: {done[-1].user_attrs.get(MESSAGE_ATTR)}",
                )
            else:
                outcome = Outcome(COMPLETE)
            break
        stop.wait(POLL_S)
    record.update(status=outcome.status, message=outcome.message)
    return outcome


def _enqueue_grid(study, space: Space) -> None:
    """Every point of a grid, in order (the first parameter's values slowest), as Katib's grid
    goes."""
    import itertools

    names = [p.name for p in space.parameters]
    for point in itertools.product(*(p.choices for p in space.parameters)):
        study.enqueue_trial(dict(zip(names, point, strict=True)))


def _grid_exhausted(study, space: Space) -> bool:
    """A grid search has drawn each of its points."""
    if space.algorithm.name != "grid":
        return False
    import optuna

    grid = math.prod(len(p.choices) for p in space.parameters)
    drawn = [
        t
        for t in study.get_trials(deepcopy=False)
        if counted(t) or t.state is optuna.trial.TrialState.RUNNING
    ]
    return len(drawn) >= grid


def _settle(study, echo: Callable[[str], None]) -> None:
    """Trials an earlier run left running (stopped, or its runner killed): each is recorded as
    stopped and asked again with the same values under its own TrainJob, which resumes it."""
    import optuna

    for trial in study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.RUNNING,)):
        optuna.Trial(study, trial._trial_id).set_user_attr(STOPPED_ATTR, True)
        study.tell(trial.number, state=optuna.trial.TrialState.FAIL, skip_if_finished=True)
        study.enqueue_trial(trial.params, user_attrs={JOB_ATTR: trial.user_attrs.get(JOB_ATTR)})
        job = trial.user_attrs.get(JOB_ATTR) or str(trial.number)
        echo(f"tunepack: trial {shown_number(job)} was stopped; it runs again from its checkpoint")


def _initialize(record: OptimizationRecord, backend, template, echo) -> Path | Outcome:
    """The dataset and model, initialized once into the shared workspace: the runtime's own
    initializer steps. The workspace path, or the outcome of a failed step."""
    from tunepack.jobs.submit import local_trainjob

    shared = record.shared
    shared.mkdir(parents=True, exist_ok=True)
    trainjob = local_trainjob(
        backend, template.runtime, template.initializer(), template.finetune(), name=record.name
    )
    runtime = load_runtime(trainjob["spec"]["runtimeRef"]["name"])
    steps = [
        s
        for s in resolve_steps(runtime, trainjob, shared.resolve())
        if s.ancestor in INITIALIZER_SOURCES
    ]
    with lock_workspace(shared, f"optimization {record.name!r}") as lock:
        for step in steps:
            echo(f"==> {step.name} (once for every trial)")
            outcome = run_step(step, shared / LOGS_DIR, echo=echo, lock=lock)
            if outcome.exit_code != 0:
                reason = outcome.error_line() or f"exit code {outcome.exit_code}"
                return Outcome(FAILED, f"step {step.name!r} failed: {reason}")
    return shared


def _launch(record, backend, study, space, template, shared: Path, gpus, echo) -> _Active | None:
    """Ask the study for a point and start its trial: a local TrainJob of the backend."""
    from tunepack.jobs.submit import local_trainjob

    trial = study.ask(distributions(space))
    job_name = trial.user_attrs.get(JOB_ATTR) or record.trial_job(trial.number)
    trial.set_user_attr(JOB_ATTR, job_name)
    values = {p.name: spelled(p, trial.params[p.name]) for p in space.parameters}
    env = {"CUDA_VISIBLE_DEVICES": str(gpus[0])} if gpus else None
    finetune = template.finetune(**{k: spaces.typed(k, v) for k, v in values.items()})
    if env:
        import dataclasses

        finetune = dataclasses.replace(finetune, env={**(finetune.env or {}), **env})
    shown = " ".join(f"{k}={v}" for k, v in values.items())
    try:
        trainjob = local_trainjob(
            backend, template.runtime, template.initializer(), finetune, name=job_name
        )
    except TunepackError as err:  # a point the job's checks refuse: the trial fails, at once
        import optuna

        trial.set_user_attr(MESSAGE_ATTR, str(err))
        trial.set_user_attr(EXIT_ATTR, err.exit_code)
        study.tell(trial, state=optuna.trial.TrialState.FAIL)
        echo(f"tunepack: trial {shown_number(job_name)} ({job_name}): {shown}: refused: {err}")
        return None
    job = JobRecord(backend.register(trainjob, replace=True))
    _link_initialized(shared, job.workspace)
    echo(f"tunepack: trial {shown_number(job_name)} ({job_name}): {shown}")
    runner.start(job)
    return _Active(trial, job, values)


def _gpu_of(active: _Active) -> int | None:
    env = (active.job.trainjob()["spec"]["trainer"].get("env")) or []
    value = next((e["value"] for e in env if e["name"] == "CUDA_VISIBLE_DEVICES"), None)
    return int(value) if value is not None else None


def _link_initialized(shared: Path, workspace: Path) -> None:
    """The shared dataset and model in a trial's workspace, as hard links where the file system
    allows (copies otherwise): its initializers find them complete and verified."""
    workspace.mkdir(parents=True, exist_ok=True)
    for part in (DATASET_DIR, MODEL_DIR):
        target = workspace / part
        if target.exists():
            continue
        staging = workspace / f".{part}.linking"
        shutil.rmtree(staging, ignore_errors=True)
        shutil.copytree(shared / part, staging, copy_function=_link_or_copy)
        staging.rename(target)


def _link_or_copy(src: str, dst: str) -> None:
    try:
        os.link(src, dst)
    except OSError:
        shutil.copy2(src, dst)


def _follow(active: _Active, study, space: Space, template, echo) -> bool:
    """Look at a running trial: report its new intermediate values, stop it if the early
    stopping rule says so, and tell the study when it has ended. True once it has."""
    import optuna

    if active.pruned_at is None:
        for step, value in _new_values(active, space.goal):
            if step in active.reported:
                continue
            active.reported.add(step)
            active.trial.report(value, step)
            if space.early_stopping is not None and active.trial.should_prune():
                active.pruned_at = step
                runner.stop(active.job)
                break
    status = _job_status(active.job)
    if status not in TERMINAL:  # Complete, Failed, or Stopped (by early stopping, a signal)
        return False
    number = shown_number(active.job.path.name)
    if active.pruned_at is not None:
        active.trial.set_user_attr(PRUNED_AT_ATTR, active.pruned_at)
        study.tell(active.trial, state=optuna.trial.TrialState.PRUNED)
        echo(
            f"tunepack: trial {number} stopped early at step {active.pruned_at}: its "
            f"{space.goal.metric} was worse than the median of the earlier trials there"
        )
        return True
    if status == kc.TRAINJOB_COMPLETE:
        result = active.job.result()
        value = objective_value(result, space.goal)
        if value is not None:
            study.tell(active.trial, value)
            best = study.best_trial.number == active.trial.number
            echo(
                f"tunepack: trial {number} done: {space.goal.metric} {value:.4f}"
                + (" (best so far)" if best else "")
            )
            return True
        message = f"its result.json reports no {space.goal.metric}"
    else:
        message = active.job.status()[1] or "failed"
    code = next(
        (s.get("exit_code") for s in active.job.state()["steps"].values() if s.get("exit_code")),
        None,
    )
    active.trial.set_user_attr(MESSAGE_ATTR, message)
    if code is not None:
        active.trial.set_user_attr(EXIT_ATTR, code)
    study.tell(active.trial, state=optuna.trial.TrialState.FAIL)
    echo(f"tunepack: trial {number} failed: {message}")
    return True


def _job_status(job: JobRecord) -> str:
    status, _ = job.status()
    return status


def _new_values(active: _Active, goal: Goal) -> list[tuple[int, float]]:
    """The trial's objective at each step its metrics.jsonl has reported since the last look:
    evaluations for the validation loss, logged steps for the loss and the method's metrics."""
    path = active.job.metrics_path
    try:
        with path.open("rb") as f:
            f.seek(active.offset)
            data = f.read()
    except FileNotFoundError:
        return []
    complete = data[: data.rfind(b"\n") + 1]  # a line still being written is read next time
    active.offset += len(complete)
    out = []
    for line in complete.decode(errors="replace").splitlines():
        try:
            record = json.loads(line)
        except ValueError:
            continue
        metric = record.get(goal.metric)
        event = "eval" if goal.metric == VAL_LOSS else "step"
        if record.get("event") == event and isinstance(metric, int | float):
            out.append((int(record["step"]), float(metric)))
    return out


def _wait_ended(job: JobRecord) -> None:
    """Until the trial's runner (and so every process of the trial) has ended."""
    ended = threading.Event()
    while job.alive():
        ended.wait(POLL_S)
