"""Measurement probe and process entry of the side-by-side benchmark.

The probe wraps a trainer's own collate function: each batch it builds is counted (real tokens,
the positions the model computes) and stamped with the process's CPU time and the wall clock, one
JSON line per batch in the file ``$TUNEPACK_BENCH_PROBE``. One batch is collated per optimizer
step, so the stamps bracket the steps and give the CPU time per real token of the steps after
warm-up, the same way for every trainer, whatever each one logs. The batch itself is returned
unchanged.

Real tokens of a batch: the tokens of its examples (their lengths before padding); for a
pre-padded pack (torchtune's ``PackedDataset``), its positions up to its last labelled one (the
padding of a pack is at its end and unlabelled, and every example ends with a labelled
end-of-turn token).

As a program, it runs one benchmarked process:

    python sbs_probe.py module NAME ARGS...   # runpy a module (tunepack's launcher, initializers)
    python sbs_probe.py script PATH ARGS...   # runpy a script (torchtune's stock recipe)

With ``$TUNEPACK_BENCH_WORKLOAD`` (the benchmark workload's fields as JSON) its model is added to
tunepack's catalog in this process first, so ``TUNEPACK_MODEL`` can name it; with the probe file
set, tunepack's recipe collates through the probe.

With ``$TUNEPACK_BENCH_PROFILE`` (a path) and ``$TUNEPACK_BENCH_PROFILE_AFTER`` (a number of
batches), torch's profiler records every operator from the batch after that many to the end of
the process (the steady steps, not the set-up), and the path gets one JSON line per operator and
input shapes: its name, shapes, self CPU microseconds and calls.
"""

from __future__ import annotations

import atexit
import json
import os
import runpy
import sys
import time

IGNORE_INDEX = -100  # torchtune's CROSS_ENTROPY_IGNORE_IDX and transformers' label padding


def _example_tokens(example) -> int:
    if "seq_lens" in example:  # a torchtune pack, already padded to max_seq_len
        labels = list(example["labels"])
        labelled = [i for i, label in enumerate(labels) if int(label) != IGNORE_INDEX]
        return labelled[-1] + 1 if labelled else 0
    ids = example["tokens"] if "tokens" in example else example["input_ids"]
    return len(ids)


def _positions(batch) -> int:
    ids = batch["tokens"] if "tokens" in batch else batch["input_ids"]
    return int(ids.numel())


class _Profile:
    """torch's profiler over the steady steps (module docstring), started by the probe."""

    profiler = None
    batches = 0

    @classmethod
    def batch_collated(cls) -> None:
        cls.batches += 1
        after = os.environ.get("TUNEPACK_BENCH_PROFILE_AFTER")
        if cls.profiler is None and after is not None and cls.batches == int(after) + 1:
            from torch.profiler import ProfilerActivity, profile

            cls.profiler = profile(activities=[ProfilerActivity.CPU], record_shapes=True)
            cls.profiler.start()

    @classmethod
    def write(cls) -> None:
        path = os.environ.get("TUNEPACK_BENCH_PROFILE")
        if cls.profiler is None or not path:
            return
        cls.profiler.stop()
        with open(path, "w") as out:
            for op in cls.profiler.key_averages(group_by_input_shape=True):
                record = {
                    "name": op.key,
                    "shapes": op.input_shapes,
                    "self_cpu_us": op.self_cpu_time_total,
                    "calls": op.count,
                }
                out.write(json.dumps(record) + "\n")


def counting(collate):
    """``collate``, recording each batch it builds in ``$TUNEPACK_BENCH_PROBE``."""
    path = os.environ.get("TUNEPACK_BENCH_PROBE")
    if not path:
        return collate

    def probed(examples, *args, **kwargs):
        _Profile.batch_collated()
        batch = collate(examples, *args, **kwargs)
        record = {
            "cpu_s": time.process_time(),
            "wall_s": time.perf_counter(),
            "real": sum(_example_tokens(e) for e in examples),
            "positions": _positions(batch),
        }
        with open(path, "a") as out:
            out.write(json.dumps(record) + "\n")
        return batch

    return probed


def counting_collate_sft(examples, *args, **kwargs):
    """torchtune's ``padded_collate_sft`` through the probe (the stock recipe's ``collate_fn``)."""
    from torchtune.data import padded_collate_sft

    return counting(padded_collate_sft)(examples, *args, **kwargs)


def _register_workload() -> None:
    raw = os.environ.get("TUNEPACK_BENCH_WORKLOAD")
    if not raw:
        return
    from sbs_workload import Workload

    from tunepack.runtimes import catalog

    entry = Workload(**json.loads(raw)).entry()
    catalog.CATALOG[entry.name] = entry


def _probe_tunepack() -> None:
    from tunepack.trainers import recipe

    recipe.padded_collate_sft = counting(recipe.padded_collate_sft)
    recipe.padded_collate_packed = counting(recipe.padded_collate_packed)


def main(argv: list[str]) -> None:
    kind, target, *args = argv
    _register_workload()
    sys.argv = [target, *args]
    if kind not in ("module", "script"):
        raise SystemExit(f"sbs_probe: kind must be module or script, got {kind!r}")
    # At exit, not after run_module: tunepack's launcher leaves without returning
    # (tunepack.core.program.leave runs the atexit handlers, then os._exit).
    atexit.register(_Profile.write)
    if kind == "module":
        if target == "tunepack.trainers.launch":
            _probe_tunepack()
        runpy.run_module(target, run_name="__main__", alter_sys=True)
    else:
        runpy.run_path(target, run_name="__main__")


if __name__ == "__main__":
    main(sys.argv[1:])
