"""The commands that need no cluster and no job: ``tunepack tiny-model``, ``tiny-dataset`` (offline
fixtures) and ``plan`` (the GPU memory planner)."""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from tunepack.runtimes import methods
from tunepack.tiny.pictures import DEFAULT_ROWS as DEFAULT_IMAGE_ROWS

DEFAULT_PLAN_SEQ_LEN = 2048  # plan --seq-len when not given (the model's context if shorter)


def cmd_tiny_model(ns: argparse.Namespace) -> int:
    from tunepack.runtimes.catalog import TINY_MODELS
    from tunepack.tiny import write_tiny_model

    tiny = TINY_MODELS[ns.model]
    with _writing(ns.directory, "a directory for the tiny model"):
        path = write_tiny_model(Path(ns.directory), tiny.entry, seed=ns.seed)
    print(
        f"tiny model ready at {path} (for --runtime {tiny.runtime}; "
        f"method={', '.join(tiny.methods)})"
    )
    return 0


def cmd_tiny_dataset(ns: argparse.Namespace) -> int:
    from tunepack.core.errors import BadValueError
    from tunepack.tiny import write_tiny_dataset
    from tunepack.tiny.dataset import (
        write_tiny_preference_dataset,
        write_tiny_prompt_dataset,
        write_tiny_unpaired_dataset,
    )

    if ns.images:
        return _tiny_image_dataset(ns)
    if os.path.isdir(ns.file):
        raise BadValueError(
            f"{ns.file} is a directory; give the path of the dataset file to write "
            f"(e.g. {os.path.join(ns.file, 'instructions.jsonl')})"
        )
    with _writing(ns.file, "a path for the dataset file"):
        if ns.preference:
            write, kind = write_tiny_preference_dataset, "preference dataset (for method=dpo)"
        elif ns.unpaired:
            write, kind = write_tiny_unpaired_dataset, "unpaired dataset (for method=kto)"
        elif ns.prompts:
            write, kind = write_tiny_prompt_dataset, "prompt dataset (for method=grpo)"
        else:
            write, kind = write_tiny_dataset, "dataset"
        path = write(Path(ns.file), rows=256 if ns.rows is None else ns.rows, seed=ns.seed)
    print(f"tiny {kind} ready at {path}")
    return 0


def _tiny_image_dataset(ns: argparse.Namespace) -> int:
    from tunepack.runtimes.catalog import TINY_MODELS, TINY_VISION_NF4
    from tunepack.tiny.pictures import write_tiny_image_dataset

    rows = DEFAULT_IMAGE_ROWS if ns.rows is None else ns.rows
    with _writing(ns.file, "a directory for the image dataset"):
        path = write_tiny_image_dataset(Path(ns.file), rows=rows, seed=ns.seed)
    tiny = TINY_MODELS[TINY_VISION_NF4.name]
    print(
        f"tiny image dataset ready at {path} ({rows} pictures; for {tiny.entry.name} with "
        f"--runtime {tiny.runtime}, method={', '.join(tiny.methods)})"
    )
    return 0


class _writing:
    """An OSError while writing ``path`` (read-only, not a directory, no space): one line."""

    def __init__(self, path: str, wanted: str):
        self.path, self.wanted = path, wanted

    def __enter__(self):
        return self

    def __exit__(self, kind, err, tb):
        from tunepack.core.errors import DeniedError

        if isinstance(err, OSError) and not isinstance(err, BlockingIOError):
            reason = (err.strerror or str(err)).lower()
            if err.filename and err.filename != self.path:
                shown = str(err.filename)
                reason = f"{shown} is a file" if os.path.isfile(shown) else f"{reason} ({shown})"
            raise DeniedError(
                f"cannot write {self.path}: {reason}; give {self.wanted} you can write to"
            ) from None
        return False


def cmd_plan(ns: argparse.Namespace) -> int:
    from tunepack.core.errors import ConflictError
    from tunepack.runtimes.args import job_defaults
    from tunepack.runtimes.planner import model_entry, plan

    if ns.lora_rank is not None and not methods.get(ns.method).adapters:
        raise ConflictError(
            f"--lora-rank {ns.lora_rank} is a LoRA setting, but --method {ns.method} trains every "
            "weight and has no adapters; leave out --lora-rank, or use --method lora"
        )
    if ns.lora_mlp is not None and not methods.get(ns.method).adapters:
        flag = "--lora-mlp" if ns.lora_mlp else "--no-lora-mlp"
        raise ConflictError(
            f"{flag} is a LoRA setting, but --method {ns.method} trains every weight and has no "
            f"adapters; leave out {flag}, or use --method lora"
        )
    if ns.num_generations is not None and not methods.get(ns.method).sequences_key:
        raise ConflictError(
            f"--num-generations {ns.num_generations} is a setting of method grpo, but --method "
            f"{ns.method} samples no answers; leave it out, or use --method grpo"
        )
    entry = model_entry(ns.model, ns.model_dir)  # a -custom runtime's config.json, read once
    batch_size = ns.batch_size
    if batch_size is None:  # as a job of the model gets it, so plan and the job agree
        batch_size = job_defaults(entry, ns.method)["batch_size"]
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
        batch_size,
        ns.gpu,
        nodes=ns.nodes,
        gpus_per_node=ns.gpus_per_node,
        activation_checkpointing=ns.activation_checkpointing,
        loss_chunk=ns.loss_chunk,
        lora_rank=16 if ns.lora_rank is None else ns.lora_rank,
        lora_mlp=ns.lora_mlp,
        num_generations=4 if ns.num_generations is None else ns.num_generations,
    )
    print(estimate.summary())
    if note:
        print(f"  note: {note}")
    return 0 if estimate.fits else 1
