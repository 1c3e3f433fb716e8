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
    from tunepack.jobs.naming import timestamped_job_name
    from tunepack.jobs.trainjob import (
        CLUSTER_RUNTIME_KIND,
        NAMESPACED_RUNTIME_KIND,
        TrainJobSpec,
        build_trainjob,
        parse_trainer_args_for,
    )

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


def cmd_render_serving(ns: argparse.Namespace) -> int:
    from tunepack.core.errors import BadInputError
    from tunepack.jobs.naming import check_dns_label
    from tunepack.tools import serving

    check_dns_label("TrainJob name (--name)", ns.name)
    if ns.gpus < 1:
        raise BadInputError(f"--gpus {ns.gpus} is not valid: expected at least 1")
    served = serving.served_result(ns.runtime, ns.trainer_args)
    sys.stdout.write(serving.render(serving.manifests(ns.name, served, gpus=ns.gpus)))
    return 0
