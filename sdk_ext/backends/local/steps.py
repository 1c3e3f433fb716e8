"""The local backend's executor: run a TrainJob on this machine, step by step, as processes.

It plays the part of the Kubeflow Trainer controller and JobSet for one machine. From the
runtime definition (the same ClusterTrainingRuntime a cluster uses) and a TrainJob it derives
each step's command and environment exactly as the platform would: ``STORAGE_URI`` for the
initializers, the TrainJob's ``args`` for the trainer, the ``PET_*`` variables of the torch
plugin; the workspace volume's mount path is replaced by a local directory. Steps run in the
order their ``dependsOn`` fields give; a failing step stops the run and is named.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass, field
from pathlib import Path

from tunepack.core import lifetime, program
from tunepack.core.errors import EXIT_BAD_INPUT, EXIT_TRANSIENT, BadValueError
from tunepack.core.workspace import JOB_NAME_ENV, LOGS_DIR, WorkspaceLock, lock_workspace
from tunepack.initializers.export import EXPORT_URI_ENV
from tunepack.runtimes import contract
from tunepack.runtimes.contract import (
    DATASET_STEP,
    EXPORT_STEP,
    MODEL_STEP,
    TRAINER_STEP,
    WORKSPACE_VOLUME,
)
from tunepack.trainers.process import noise

# Which TrainJob initializer block feeds which step (by the step's ancestor label).
INITIALIZER_SOURCES = {DATASET_STEP.ancestor: "dataset", MODEL_STEP.ancestor: "model"}


@dataclass
class StepProcess:
    """One replicated job of the runtime, resolved for this TrainJob: the command, environment
    and replica count of the processes that run it here (the runtime's own step names are
    ``tunepack.runtimes``')."""

    name: str
    ancestor: str | None
    command: list[str]
    env: dict[str, str]
    replicas: int = 1
    depends_on: list[str] = field(default_factory=list)


MAX_DETAIL_LINES = 5  # of the lines detailing a step's error (offending rows) that are shown


@dataclass
class StepOutcome:
    name: str
    exit_code: int
    seconds: float
    log: Path

    def error_lines(self) -> list[str]:
        """The last ``<program>: error: ...`` line the step printed, with the indented lines
        after it that detail it (the first offending rows of a dataset); empty if none."""
        return program.last_error_in(self.log, MAX_DETAIL_LINES)

    def error_line(self) -> str | None:
        """``error_lines()`` as one message (lines joined by newlines), or None."""
        return "\n".join(self.error_lines()) or None


@dataclass
class RunOutcome:
    steps: list[StepOutcome]
    # True when every step succeeded and the trainer had nothing to do (its result.json was
    # complete for this configuration and is unchanged): the run changed nothing.
    nothing_to_do: bool = False
    # True when the trainer had nothing to do but the exporter sent the result (an export added
    # to a finished job, or a destination that had lost it): the run did that much.
    exported_only: bool = False

    @property
    def failed(self) -> StepOutcome | None:
        return next((s for s in self.steps if s.exit_code != 0), None)


def describe_exit(code: int) -> str:
    if code == EXIT_BAD_INPUT:
        return "bad input: fix it and run again"
    if code == EXIT_TRANSIENT:
        return "transient failure: running again may succeed"
    if code > 128 and code - 128 in signal.valid_signals():
        name = signal.Signals(code - 128).name
        return f"killed by {name}: running it again resumes from the newest checkpoint"
    return "unexpected failure: see the log"


def order_steps(replicated_jobs: list[dict]) -> list[dict]:
    """Order jobs so each comes after the jobs it ``dependsOn`` (stable for independent jobs)."""
    by_name = {job["name"]: job for job in replicated_jobs}
    ordered: list[dict] = []
    state: dict[str, str] = {}

    def visit(name: str, chain: tuple[str, ...]) -> None:
        if state.get(name) == "done":
            return
        if name in chain:
            cycle = " -> ".join((*chain, name))
            raise BadValueError(f"runtime jobs depend on each other in a cycle: {cycle}")
        if name not in by_name:
            raise BadValueError(f"runtime job {chain[-1]!r} depends on unknown job {name!r}")
        for dep in by_name[name].get("dependsOn") or []:
            visit(dep["name"], (*chain, name))
        state[name] = "done"
        ordered.append(by_name[name])

    for job in replicated_jobs:
        visit(job["name"], ())
    return ordered


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def resolve_steps(runtime: dict, trainjob: dict, workspace: Path) -> list[StepProcess]:
    """Turn runtime + TrainJob into the commands and environments of each step."""
    spec = trainjob.get("spec", {})
    initializer = spec.get("initializer") or {}
    trainer = spec.get("trainer") or {}
    num_nodes = trainer.get("numNodes") or runtime["spec"].get("mlPolicy", {}).get("numNodes", 1)
    master_port = _free_port()

    steps = []
    for job in order_steps(contract.replicated_jobs(runtime)):
        ancestor = contract.step_label(job)
        container = contract.container(job)
        env = contract.env(container)
        command = list(container.get("command", [])) + list(container.get("args", []))
        replicas = 1

        if ancestor in INITIALIZER_SOURCES:
            source = initializer.get(INITIALIZER_SOURCES[ancestor]) or {}
            if source.get("storageUri"):
                env["STORAGE_URI"] = source["storageUri"]
            env.update({e["name"]: e["value"] for e in source.get("env", []) if "value" in e})
        elif ancestor == TRAINER_STEP.ancestor:
            command = list(trainer.get("command") or container.get("command", []))
            command += list(trainer.get("args") or container.get("args", []))
            env.update({e["name"]: e["value"] for e in trainer.get("env", []) if "value" in e})
            replicas = int(num_nodes)
            env.update(
                PET_NNODES=str(num_nodes),
                PET_NPROC_PER_NODE=str(trainer.get("numProcPerNode", "auto")),
                PET_MASTER_ADDR="127.0.0.1",
                PET_MASTER_PORT=str(master_port),
            )

        # Per-job environment of the other containers (the exporter's EXPORT_URI) comes through
        # the TrainJob's runtimePatches, as on a cluster. Secret references have no local
        # equivalent: credentials come from this process's environment.
        env.update(patched_env(trainjob, job["name"], container["name"]))
        # What JobSet's pod labels give each step on a cluster (the runtime's downward API).
        if job_name := (trainjob.get("metadata") or {}).get("name"):
            env[JOB_NAME_ENV] = job_name
        if ancestor == EXPORT_STEP.ancestor and not env.get(EXPORT_URI_ENV):
            # On a cluster the exporter Pod runs and does nothing; here the no-op is left out.
            continue
        # The workspace volume's mount path becomes the local directory.
        for mount in container.get("volumeMounts", []):
            if mount["name"] == WORKSPACE_VOLUME:
                env = {k: v.replace(mount["mountPath"], str(workspace)) for k, v in env.items()}
        if command and command[0] in ("python", "python3"):
            command[0] = sys.executable
        deps = [d["name"] for d in job.get("dependsOn") or []]
        steps.append(StepProcess(job["name"], ancestor, command, env, replicas, deps))
    return steps


def shown_command(command: list[str]) -> str:
    """A step's command as the console shows it: ``python -m ...`` rather than the full path of
    this environment's interpreter, which every step shares (the log files keep nothing else)."""
    shown = ["python" if i == 0 and arg == sys.executable else arg for i, arg in enumerate(command)]
    return " ".join(shown)


def patched_env(trainjob: dict, job: str, container: str) -> dict[str, str]:
    """The plain-value environment the TrainJob's ``runtimePatches`` give ``container`` of
    replicated job ``job`` (later patches win, as the Trainer merges them)."""
    env: dict[str, str] = {}
    for patch in contract.runtime_patches(trainjob):
        for rjob in contract.replicated_jobs(patch, partial=True):
            if rjob.get("name") != job:
                continue
            for c in contract.containers(rjob, partial=True):
                if c.get("name") == container:
                    env.update(contract.env(c))
    return env


# Lines tunepack's programs write themselves ("trainer: ...", "model-initializer: ...", records
# of the "tunepack.*" loggers); everything else in a step's log is other packages' (kept in the
# log file, echoed only with TUNEPACK_VERBOSE) unless it reports an error.
_OWN_LINE = re.compile(
    r"^(?:[a-z]+(?:-[a-z]+)*-initializer|trainer|exporter|tunepack(?:\.[\w.]+)?): "
    r"|^(?:DEBUG|INFO|WARNING|ERROR|CRITICAL) tunepack[.:]"
    r"|^(?:ERROR|CRITICAL) "
)


def progress_line(line: str, verbose: bool | None = None) -> str | None:
    """What the console shows of a line a step wrote, or None for lines not worth echoing.

    The trainer logs one JSON record per step (kept whole in the step's log file); a person
    watching the console wants about twenty lines per run, not hundreds, and tunepack's own
    lines, not other packages' warnings (``verbose``, default ``$TUNEPACK_VERBOSE``: all of them).
    """
    verbose = noise.verbose() if verbose is None else verbose
    try:
        record = json.loads(line)
    except ValueError:
        record = None
    if not isinstance(record, dict) or "event" not in record:
        return line.rstrip() if verbose or _OWN_LINE.match(line) else None
    if record["event"] == "eval" and "val_loss" in record:
        best = record.get("best_val_loss")
        return (
            f"eval at step {record['step']}/{record.get('total_steps', '?')}  val_loss "
            f"{record['val_loss']:.4f}  perplexity {record.get('val_perplexity', float('nan')):.2f}"
            + (f"  best {best:.4f} (step {record.get('best_step')})" if best is not None else "")
        )
    if record["event"] != "step":
        return line.rstrip() if verbose else None
    step, total = record["step"], record["total_steps"]
    if step != 1 and step != total and step % max(1, total // 20):
        return None
    line = (
        f"step {step}/{total}  epoch {record['epoch']}  loss {record['loss']:.4f}  "
        f"lr {record['lr']:.2e}  {record['tokens_per_second']:.0f} tok/s"
    )
    if "reward_margin" in record:  # method=dpo
        line += f"  margin {record['reward_margin']:.4f}  accuracy {record['reward_accuracy']:.2f}"
    if "reward_mean" in record:  # method=grpo
        line += f"  reward {record['reward_mean']:.3f}  kl {record['kl']:.4f}"
    return line


LOG_SUFFIX = ".log"
PREVIOUS_RUNS_DIR = "previous"  # logs/previous/<n>/: the logs of earlier runs in this workspace


def replica_name(step: str, rank: int, replicas: int) -> str:
    """The name one replica of a step goes by on the console, in ``logs/`` and for ``tunepack
    logs --step``: the step's own (``node``) where it has one replica, else ``node-0``,
    ``node-1`` ..."""
    return step if replicas == 1 else f"{step}-{rank}"


def step_log(log_dir: Path, step: str, rank: int = 0, replicas: int = 1) -> Path:
    """The log of one replica of a step: ``node.log``, or ``node-0.log``, ``node-1.log`` ... for
    a step of several replicas (``replica_name``)."""
    return log_dir / f"{replica_name(step, rank, replicas)}{LOG_SUFFIX}"


def keep_previous_logs(log_dir: Path) -> Path | None:
    """Move the logs of the previous run in this workspace to ``logs/previous/<n>/`` (n counts
    up from 1), so each run keeps its own and the current run's are always ``logs/<step>.log``."""
    old = sorted(log_dir.glob(f"*{LOG_SUFFIX}")) if log_dir.is_dir() else []
    if not old:
        return None
    previous = log_dir / PREVIOUS_RUNS_DIR
    previous.mkdir(exist_ok=True)
    numbers = [int(p.name) for p in previous.iterdir() if p.name.isdigit()]
    target = previous / str(max(numbers, default=0) + 1)
    target.mkdir()
    for path in old:
        path.rename(target / path.name)
    return target


def restore_previous_logs(log_dir: Path, kept: Path, current: tuple[str, ...] = ()) -> None:
    """Undo ``keep_previous_logs`` after a run that trained nothing: its logs (which only say
    so) are dropped and the logs of the run before, ``kept``, are ``logs/<step>.log`` again,
    so that ``tunepack logs`` shows the run that trained; but the logs of the ``current`` steps
    (an exporter that sent files) are this run's."""
    for path in log_dir.glob(f"*{LOG_SUFFIX}"):
        if path.name not in current:
            path.unlink()
    for path in kept.iterdir():
        if path.name not in current:
            path.rename(log_dir / path.name)
        else:
            path.unlink()
    kept.rmdir()
    try:
        kept.parent.rmdir()  # logs/previous/, when that run was the only earlier one
    except OSError:
        pass


def _tail(
    log: Path,
    prefix: str,
    echo: Callable[[str], None],
    done: threading.Event,
    held: list[str] | None = None,
) -> None:
    """Echo the progress lines a step writes to ``log`` until the step has ended.

    An error line and the lines detailing it (a dataset's first offending rows) are held back
    while nothing follows them: left in ``held`` at the end, they are the step's last error,
    which the run's summary of a failed step says (``run_step`` echoes them where it does not).

    The step writes its log file itself, not through a pipe to this process: when the CLI is
    killed or its terminal closes, the steps' output has nowhere to break, and a trainer that is
    checkpointing after a stop signal is not killed by a write to a closed pipe.
    """
    held = [] if held is None else held
    partial = ""
    with log.open(errors="replace") as f:
        while True:
            ended = done.is_set()  # read to the end once more after the step ended
            while line := f.readline():
                if not line.endswith("\n"):
                    partial += line
                    continue
                text, partial = partial + line, ""
                if held and text.startswith(program.DETAIL_INDENT):
                    if len(held) <= MAX_DETAIL_LINES:
                        held.append(text.rstrip())
                    continue
                shown = progress_line(text)
                if shown is None:
                    continue
                for earlier in held:  # an error that was not the last
                    if not _echo(echo, f"[{prefix}] {earlier}"):
                        return
                held.clear()
                if program.ERROR_MARK in shown:
                    held.append(shown)
                elif not _echo(echo, f"[{prefix}] {shown}"):
                    return
            if ended:
                if partial:
                    _echo(echo, f"[{prefix}] {partial.rstrip()}")
                return
            done.wait(0.1)


def _echo(echo: Callable[[str], None], line: str) -> bool:
    try:
        echo(line)
    except (OSError, ValueError):  # the console went away: the log file keeps everything
        return False
    return True


def run_step(
    step: StepProcess,
    log_dir: Path,
    echo: Callable[[str], None] | None = print,
    lock: WorkspaceLock | None = None,
) -> StepOutcome:
    """Run every replica of a step (the node step has one per node) and wait for all.

    Each replica runs through ``tunepack.core.lifetime``'s shim: it gets SIGTERM from the kernel
    when this process dies, so a killed CLI or runner never leaves a step running. ``lock``: the
    workspace lock the run holds; each replica inherits it, so it outlives no process of the run.
    """
    log_dir.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    procs, tails = [], []
    held: list[list[str]] = [[] for _ in range(step.replicas)]  # each replica's last error
    ended = threading.Event()
    for rank in range(step.replicas):
        env = {**os.environ, **step.env, **(lock.env() if lock else {})}
        if step.ancestor == TRAINER_STEP.ancestor:
            env["PET_NODE_RANK"] = str(rank)
        log_path = step_log(log_dir, step.name, rank, step.replicas)
        with log_path.open("wb") as log_file:  # the child keeps its own copy of the descriptor
            proc = subprocess.Popen(
                lifetime.shim(step.command),
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=log_file,
                stderr=subprocess.STDOUT,
                pass_fds=(lock.fd,) if lock else (),
            )
        procs.append(proc)
        if echo is not None:
            prefix = replica_name(step.name, rank, step.replicas)
            tail = threading.Thread(
                target=_tail, args=(log_path, prefix, echo, ended, held[rank]), daemon=True
            )
            tail.start()
            tails.append(tail)
    try:
        codes = [proc.wait() for proc in procs]
    finally:
        ended.set()
        for tail in tails:
            tail.join()
    rank, code = next(((r, c) for r, c in enumerate(codes) if c != 0), (0, 0))
    if code < 0:  # killed by signal N: 128 + N, as a shell and the kubelet report it
        code = 128 - code
    log = step_log(log_dir, step.name, rank, step.replicas)  # the failing replica's, if one did
    # The failed replica's last error is its caller's to say, once, with the step's failure
    # (StepOutcome.error_lines); any other replica's is echoed here.
    for other, lines in enumerate(held):
        if code == 0 or other != rank:
            for line in lines:
                _echo(echo, f"[{replica_name(step.name, other, step.replicas)}] {line}")
    return StepOutcome(step.name, code, time.perf_counter() - started, log)


def run_trainjob(
    runtime: dict,
    trainjob: dict,
    workspace: Path,
    echo: Callable[[str], None] | None = print,
) -> RunOutcome:
    """Run all steps in dependency order; stop at the first failing step."""
    workspace.mkdir(parents=True, exist_ok=True)
    name = trainjob.get("metadata", {}).get("name", "?")
    with lock_workspace(workspace, f"local TrainJob {name!r}") or nullcontext() as lock:
        keep_previous_logs(workspace / LOGS_DIR)
        outcomes = []
        for step in resolve_steps(runtime, trainjob, workspace.resolve()):
            if echo:
                echo(f"==> {step.name}: {shown_command(step.command)}")
            outcome = run_step(step, workspace / LOGS_DIR, echo, lock)
            outcomes.append(outcome)
            if outcome.exit_code != 0:
                break
    return RunOutcome(outcomes)
