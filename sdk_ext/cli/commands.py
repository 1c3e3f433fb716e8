"""The ``tunepack`` commands: one ``cmd_*`` function per subcommand, and the parser.

The job commands work through ``TrainingClient`` (``tunepack.client``), as a notebook does: the
local backend's (``--local``) or the cluster's. ``tunepack.cli`` is the entry point (exit codes,
one-line errors).
"""

from __future__ import annotations

import argparse
import errno
import json
import logging
import os
import re
import sys
import tempfile
import time
from contextlib import nullcontext
from pathlib import Path

from tunepack.cli.cluster import backend_config, check_cluster, load_config
from tunepack.runtimes import methods


def _table(rows: list[list[str]], header: list[str]) -> str:
    widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(len(header))]
    lines = [
        "  ".join(str(c).ljust(w) for c, w in zip(row, widths, strict=True))
        for row in [header, *rows]
    ]
    return "\n".join(line.rstrip() for line in lines)


def _count(n: int) -> str:
    for div, unit in ((1e9, "B"), (1e6, "M"), (1e3, "K")):
        if n >= div:
            return f"{n / div:.2f}{unit}"
    return str(n)


def cmd_runtimes(_: argparse.Namespace) -> int:
    from tunepack.runtimes.store import list_runtimes

    rows = [
        [
            r["name"],
            ",".join(r["methods"]),
            _count(r["params"]) if r["params"] else "yours",
            r["gpus"],
            r["description"],
        ]
        for r in list_runtimes()
    ]
    print(_table(rows, ["RUNTIME", "METHODS", "PARAMS", "GPUS", "DESCRIPTION"]))
    return 0


def cmd_args(_: argparse.Namespace) -> int:
    from tunepack.trainers.args import vocabulary_table

    print(_table([list(r) for r in vocabulary_table()], ["KEY", "DEFAULT", "MEANING"]))
    return 0


def cmd_tiny_model(ns: argparse.Namespace) -> int:
    from tunepack.tiny import write_tiny_model

    with _writing(ns.directory, "a directory for the tiny model"):
        path = write_tiny_model(Path(ns.directory), seed=ns.seed)
    print(f"tiny model ready at {path}")
    return 0


def cmd_tiny_dataset(ns: argparse.Namespace) -> int:
    from tunepack.core.errors import BadInputError
    from tunepack.tiny import write_tiny_dataset
    from tunepack.tiny.dataset import write_tiny_preference_dataset

    if os.path.isdir(ns.file):
        raise BadInputError(
            f"{ns.file} is a directory; give the path of the dataset file to write "
            f"(e.g. {os.path.join(ns.file, 'instructions.jsonl')})"
        )
    with _writing(ns.file, "a path for the dataset file"):
        write = write_tiny_preference_dataset if ns.preference else write_tiny_dataset
        path = write(Path(ns.file), rows=ns.rows, seed=ns.seed)
    kind = "preference dataset (for method=dpo)" if ns.preference else "dataset"
    print(f"tiny {kind} ready at {path}")
    return 0


class _writing:
    """An OSError while writing ``path`` (read-only, not a directory, no space): one line."""

    def __init__(self, path: str, wanted: str):
        self.path, self.wanted = path, wanted

    def __enter__(self):
        return self

    def __exit__(self, kind, err, tb):
        from tunepack.core.errors import BadInputError

        if isinstance(err, OSError) and not isinstance(err, BlockingIOError):
            reason = (err.strerror or str(err)).lower()
            if err.filename and err.filename != self.path:
                shown = str(err.filename)
                reason = f"{shown} is a file" if os.path.isfile(shown) else f"{reason} ({shown})"
            raise BadInputError(
                f"cannot write {self.path}: {reason}; give {self.wanted} you can write to"
            ) from None
        return False


def _default_job_name(runtime: str) -> str:
    model = runtime.removeprefix("tunepack-")
    return re.sub(r"[^a-z0-9-]", "-", f"{model}-{time.strftime('%Y%m%d-%H%M%S')}")


def _trainjob(ns: argparse.Namespace, *, local: bool = False) -> dict:
    from tunepack.jobs.trainjob import (
        CLUSTER_RUNTIME_KIND,
        NAMESPACED_RUNTIME_KIND,
        TrainJobSpec,
        build_trainjob,
    )

    namespaced = getattr(ns, "namespaced", False)
    spec = TrainJobSpec(
        name=ns.name if ns.name is not None else _default_job_name(ns.runtime),
        runtime=ns.runtime,
        dataset_uri=ns.dataset,
        model_uri=ns.model,
        trainer_args=ns.trainer_args,
        num_nodes=ns.num_nodes,
        namespace=getattr(ns, "namespace", None),
        num_proc_per_node=ns.num_proc_per_node,
        queue=ns.queue,
        runtime_kind=NAMESPACED_RUNTIME_KIND if namespaced else CLUSTER_RUNTIME_KIND,
        export_uri=ns.export,
        export_secret=ns.export_secret,
        dataset_secret=ns.dataset_secret,
        model_secret=ns.model_secret,
        local=local,
    )
    trainjob = build_trainjob(spec)
    if not local:
        from tunepack.jobs.submit import check_spec_plan

        # The memory check of `train` (TrainingClient), with the same --gpu and --memory-check.
        check_spec_plan(spec, ns.gpu, ns.memory_check)
    return trainjob


def cmd_render_trainjob(ns: argparse.Namespace) -> int:
    from tunepack.jobs.trainjob import to_yaml

    sys.stdout.write(to_yaml(_trainjob(ns)))
    return 0


def cmd_render_serving(ns: argparse.Namespace) -> int:
    from tunepack.core.errors import BadInputError
    from tunepack.jobs.trainjob import check_dns_label
    from tunepack.tools import serving

    check_dns_label("TrainJob name (--name)", ns.name)
    if ns.gpus < 1:
        raise BadInputError(f"--gpus {ns.gpus} is not valid: expected at least 1")
    served = serving.served_result(ns.runtime, ns.trainer_args)
    sys.stdout.write(serving.render(serving.manifests(ns.name, served, gpus=ns.gpus)))
    return 0


def stable_job_name(
    runtime: str, dataset: str, model: str, trainer, workspace: Path | None = None
) -> str:
    """The default name of a local job: ``<model>-<digest>``, the digest of what the command
    trains (the runtime, the dataset and model as their canonical URIs, the trainer arguments in
    their canonical spelling and the placement) and where (``workspace``, the absolute
    ``--workspace`` when one is given). The same command gets the same job, hence its workspace,
    and resumes it; another dataset, model, argument value or workspace gets another job."""
    from tunepack.core.digest import json_digest
    from tunepack.core.errors import BadInputError
    from tunepack.initializers import uri as storage_uri
    from tunepack.jobs.trainjob import max_name_length

    def canonical(uri: str) -> str:
        try:
            parsed = storage_uri.parse(uri)
        except BadInputError:
            return uri  # refused by the TrainJob's own checks, with the flag's name
        if parsed.is_local and parsed.options:  # file:///d?split=test: the split is the data
            return f"{parsed.canonical}?{sorted(parsed.options.items())}"
        return parsed.canonical

    identity = {
        "runtime": runtime,
        "dataset": canonical(dataset),
        "model": canonical(model),
        "args": trainer.to_args(),  # vocabulary order, values parsed: lr=1e-4 is lr=0.0001
        "num_nodes": trainer.num_nodes or 1,
        "num_proc_per_node": trainer.num_proc_per_node,
    }
    if workspace is not None:  # two workspaces are two jobs (each with its own lock)
        identity["workspace"] = str(workspace)
    digest = json_digest(identity)[:10]
    model_part = re.sub(r"[^a-z0-9-]", "-", runtime.removeprefix("tunepack-").lower()).strip("-")
    keep = max_name_length(trainer.num_nodes or 1) - len(digest) - 1
    return f"{model_part[:keep].rstrip('-') or 'job'}-{digest}"


def _local_trainjob(ns: argparse.Namespace, backend, workspace: Path | None) -> dict:
    """The TrainJob of ``train --local``, through the checks ``TrainingClient(
    LocalBackendConfig()).train`` applies (``submit.local_trainjob``): the runtime's name, the
    trainer arguments, the memory plan (``--gpu``, ``--memory-check``). ``workspace``: the
    ``--workspace`` given (absolute), part of the default name."""
    from tunepack.jobs.submit import local_trainjob
    from tunepack.jobs.translate import Initializer

    trainer = _finetune(ns)
    runtime = backend.resolve_runtime(ns.runtime)  # a short name resolves, said on the console
    initializer = Initializer(
        dataset=ns.dataset,
        model=ns.model,
        env=_verbose_env(ns) or {},
        dataset_secret=ns.dataset_secret,
        model_secret=ns.model_secret,
    )
    name = (
        ns.name
        if ns.name is not None
        else stable_job_name(runtime.name, ns.dataset, ns.model, trainer, workspace)
    )
    return local_trainjob(backend, runtime.name, initializer, trainer, name=name)


def _finetune(ns: argparse.Namespace):
    """The trainer of ``train`` (local or cluster): its ``key=value`` arguments checked as
    ``FineTune`` checks a notebook's, with the placement and export flags."""
    from tunepack.finetune import FineTune

    return FineTune.from_args(
        ns.trainer_args,
        num_nodes=ns.num_nodes,
        num_proc_per_node=ns.num_proc_per_node,
        env=_verbose_env(ns),
        export=ns.export,
        export_secret=ns.export_secret,
    )


def _verbose_env(ns: argparse.Namespace) -> dict[str, str] | None:
    """``--verbose``: the steps show third-party warnings and debug lines (TUNEPACK_VERBOSE)."""
    return {VERBOSE_ENV: "1"} if getattr(ns, "verbose", False) else None


VERBOSE_ENV = "TUNEPACK_VERBOSE"


def cmd_train(ns: argparse.Namespace) -> int:
    if ns.verbose:
        os.environ[VERBOSE_ENV] = "1"  # this process's own steps too
        _console_logging(verbose=True)
    if not ns.local:
        return _train_on_cluster(ns)
    from tunepack.core.errors import BadInputError

    if ns.queue is not None:
        raise BadInputError(
            f"--queue {ns.queue} names a Kueue queue on a cluster; the local backend has none "
            "(leave out --queue, or --local)"
        )
    from tunepack.core.workspace import lock_workspace

    if ns.workspace is not None and not ns.workspace.strip():
        raise BadInputError(
            "--workspace is empty; give a directory, or leave --workspace out to use the job's"
        )
    backend = _local_client(ns).backend  # the foreground run is the local backend's own
    given = Path(ns.workspace).resolve() if ns.workspace is not None else None
    trainjob = _local_trainjob(ns, backend, given)
    name = trainjob["metadata"]["name"]
    previous, previous_workspace = _previous_job(backend, name)
    if given is None and previous_workspace is not None:
        workspace = previous_workspace  # the same job again: resume its workspace
    else:
        workspace = given or (Path(".tunepack/runs") / name).resolve()
    _check_workspace(workspace, given=ns.workspace)
    # Resumed: the same job, in the workspace it ran in, which holds what it made.
    resumed = previous if workspace == previous_workspace and _has_work(workspace) else None
    # The workspace first: a run refused because another holds it touches no job's record.
    with lock_workspace(workspace, f"local TrainJob {name!r}") or nullcontext() as lock:
        job_dir = backend.register(trainjob, workspace, replace=True)
        return _run_local(ns, trainjob, job_dir, workspace, resumed, lock)


def _run_local(ns, trainjob, job_dir, workspace, resumed, lock) -> int:
    """``train --local`` once its job is recorded and its workspace locked (``lock``);
    ``resumed``: the status the job had where this run resumes it."""
    from tunepack.backends.local import run_job
    from tunepack.backends.local.steps import describe_exit
    from tunepack.cli.interrupt import StopOnInterrupt

    name, runtime = trainjob["metadata"]["name"], trainjob["spec"]["runtimeRef"]["name"]
    shown = runtime if ns.runtime == runtime else f"{runtime} (for {ns.runtime!r})"
    print(f"tunepack: job {name}: local run of {shown} in {workspace}", flush=True)
    if resumed == "Complete":
        pass  # said at the end: nothing to do, or (a source or setting changed) trained again
    elif resumed is not None:
        print(
            f"tunepack: job {name} ran before ({resumed}): resuming it (what is complete is "
            "kept; the trainer continues from its last checkpoint)",
            flush=True,
        )
    else:
        again = "" if ns.name else " (named after this command: the same command resumes it)"
        print(f"tunepack: a new job{again}", flush=True)
    started = time.perf_counter()
    stop = StopOnInterrupt(
        f"tunepack: interrupted ({{cause}}): stopping run {name!r} (the trainer saves a "
        "checkpoint first; Ctrl-C again kills it now)"
    )

    def echo(line: str) -> None:
        if not stop.interrupted:  # after a stop the steps' last words go to their logs only
            print(line, flush=True)

    try:
        with stop:
            outcome = run_job(job_dir, echo=None if ns.quiet else echo, cli=True, lock=lock)
    except BaseException as err:
        _record_failure(job_dir, f"tunepack train --local stopped: {type(err).__name__}: {err}")
        raise
    failed = outcome.failed
    if stop.interrupted and failed:
        _record_failure(
            job_dir,
            f"stopped ({stop.cause}) in step {failed.name!r}; to resume, run the same command "
            f"again (it resumes in {workspace})",
        )
        try:
            print(
                f"tunepack: run {name!r} stopped, no process of it left ({stop.cause}); logs in "
                f"{workspace / 'logs'}; to resume, run the same command again (it resumes in "
                f"{workspace})",
                file=sys.stderr,
            )
        except OSError:
            pass  # the terminal went away (SIGHUP): the job's state says the same
        return stop.exit_code
    if failed:
        # The job's record has the same lines (run_job), for tunepack status and get_job().
        reason = "\n  ".join(failed.error_lines())
        print(
            f"tunepack: step {failed.name!r} failed with exit code {failed.exit_code} "
            f"({describe_exit(failed.exit_code)}); log: {failed.log}"
            + (f"\n  {reason}" if reason else ""),
            file=sys.stderr,
        )
        return failed.exit_code
    from tunepack.jobs.trainjob import export_of

    if outcome.nothing_to_do:
        _print_nothing_to_do(name, workspace, export_of(trainjob), ns.jobs_dir)
        return 0
    _print_summary(name, runtime, workspace, time.perf_counter() - started, export_of(trainjob))
    return 0


def _previous_job(backend, name: str) -> tuple[str | None, Path | None]:
    """The status and workspace of the local job ``name`` if it ran before (None: a new job)."""
    from tunepack.core.errors import BadInputError

    try:
        return backend.get_job(name).status, backend.workspace(name).resolve()
    except (BadInputError, OSError, ValueError, KeyError):
        return None, None  # none (or a record too damaged to read: it is replaced)


def _has_work(workspace: Path) -> bool:
    """Whether ``workspace`` holds anything a run made (a fresh one is not resumed)."""
    from tunepack.core import workspace as layout

    made = (layout.DATASET_DIR, layout.MODEL_DIR, layout.CHECKPOINTS_DIR, layout.OUTPUT_DIR)
    return any((workspace / part).exists() for part in made)


def _record_failure(job_dir: Path, message: str) -> None:
    from tunepack.backends.local import update_state

    try:
        update_state(job_dir, status="Failed", message=message)
    except OSError:
        pass  # the record is gone: nothing to say it in


def _check_workspace(workspace: Path, given: str | None) -> None:
    """Refuse a workspace that cannot be one (a file, a read-only place) before any work."""
    from tunepack.core.errors import BadInputError

    shown = given or str(workspace)
    if workspace.exists() and not workspace.is_dir():
        raise BadInputError(
            f"--workspace {shown} is a file, not a directory; give a directory (it is created "
            "when missing)"
        )
    try:
        workspace.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=workspace):
            pass
    except OSError as err:
        reason = (err.strerror or str(err)).lower()
        existing = next(p for p in (workspace, *workspace.parents) if p.exists())
        if not existing.is_dir():
            reason = f"{existing} is a file"
        elif err.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
            reason = f"{existing} is not writable ({reason})"
        raise BadInputError(
            f"--workspace {shown} cannot be written: {reason}; give a directory you can write to"
        ) from None


def _train_on_cluster(ns: argparse.Namespace) -> int:
    """Submit through ``TrainingClient.train``, as a notebook does: the same runtime lookup
    (a TrainingRuntime in the namespace first), validation and memory check."""
    from kubeflow.trainer.options import Labels, Name

    from tunepack.client import TrainingClient
    from tunepack.jobs.trainjob import QUEUE_LABEL
    from tunepack.jobs.translate import Initializer

    trainer = _finetune(ns)
    options = [Name(ns.name if ns.name is not None else _default_job_name(ns.runtime))]
    if ns.queue is not None:
        options.append(Labels({QUEUE_LABEL: ns.queue}))
    check_cluster(ns.context)
    client = TrainingClient(backend_config(ns), gpu=ns.gpu, memory_check=ns.memory_check)
    name = client.train(
        runtime=ns.runtime,
        initializer=Initializer(
            dataset=ns.dataset,
            model=ns.model,
            env=_verbose_env(ns) or {},
            dataset_secret=ns.dataset_secret,
            model_secret=ns.model_secret,
        ),
        trainer=trainer,
        options=options,
    )
    print(f"tunepack: submitted TrainJob {client.backend.namespace}/{name}")
    return 0


def _cluster_client(ns: argparse.Namespace):
    """``TrainingClient()`` on the cluster the kubeconfig names, once its API server answers."""
    from tunepack.client import TrainingClient

    check_cluster(ns.context)
    return TrainingClient(backend_config(ns))


def _local_client(ns: argparse.Namespace):
    """``TrainingClient(LocalBackendConfig(root_dir=..., gpu=..., memory_check=...))``."""
    from tunepack.backends.local import LocalBackendConfig
    from tunepack.client import TrainingClient
    from tunepack.core.errors import BadInputError

    if ns.jobs_dir is not None and not ns.jobs_dir.strip():
        raise BadInputError(
            "--jobs-dir is empty; give a directory, or leave --jobs-dir out for the default "
            "($TUNEPACK_HOME/jobs or ~/.tunepack/jobs)"
        )
    checks = {k: getattr(ns, k) for k in ("gpu", "memory_check") if hasattr(ns, k)}
    client = TrainingClient(LocalBackendConfig(root_dir=ns.jobs_dir, **checks))
    root = client.backend.root
    if os.path.exists(root) and not os.path.isdir(root):  # False if unreadable
        given = f"--jobs-dir {ns.jobs_dir}" if ns.jobs_dir else f"the jobs dir {root}"
        raise BadInputError(
            f"{given} is a file, not a directory; give a directory for the local jobs (or set "
            "TUNEPACK_HOME)"
        )
    return client


def _client(ns: argparse.Namespace):
    """The ``TrainingClient`` a command works through: the local backend's or the cluster's."""
    return _local_client(ns) if ns.local else _cluster_client(ns)


def cmd_jobs(ns: argparse.Namespace) -> int:
    client = _client(ns)
    jobs = sorted(client.list_jobs(), key=lambda j: j.creation_timestamp)
    if not jobs:
        print(f"no {'local ' if ns.local else ''}TrainJobs {client.backend.location}")
        return 0
    rows = [
        [
            job.name,
            job.runtime.name if job.runtime else "",
            job.status,
            job.creation_timestamp.astimezone().strftime("%Y-%m-%d %H:%M:%S"),
            _percent(job),
            client.backend.workspace_of(job.name),
        ]
        for job in jobs
    ]
    print(_table(rows, ["NAME", "RUNTIME", "STATUS", "CREATED", "PROGRESS", "WORKSPACE"]))
    return 0


def _percent(job) -> str:
    """A job's progress in ``tunepack jobs``: its percentage, or ``-`` where none was reported
    (``tunepack status`` says why)."""
    progress = getattr(job, "progress", None)
    return f"{progress.percent}%" if progress and progress.percent is not None else "-"


def cmd_result(ns: argparse.Namespace) -> int:
    from tunepack.core.errors import BadInputError

    client = _client(ns)
    job = client.get_job(ns.name)
    if job.status != "Complete":
        message = f": {job.message}" if getattr(job, "message", None) else ""
        raise BadInputError(
            f"TrainJob {ns.name} is {job.status}, not Complete{message}; it has no result"
            + (" yet (tunepack status)" if job.status != "Failed" else "")
        )
    result = client.result(ns.name)
    print(f"{ns.name}  {job.runtime.name}")
    print(f"  result      {result.path}")
    print(f"  base model  {result.base_model}")
    if result.method:
        print(f"  method      {result.method}")
    if result.final_loss is not None:
        print(f"  final loss  {result.final_loss:.4f}")
    if result.export:
        print(f"  exported    {result.export} (tunepack download {ns.name} DIR)")
    return 0


def cmd_download(ns: argparse.Namespace) -> int:
    """Fetch an exported result: of a finished TrainJob, or at an export URI."""
    from tunepack.initializers.sinks import fetch_export

    def log(line: str) -> None:
        print(f"tunepack: {line}", flush=True)

    if "://" in ns.name:
        fetch_export(ns.name, Path(ns.dir), log)
        return 0
    from tunepack.core.errors import BadInputError

    client = _client(ns)
    job = client.get_job(ns.name)
    if job.status != "Complete":
        raise BadInputError(
            f"TrainJob {ns.name} is {job.status}, not Complete; it has no exported result"
            + (" yet (tunepack status)" if job.status != "Failed" else "")
        )
    client.result(ns.name).download(ns.dir, log)
    return 0


def cmd_delete(ns: argparse.Namespace) -> int:
    from tunepack.core.errors import BadInputError
    from tunepack.runtimes.contract import workspace_pvc

    if not ns.local:
        if ns.workspace_too:
            raise BadInputError(
                f"--workspace-too is for local jobs; on a cluster the workspace is the PVC "
                f"{workspace_pvc(ns.name)}: kubectl delete pvc {workspace_pvc(ns.name)}"
            )
        client = _cluster_client(ns)
        client.delete_job(ns.name)
        print(
            f"tunepack: deleted TrainJob {client.backend.namespace}/{ns.name}; its workspace "
            f"volume pvc/{workspace_pvc(ns.name)} is kept (kubectl delete pvc to remove it)"
        )
        return 0
    kept = _local_client(ns).delete_job(ns.name, keep_workspace=not ns.workspace_too)
    if kept:
        print(
            f"tunepack: deleted local TrainJob {ns.name}; its workspace {kept} is kept "
            "(--workspace-too removes it)"
        )
    else:
        print(f"tunepack: deleted local TrainJob {ns.name} and its workspace")
    return 0


def cmd_status(ns: argparse.Namespace) -> int:
    job = _client(ns).get_job(ns.name)
    print(f"{job.name}  {job.status}  runtime {job.runtime.name}")
    for step in job.steps:
        print(f"  {step.name:<22}{step.status}")
    finished = job.status in ("Complete", "Failed")
    if job.progress and job.progress.percent is not None:
        print(f"  progress {_progress_line(job.progress, finished)}")
    elif not ns.local:
        print(f"  progress unavailable{_why_no_progress(ns.name, finished)}")
    if job.message:
        print(f"  message: {job.message}")
    return 1 if job.status == "Failed" else 0


def _progress_line(p, finished: bool) -> str:
    """``40%  loss 1.2345  val_loss 1.5000  812 tokens/s  eta 1m05s`` (no eta once finished)."""
    line = f"{p.percent}%"
    if p.loss is not None:
        line += f"  loss {p.loss:.4f}"
    if p.val_loss is not None:
        line += f"  val_loss {p.val_loss:.4f}"
    if p.tokens_per_second is not None:
        line += f"  {p.tokens_per_second:.0f} tokens/s"
    if p.estimated_remaining_seconds is not None and not finished:
        line += f"  eta {_duration(p.estimated_remaining_seconds)}"
    return line


def _duration(seconds: int) -> str:
    minutes, s = divmod(int(seconds), 60)
    hours, m = divmod(minutes, 60)
    return f"{hours}h{m:02d}m" if hours else f"{m}m{s:02d}s" if m else f"{s}s"


def _why_no_progress(name: str, finished: bool) -> str:
    """Why a cluster job shows no progress: its TrainJob has no ``status.trainerStatus``."""
    if finished:
        from tunepack.notebook_progress import NO_TRAINER_STATUS as why
    else:
        why = (
            "no status.trainerStatus yet (the trainer posts it from its first step where the "
            "Kubeflow Trainer runs with its TrainJobStatus feature gate)"
        )
    return f": {why}; see tunepack logs {name}"


def cmd_logs(ns: argparse.Namespace) -> int:
    from kubeflow.trainer.constants import constants as kc

    from tunepack.backends.base import sdk_step
    from tunepack.core.errors import BadInputError

    client = _client(ns)
    job = client.get_job(ns.name)
    # The runtime's steps, whether or not they started yet (on a cluster the node pods appear
    # only once the initializers are done): the initializers and node-0 .. node-<nodes - 1>.
    steps = [s.name for s in job.steps if not s.name.startswith(f"{kc.NODE}-")]
    steps = list(dict.fromkeys(steps or [kc.DATASET_INITIALIZER, kc.MODEL_INITIALIZER]))
    steps += [f"{kc.NODE}-{i}" for i in range(job.num_nodes or 1)]
    step = sdk_step(ns.step, steps)  # node: node-0 of a one-node job, as the console says
    if step not in steps:
        raise BadInputError(
            f"TrainJob {ns.name} has no step {ns.step!r}; its steps are {', '.join(steps)} (--step)"
        )
    for line in client.get_job_logs(ns.name, follow=ns.follow, step=step):
        print(line)
    return 0


def cmd_plan(ns: argparse.Namespace) -> int:
    from tunepack.core.errors import BadInputError
    from tunepack.tools.planner import model_entry, plan

    if ns.lora_rank is not None and not methods.get(ns.method).adapters:
        raise BadInputError(
            f"--lora-rank {ns.lora_rank} is a LoRA setting, but --method full trains every "
            "weight and has no adapters; leave out --lora-rank, or use --method lora"
        )
    entry = model_entry(ns.model, ns.model_dir)  # a -custom runtime's config.json, read once
    seq_len, note = ns.seq_len, None
    if seq_len is None:
        seq_len = min(DEFAULT_PLAN_SEQ_LEN, entry.shape.max_seq_len)
        if seq_len < DEFAULT_PLAN_SEQ_LEN:
            note = (
                f"seq_len {seq_len} is {entry.name}'s context (the default "
                f"{DEFAULT_PLAN_SEQ_LEN} is longer); --seq-len N to choose"
            )
    estimate = plan(
        entry,
        ns.method,
        seq_len,
        ns.batch_size,
        ns.gpu,
        nodes=ns.nodes,
        gpus_per_node=ns.gpus_per_node,
        activation_checkpointing=ns.activation_checkpointing,
        lora_rank=16 if ns.lora_rank is None else ns.lora_rank,
    )
    print(estimate.summary())
    if note:
        print(f"  note: {note}")
    return 0 if estimate.fits else 1


DEFAULT_PLAN_SEQ_LEN = 2048  # plan --seq-len when not given (the model's context if shorter)


def cmd_install(ns: argparse.Namespace) -> int:
    from kubernetes import client

    from tunepack.core.errors import BadInputError
    from tunepack.jobs.trainjob import check_dns_label
    from tunepack.tools.install import admission_objects, describe, install, runtime_objects

    if ns.namespace is not None:
        check_dns_label("--namespace", ns.namespace)
    if not ns.delete_timeout > 0:
        raise BadInputError(
            f"--delete-timeout {ns.delete_timeout:g} is not valid: expected a number of seconds > 0"
        )
    objects = runtime_objects(ns.runtime or None, namespace=ns.namespace)
    objects += admission_objects(ns.namespace)
    check_cluster(ns.context, local_option=False)
    load_config(ns.context)
    api = client.ApiClient()
    for obj in objects:
        action = install(api, obj, delete_timeout=ns.delete_timeout)
        print(f"{describe(obj)} {action}", flush=True)
    return 0


def _print_nothing_to_do(
    name: str, workspace: Path, export: str | None, jobs_dir: str | None
) -> None:
    """The end of a re-run whose trainer found its result complete: nothing trained, and the
    logs are still those of the run that did (``run_job`` put them back)."""
    from tunepack.core.workspace import result_file

    result = json.loads(result_file(workspace).read_text())
    where = f" --jobs-dir {jobs_dir}" if jobs_dir else ""
    print()
    print(f"tunepack: job {name} already finished; nothing to do")
    print(f"  result      {result['artifact']}")
    if export:
        print(f"  exported    {export} (tunepack download {name} DIR)")
    print(f"  logs        tunepack logs {name} --local{where} (of the run that trained)")


def _print_summary(
    name: str, runtime: str, workspace: Path, elapsed: float, export: str | None = None
) -> None:
    from tunepack.core.workspace import result_file
    from tunepack.notebook import tracker_pointer

    result = json.loads(result_file(workspace).read_text())
    print()
    print("tunepack: training finished")
    print(f"  job         {name}")
    print(f"  runtime     {runtime}")
    print(f"  method      {result['method']}")
    print(f"  steps       {result['steps']}")
    first, last = result["first_loss"], result["final_loss"]
    print(f"  loss        {first:.4f} (first step) -> {last:.4f} (last step)")
    dpo = result.get("dpo") or {}
    if "reward_margin" in dpo:  # method=dpo: whether it prefers the chosen answers
        print(
            f"  rewards     margin {dpo['reward_margin']:.4f}, accuracy "
            f"{dpo['reward_accuracy']:.2f} (last step)"
        )
    if result.get("val_loss") is not None:
        kept = ", published" if result.get("keep_best") else ""
        print(
            f"  val loss    {result['val_loss']:.4f} (last step); best "
            f"{result['best_val_loss']:.4f} at step {result['best_step']}{kept}"
        )
    print(f"  elapsed     {elapsed:.1f} s")
    print(f"  result      {result['artifact']}")
    if export:
        print(f"  exported    {export} (tunepack download {name} DIR)")
    print(f"  logs        {workspace / 'logs'}")
    if pointer := tracker_pointer(result.get("tracker")):
        print(f"  tracker     {pointer}")


DESCRIPTION = (
    "Fine-tune LLMs with tunepack's Kubeflow Trainer runtimes, on a Kubernetes cluster or on "
    "this machine; `tunepack COMMAND --help` describes each command."
)
URI_HELP = (
    "hf://org/name, s3://bucket/prefix, https://host/file, file:///absolute/path or a local path"
)


def _gpu_help() -> str:
    from tunepack.tools.planner import GPUS

    return f"one of {', '.join(GPUS)} (default H100-80GB), in any case; h100: the one size there is"


JOBS_DIR_HELP = "local backend jobs dir (default: $TUNEPACK_HOME/jobs or ~/.tunepack/jobs)"


def _add_backend_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--local", action="store_true", help="jobs of the local backend")
    parser.add_argument("--jobs-dir", help=JOBS_DIR_HELP)
    parser.add_argument("--namespace", help="cluster namespace (default: the kubeconfig's)")
    parser.add_argument("--context", help="kubeconfig context")


def _add_job_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--runtime", required=True, help="runtime name, e.g. tunepack-tiny-llama3")
    parser.add_argument("--dataset", required=True, help=f"dataset storage URI: {URI_HELP}")
    parser.add_argument("--model", required=True, help=f"model storage URI: {URI_HELP}")
    parser.add_argument(
        "--name",
        help="TrainJob name (default, local: <model>-<digest of the dataset, model and trainer "
        "arguments>, so the same command resumes its job; cluster: <model>-<timestamp>)",
    )
    parser.add_argument("--num-nodes", type=int, help="number of trainer nodes")
    parser.add_argument(
        "--num-proc-per-node",
        type=int,
        help="trainer processes per node (default: the runtime's GPUs per node, or 1)",
    )
    parser.add_argument(
        "--queue", help="Kueue LocalQueue for the TrainJob (label kueue.x-k8s.io/queue-name)"
    )
    for what in ("dataset", "model"):
        parser.add_argument(
            f"--{what}-secret",
            metavar="SECRET",
            help=f"cluster: a Secret whose keys (HF_TOKEN, AWS_ACCESS_KEY_ID, HTTPS_USERNAME, ...) "
            f"the {what} initializer gets",
        )
    parser.add_argument(
        "--export",
        metavar="URI",
        help="where the result goes after training: s3://bucket/prefix, hf://org/name (a "
        "private model repository) or a path (docs/export.md)",
    )
    parser.add_argument(
        "--export-secret",
        metavar="SECRET",
        help="cluster: a Secret whose keys (HF_TOKEN, AWS_ACCESS_KEY_ID, ...) the exporter gets",
    )
    parser.add_argument(
        "trainer_args", nargs="*", metavar="key=value", help="trainer arguments (tunepack args)"
    )


def _add_memory_arguments(parser: argparse.ArgumentParser) -> None:
    from tunepack.tools.planner import MEMORY_CHECKS

    parser.add_argument(
        "--gpu", default="H100-80GB", help=f"GPU type the memory check assumes: {_gpu_help()}"
    )
    parser.add_argument(
        "--memory-check",
        choices=MEMORY_CHECKS,
        default="refuse",
        help="when the planner says the job cannot fit in GPU memory (as TrainingClient's "
        "memory_check; train on a cluster or --local, and render trainjob alike)",
    )


class _Parser(argparse.ArgumentParser):
    """argparse, with a usage mistake reported like any other bad input: one line, exit 65."""

    def error(self, message: str):
        from tunepack.core.errors import BadInputError

        raise BadInputError(f"{message} (see `{self.prog} --help`)")


class _ConsoleHandler(logging.Handler):
    """tunepack's own warnings (a memory plan passed with --memory-check warn, ...) on the
    console, as ``tunepack: warning: ...``; info messages too with --verbose."""

    def emit(self, record: logging.LogRecord) -> None:
        level = "" if record.levelno < logging.WARNING else f"{record.levelname.lower()}: "
        try:
            print(f"tunepack: {level}{record.getMessage()}", file=sys.stderr, flush=True)
        except (OSError, ValueError):
            pass  # no console left to say it on


def _console_logging(verbose: bool = False) -> None:
    logger = logging.getLogger("tunepack")
    if not any(isinstance(h, _ConsoleHandler) for h in logger.handlers):
        logger.addHandler(_ConsoleHandler())
    logger.setLevel(logging.INFO if verbose else logging.WARNING)


def build_parser() -> argparse.ArgumentParser:

    parser = _Parser(prog="tunepack", description=DESCRIPTION)
    parser.add_argument("--version", action="version", version=f"%(prog)s {_version()}")
    sub = parser.add_subparsers(dest="command", required=True)

    sub.add_parser("runtimes", help="list tunepack runtimes").set_defaults(func=cmd_runtimes)
    sub.add_parser("args", help="list trainer arguments").set_defaults(func=cmd_args)

    p = sub.add_parser("tiny-model", help="write a tiny random Llama-3 model (offline)")
    p.add_argument("directory", help="directory to write the model to (config, weights, tokenizer)")
    p.add_argument(
        "--seed", type=int, default=0, help="seed of the random weights (default 0: the same model)"
    )
    p.set_defaults(func=cmd_tiny_model)

    p = sub.add_parser("tiny-dataset", help="write a small instruction dataset (offline)")
    p.add_argument("file", help="the JSON Lines file to write (e.g. data/instructions.jsonl)")
    p.add_argument(
        "--preference", action="store_true", help="preference pairs for method=dpo instead"
    )
    p.add_argument("--rows", type=int, default=256, help="number of rows (default 256)")
    p.add_argument(
        "--seed", type=int, default=0, help="seed of the rows' choice (default 0: the same rows)"
    )
    p.set_defaults(func=cmd_tiny_dataset)

    p = sub.add_parser("train", help="fine-tune: run a TrainJob")
    _add_job_arguments(p)
    p.add_argument("--local", action="store_true", help="run on this machine (local backend)")
    p.add_argument("--namespace", help="cluster namespace (default: the kubeconfig's)")
    p.add_argument("--context", help="kubeconfig context (cluster)")
    _add_memory_arguments(p)
    p.add_argument(
        "--workspace",
        help="local workspace dir (default: the job's, .tunepack/runs/<name> when it is new; "
        "a re-run of the same command, or of --name NAME, resumes in that job's)",
    )
    p.add_argument(
        "--verbose",
        action="store_true",
        help="show the steps' third-party warnings and debug lines (TUNEPACK_VERBOSE=1), and "
        "tunepack's own info messages",
    )
    p.add_argument("--jobs-dir", help=JOBS_DIR_HELP)
    p.add_argument("--quiet", action="store_true", help="do not echo step output")
    p.set_defaults(func=cmd_train)

    p = sub.add_parser("jobs", help="list TrainJobs: name, runtime, status, created, workspace")
    _add_backend_arguments(p)
    p.set_defaults(func=cmd_jobs)

    for cmd, func, helptext in (
        ("status", cmd_status, "a TrainJob's status, steps and progress"),
        ("logs", cmd_logs, "a TrainJob step's log"),
        ("result", cmd_result, "a finished TrainJob's adapter (or model) and final loss"),
        ("delete", cmd_delete, "delete a TrainJob (its workspace is kept)"),
    ):
        p = sub.add_parser(cmd, help=helptext)
        p.add_argument("name", help="TrainJob name")
        _add_backend_arguments(p)
        if cmd == "logs":
            p.add_argument(
                "--step",
                default="node-0",
                help="dataset-initializer, model-initializer, node (a one-node job's trainer, as "
                "the console and logs/node.log name it; node-0, node-1 ... of several nodes), "
                "export (default: the first node's)",
            )
            p.add_argument(
                "--follow",
                "-f",
                action="store_true",
                help="keep printing new lines until the job ends (Ctrl-C stops following, "
                "not the job)",
            )
        if cmd == "delete":
            p.add_argument(
                "--workspace-too",
                action="store_true",
                help="also remove the local job's workspace (default: kept)",
            )
        p.set_defaults(func=func)

    p = sub.add_parser(
        "download", help="fetch a TrainJob's exported result (or the export at a URI), verified"
    )
    p.add_argument("name", help="TrainJob name, or an export URI (s3://, hf://, a path)")
    p.add_argument("dir", help="directory to create (it appears only when complete)")
    _add_backend_arguments(p)
    p.set_defaults(func=cmd_download)

    p = sub.add_parser("plan", help="estimate GPU memory and recommend nodes x GPUs")
    p.add_argument("--model", required=True, help="catalog model or runtime name")
    p.add_argument("--method", default=methods.DEFAULT, help=", ".join(methods.NAMES))
    p.add_argument(
        "--seq-len",
        type=int,
        help=f"tokens per sequence (max_seq_len; default {DEFAULT_PLAN_SEQ_LEN}, or the model's "
        "context where shorter)",
    )
    p.add_argument("--batch-size", type=int, default=1, help="per device")
    p.add_argument("--gpu", default="H100-80GB", help=_gpu_help())
    p.add_argument("--nodes", type=int, default=1, help="trainer nodes (default 1)")
    p.add_argument("--gpus-per-node", type=int, default=1, help="GPUs per node (default 1)")
    p.add_argument("--lora-rank", type=int, help="LoRA rank (lora, qlora, dora; default 16)")
    p.add_argument(
        "--activation-checkpointing",
        action=argparse.BooleanOptionalAction,
        default="auto",
        help="plan with (or without) activation checkpointing, which recomputes activations "
        "for less memory (default: with, as the trainer runs on a GPU)",
    )
    p.add_argument("--model-dir", help="checkpoint directory a -custom runtime is sized from")
    p.set_defaults(func=cmd_plan)

    p = sub.add_parser(
        "install",
        help="server-side apply tunepack's runtimes to the cluster",
        epilog="Queues: with Kueue (TrainJob integration on), `kubectl apply --server-side -k "
        "manifests/kueue` adds a ClusterQueue with GPU quota, the LocalQueue 'team' and two "
        "priority classes; then `tunepack train --queue team ...` (docs/cluster.md, 'Gang "
        "scheduling and queues').",
    )
    p.add_argument("--namespace", help="install namespace-scoped TrainingRuntimes there instead")
    p.add_argument("--runtime", action="append", help="only this runtime (repeatable)")
    p.add_argument("--context", help="kubeconfig context")
    p.add_argument(
        "--delete-timeout",
        type=float,
        default=60.0,
        metavar="SECONDS",
        help="how long to wait for a runtime that must be re-created to be deleted (default 60)",
    )
    p.set_defaults(func=cmd_install)

    p = sub.add_parser("render", help="print Kubernetes objects as YAML")
    render = p.add_subparsers(dest="kind", required=True)
    p = render.add_parser("trainjob", help="the TrainJob for `kubectl apply -f -`")
    _add_job_arguments(p)
    p.add_argument("--namespace", help="metadata.namespace of the TrainJob")
    p.add_argument(
        "--namespaced",
        action="store_true",
        help="reference a TrainingRuntime in the TrainJob's namespace (tunepack install "
        "--namespace) instead of the ClusterTrainingRuntime",
    )
    _add_memory_arguments(p)
    p.set_defaults(func=cmd_render_trainjob)
    p = render.add_parser(
        "serving",
        help="vLLM serving a finished TrainJob's result (give the training's runtime, name and "
        "key=value arguments)",
    )
    p.add_argument("--runtime", required=True, help="the runtime the TrainJob ran")
    p.add_argument("--name", required=True, help="the TrainJob's name (its PVC is served)")
    p.add_argument("--gpus", type=int, default=1, help="GPUs for the vLLM pod (default 1)")
    p.add_argument("trainer_args", nargs="*", metavar="key=value", help="the training arguments")
    p.set_defaults(func=cmd_render_serving)
    return parser


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("tunepack")
    except PackageNotFoundError:
        return "unknown (not installed)"
