"""``LocalBackend``: ``TrainingClient``'s backend for TrainJobs run as processes on this machine.

A thin facade over the package's other modules. ``tunepack train --local`` registers its jobs
here too and runs them through the same ``runner.run_job``, so the CLI and Python see one set of
jobs (docs/sdk.md, "Local jobs and the command line").

    >>> from tunepack import TrainingClient, LocalBackendConfig"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable, Iterator
from datetime import datetime
from pathlib import Path

from kubeflow.trainer.constants import constants as kc
from kubeflow.trainer.types import types as kf
from pydantic import BaseModel

from tunepack.backends.base import TunepackBackend, builtin_torchtune_trainer, sdk_step
from tunepack.backends.local import runner
from tunepack.backends.local.job import RUNNER_CLI, TERMINAL, TRAINJOB_STOPPED, JobRecord
from tunepack.backends.local.progress import read_progress
from tunepack.backends.local.steps import order_steps
from tunepack.core.errors import (
    BadInputError,
    ConflictError,
    DeniedError,
    NotFoundError,
    UnknownRuntimeError,
    WorkspaceBusyError,
)
from tunepack.core.workspace import MODEL_DIR, job_owner
from tunepack.jobs import naming, submit
from tunepack.jobs.trainjob import export_of
from tunepack.runtimes import catalog, contract
from tunepack.runtimes.contract import EXPORT_STEP
from tunepack.runtimes.planner import DEFAULT_GPU, DEFAULT_MEMORY_CHECK
from tunepack.runtimes.store import load_runtime
from tunepack.types import Result, RuntimeList, TrainJob, TunepackRuntime

HOME_ENV = "TUNEPACK_HOME"


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
    gpu: str = DEFAULT_GPU
    memory_check: str = DEFAULT_MEMORY_CHECK


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
            raise UnknownRuntimeError(f"{what}; {hint}", runtime=name, suggestions=matches)
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
            self, runtime, initializer, trainer, options, name=naming.random_job_name()
        )
        runner.start(JobRecord(self.register(trainjob)))
        return trainjob["metadata"]["name"]

    def register(
        self, trainjob: dict, workspace: Path | None = None, *, replace: bool = False
    ) -> Path:
        """Record ``trainjob`` (a TrainJob dict) as a job of this backend, status Created:
        ``<root>/<name>/`` with ``trainjob.yaml`` and ``state.json``. ``workspace`` is where its
        steps run (default ``<root>/<name>/workspace``). A job of the same name is refused, or
        with ``replace=True`` (a re-run of ``tunepack train --local --name``) replaced unless it
        is still running; its workspace is left as it is. Returns the job's directory."""
        name = trainjob["metadata"]["name"]
        job = JobRecord(self.root / name)
        created = None
        if job.exists():
            if not replace:
                raise ConflictError(f"a local TrainJob {name!r} already exists under {self.root}")
            if self.get_job(name).status in (kc.TRAINJOB_CREATED, kc.TRAINJOB_RUNNING):
                raise WorkspaceBusyError(  # busy, not bad input: it can run once that one ends
                    f"local TrainJob {name!r} is still running (pid {job.pid()}, in "
                    f"{self.workspace(name)}); wait for it to end, or give another --name"
                )
            created = job.created()  # a re-run is the same job: it keeps its creation time
        try:
            job.create(trainjob, workspace, created)
        except OSError as err:
            raise DeniedError(
                f"cannot record local TrainJob {name!r} under {self.root}: "
                f"{(err.strerror or str(err)).lower()}; set TUNEPACK_HOME (or --jobs-dir) to a "
                "directory you can write to"
            ) from None
        return job.path

    def list_jobs(self, runtime: kf.Runtime | None = None) -> list[TrainJob]:
        if not self.root.is_dir():
            return []
        jobs = []
        for path in sorted(self.root.iterdir()):
            if JobRecord(path).exists():
                try:
                    jobs.append(self.get_job(path.name))
                except (BadInputError, FileNotFoundError):
                    continue  # deleted since the directory was listed
        if runtime is not None:
            jobs = [j for j in jobs if j.runtime.name == runtime.name]
        return sorted(jobs, key=lambda j: j.creation_timestamp)

    def jobs_in_workspace(self, workspace: Path, besides: str | None = None) -> list[str]:
        """The names of the jobs whose steps run in ``workspace`` (but ``besides``), the one
        the workspace records as its owner first, then the newest first."""
        if not self.root.is_dir():
            return []
        wanted = Path(workspace).resolve()
        found = []
        for path in self.root.iterdir():
            job = JobRecord(path)
            if path.name == besides or not job.exists():
                continue
            try:
                if job.workspace.resolve() == wanted:
                    found.append((job.created() or "", path.name))
            except (OSError, ValueError, KeyError):
                continue  # deleted since the directory was listed, or unreadable
        owner = job_owner(wanted)
        found.sort(key=lambda f: (owner is not None and f[1] == owner.name, f[0]), reverse=True)
        return [name for _, name in found]

    def job_dir(self, name: str) -> Path:
        """The directory of job ``name``'s record (``<root>/<name>/``)."""
        return self._job(name).path

    def _job(self, name: str) -> JobRecord:
        """The record of job ``name``; BadInputError when there is none."""
        job = JobRecord(self.root / name)
        if not name or "/" in name or name in (".", "..") or not job.exists():
            missing = f"no local TrainJob {name!r} under {self.root}"
            raise NotFoundError(
                f"{missing}; see list_jobs() (tunepack jobs --local)",
                cli_message=f"{missing}; `tunepack jobs --local` lists them",
                what="TrainJob",
                name=name,
            )
        return job

    def workspace(self, name: str) -> Path:
        """Where the job's steps run: ``<root>/<name>/workspace``, or the directory
        ``tunepack train --local --workspace`` was given."""
        return self._job(name).workspace

    def workspace_of(self, name: str) -> str:
        return str(self.workspace(name))

    @property
    def location(self) -> str:
        return f"under {self.root}"

    def metrics(self, name: str) -> list[dict]:
        """The records of the trainer's ``metrics.jsonl`` that carry a loss."""
        from tunepack.notebook_progress import read_metrics

        return read_metrics(self._job(name).metrics_path)

    def trainjob_object(self, name: str) -> dict:
        return self._job(name).trainjob()

    def _result(self, name: str):
        job = self._job(name)
        trainjob, workspace, info = job.trainjob(), job.workspace, job.result()
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
        job = self._job(name)
        state, trainjob = job.state(), job.trainjob()
        logs = str(job.logs_dir)
        status, message = job.status(state)
        steps = [
            kf.Step(name=step, status=info["status"], pod_name=logs)
            for step, info in state["steps"].items()
        ]
        return TrainJob(
            name=name,
            runtime=self.get_runtime(trainjob["spec"]["runtimeRef"]["name"]),
            steps=steps,
            num_nodes=trainjob["spec"]["trainer"].get("numNodes", 1),
            creation_timestamp=datetime.fromisoformat(state["created"]),
            status=status,
            message=message,
            progress=read_progress(job.metrics_path),
            exit_code=next(
                (
                    s["exit_code"]
                    for s in state["steps"].values()
                    if s.get("status") in (kc.TRAINJOB_FAILED, TRAINJOB_STOPPED)
                ),
                None,
            ),
        )

    def get_job_logs(
        self, name: str, follow: bool = False, step: str = kc.NODE + "-0"
    ) -> Iterator[str]:
        steps = self._step_names(name)
        step = sdk_step(step, steps)
        if step not in steps:
            raise NotFoundError(
                f"local TrainJob {name!r} has no step {step!r}; its steps are {', '.join(steps)}",
                what="step",
                name=step,
                available=steps,
            )
        log = self._job(name).step_log(step, steps)
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
            if not follow or self.get_job(name).status in TERMINAL:
                if follow and log.exists() and log.stat().st_size > position:
                    continue  # drain what was written before the job ended
                return
            time.sleep(0.2)

    def _step_names(self, name: str) -> list[str]:
        """The SDK names of the job's steps, whether or not they ran: the runtime's jobs in
        order, the node job as ``node-0`` .. ``node-<nodes - 1>``."""
        trainjob = self._job(name).trainjob()
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
        state = self._job(name).state()
        events = []
        for step, info in state["steps"].items():
            if "started" in info:
                events.append((info["started"], step, "Started", f"step {step} started"))
            if "finished" in info:
                reason = {"Succeeded": "Completed", TRAINJOB_STOPPED: TRAINJOB_STOPPED}.get(
                    info["status"], "Failed"
                )
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
            TRAINJOB_STOPPED,
        }
        if not status.issubset(allowed):
            raise ValueError(f"Expected status {status} must be a subset of {allowed}")
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            job = self.get_job(name)
            for callback in callbacks or []:
                callback(job)
            if job.status in (kc.TRAINJOB_FAILED, TRAINJOB_STOPPED) and job.status not in status:
                # A stopped job stays stopped until it is run again: waiting longer is no use.
                raise RuntimeError(f"TrainJob {name} is {job.status}: {job.message}")
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
        job = self._job(name)
        state, workspace = job.state(), job.workspace
        pid = job.pid()
        if pid and job.alive() and state["status"] not in TERMINAL:
            if state.get("runner") == RUNNER_CLI:
                raise ConflictError(
                    f"local TrainJob {name!r} is running in the foreground of `tunepack train "
                    f"--local` (pid {pid}); stop it there with Ctrl-C first"
                )
            runner.stop(job)
        keep = (not job.workspace_inside) if keep_workspace is None else keep_workspace
        job.delete(keep)
        return workspace if keep and workspace.exists() else None
