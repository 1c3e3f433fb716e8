"""``tunepack render``: Kubernetes objects as YAML, for ``kubectl apply -f -``: a TrainJob, and
vLLM serving a finished TrainJob's result."""

from __future__ import annotations

import argparse
import sys


def cmd_render_trainjob(ns: argparse.Namespace) -> int:
    from tunepack.jobs.trainjob import to_yaml

    sys.stdout.write(to_yaml(_trainjob(ns)))
    return 0


def _trainjob(ns: argparse.Namespace, *, local: bool = False) -> dict:
    from tunepack.cli.train import resources_per_node
    from tunepack.jobs.naming import timestamped_job_name
    from tunepack.jobs.trainjob import (
        CLUSTER_RUNTIME_KIND,
        NAMESPACED_RUNTIME_KIND,
        TrainJobSpec,
        build_trainjob,
        parse_trainer_args_for,
    )
    from tunepack.spelling import CLI

    namespaced = getattr(ns, "namespaced", False)
    spec = TrainJobSpec(
        name=ns.name if ns.name is not None else timestamped_job_name(ns.runtime),
        runtime=ns.runtime,
        dataset_uri=ns.dataset,
        model_uri=ns.model,
        # The CLI's words, parsed once here: the TrainJob and the memory check read the result.
        trainer_args=parse_trainer_args_for(ns.trainer_args, ns.runtime, ns.model),
        num_nodes=ns.num_nodes,
        namespace=getattr(ns, "namespace", None),
        num_proc_per_node=ns.num_proc_per_node,
        resources_per_node=resources_per_node(ns),
        queue=ns.queue,
        runtime_kind=NAMESPACED_RUNTIME_KIND if namespaced else CLUSTER_RUNTIME_KIND,
        export_uri=ns.export,
        export_secret=ns.export_secret,
        dataset_secret=ns.dataset_secret,
        model_secret=ns.model_secret,
        local=local,
    )
    trainjob = build_trainjob(spec, CLI)
    if not local:
        from tunepack.jobs.submit import check_spec_plan

        # The memory check of `train` (TrainingClient), with the same --gpu and --memory-check.
        check_spec_plan(spec, ns.gpu, ns.memory_check, CLI)
    return trainjob


def cmd_render_serving(ns: argparse.Namespace) -> int:
    from tunepack.core.errors import BadValueError
    from tunepack.jobs.naming import check_dns_label
    from tunepack.runtimes import custom
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
    if custom.is_placeholder(entry):
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
