"""What ``TrainingClient.train`` submits for a tunepack runtime, whichever the backend.

One function turns (runtime, initializer, trainer) into a strictly validated TrainJob: it
translates the upstream SDK's types, checks the trainer arguments against the vocabulary and the
chosen shape against the memory planner, all before anything is submitted.
"""

from __future__ import annotations

import difflib
import logging
import os

from kubeflow.trainer.types import types as kf

from tunepack.core.errors import BadValueError, DoesNotFitError, NotFoundError, UnsupportedError
from tunepack.jobs.naming import random_job_name
from tunepack.jobs.trainjob import (
    CLUSTER_RUNTIME_KIND,
    TrainJobSpec,
    build_trainjob,
    gpus_per_node,
    model_entry_for,
    names_gpus,
    processes_per_node,
    requested_resources,
)
from tunepack.jobs.translate import (
    dataset_split,
    initializer_env,
    refuse_upstream_full,
    storage_uri,
    to_finetune,
    to_initializer,
)
from tunepack.runtimes import catalog, planner
from tunepack.runtimes.args import resolve_args
from tunepack.spelling import SDK, Spelling

logger = logging.getLogger(__name__)


def is_tunepack_runtime(runtime: str | kf.Runtime | None) -> bool:
    """Whether ``runtime`` is named as a tunepack runtime (``tunepack-<catalog model>``).

    A short name (``llama3.2-1b``) is not: it may be another runtime's exact name
    (``short_name_target``).
    """
    name = runtime.name if isinstance(runtime, kf.Runtime) else runtime
    return (
        bool(name)
        and name.startswith(catalog.RUNTIME_PREFIX)
        and name.removeprefix(catalog.RUNTIME_PREFIX) in catalog.CATALOG
    )


def short_name_target(name: str) -> str | None:
    """``tunepack-<name>`` when ``name`` is a catalog model's short name (``llama3.2-1b``).

    Only a candidate: a backend uses it when no runtime of the exact name ``name`` exists, and
    says so (``log_short_name``), so a name is never rewritten silently.
    """
    if name and not name.startswith(catalog.RUNTIME_PREFIX) and name in catalog.CATALOG:
        return catalog.CATALOG[name].runtime_name
    return None


def log_short_name(name: str, resolved: str, where: str) -> None:
    logger.info("runtime %r: no runtime of that name %s; using %r", name, where, resolved)


def close_matches(name: str, candidates) -> list[str]:
    """Up to three names like ``name`` (a typo), the closest first."""
    return difflib.get_close_matches(name, sorted(set(candidates)), n=3, cutoff=0.6)


def build(
    runtime: str | kf.Runtime,
    initializer,
    trainer,
    *,
    name: str | None = None,
    namespace: str | None = None,
    gpu: str = planner.DEFAULT_GPU,
    memory_check: planner.MemoryCheck = planner.DEFAULT_MEMORY_CHECK,
    runtime_kind: str = CLUSTER_RUNTIME_KIND,
    labels: dict[str, str] | None = None,
    annotations: dict[str, str] | None = None,
    active_deadline_seconds: int | None = None,
    runtime_patches: list[dict] | None = None,
    local: bool = False,
    spelling: Spelling = SDK,
) -> dict:
    """The TrainJob (a dict) for a tunepack runtime, built from the ``TrainJobSpec`` these
    inputs make. Raises ``BadInputError`` on bad input, in ``spelling``'s words.

    ``runtime_kind`` and the metadata/spec extras are ``TrainJobSpec``'s; ``local=True`` builds
    for the local backend (plain paths kept, ``numProcPerNode`` left to the launcher unless the
    FineTune or its GPUs say).
    """
    gpu = check_settings(gpu, memory_check)
    runtime_name = runtime.name if isinstance(runtime, kf.Runtime) else runtime
    catalog.get(runtime_name)  # BadInputError listing the runtimes when unknown
    init = to_initializer(initializer)
    finetune = to_finetune(trainer)
    entry = model_entry_for(runtime_name, storage_uri(init.model, "model"))
    refuse_upstream_full(trainer, entry)
    # The FineTune's values, parsed when it was made, held against the model once (method
    # availability, seq_len limit, ...): no words written and read back; the TrainJob's
    # spec.trainer.args are written from what this returns (TrainArgs.argv).
    resolved = resolve_args(finetune.parsed_args(), entry)
    init_env = initializer_env(init, trainer)
    check_method_fits_dataset(
        resolved.method, storage_uri(init.dataset, "dataset"), init_env or {}, local=local
    )
    resources = finetune.resources_per_node
    num_proc = check_plan(
        entry,
        resolved,
        num_nodes=finetune.num_nodes,
        num_proc=finetune.num_proc_per_node,
        resources=resources,
        gpu=gpu,
        memory_check=memory_check,
        local=local,
        spelling=spelling,
    )
    spec = TrainJobSpec(
        name=random_job_name() if name is None else name,
        runtime=entry.runtime_name,
        dataset_uri=storage_uri(init.dataset, "dataset"),
        model_uri=storage_uri(init.model, "model"),
        trainer_args=resolved,
        num_nodes=finetune.num_nodes,
        namespace=namespace,
        num_proc_per_node=num_proc,
        resources_per_node=resources,
        trainer_env=finetune.env,
        initializer_env=init_env,
        dataset_secret=init.dataset_secret,
        model_secret=init.model_secret,
        dataset_split=dataset_split(trainer),
        labels=labels,
        annotations=annotations,
        runtime_kind=runtime_kind,
        active_deadline_seconds=active_deadline_seconds,
        runtime_patches=runtime_patches,
        export_uri=finetune.export,
        export_secret=finetune.export_secret,
        local=local,
    )
    return build_trainjob(spec, spelling)


def check_method_fits_dataset(method: str, dataset_uri: str, env: dict, *, local: bool) -> None:
    """Refuse a method that cannot learn from the dataset's rows (dpo on instructions) where the
    schema is known before anything runs: named by the initializers' ``DATASET_SCHEMA``, or, on
    the local backend, shown by the first row of a local file (after ``COLUMN_MAP``). Elsewhere
    the dataset initializer says it, at the first row, before the model is fetched."""
    from tunepack.initializers.data import schemas

    if local:  # the local steps inherit this process's environment (the TrainJob's wins)
        names = (schemas.SCHEMA_ENV, schemas.COLUMN_MAP_ENV)
        env = {**{k: os.environ[k] for k in names if k in os.environ}, **env}
    schema = schemas.parse_schema(env.get(schemas.SCHEMA_ENV, ""))
    if schema is None and local:
        schema = _first_row_schema(dataset_uri, env.get(schemas.COLUMN_MAP_ENV, ""))
    if schema is not None:
        schemas.check_method(method, schema.output)


def _first_row_schema(dataset_uri: str, column_map: str):
    """The schema the first row of a local data file shows (renamed by ``column_map``), or None
    where there is none to read here (a directory, a remote source, a row the initializer will
    refuse with its own message)."""
    from pathlib import Path

    from tunepack.core.errors import BadInputError
    from tunepack.initializers.data import formats, schemas
    from tunepack.initializers.transport import uri as storage

    try:
        parsed = storage.parse(dataset_uri)
        path = Path(parsed.location)
        if not parsed.is_local or not path.is_file() or formats.format_of(path.name) is None:
            return None
        rows = formats.read_rows(path.name, path)
        try:
            _, row, problem = next(rows, (None, None, "no rows"))
        finally:
            rows.close()
        if problem is not None:
            return None
        return schemas.detect(schemas.rename(row, schemas.parse_column_map(column_map)), "")
    except (BadInputError, OSError):
        return None


def check_plan(
    entry,
    resolved,
    *,
    num_nodes: int | None,
    num_proc: int | None,
    resources: dict | None,
    gpu: str,
    memory_check: planner.MemoryCheck,
    local: bool = False,
    spelling: Spelling = SDK,
) -> int | None:
    """The memory check of a job on ``entry`` with the parsed arguments ``resolved``
    (``check_memory`` on the GPUs the job gets: those a pod holds, ``resources`` merged into the
    runtime's); returns the processes per node, one per GPU (``processes_per_node``: a
    ``num_proc`` that does not match the GPUs is refused)."""
    requested = requested_resources(resources, entry)
    gpus = gpus_per_node(requested, entry)
    if requested and not names_gpus(requested) and gpus:
        logger.info(
            "resources_per_node=%r names no GPU, so the pods keep the runtime's %d GPU(s) per "
            "node (the Trainer merges resourcesPerNode into the runtime's resources); give "
            "{'gpu': 0} for none",
            resources,
            gpus,
        )
    num_proc = processes_per_node(entry, num_proc, resources, local=local, spelling=spelling)
    if gpus and memory_check != "off" and not catalog.is_placeholder(entry):
        check_memory(entry, resolved, num_nodes or 1, num_proc or gpus, gpu, memory_check, spelling)
    return num_proc


def local_trainjob(
    backend,
    runtime,
    initializer,
    trainer,
    options=None,
    *,
    name: str | None = None,
    spelling: Spelling = SDK,
) -> dict:
    """The TrainJob the local backend runs for ``train(runtime, initializer, trainer,
    options)``: everything ``LocalBackend.train`` and ``tunepack train --local`` check before a
    job is recorded (options, the runtime's name, the trainer arguments, the memory plan with the
    backend's ``gpu`` and ``memory_check``, no Secret references). Raises ``BadInputError``."""
    if options:
        listed = options if isinstance(options, list | tuple) else [options]
        names = ", ".join(type(o).__name__ for o in listed)
        raise UnsupportedError(
            f"options ({names}) are not supported by tunepack's local backend: they set "
            "fields of a TrainJob on a cluster (use TrainingClient() with a cluster)"
        )
    if runtime is None:
        raise BadValueError("pass runtime=, e.g. runtime='tunepack-tiny-llama3'")
    resolved = backend.resolve_runtime(runtime if isinstance(runtime, str) else runtime.name)
    trainjob = build(
        resolved.name,
        initializer,
        trainer,
        name=random_job_name() if name is None else name,
        gpu=backend.cfg.gpu,
        memory_check=backend.cfg.memory_check,
        local=True,  # plain paths are read on this machine; nproc as the launcher decides
        spelling=spelling,
    )
    if to_finetune(trainer).export_secret is not None:
        raise UnsupportedError(
            "export_secret is a cluster feature: on the local backend, export the credential "
            "(HF_TOKEN, AWS_ACCESS_KEY_ID, ...) in the environment that runs the notebook instead"
        )
    for block in trainjob["spec"]["initializer"].values():
        if "secretRef" in block:
            raise UnsupportedError(
                "secretRef is a cluster feature: on the local backend, export the credential "
                "(e.g. HF_TOKEN) in the environment that runs the notebook instead"
            )
    for what, block in trainjob["spec"]["initializer"].items():
        if block.get("storageUri"):
            _check_local_source(what, block["storageUri"])
    _check_local_split(trainjob["spec"]["initializer"]["dataset"])
    return trainjob


def _check_local_source(what: str, uri: str) -> None:
    """A local path or file:// URI that is not there, refused before anything runs (this
    machine is the one the local backend's initializers read it on)."""
    from pathlib import Path

    from tunepack.initializers.transport import uri as storage

    parsed = storage.parse(uri)
    if parsed.is_local and not Path(parsed.location).exists():
        where = "" if parsed.display == parsed.location else f" ({parsed.location})"
        raise NotFoundError(
            f"{what} {parsed.display!r} does not exist{where}; give an existing "
            "file or directory on this machine, or an hf://, s3:// or https:// URI",
            what=what,
            name=parsed.display,
        )


def _check_local_split(dataset: dict) -> None:
    """A split other than ``train`` of a single local data file, refused before the run starts
    (the dataset initializer refuses it too)."""
    import os
    from pathlib import Path

    from tunepack.initializers.data import splits
    from tunepack.initializers.transport import uri as storage

    parsed = storage.parse(dataset["storageUri"])
    env = {e["name"]: e.get("value") for e in dataset.get("env", [])}
    split = (
        parsed.options.get("split") or env.get("DATASET_SPLIT") or os.environ.get("DATASET_SPLIT")
    )
    if parsed.is_local and split and Path(parsed.location).is_file():
        splits.check_single_file(Path(parsed.location).name, split, parsed.display)


MEMORY_CHECKS = planner.MEMORY_CHECKS


def check_settings(gpu: object, memory_check: object) -> str:
    """The client's ``gpu`` and ``memory_check`` (``BadInputError`` naming the value); returns
    the planner's name for the GPU (``h100`` -> ``H100-80GB``)."""
    if memory_check not in MEMORY_CHECKS:
        expected = f"one of {', '.join(map(repr, MEMORY_CHECKS))}"
        raise BadValueError(
            f"memory_check={memory_check!r} is not valid: expected {expected}",
            name="memory_check",
            value=memory_check,
            expected=expected,
        )
    return planner.gpu_type(gpu)


def check_memory(
    entry,
    args,
    nodes: int,
    gpus_per_node: int,
    gpu: str,
    mode: planner.MemoryCheck,
    spelling: Spelling = SDK,
):
    """Refuse (or warn about) a shape the planner says cannot fit, with the numbers and the ways
    out in ``spelling``'s words."""
    estimate = planner.plan(
        entry,
        args.method,
        args.max_seq_len,
        args.batch_size,
        gpu,
        nodes=nodes,
        gpus_per_node=gpus_per_node,
        dtype="fp32" if args.dtype == "fp32" else "bf16",
        # auto: the step the trainer chooses on that GPU (runtimes/planner.py: choose_step)
        activation_checkpointing=args.activation_checkpointing,
        loss_chunk=args.loss_chunk,
        lora_rank=args.lora_rank,
        lora_attn_modules=tuple(args.lora_attn_modules),
        lora_mlp=args.lora_mlp,
        grad_accum=args.grad_accum,
        num_generations=args.num_generations,
    )
    if estimate.fits:
        return estimate
    message = (
        f"this fine-tune is estimated not to fit in GPU memory:\n{estimate.summary()}\n"
        f"Lower max_seq_len or batch_size, {spelling.more_gpus}, choose "
        f"{spelling.method.format('qlora')} where available, or {spelling.memory_check} to "
        "submit anyway (see docs/planner.md)."
    )
    if mode == "refuse":
        raise DoesNotFitError(
            message, need_gib=estimate.peak_gib, have_gib=estimate.capacity_gib, gpu=estimate.gpu
        )
    logger.warning(message)
    return estimate
