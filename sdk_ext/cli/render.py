"""``tunepack render``: Kubernetes objects as YAML, for ``kubectl apply -f -``: a TrainJob, and
vLLM serving a finished TrainJob's result."""

from __future__ import annotations

import argparse
import sys


def cmd_render_trainjob(ns: argparse.Namespace) -> int:
    from tunepack.jobs.trainjob import to_yaml

    sys.stdout.write(to_yaml(_trainjob(ns)))
    return 0


def _trainjob(ns: argparse.Namespace) -> dict:
    """The TrainJob ``tunepack train`` submits for the same flags (``train.cluster_job``, built
    by ``submit.build`` as the cluster backend builds it): every job flag, the checks of
    submission (the memory check with ``--gpu`` and ``--memory-check``, the method against a
    ``--dataset-schema``) in the same words. Only the runtime's kind is the flags' here
    (``--namespaced``), where ``train`` finds the installed one."""
    from tunepack.cli.train import cluster_job
    from tunepack.jobs import submit
    from tunepack.jobs.trainjob import CLUSTER_RUNTIME_KIND, NAMESPACED_RUNTIME_KIND
    from tunepack.spelling import CLI

    job = cluster_job(ns)
    return submit.build(
        ns.runtime,
        job.initializer,
        job.trainer,
        name=job.name,
        namespace=ns.namespace,
        gpu=ns.gpu,
        memory_check=ns.memory_check,
        runtime_kind=NAMESPACED_RUNTIME_KIND if ns.namespaced else CLUSTER_RUNTIME_KIND,
        labels=job.labels,
        spelling=CLI,
    )


def cmd_render_serving(ns: argparse.Namespace) -> int:
    from tunepack.core.errors import BadValueError
    from tunepack.jobs.naming import check_dns_label
    from tunepack.runtimes import catalog
    from tunepack.runtimes.planner import gpu_type
    from tunepack.tools import serving, serving_memory

    for flag, value in (
        ("--gpus", ns.gpus),
        ("--max-model-len", ns.max_model_len),
        ("--concurrency", ns.concurrency),
    ):
        if value is not None and value < 1:
            raise BadValueError(f"{flag} {value} is not valid: expected at least 1")
    gpu = gpu_type(ns.gpu)
    run = _finished_run(ns)
    name = ns.name or ns.job
    if name is None:
        raise BadValueError(
            "--name is missing: give the TrainJob whose workspace PVC is served (or --job NAME)"
        )
    check_dns_label("TrainJob name (--name)", name)
    runtime = ns.runtime or (run.runtime if run else None)
    if runtime is None:
        raise BadValueError(
            "--runtime is missing: give the runtime the TrainJob ran, or --job NAME (or "
            "--result PATH) to read it from the finished run"
        )
    args = serving.merged_args(run.args if run else {}, ns.trainer_args)
    entry, trained = serving.trained_run(runtime, args)
    served = serving.served(entry, trained)
    context = ns.max_model_len or trained.max_seq_len
    if catalog.is_placeholder(entry):
        # A bring-your-own runtime's shape is its checkpoint's, on the PVC: not planned here.
        gpus = ns.gpus or 1
    else:
        if context > entry.shape.max_seq_len:
            raise BadValueError(
                f"--max-model-len {context} is longer than {entry.name}'s context of "
                f"{entry.shape.max_seq_len} tokens"
            )
        plan = serving_memory.choose(
            entry, gpu, context, ns.concurrency, served.max_lora_rank, ns.gpus
        )
        gpus = plan.gpus
        print(
            f"tunepack: serving {entry.name} on {gpus} x {gpu}: {plan.total:.1f} of "
            f"{plan.capacity:.1f} GiB per GPU ({plan.breakdown()})",
            file=sys.stderr,
        )
    objects = serving.manifests(name, served, gpus=gpus, max_model_len=context)
    sys.stdout.write(serving.render(objects))
    return 0


def _finished_run(ns: argparse.Namespace):
    """The run ``--job`` or ``--result`` names (a ``serving.FinishedRun``), or None."""
    from pathlib import Path

    from tunepack.tools import serving

    if ns.result is not None:
        return serving.run_of_result(Path(ns.result), "--result")
    if ns.job is None:
        return None
    from tunepack.cli import clients

    client = clients.client(ns)
    clients.complete_job(client, ns.job, "result to serve")
    return serving.run_of_trainjob(client.backend.trainjob_object(ns.job))
