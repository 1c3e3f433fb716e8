"""The commands on jobs that exist, through the ``TrainingClient`` of ``--local`` or the cluster:
``jobs``, ``status``, ``logs``, ``result``, ``download`` and ``delete``."""

from __future__ import annotations

import argparse
from pathlib import Path

from tunepack.cli import clients, output
from tunepack.core.errors import EXIT_BAD_INPUT, EXIT_TRANSIENT


def cmd_jobs(ns: argparse.Namespace) -> int:
    client = clients.client(ns)
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
            output.percent(job),
            client.backend.workspace_of(job.name),
        ]
        for job in jobs
    ]
    print(output.table(rows, ["NAME", "RUNTIME", "STATUS", "CREATED", "PROGRESS", "WORKSPACE"]))
    return 0


def cmd_status(ns: argparse.Namespace) -> int:
    job = clients.client(ns).get_job(ns.name)
    print(f"{job.name}  {job.status}  runtime {job.runtime.name}")
    for step in job.steps:
        print(f"  {step.name:<22}{step.status}")
    finished = job.status in ("Complete", "Failed", "Stopped")
    progress = getattr(job, "progress", None)  # None: a job of a runtime not tunepack's
    if progress and progress.percent is not None:
        print(f"  progress {output.progress_line(progress, finished)}")
    elif not ns.local:
        print(f"  progress unavailable{_why_no_progress(ns.name, finished)}")
    if getattr(job, "message", None):
        print(f"  message: {job.message}")
    if job.status == "Stopped":
        return EXIT_TRANSIENT  # a local job its user stopped: running it again resumes it
    if job.status != "Failed":
        return 0
    # As the runtimes' failure policy reads the code: 65 was bad input; anything else was
    # retried (network, preemption, a crash) until the retries ran out, and may pass.
    return EXIT_BAD_INPUT if getattr(job, "exit_code", None) == EXIT_BAD_INPUT else EXIT_TRANSIENT


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
    from tunepack.core.errors import NotFoundError

    client = clients.client(ns)
    job = client.get_job(ns.name)
    # The runtime's steps, whether or not they started yet (on a cluster the node pods appear
    # only once the initializers are done): the initializers and node-0 .. node-<nodes - 1>.
    steps = [s.name for s in job.steps if not s.name.startswith(f"{kc.NODE}-")]
    steps = list(dict.fromkeys(steps or [kc.DATASET_INITIALIZER, kc.MODEL_INITIALIZER]))
    steps += [f"{kc.NODE}-{i}" for i in range(job.num_nodes or 1)]
    step = sdk_step(ns.step, steps)  # node: node-0 of a one-node job, as the console says
    if step not in steps:
        raise NotFoundError(
            f"TrainJob {ns.name} has no step {ns.step!r}; its steps are {', '.join(steps)} "
            "(--step)",
            what="step",
            name=ns.step,
            available=steps,
        )
    for line in client.get_job_logs(ns.name, follow=ns.follow, step=step):
        print(line)
    return 0


def cmd_result(ns: argparse.Namespace) -> int:
    client = clients.client(ns)
    job = clients.complete_job(client, ns.name, "result")
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

    if _names_an_export(ns.name):
        fetch_export(ns.name, Path(ns.dir), log)
        return 0
    from tunepack.core.errors import ConflictError

    client = clients.client(ns)
    job = client.get_job(ns.name)
    if job.status != "Complete":
        raise ConflictError(
            f"TrainJob {ns.name} is {job.status}, not Complete; it has no exported result"
            + (" yet (tunepack status)" if job.status != "Failed" else "")
        )
    client.result(ns.name).download(ns.dir, log)
    return 0


def _names_an_export(name: str) -> bool:
    """Whether ``download``'s NAME is an export's URI or path, not a TrainJob's name: a URI, what
    no TrainJob can be named (``./result``, ``/data/run``, ``run.v2``), or a directory holding an
    export (its manifest)."""
    from tunepack.initializers.sinks import MANIFEST_FILE
    from tunepack.jobs.naming import DNS_LABEL

    if "://" in name or not DNS_LABEL.match(name):
        return True
    return (Path(name) / MANIFEST_FILE).is_file()


def cmd_delete(ns: argparse.Namespace) -> int:
    from tunepack.core.errors import UnsupportedError
    from tunepack.runtimes.contract import workspace_pvc

    if not ns.local:
        if ns.workspace_too:
            raise UnsupportedError(
                f"--workspace-too is for local jobs; on a cluster the workspace is the PVC "
                f"{workspace_pvc(ns.name)}: kubectl delete pvc {workspace_pvc(ns.name)}"
            )
        client = clients.cluster_client(ns)
        client.delete_job(ns.name)
        print(
            f"tunepack: deleted TrainJob {client.backend.namespace}/{ns.name}; its workspace "
            f"volume pvc/{workspace_pvc(ns.name)} is kept (kubectl delete pvc to remove it)"
        )
        return 0
    kept = clients.local_client(ns).delete_job(ns.name, keep_workspace=not ns.workspace_too)
    if kept:
        print(
            f"tunepack: deleted local TrainJob {ns.name}; its workspace {kept} is kept "
            "(--workspace-too removes it)"
        )
    else:
        print(f"tunepack: deleted local TrainJob {ns.name} and its workspace")
    return 0
