"""tunepack's local backend for ``TrainingClient``: TrainJobs as processes on this machine.

``train()`` writes the TrainJob under ``<root_dir>/<name>/`` and starts a detached runner process
(``python -m tunepack.backends.local <job dir>``) that runs the runtime's steps with
``tunepack.backends.local.steps``, recording each step's state in ``state.json``. Jobs therefore
outlive the notebook kernel.

``tunepack train --local`` creates its jobs here too (``register``), and runs them in the
foreground through the same ``run_job``, in the workspace it was given (``state.json`` records
it). So the CLI (``tunepack jobs``, ``status``, ``logs``, ``result``, ``delete``) and Python
(``list_jobs()``, ``get_job()``, ...) see the same jobs, whichever created them.

    >>> from tunepack import TrainingClient, LocalBackendConfig
    >>> client = TrainingClient(LocalBackendConfig(root_dir="/tmp/tunepack-jobs"))
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import nullcontext
from datetime import UTC, datetime
from pathlib import Path

import yaml
from kubeflow.trainer.constants import constants as kc
from kubeflow.trainer.types import types as kf
from pydantic import BaseModel

from tunepack.backends.base import TunepackBackend, builtin_torchtune_trainer, sdk_step
from tunepack.core import durable, program
from tunepack.core.errors import BadInputError, TransientError, TunepackError
from tunepack.core.workspace import (
    LOGS_DIR,
    MODEL_DIR,
    WorkspaceLock,
    lock_workspace,
    metrics_file,
    result_file,
)
from tunepack.jobs import submit
from tunepack.jobs.trainjob import export_of
from tunepack.notebook import Progress, Result, RuntimeList, TrainJob, TunepackRuntime
from tunepack.runtimes import catalog, contract
from tunepack.runtimes.contract import EXPORT_STEP
from tunepack.runtimes.store import load_runtime

HOME_ENV = "TUNEPACK_HOME"
STATE_FILE = "state.json"
TRAINJOB_FILE = "trainjob.yaml"
WORKSPACE_DIR = "workspace"


def default_root() -> Path:
    return Path(os.environ.get(HOME_ENV, Path.home() / ".tunepack")) / "jobs"


class LocalBackendConfig(BaseModel):
    """Configuration of tunepack's local backend.

    Args:
        root_dir: where jobs live (``<root_dir>/<job name>/``); default ``~/.tunepack/jobs``
            (or ``$TUNEPACK_HOME/jobs``).
        gpu: GPU type the memory planner checks against when a runtime uses GPUs.
        memory_check: ``refuse`` (default), ``warn`` or ``off`` when the plan does not fit.
    """

    root_dir: str | None = None
    gpu: str = "H100-80GB"
    memory_check: str = "refuse"


RUNNER_CLI = "cli"  # state["runner"]: run in the foreground by `tunepack train --local`


def _now() -> str:
    return datetime.now(UTC).isoformat()


_write_json = durable.write_json  # readers (other processes) never see half a state file


class LocalBackend(TunepackBackend):
    """Runs tunepack runtimes as local processes (``tunepack.backends.base``'s interface)."""

    def __init__(self, cfg: LocalBackendConfig):
        self.cfg = cfg
        self.root = Path(cfg.root_dir).expanduser() if cfg.root_dir else default_root()

    # --- runtimes ------------------------------------------------------------------------------

    def list_runtimes(self) -> RuntimeList:
        return RuntimeList(self.get_runtime(e.runtime_name) for e in catalog.CATALOG.values())

    def resolve_runtime(self, name: str) -> TunepackRuntime:
        """The runtime ``train(runtime=name)`` uses. The local backend has tunepack's runtimes
        only, so a catalog model's short name (``tiny-llama3``) resolves to its runtime
        (``tunepack-tiny-llama3``), which is logged; any other name is ``get_runtime``'s error."""
        target = submit.short_name_target(name)
        if target is not None:
            submit.log_short_name(name, target, "on the local backend")
            name = target
        return self.get_runtime(name)

    def get_runtime(self, name: str) -> TunepackRuntime:
        if not submit.is_tunepack_runtime(name):
            known = [e.runtime_name for e in catalog.CATALOG.values()]
            prefix = catalog.RUNTIME_PREFIX
            if name.startswith(prefix):  # a typo in the model: match on the model part alone
                models = [k.removeprefix(prefix) for k in known]
                matches = [prefix + m for m in submit.close_matches(name[len(prefix) :], models)]
                what = f"unknown runtime or model {name!r}: tunepack has no model of that name"
            else:
                target = submit.short_name_target(name)
                matches = [target] if target else submit.close_matches(name, known)
                what = (
                    f"runtime {name!r} is not available on the local backend, which runs "
                    "tunepack runtimes only"
                )
            hint = (
                f"did you mean {', '.join(map(repr, matches))}?"
                if matches
                else f"tunepack runtimes are: {', '.join(known)}"
            )
            raise BadInputError(f"{what}; {hint}")
        obj = load_runtime(name)
        node = contract.container(contract.replicated_job(obj, kc.NODE))
        image, command = node["image"], node["command"]
        trainer = builtin_torchtune_trainer(
            kf.RuntimeTrainer(
                trainer_type=kf.TrainerType.BUILTIN_TRAINER, framework=kf.TORCH_TUNE, image=image
            ),
            tuple(command),
        )
        base = kf.Runtime(
            name=obj["metadata"]["name"],
            trainer=trainer,
            kind=kf.RuntimeKind.CLUSTER_TRAINING_RUNTIME,
        )
        return TunepackRuntime.wrap(base)

    def get_runtime_packages(self, runtime: kf.Runtime):
        """Print the Python and packages the runtime's steps run with: this environment's."""
        from importlib.metadata import distributions

        print(f"Python: {sys.version}")
        rows = sorted(
            (d.metadata["Name"], d.version) for d in distributions() if d.metadata["Name"]
        )
        for name, version in rows:
            print(f"{name}=={version}")

    # --- jobs ----------------------------------------------------------------------------------

    def train(self, runtime=None, initializer=None, trainer=None, options=None) -> str:
        # The checks `tunepack train --local` makes too: one function for both local paths.
        trainjob = submit.local_trainjob(
            self, runtime, initializer, trainer, options, name=submit.job_name()
        )
        name = trainjob["metadata"]["name"]
        job_dir = self.register(trainjob)
        with (job_dir / "runner.log").open("w") as log:
            proc = subprocess.Popen(
                [sys.executable, "-m", "tunepack.backends.local", str(job_dir)],
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,  # survives the kernel; killed as a group by delete_job
            )
        (job_dir / "pid").write_text(str(proc.pid))
        return name

    def register(
        self, trainjob: dict, workspace: Path | None = None, *, replace: bool = False
    ) -> Path:
        """Record ``trainjob`` (a TrainJob dict) as a job of this backend, status Created:
        ``<root>/<name>/`` with ``trainjob.yaml`` and ``state.json``. ``workspace`` is where its
        steps run (default ``<root>/<name>/workspace``). A job of the same name is refused, or
        with ``replace=True`` (a re-run of ``tunepack train --local --name``) replaced unless it
        is still running; its workspace is left as it is. Returns the job's directory."""
        name = trainjob["metadata"]["name"]
        job_dir = self.root / name
        created = None
        if (job_dir / STATE_FILE).exists():
            if not replace:
                raise BadInputError(f"a local TrainJob {name!r} already exists under {self.root}")
            if self.get_job(name).status in (kc.TRAINJOB_CREATED, kc.TRAINJOB_RUNNING):
                raise TransientError(  # busy, not bad input: it can run once that one ends
                    f"local TrainJob {name!r} is still running (pid {_pid(job_dir)}, in "
                    f"{self.workspace(name)}); wait for it to end, or give another --name"
                )
            created = _created(job_dir)
        try:
            job_dir.mkdir(parents=True, exist_ok=True)
            for record in (STATE_FILE, TRAINJOB_FILE, "pid", "runner.log"):
                (job_dir / record).unlink(missing_ok=True)
            (job_dir / TRAINJOB_FILE).write_text(yaml.safe_dump(trainjob, sort_keys=False))
            # A re-run is the same job: it keeps the time the job was first created.
            state = {"status": kc.TRAINJOB_CREATED, "created": created or _now(), "steps": {}}
            if workspace is not None and Path(workspace) != job_dir / WORKSPACE_DIR:
                state["workspace"] = str(Path(workspace).resolve())
            _write_json(job_dir / STATE_FILE, state)
        except OSError as err:
            raise BadInputError(
                f"cannot record local TrainJob {name!r} under {self.root}: "
                f"{(err.strerror or str(err)).lower()}; set TUNEPACK_HOME (or --jobs-dir) to a "
                "directory you can write to"
            ) from None
        return job_dir

    def list_jobs(self, runtime: kf.Runtime | None = None) -> list[TrainJob]:
        if not self.root.is_dir():
            return []
        jobs = []
        for path in sorted(self.root.iterdir()):
            if (path / STATE_FILE).exists():
                try:
                    jobs.append(self.get_job(path.name))
                except (BadInputError, FileNotFoundError):
                    continue  # deleted since the directory was listed
        if runtime is not None:
            jobs = [j for j in jobs if j.runtime.name == runtime.name]
        return sorted(jobs, key=lambda j: j.creation_timestamp)

    def job_dir(self, name: str) -> Path:
        path = self.root / name
        if not name or "/" in name or name in (".", "..") or not (path / STATE_FILE).exists():
            missing = f"no local TrainJob {name!r} under {self.root}"
            raise BadInputError(
                f"{missing}; see list_jobs() (tunepack jobs --local)",
                cli_message=f"{missing}; `tunepack jobs --local` lists them",
            )
        return path

    def workspace(self, name: str) -> Path:
        """Where the job's steps run: ``<root>/<name>/workspace``, or the directory
        ``tunepack train --local --workspace`` was given."""
        job_dir = self.job_dir(name)
        state = json.loads((job_dir / STATE_FILE).read_text())
        return Path(state["workspace"]) if "workspace" in state else job_dir / WORKSPACE_DIR

    def workspace_of(self, name: str) -> str:
        return str(self.workspace(name))

    @property
    def location(self) -> str:
        return f"under {self.root}"

    def metrics(self, name: str) -> list[dict]:
        """The records of the trainer's ``metrics.jsonl`` that carry a loss."""
        from tunepack.notebook_progress import read_metrics

        return read_metrics(metrics_file(self.workspace(name)))

    def _result(self, name: str):
        trainjob = yaml.safe_load((self.job_dir(name) / TRAINJOB_FILE).read_text())
        workspace = self.workspace(name)
        info = json.loads(result_file(workspace).read_text())
        return Result(
            job=name,
            path=info["artifact"],
            base_model=str(workspace / MODEL_DIR),
            method=info.get("method"),
            final_loss=info.get("final_loss"),
            export=export_of(trainjob),
            chat_template=info.get("chat_template"),
            system_prompt=info.get("system_prompt"),
            val_loss=info.get("val_loss"),
            best_val_loss=info.get("best_val_loss"),
            tracker=info.get("tracker"),
        )

    def get_job(self, name: str) -> TrainJob:
        job_dir = self.job_dir(name)
        state = json.loads((job_dir / STATE_FILE).read_text())
        trainjob = yaml.safe_load((job_dir / TRAINJOB_FILE).read_text())
        workspace = self.workspace(name)
        status = state["status"]
        if status in (kc.TRAINJOB_CREATED, kc.TRAINJOB_RUNNING) and not _alive(job_dir):
            status = kc.TRAINJOB_FAILED
            state["message"] = (
                "the `tunepack train --local` process that ran it ended before the job did"
                if state.get("runner") == RUNNER_CLI
                else "the local runner process ended unexpectedly; see runner.log"
            )
        steps = [
            kf.Step(name=step, status=info["status"], pod_name=str(workspace / LOGS_DIR))
            for step, info in state["steps"].items()
        ]
        return TrainJob(
            name=name,
            runtime=self.get_runtime(trainjob["spec"]["runtimeRef"]["name"]),
            steps=steps,
            num_nodes=trainjob["spec"]["trainer"].get("numNodes", 1),
            creation_timestamp=datetime.fromisoformat(state["created"]),
            status=status,
            message=state.get("message"),
            progress=read_progress(metrics_file(workspace)),
        )

    def get_job_logs(
        self, name: str, follow: bool = False, step: str = kc.NODE + "-0"
    ) -> Iterator[str]:
        steps = self._step_names(name)
        step = sdk_step(step, steps)
        if step not in steps:
            raise BadInputError(
                f"local TrainJob {name!r} has no step {step!r}; its steps are {', '.join(steps)}"
            )
        log = _step_log(self.workspace(name), step, steps)
        position = 0
        while True:
            if log.exists():
                with log.open() as f:
                    f.seek(position)
                    while line := f.readline():
                        if not line.endswith("\n") and follow:
                            break  # a line still being written: read it whole next time
                        position = f.tell()
                        yield line.rstrip("\n")
            if not follow or self.get_job(name).status in (
                kc.TRAINJOB_COMPLETE,
                kc.TRAINJOB_FAILED,
            ):
                if follow and log.exists() and log.stat().st_size > position:
                    continue  # drain what was written before the job ended
                return
            time.sleep(0.2)

    def _step_names(self, name: str) -> list[str]:
        """The SDK names of the job's steps, whether or not they ran: the runtime's jobs in
        order, the node job as ``node-0`` .. ``node-<nodes - 1>``."""
        from tunepack.backends.local.steps import order_steps

        trainjob = yaml.safe_load((self.job_dir(name) / TRAINJOB_FILE).read_text())
        runtime = load_runtime(trainjob["spec"]["runtimeRef"]["name"])
        nodes = (trainjob["spec"].get("trainer") or {}).get("numNodes") or runtime["spec"].get(
            "mlPolicy", {}
        ).get("numNodes", 1)
        names = []
        for job in order_steps(contract.replicated_jobs(runtime)):
            if job["name"] == EXPORT_STEP.job and export_of(trainjob) is None:
                continue  # no export asked for: the local backend leaves the no-op step out
            if job["name"] == kc.NODE:
                names += [f"{kc.NODE}-{i}" for i in range(int(nodes))]
            else:
                names.append(job["name"])
        return names

    def get_job_events(self, name: str) -> list[kf.Event]:
        """The steps' starts and ends, in time order (what Kubernetes events show on a cluster)."""
        state = json.loads((self.job_dir(name) / STATE_FILE).read_text())
        events = []
        for step, info in state["steps"].items():
            if "started" in info:
                events.append((info["started"], step, "Started", f"step {step} started"))
            if "finished" in info:
                reason = "Completed" if info["status"] == "Succeeded" else "Failed"
                message = f"step {step} {reason.lower()} (exit code {info['exit_code']})"
                events.append((info["finished"], step, reason, message))
        return [
            kf.Event(
                involved_object_kind="Job",
                involved_object_name=step,
                message=message,
                reason=reason,
                event_time=datetime.fromisoformat(when),
            )
            for when, step, reason, message in sorted(events)
        ]

    def wait_for_job_status(
        self,
        name: str,
        status: set[str] = {kc.TRAINJOB_COMPLETE},  # noqa: B006 (the SDK's signature)
        timeout: int = 600,
        polling_interval: int = 2,
        callbacks: list[Callable[[kf.TrainJob], None]] | None = None,
    ) -> TrainJob:
        allowed = {
            kc.TRAINJOB_CREATED,
            kc.TRAINJOB_RUNNING,
            kc.TRAINJOB_COMPLETE,
            kc.TRAINJOB_FAILED,
        }
        if not status.issubset(allowed):
            raise ValueError(f"Expected status {status} must be a subset of {allowed}")
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            job = self.get_job(name)
            for callback in callbacks or []:
                callback(job)
            if job.status == kc.TRAINJOB_FAILED and kc.TRAINJOB_FAILED not in status:
                raise RuntimeError(f"TrainJob {name} is Failed: {job.message}")
            if job.status in status:
                return job
            time.sleep(polling_interval)
        raise TimeoutError(f"Timeout waiting for TrainJob {name} to reach status: {status}")

    def delete_job(self, name: str, keep_workspace: bool | None = None) -> Path | None:
        """Delete the job, stopping its runner first. ``keep_workspace``: ``None`` (the SDK's
        call) removes a workspace under the job's directory and keeps one given to ``tunepack
        train --local --workspace``; ``True`` keeps it either way, ``False`` removes it either
        way. Returns the workspace kept, if any.

        A job run in the foreground by ``tunepack train --local`` is not stopped from here: it
        is refused while it runs (Ctrl-C there stops it, with a checkpoint)."""
        job_dir = self.job_dir(name)
        state = json.loads((job_dir / STATE_FILE).read_text())
        workspace = self.workspace(name)
        inside = workspace == job_dir / WORKSPACE_DIR
        pid = _pid(job_dir)
        if pid and _alive(job_dir) and state["status"] not in TERMINAL:
            if state.get("runner") == RUNNER_CLI:
                raise BadInputError(
                    f"local TrainJob {name!r} is running in the foreground of `tunepack train "
                    f"--local` (pid {pid}); stop it there with Ctrl-C first"
                )
            try:
                os.killpg(pid, signal.SIGTERM)  # the runner's own session: it and its steps
            except ProcessLookupError:
                pass
        keep = (not inside) if keep_workspace is None else keep_workspace
        if not keep and not inside:
            shutil.rmtree(workspace, ignore_errors=True)
        if keep and inside:
            for path in job_dir.iterdir():  # the record only; <root>/<name>/workspace stays
                if path.name != WORKSPACE_DIR:
                    shutil.rmtree(path) if path.is_dir() else path.unlink()
        else:
            shutil.rmtree(job_dir)
        return workspace if keep and workspace.exists() else None


TERMINAL = (kc.TRAINJOB_COMPLETE, kc.TRAINJOB_FAILED)


def update_state(job_dir: Path, **fields) -> None:
    """Set top-level fields of a job's ``state.json`` (e.g. a status and message)."""
    state = json.loads((job_dir / STATE_FILE).read_text())
    _write_json(job_dir / STATE_FILE, {**state, **fields})


def _step_log(workspace: Path, step: str, steps: list[str]) -> Path:
    """The log of an SDK step name among the job's ``steps``: ``node-0`` is the node job's
    first replica (``node.log`` with one node, ``node-0.log`` of several), ``node-1`` its
    second (``node-1.log``)."""
    from tunepack.backends.local.steps import step_log

    head, _, index = step.rpartition("-")
    if head == kc.NODE and index.isdigit():
        replicas = sum(s.startswith(f"{kc.NODE}-") for s in steps)
        return step_log(workspace / LOGS_DIR, head, int(index), replicas)
    return step_log(workspace / LOGS_DIR, step)


def _created(job_dir: Path) -> str | None:
    """When the job in ``job_dir`` was first created (None: its record cannot say)."""
    try:
        created = json.loads((job_dir / STATE_FILE).read_text())["created"]
        datetime.fromisoformat(created)
        return created
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _pid(job_dir: Path) -> int | None:
    try:
        return int((job_dir / "pid").read_text())
    except (FileNotFoundError, ValueError):
        return None


def _alive(job_dir: Path) -> bool:
    pid = _pid(job_dir)
    if pid is None:
        return True  # between mkdir and Popen: still being created
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


def read_progress(metrics: Path) -> Progress | None:
    """Progress from the trainer's ``metrics.jsonl``: the last step record (one per optimizer
    step) and the last evaluation record (runs with a validation split)."""
    if not metrics.exists():
        return None
    last: dict[str, dict] = {}
    for line in metrics.read_text().splitlines():
        try:
            record = json.loads(line)
        except ValueError:
            continue  # a line being written
        if isinstance(record, dict) and record.get("event") in ("step", "eval"):
            last[record["event"]] = record
    if "step" not in last:
        return None
    step, total = last["step"].get("step"), last["step"].get("total_steps")
    evaluation = last.get("eval", {})
    return Progress(
        percent=int(100 * step / total) if step and total else None,
        step=step,
        total_steps=total,
        loss=last["step"].get("loss"),
        val_loss=evaluation.get("val_loss"),
        val_perplexity=evaluation.get("val_perplexity"),
        tokens_per_second=last["step"].get("tokens_per_second"),
    )


# --- the runner process ---------------------------------------------------------------------------


def runner_main(job_dir: Path) -> int:
    """The detached runner's body (``python -m tunepack.backends.local <job dir>``): run the
    job, return the failed step's exit code or 0."""
    try:
        failed = run_job(job_dir).failed
    except TunepackError as err:  # e.g. the workspace is in use: the job's state says so
        update_state(job_dir, status=kc.TRAINJOB_FAILED, message=str(err))
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
):
    """Run the job in ``job_dir`` step by step in its workspace, recording each step's state;
    stop at the first failing step. ``echo`` gets each step's command and output lines.
    ``cli=True``: run by ``tunepack train --local`` in its own process (recorded as the job's
    runner). The workspace is locked for the whole run (``tunepack.core.workspace``): a second run
    on it is refused with ``WorkspaceBusyError`` before anything is touched. ``lock``: the lock
    the caller took before recording the job (None: the file system cannot lock), which it
    releases; by default the lock is taken here.
    Returns ``tunepack.backends.local.steps.RunOutcome``."""
    from tunepack.backends.local.steps import (
        keep_previous_logs,
        resolve_steps,
        restore_previous_logs,
    )

    state_path = job_dir / STATE_FILE
    state = json.loads(state_path.read_text())
    trainjob = yaml.safe_load((job_dir / TRAINJOB_FILE).read_text())
    runtime = load_runtime(trainjob["spec"]["runtimeRef"]["name"])
    workspace = Path(state.get("workspace") or job_dir / WORKSPACE_DIR)
    workspace.mkdir(parents=True, exist_ok=True)
    if cli:
        (job_dir / "pid").write_text(str(os.getpid()))
        state["runner"] = RUNNER_CLI
    name = trainjob["metadata"]["name"]
    held = (
        nullcontext(lock)
        if lock is not _TAKE_LOCK
        else lock_workspace(workspace, f"local TrainJob {name!r}") or nullcontext()
    )
    with held as lock:
        before = _read_bytes(result_file(workspace))
        kept = keep_previous_logs(workspace / LOGS_DIR)
        steps = resolve_steps(runtime, trainjob, workspace.resolve())
        outcome = _run_steps(job_dir, state, steps, workspace, echo, lock)
        # The trainer rewrites result.json whenever it trains: unchanged, nothing was trained.
        if (
            not outcome.failed
            and before is not None
            and _read_bytes(result_file(workspace)) == before
        ):
            outcome.nothing_to_do = True
            if kept is not None:
                restore_previous_logs(workspace / LOGS_DIR, kept)
        return outcome


def _read_bytes(path: Path) -> bytes | None:
    try:
        return path.read_bytes()
    except FileNotFoundError:
        return None


def _run_steps(job_dir, state, steps, workspace: Path, echo, lock):
    from tunepack.backends.local.steps import RunOutcome, describe_exit, run_step, shown_command

    state_path = job_dir / STATE_FILE
    names = {s.name: _sdk_names(s) for s in steps}
    state["steps"] = {n: {"status": "Pending"} for s in steps for n in names[s.name]}
    state["status"] = kc.TRAINJOB_RUNNING
    _write_json(state_path, state)
    outcomes = []
    for step in steps:
        started = _now()
        for n in names[step.name]:
            state["steps"][n] = {"status": "Running", "started": started}
        _write_json(state_path, state)
        if echo:
            echo(f"==> {step.name}: {shown_command(step.command)}")
        outcome = run_step(step, workspace / LOGS_DIR, echo=echo, lock=lock)
        outcomes.append(outcome)
        phase = "Succeeded" if outcome.exit_code == 0 else "Failed"
        for n in names[step.name]:
            state["steps"][n] = {
                "status": phase,
                "exit_code": outcome.exit_code,
                "started": started,
                "finished": _now(),
            }
        if outcome.exit_code != 0:
            reason = outcome.error_line()
            state["status"] = kc.TRAINJOB_FAILED
            state["message"] = (
                f"step {step.name!r} failed with exit code {outcome.exit_code} "
                f"({describe_exit(outcome.exit_code)})" + (f": {reason}" if reason else "")
            )
            _write_json(state_path, state)
            return RunOutcome(outcomes)
        _write_json(state_path, state)
    state["status"] = kc.TRAINJOB_COMPLETE
    _write_json(state_path, state)
    return RunOutcome(outcomes)


def _sdk_names(step) -> list[str]:
    if step.name == kc.NODE:
        return [f"{kc.NODE}-{i}" for i in range(step.replicas)]
    return [step.name]
