"""``tunepack train``: on a cluster through ``TrainingClient.train``, as a notebook submits, or
(``--local``) in the foreground as the local backend's own run: the same command names the same job,
which resumes in its workspace.
"""

from __future__ import annotations

import argparse
import errno
import os
import sys
import tempfile
import time
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path

from tunepack.cli import clients, output
from tunepack.cli.cluster import backend_config, check_cluster
from tunepack.trainers.process.noise import VERBOSE_ENV


def cmd_train(ns: argparse.Namespace) -> int:
    if ns.verbose:
        os.environ[VERBOSE_ENV] = "1"  # this process's own steps too
        output.console_logging(verbose=True)
    if not ns.local:
        return _train_on_cluster(ns)
    from tunepack.core.errors import BadValueError, UnsupportedError

    if ns.queue is not None:
        raise UnsupportedError(
            f"--queue {ns.queue} names a Kueue queue on a cluster; the local backend has none "
            "(leave out --queue, or --local)"
        )
    from tunepack.core.workspace import lock_workspace

    if ns.workspace is not None and not ns.workspace.strip():
        raise BadValueError(
            "--workspace is empty; give a directory, or leave --workspace out to use the job's"
        )
    backend = clients.local_client(ns).backend  # the foreground run is the local backend's own
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
        _claim(backend, workspace, name, given=ns.workspace)
        job_dir = backend.register(trainjob, workspace, replace=True)
        return _run_local(ns, trainjob, job_dir, workspace, resumed, lock)


def _claim(backend, workspace: Path, name: str, given: str | None) -> None:
    """Make ``workspace`` job ``name``'s, refusing one that another local job ran in: that job's
    result, status and checkpoints live there, and this run would replace them."""
    from tunepack.core.errors import WorkspaceClaimedError
    from tunepack.core.workspace import JobIdentity, record_owner

    others = backend.jobs_in_workspace(workspace, besides=name)
    if others:
        owner = others[0]
        status = backend.get_job(owner).status
        raise WorkspaceClaimedError(
            f"--workspace {given or workspace} holds local TrainJob {owner!r} ({status}); these "
            f"arguments make job {name!r}, which would replace its dataset, model, checkpoints "
            f"and result: give this job another --workspace, run {owner!r} again with --name "
            f"{owner}, or delete it first (`tunepack delete {owner} --local` keeps the workspace)",
            workspace=str(workspace),
            owner=owner,
            job=name,
        )
    record_owner(workspace, JobIdentity(name))


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
        _record_stop(
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
        # The job's record has the same lines (run_job), for tunepack status and get_job(). The
        # echo held them back (steps._tail): said once, here, on stderr.
        reason = "\n  ".join(failed.error_lines())
        print(
            f"tunepack: step {failed.name!r} failed with exit code {failed.exit_code} "
            f"({describe_exit(failed.exit_code)}); log: {failed.log}"
            + (f"\n  {reason}" if reason else ""),
            file=sys.stderr,
        )
        return failed.exit_code
    from tunepack.jobs.trainjob import export_of

    if outcome.nothing_to_do or outcome.exported_only:
        output.print_nothing_to_do(
            name, workspace, export_of(trainjob), ns.jobs_dir, outcome.exported_only
        )
        return 0
    output.print_summary(
        name, runtime, workspace, time.perf_counter() - started, export_of(trainjob)
    )
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


def _record_stop(job_dir: Path, message: str) -> None:
    from tunepack.backends.local import JobRecord

    try:
        JobRecord(job_dir).stopped(message)
    except (OSError, ValueError, KeyError):
        pass  # the record is gone or damaged: nothing to say it in


def _check_workspace(workspace: Path, given: str | None) -> None:
    """Refuse a workspace that cannot be one (a file, a read-only place) before any work."""
    from tunepack.core.errors import BadValueError, DeniedError

    shown = given or str(workspace)
    if workspace.exists() and not workspace.is_dir():
        raise BadValueError(
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
        raise DeniedError(
            f"--workspace {shown} cannot be written: {reason}; give a directory you can write to"
        ) from None


def _local_trainjob(ns: argparse.Namespace, backend, workspace: Path | None) -> dict:
    """The TrainJob of ``train --local``, through the checks ``TrainingClient(
    LocalBackendConfig()).train`` applies (``submit.local_trainjob``): the runtime's name, the
    trainer arguments, the memory plan (``--gpu``, ``--memory-check``). ``workspace``: the
    ``--workspace`` given (absolute), part of the default name."""
    from tunepack.jobs.naming import stable_job_name
    from tunepack.jobs.submit import local_trainjob
    from tunepack.spelling import CLI

    trainer = _finetune(ns)
    runtime = backend.resolve_runtime(ns.runtime)  # a short name resolves, said on the console
    initializer = _initializer(ns)
    name = (
        ns.name
        if ns.name is not None
        else stable_job_name(runtime.name, ns.dataset, ns.model, trainer, workspace)
    )
    return local_trainjob(backend, runtime.name, initializer, trainer, name=name, spelling=CLI)


def _train_on_cluster(ns: argparse.Namespace) -> int:
    """Submit through ``TrainingClient.train``, as a notebook does: the same runtime lookup
    (a TrainingRuntime in the namespace first), validation and memory check."""
    from tunepack.client import TrainingClient
    from tunepack.spelling import CLI

    job = cluster_job(ns)  # the flags checked before the cluster is asked anything
    check_cluster(ns.context)
    client = TrainingClient(backend_config(ns), gpu=ns.gpu, memory_check=ns.memory_check)
    client.backend.spelling = CLI  # its refusals in this command's words
    name = client.train(
        runtime=ns.runtime,
        initializer=job.initializer,
        trainer=job.trainer,
        options=job.options(),
    )
    print(f"tunepack: submitted TrainJob {client.backend.namespace}/{name}")
    return 0


@dataclass(frozen=True)
class ClusterJob:
    """What the job flags (``_add_job_arguments``) say of a TrainJob on a cluster, made once by
    ``cluster_job``: ``train`` submits it (``TrainingClient.train``, whose backend hands it to
    ``submit.build``) and ``render trainjob`` prints it (``submit.build`` with the same
    arguments), so the two write the same TrainJob for the same flags."""

    name: str
    initializer: object  # jobs.translate.Initializer
    trainer: object  # finetune.FineTune
    labels: dict[str, str] | None

    def options(self) -> list:
        """The SDK's options that say the name and labels (``KubernetesBackend`` reads them
        back into ``submit.build``'s ``name`` and ``labels``)."""
        from kubeflow.trainer.options import Labels, Name

        return [Name(self.name)] + ([Labels(self.labels)] if self.labels else [])


def cluster_job(ns: argparse.Namespace) -> ClusterJob:
    """The TrainJob's inputs from ``train``'s and ``render trainjob``'s job flags: the trainer
    (``key=value``, placement, ``--export``), the initializers (URIs, Secrets, ``--column-map``,
    ``--dataset-schema``), the name (``--name``, else ``<model>-<timestamp>``) and the labels
    (``--queue``)."""
    from tunepack.jobs.naming import timestamped_job_name
    from tunepack.jobs.trainjob import QUEUE_LABEL

    trainer = _finetune(ns)
    initializer = _initializer(ns)
    name = ns.name if ns.name is not None else timestamped_job_name(ns.runtime)
    labels = {QUEUE_LABEL: ns.queue} if ns.queue is not None else None
    return ClusterJob(name, initializer, trainer, labels)


def _initializer(ns: argparse.Namespace):
    """The initializers of ``train`` (local or cluster): the storage URIs and Secret references
    of its flags."""
    from tunepack.initializers.data import schemas
    from tunepack.jobs.translate import Initializer

    env = _verbose_env(ns) or {}
    # Checked here, before anything starts: the dataset initializer reads them again.
    if ns.column_map:
        schemas.parse_column_map(ns.column_map, schemas.FLAGS)
        env[schemas.COLUMN_MAP_ENV] = ns.column_map
    if ns.dataset_schema:
        schemas.parse_schema(ns.dataset_schema, schemas.FLAGS)
        env[schemas.SCHEMA_ENV] = ns.dataset_schema
    return Initializer(
        dataset=ns.dataset,
        model=ns.model,
        env=env,
        dataset_secret=ns.dataset_secret,
        model_secret=ns.model_secret,
    )


def _finetune(ns: argparse.Namespace):
    """The trainer of ``train`` (local or cluster): its ``key=value`` arguments checked as
    ``FineTune`` checks a notebook's, with the placement and export flags."""
    from tunepack.finetune import FineTune
    from tunepack.spelling import CLI

    return FineTune.from_args(
        ns.trainer_args,
        spelling=CLI,
        num_nodes=ns.num_nodes,
        num_proc_per_node=ns.num_proc_per_node,
        resources_per_node=resources_per_node(ns),
        env=_verbose_env(ns),
        export=ns.export,
        export_secret=ns.export_secret,
    )


def resources_per_node(ns: argparse.Namespace) -> dict | None:
    """``--gpus-per-node N`` as the SDK's ``resources_per_node`` (``{"gpu": N}``: the pods'
    ``nvidia.com/gpu``), None without it (the runtime's GPUs)."""
    from tunepack.core.errors import BadValueError

    if ns.gpus_per_node is None:
        return None
    if ns.gpus_per_node < 0:
        raise BadValueError(
            f"--gpus-per-node {ns.gpus_per_node} is not valid: expected an integer >= 0"
        )
    return {"gpu": ns.gpus_per_node}


def _verbose_env(ns: argparse.Namespace) -> dict[str, str] | None:
    """``--verbose``: the steps show third-party warnings and debug lines (TUNEPACK_VERBOSE)."""
    return {VERBOSE_ENV: "1"} if getattr(ns, "verbose", False) else None
