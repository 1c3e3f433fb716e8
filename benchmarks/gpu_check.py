"""GPU check: tunepack's trainer on real-size random-weight models, in one command and one report.

    python benchmarks/gpu_check.py               # a CUDA machine: Llama 3.2 1B and 3.1 8B shapes
    python benchmarks/gpu_check.py --loan        # the most telling runs within a device loan
    python benchmarks/gpu_check.py --sizes 1b    # the 1B shape only
    python benchmarks/gpu_check.py --dry-run     # CPU: a tiny model of the same architecture

It writes one JSON report (``--out``) and prints a table; it never asserts a speed. Nothing is
downloaded: each model is written here with random weights at the catalog's shape (Llama 3.2 1B,
Llama 3.1 8B; ``--dry-run``: two layers of width 256, whose projections NF4 can quantize) and the
tiny Llama 3 tokenizer; it trains through tunepack's bring-your-own runtime (``llama-custom``),
which builds the model from the checkpoint's config.json with torchtune's Llama 3.2 builders (tied
or untied embeddings, Llama 3 RoPE scaling). Every row is longer than ``max_seq_len`` and is cut to
it, so every batch is full and every trainer computes the same positions; the loss covers the
whole row (``train_on_input=true``).

For each size and method (LoRA, QLoRA, DoRA, full; bf16 on a GPU, fp32 on CPU), each in a fresh
process:

- ``tunepack``: tunepack's launcher with its defaults (the step chosen for the device:
  ``activation_checkpointing=auto`` and ``loss_chunk=auto``; the loss fused with the output
  projection; ``compile=auto``, which does not compile runs this short);
- ``torchtune-stock``: torchtune 0.6.1's own single-device recipe (``lora_finetune_single_device``;
  ``full_finetune_single_device`` for full) with a config derived from the one tunepack wrote
  (``trainer_bench.stock_config``), the same model, data and optimizer, the activation
  checkpointing of torchtune's own config for the model and method (``stock_settings``),
  torchtune's plain cross-entropy over the whole logits;
- ``torchtune-stock-compiled``: the same with the recipe's own ``compile: True``;
- LoRA also ``tunepack-compiled`` (``compile=true``) and ``tunepack-plain-loss`` (the fused loss
  switched off: the whole logits and a plain cross-entropy, as before
  ``trainers/objectives/vocab_loss.py``).

Each run's step (``step_plan``: the trainer's record in result.json; the stock config's) is in
the report and the table, and its memory plan is computed with exactly that step. On a GPU a run
whose plan does not fit the device is recorded as skipped with the plan, not run.

Figures per run: real tokens per second over the steps after ``--warmup`` (``sbs_probe`` counts
the tokens of each batch and stamps it, the same way for every trainer), MFU (those tokens x the
model FLOPs per token of ``side_by_side.model_flops_per_token`` / the peak: on a GPU the dense bf16
peak of the device from ``GPU_PEAK_TFLOPS``, null with the reason for an unknown device; on CPU
the single-thread fp32 matmul peak measured in this run, ``side_by_side.sgemm_peak``), the peak
memory (GPU: the trainer's peak allocated memory, which is what the planner estimates; CPU: the
process's peak resident set) against the memory planner's estimate of the same job (the ratio),
and the last loss. Derived from them:

- ``compile``: what ``compile=auto`` assumes (``trainers/process/compiling.py``:
  ``GPU.compile_s`` = 90 s and ``GPU.saving`` = 10%, on CPU ``CPU``), measured: the compile time
  is the compiled run's warm-up steps minus its steady step time, less the same for the eager
  run; the saving is 1 - compiled / eager steady step time. The report names the constant each
  figure would replace.
- ``fused_loss``: the fused loss against the plain cross-entropy: peak memory and step time.
- ``fsdp2``: a LoRA run through torchrun with FSDP2 (NCCL on a GPU, gloo on CPU) that
  checkpoints, is stopped by SIGTERM (the trainer's own stop: checkpoint, exit 75), resumes from
  its checkpoint and ends with the adapter of an uninterrupted run, compared bit for bit. With one
  process the trainer would not shard (it shards when there are several), so each worker of this
  check takes the sharded path whatever the world size (``--fsdp-nproc``, default 1).

On a GPU the runs go one at a time, the most telling first (each size's LoRA runs, the FSDP2
check, then QLoRA, DoRA and full); a run that would end after ``--budget-s`` seconds (a rough
guess from the runs before it) is recorded as skipped, with that reason. Before starting it
prints how long its runs took on one H100 (``H100_S``). ``--loan`` runs only ``LOAN``'s runs
within ``LOAN_BUDGET_S``: one call that fits a 15-minute device loan with a rerun's margin.
``--dry-run`` runs the same code on CPU with a tiny model and a few steps (two runs at a time),
which is what ``make test`` checks, leaving out only the ``compile=true`` runs (a minute of CPU
even at that size; ``--compile-run yes`` adds them); its figures check the harness, not the
machine.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import dataclasses
import itertools
import json
import math
import os
import platform
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))

from sbs_harness import read_records  # noqa: E402
from sbs_workload import Workload, rows  # noqa: E402
from side_by_side import (  # noqa: E402
    PROBE,
    model_flops_per_token,
    sgemm_peak,
    steady,
    summarize,
    versions,
)
from trainer_bench import free_port, run_measured, stock_config, stock_recipe_file  # noqa: E402

from tunepack.runtimes import catalog, custom, methods  # noqa: E402
from tunepack.runtimes.catalog import Shape  # noqa: E402

MODEL = custom.runtime_model_name("llama")  # the bring-your-own Llama runtime's model
SYSTEMS = (
    "tunepack",
    "torchtune-stock",
    "torchtune-stock-compiled",
    "tunepack-compiled",
    "tunepack-plain-loss",
)
LORA_ONLY = ("tunepack-compiled", "tunepack-plain-loss")
STOCK = ("torchtune-stock", "torchtune-stock-compiled")
# compile=true: the compile time is counted in the budget; left out of --dry-run (--compile-run).
COMPILED = ("torchtune-stock-compiled", "tunepack-compiled")
WHOLE_LOGITS = (*STOCK, "tunepack-plain-loss")  # the runs that hold the whole logits
METHODS = ("lora", "qlora", "dora", "full")
# Dense (no sparsity) bf16 tensor-core peaks in TFLOP/s, from the vendors' data sheets, matched
# in this order against torch.cuda.get_device_name() ("NVIDIA H100 80GB HBM3" is the SXM part).
GPU_PEAK_TFLOPS = (
    ("H100 PCIe", 756.0),
    ("H100 NVL", 835.0),
    ("GH200", 989.0),
    ("H200 NVL", 835.0),
    ("H100", 989.0),
    ("H200", 989.0),
    ("A100", 312.0),
    ("L40S", 362.0),
    ("L4", 121.0),
)
FSDP_MARK = "gpu_check: DTensor parameters:"  # the worker's line: sharded, all
RUN_TIMEOUT_S = 300  # one trainer process; a hung run is killed and recorded as failed
INIT_STD, NORM_STD = 0.02, 0.1  # tunepack.tiny.hf's random weights: normal(0, 0.02); norms ~1


@dataclasses.dataclass(frozen=True)
class Size:
    """One model size of the check and the job each of its runs trains."""

    name: str
    catalog_name: str  # the family (RoPE scaling, norms) and, unless ``shape`` is given, shape
    torchtune_configs: str  # torchtune's own configs of the model: <dir>/<size> (stock_settings)
    methods: tuple[str, ...]
    seq_len: int
    batch_size: int
    steps: int
    warmup: int
    lora_rank: int = 16
    shards: int = 1
    shape: Shape | None = None

    @property
    def entry(self) -> catalog.ModelEntry:
        entry = catalog.get(self.catalog_name)
        return dataclasses.replace(entry, shape=self.shape) if self.shape else entry

    @property
    def title(self) -> str:
        s = self.entry.shape
        return (
            f"{self.catalog_name if self.shape is None else 'tiny Llama 3.2'} shape "
            f"({self.entry.parameter_count / 1e9:.3g}B parameters, {s.num_layers} layers, "
            f"width {s.embed_dim}, vocab {s.vocab_size})"
        )


SIZES = {
    "1b": Size("1b", "llama3.2-1b", "llama3_2/1B", METHODS, seq_len=2048, batch_size=4, steps=10,
               warmup=3),
    "8b": Size("8b", "llama3.1-8b", "llama3_1/8B", METHODS, seq_len=2048, batch_size=2, steps=6,
               warmup=2, shards=4),
}  # fmt: skip
# The same architecture at a size a CPU trains in a second: projections NF4 can quantize
# (multiples of 64 x 256 values, like tests.helpers.NF4_TINY), tied embeddings as Llama 3.2 1B.
DRY = Size(
    "dry", "llama3.2-1b", "llama3_2/1B", METHODS, seq_len=128, batch_size=2, steps=4, warmup=1,
    lora_rank=8, shape=Shape(1024, num_layers=2, num_heads=4, num_kv_heads=2, embed_dim=256,
                             intermediate_dim=512, max_seq_len=2048, tied_embeddings=True),
)  # fmt: skip

# What each part of a check took on one H100 80GB, in seconds (rounded up): each run's
# process_wall_s in benchmarks/results/gpu-h100-2026-11-26-*.json and -27-*.json; a size's
# "start" (reading the GPU, writing the random model, the initializers) is a report's wall_s less
# its runs (1B: the dora-full report, 116 - 95 s; 8B: the lora report, 155 - 90 s: 16 GB
# written); "fsdp" the fsdp2-repeat report's 143 s less 1B's start. Those runs recomputed every
# layer (tunepack's step before the planner chose it): a step that recomputes less is faster.
# A compiled stock run has not been timed: the stock run's time and compiling.GPU.compile_s.
H100_S = {
    ("1b", "start"): 21, ("8b", "start"): 65, ("1b", "fsdp"): 122,
    ("1b", "lora", "tunepack"): 29, ("1b", "lora", "torchtune-stock"): 25,
    ("1b", "lora", "tunepack-compiled"): 45, ("1b", "lora", "tunepack-plain-loss"): 23,
    ("1b", "qlora", "tunepack"): 28, ("1b", "qlora", "torchtune-stock"): 25,
    ("1b", "dora", "tunepack"): 24, ("1b", "dora", "torchtune-stock"): 21,
    ("1b", "full", "tunepack"): 26, ("1b", "full", "torchtune-stock"): 25,
    ("8b", "lora", "tunepack"): 33, ("8b", "lora", "torchtune-stock"): 29,
    ("8b", "lora", "tunepack-plain-loss"): 31,
    ("8b", "qlora", "tunepack"): 46, ("8b", "qlora", "torchtune-stock"): 45,
}  # fmt: skip
# --loan: the most telling runs in one call that fits a 15-minute device loan twice (a rerun's
# margin) with the machine's starts and transfers: by H100_S, 1B's start 21 s + LoRA 29 + 25 +
# 45 (stock compiled: 25 + 20) + full 26 + 25, 8B's start 65 s + LoRA 33 + 29 = 298 s, within
# LOAN_BUDGET_S (the budget cuts the last runs if a device is slower). Left out: the FSDP2
# check (122 s; measured four times), the plain-loss runs (the fused loss's cost, measured at
# both sizes), tunepack-compiled (measured at 1B), QLoRA and DoRA (measured at 1B, QLoRA at 8B),
# 8B DoRA and full (not yet timed; full plans 75 GiB, about all of an 80 GB card).
LOAN = (
    ("1b", "lora", ("tunepack", "torchtune-stock", "torchtune-stock-compiled")),
    ("1b", "full", ("tunepack", "torchtune-stock")),
    ("8b", "lora", ("tunepack", "torchtune-stock")),
)
LOAN_BUDGET_S = 330.0
DEFAULT_BUDGET_S = 420.0


@dataclasses.dataclass
class Context:
    """What every run of one check shares."""

    root: Path
    device: str  # cuda or cpu
    dtype: str  # bf16 or fp32
    env: dict
    started: float
    budget_s: float
    peak_flops: float | None  # the MFU denominator
    peak_why: str | None  # why there is none
    compile: str | None  # why the compile=true run is left out; None: it runs
    fsdp_nproc: int
    deterministic: bool = False  # the FSDP2 check's runs with deterministic=true
    # The device's memory as the trainer sizes its step (its total less CUDA_RESERVE_GIB); a run
    # whose memory plan exceeds it is skipped. None on CPU: no run is skipped for memory.
    capacity_gib: float | None = None
    runs: itertools.count = dataclasses.field(default_factory=lambda: itertools.count(1))
    walls: dict = dataclasses.field(default_factory=dict)  # size -> its runs' process seconds

    def expected_s(self, size: Size) -> float:
        """A rough guess of one more run of ``size``: the median of its runs so far, else half
        as much again as the other sizes' (45 s before any)."""
        if self.walls.get(size.name):
            return statistics.median(self.walls[size.name])
        others = [w for walls in self.walls.values() for w in walls]
        return 1.5 * statistics.median(others) if others else 45.0

    def over_budget(self, expected_s: float = 0.0) -> str | None:
        """Why a run expected to take ``expected_s`` does not start (None: it starts)."""
        spent = time.monotonic() - self.started
        if spent + expected_s > self.budget_s:
            return (
                f"time budget: {spent:.0f} s spent, about {expected_s:.0f} s more expected, "
                f"--budget-s {self.budget_s:.0f}"
            )
        return None

    def run_dir(self, name: str) -> Path:
        path = self.root / "runs" / f"{next(self.runs):02d}-{name.replace('/', '-')}"
        path.mkdir(parents=True)
        return path


def log(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


# ----------------------------------------------------------------------------- the model, data
def write_model(target: Path, size: Size, *, dtype: str, device: str, seed: int = 0) -> Path:
    """A random-weight Hugging Face Llama checkpoint of ``size``'s shape in ``target``.

    The layout (tensor names and shapes) is tunepack.tiny.hf's, taken on the meta device; the
    values are drawn here in the training dtype, on the GPU when there is one (an 8B model's
    16 GB of bf16 in seconds, not the fp32 tiny writer's 32 GB). The tokenizer is the tiny Llama
    3 one: its ids are a small part of the model's vocabulary, the rest are never seen.
    """
    import torch
    from safetensors.torch import save_file

    from tunepack.tiny import hf

    entry = size.entry
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
    write_config(tmp, size, dtype=dtype)
    with torch.device("meta"):
        layout = hf.LLAMA.weights(entry, seed)
    generator = torch.Generator(device=device).manual_seed(seed)
    torch_dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[dtype]

    def draw(name: str, shape: torch.Size) -> torch.Tensor:
        value = torch.randn(shape, generator=generator, device=device)
        value = 1 + value * NORM_STD if "norm" in name else value * INIT_STD
        return value.to(torch_dtype).cpu()

    names = list(layout)
    total = sum(t.numel() for t in layout.values())
    if size.shards == 1:
        save_file({n: draw(n, layout[n].shape) for n in names}, tmp / "model.safetensors",
                  {"format": "pt"})  # fmt: skip
    else:
        weight_map, shard, filled, index = {}, {}, 0, 1
        for name in names:
            shard[name] = draw(name, layout[name].shape)
            filled += layout[name].numel()
            if filled >= total * index / size.shards or name == names[-1]:
                file = f"model-{index:05d}-of-{size.shards:05d}.safetensors"
                save_file(shard, tmp / file, {"format": "pt"})
                weight_map.update(dict.fromkeys(shard, file))
                shard, index = {}, index + 1
        width = torch.finfo(torch_dtype).bits // 8
        index_json = {"metadata": {"total_size": total * width}, "weight_map": weight_map}
        (tmp / catalog.SAFETENSORS_INDEX).write_text(json.dumps(index_json, indent=2))
    for path in (tmp, *tmp.rglob("*")):
        os.chmod(path, 0o755 if path.is_dir() else 0o644)
    os.rename(tmp, target)
    if device == "cuda":
        torch.cuda.empty_cache()  # the trainers, in their own processes, get the memory back
    return target


def write_config(target: Path, size: Size, *, dtype: str) -> None:
    """The config.json of ``size``'s checkpoint and the tiny Llama 3 tokenizer in ``target``
    (what the memory planner reads of a bring-your-own model)."""
    from tunepack.tiny import hf
    from tunepack.tiny.bpe import TiktokenFormat, dump_json

    tokenizer = TiktokenFormat().write(catalog.TINY["llama3_2"])
    config = hf.LLAMA.config(size.entry, tokenizer)
    config["torch_dtype"] = {"bf16": "bfloat16", "fp32": "float32"}[dtype]
    for name, data in {"config.json": dump_json(config), **tokenizer.files}.items():
        (target / name).parent.mkdir(parents=True, exist_ok=True)
        (target / name).write_bytes(data)


def write_rows(path: Path, model_dir: Path, size: Size, count: int) -> Path:
    """Alpaca rows of at least ``seq_len`` text tokens each (sbs_workload's generator), so that
    every row is cut to ``seq_len`` and every batch is full."""
    workload = Workload(
        vocab_size=size.entry.shape.vocab_size, num_layers=0, num_heads=0, num_kv_heads=0,
        embed_dim=0, intermediate_dim=0, max_seq_len=size.seq_len, rows=count,
        min_tokens=size.seq_len, max_tokens=size.seq_len, lexicon=2000, corpus_words=0,
    )  # fmt: skip
    records = rows(workload, model_dir)
    path.write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")
    return path


def prepare(ctx: Context, size: Size) -> Path:
    """The size's model and rows, through tunepack's own initializers into a template
    workspace whose ``dataset/`` and ``model/`` every run of the size links to."""
    src = ctx.root / f"src-{size.name}"
    src.mkdir()
    began = time.monotonic()
    model = write_model(src / "model", size, dtype=ctx.dtype, device=ctx.device)
    data = write_rows(src / "data.jsonl", model, size, (size.steps + 2) * size.batch_size)
    template = ctx.root / f"ws-{size.name}"
    for module, uri in (
        ("tunepack.initializers.dataset", f"file://{data}"),
        ("tunepack.initializers.model", f"file://{model}"),
    ):
        env = {**ctx.env, "TUNEPACK_WORKSPACE": str(template), "STORAGE_URI": uri}
        done = subprocess.run(
            [sys.executable, "-m", module], env=env, capture_output=True, text=True, timeout=900
        )
        if done.returncode:
            raise RuntimeError(f"{module} exited {done.returncode}: {done.stderr[-2000:]}")
    log(f"{size.name}: model and rows ready in {time.monotonic() - began:.0f} s")
    return template


def plan(ctx: Context, size: Size, method: str, template: Path, *, whole_logits: bool,
         step=None) -> dict:  # fmt: skip
    """The memory planner's estimate of the same job (tunepack.runtimes.planner.estimate), with
    ``step`` (planner.Step: a run's record) exactly; without it, with the step the trainer would
    choose on this device (``ctx.capacity_gib``). ``whole_logits``: the runs that hold the whole
    logits (the stock recipe, tunepack's plain loss), planned with ``fused_loss=False``."""
    from tunepack.runtimes.planner import estimate

    if whole_logits and step is not None:
        step = dataclasses.replace(step, loss_chunk_rows=None)
    p = estimate(
        MODEL, method, size.seq_len, size.batch_size, dtype=ctx.dtype, lora_rank=size.lora_rank,
        model_dir=template / "model", fused_loss=not whole_logits, capacity_gib=ctx.capacity_gib,
        step=step,
    )  # fmt: skip
    parts = ("weights", "gradients", "optimizer", "activations", "logits", "update")
    return {
        "peak_gib": p.peak_gib,
        **{f"{k}_gib": getattr(p, k) / 2**30 for k in parts},
        "step": p.step.record(),
        "trainable": p.trainable,
        "parameters": p.parameters,
    }


def stock_settings(size: Size, method: str) -> tuple[str, bool]:
    """The torchtune config a torchtune user of this model and method starts from (DoRA: the
    LoRA one, which torchtune's DoRA configs are with ``use_dora``), and its
    ``enable_activation_checkpointing``, which the stock runs keep: torchtune 0.6.1 ships Llama
    3.2 1B's single-device configs with it off and Llama 3.1 8B's with it on."""
    how = methods.get(method)
    kind = "full" if not how.adapters else "qlora" if how.quantize_base else "lora"
    name = f"{size.torchtune_configs}_{kind}_single_device.yaml"
    shipped = yaml.safe_load((stock_recipe_file().parent / "configs" / name).read_text())
    return name, bool(shipped["enable_activation_checkpointing"])


def stock_step(size: Size, method: str, system: str) -> dict:
    """The stock run's step, as the trainer records its own (``step_plan``): the shipped
    config's activation checkpointing (every layer or none), the whole logits (torchtune's
    cross-entropy), ``compile`` for the compiled system."""
    from tunepack.runtimes.planner import Step

    layers = size.entry.shape.num_layers
    checkpointing = stock_settings(size, method)[1]
    step = Step(layers, layers if checkpointing else 0, None, chosen=False)
    return {**step.record(), "compiled": system == "torchtune-stock-compiled"}


def step_cell(record: dict | None) -> str:
    """A step in the table's few characters: ``r0/16 c8192`` (no layer of 16 recomputed, 8192
    rows of logits at a time), ``whole`` for the whole logits, `` +C`` compiled."""
    if not record:
        return "-"
    rows = record["loss_chunk_rows"]
    return (
        f"r{record['recompute_layers']}/{record['layers']} "
        + ("whole" if rows is None else f"c{rows}")
        + (" +C" if record.get("compiled") else "")
    )


# ----------------------------------------------------------------------------- one run
def trainer_args(ctx: Context, size: Size, method: str) -> list[str]:
    return [
        f"method={method}",
        f"max_steps={size.steps}",
        f"batch_size={size.batch_size}",
        f"max_seq_len={size.seq_len}",
        f"device={ctx.device}",
        f"dtype={ctx.dtype}",
        "train_on_input=true",
        "warmup_steps=0",
        "checkpoint_every_minutes=0",
        *([f"lora_rank={size.lora_rank}", f"lora_alpha={2 * size.lora_rank}"]
          if methods.get(method).adapters else []),
    ]  # fmt: skip


def _workspace(run: Path, template: Path) -> Path:
    ws = run / "ws"
    ws.mkdir()
    for part in ("dataset", "model"):
        (ws / part).symlink_to(template / part)
    return ws


def _measured(cmd: list, env: dict, log_path: Path) -> dict:
    """Run a trainer (killed after RUN_TIMEOUT_S) and measure it; wait4 counts the process
    under ``timeout`` too, which waits for it."""
    began = time.perf_counter()
    watched = ["timeout", "-s", "KILL", str(RUN_TIMEOUT_S), *map(str, cmd)]
    code, rss, cpu = run_measured(watched, env, log_path)
    if code:
        tail = log_path.read_text(errors="replace")[-3000:]
        raise RuntimeError(f"exited {code}:\n{tail}")
    return {"cpu_s": cpu, "wall_s": time.perf_counter() - began, "rss_gib": rss}


def _metrics(ws: Path) -> list[dict]:
    path = ws / "output" / "metrics.jsonl"
    lines = [json.loads(x) for x in path.read_text().splitlines() if x.strip()]
    return [m for m in lines if m.get("event", "step") == "step"]


def run_tunepack(ctx: Context, size: Size, method: str, system: str, template: Path) -> dict:
    run = ctx.run_dir(f"{size.name}-{method}-{system}")
    ws = _workspace(run, template)
    args = trainer_args(ctx, size, method)
    entry = [PROBE, "module", "tunepack.trainers.launch"]
    if system == "tunepack-compiled":
        args.append("compile=true")
    elif system == "tunepack-plain-loss":
        entry = [HERE / "gpu_check.py", "--plain-loss-child", *entry[1:]]
    probe = run / "probe.jsonl"
    env = {**ctx.env, "TUNEPACK_WORKSPACE": str(ws), "TUNEPACK_BENCH_PROBE": str(probe)}
    usage = _measured([sys.executable, *entry, *args], env, run / "train.log")
    steps = _metrics(ws)
    config = yaml.safe_load((ws / "output" / "config.yaml").read_text())
    result = json.loads((ws / "output" / "result.json").read_text())
    figures = _figures(ctx, size, read_records(probe), usage, steps[-1]["loss"])
    if ctx.device == "cuda":
        figures["peak_memory_gib"] = max(s["peak_memory_gib"] for s in steps)
    figures["step_elapsed_s"] = [s["elapsed_s"] for s in steps]
    figures["step_plan"] = result["step_plan"]  # the step the trainer chose (and compiled)
    figures["config"] = config
    return figures


def run_stock(ctx: Context, size: Size, method: str, system: str, tunepack_cfg: dict) -> dict:
    run = ctx.run_dir(f"{size.name}-{method}-{system}")
    out = run / "out"
    out.mkdir()
    cfg = stock_config(tunepack_cfg, out, size.steps, ctx.device)
    cfg["collate_fn"] = "sbs_probe.counting_collate_sft"
    # What a torchtune user runs: the shipped config's activation checkpointing, torchtune's
    # plain cross-entropy over the whole logits, and for the compiled system the recipe's own
    # compile=True (torch.compile of each layer and of the loss), not trainer_bench's settings.
    step = stock_step(size, method, system)
    cfg["enable_activation_checkpointing"] = step["recompute_layers"] > 0
    cfg["compile"] = step["compiled"]
    recipe = stock_recipe_file()
    if not methods.get(method).adapters:
        recipe = recipe.with_name("full_finetune_single_device.py")
        cfg["optimizer_in_bwd"] = False
        cfg.pop("save_adapter_weights_only")
    (run / "config.yaml").write_text(yaml.safe_dump(cfg))
    probe = run / "probe.jsonl"
    env = {**ctx.env, "TUNEPACK_BENCH_PROBE": str(probe)}
    cmd = [sys.executable, PROBE, "script", recipe, "--config", run / "config.yaml"]
    usage = _measured(cmd, env, run / "train.log")
    text = "".join(p.read_text() for p in (out / "logs").glob("*.txt"))
    losses = [float(x) for x in _find(text, "loss")]
    figures = _figures(ctx, size, read_records(probe), usage, losses[-1] if losses else None)
    if ctx.device == "cuda":
        # torchtune resets the peak at every logged step: the run's peak is the largest.
        peaks = [float(x) for x in _find(text, "peak_memory_alloc")]
        figures["peak_memory_gib"] = max(peaks) if peaks else None
    figures["step_plan"] = step
    figures["stock_config"] = stock_settings(size, method)[0]
    return figures


def _find(text: str, key: str) -> list[str]:
    import re

    return re.findall(rf"\b{key}:([0-9.eE+-]+)", text)


def _figures(ctx: Context, size: Size, records: list[dict], usage: dict, loss) -> dict:
    """Throughput over the steps after the warm-up, from the probe's stamps."""
    settings = argparse.Namespace(steps=size.steps, warmup=size.warmup)
    summary = summarize("", records, settings, 0, usage, loss)
    window = steady(records, size.warmup, 0)
    return {
        "tokens_per_s": summary["tokens_per_wall_s"],
        "tokens_per_cpu_s": summary["tokens_per_cpu_s"],
        "step_s": window["wall_s"] / window["steps"] if window["steps"] else None,
        "step_cpu_s": window["cpu_s"] / window["steps"] if window["steps"] else None,
        "steady_steps": summary["steady_steps"],
        "fill": summary["fill"],
        "loss": loss,
        "peak_memory_gib": usage["rss_gib"],  # the GPU's figure replaces it on cuda
        "memory_kind": "peak RSS" if ctx.device == "cpu" else "peak allocated (GPU)",
        "process_wall_s": usage["wall_s"],
        "note": summary["note"],
    }


def finish(ctx: Context, figures: dict, flops: dict, planned: dict) -> dict:
    """MFU and memory against the plan, once the run's figures are in."""
    rate = figures["tokens_per_cpu_s" if ctx.device == "cpu" else "tokens_per_s"]
    figures["mfu"], figures["mfu_null_reason"] = None, None
    if ctx.peak_flops is None:
        figures["mfu_null_reason"] = ctx.peak_why
    elif not rate:
        figures["mfu_null_reason"] = figures["note"] or "no steady steps measured"
    else:
        figures["mfu"] = rate * flops["total"] / ctx.peak_flops
    peak = figures["peak_memory_gib"]
    figures["plan_gib"] = planned["peak_gib"]
    figures["memory_vs_plan"] = peak / planned["peak_gib"] if peak else None
    return figures


# ----------------------------------------------------------------------------- workloads
def method_workloads(
    ctx: Context,
    size: Size,
    method: str,
    systems: tuple[str, ...],
    template: Path | None,
    skip: str | None = None,
) -> list[dict]:
    """The runs of one size and method, in ``systems``' order (tunepack's first: the stock
    configs derive from its); all of them skipped, with ``skip`` as the reason, when given."""
    from tunepack.runtimes.planner import CUDA_RESERVE_GIB, Step
    from tunepack.trainers.process import compiling

    entries = []
    base = {"size": size.name, "method": method, "model": size.title}
    tunepack_cfg = None
    flops = model_flops_per_token(
        size.entry.shape, size.seq_len, method=method, lora_rank=size.lora_rank
    )
    for system in systems:
        entry = {"name": f"{size.name}/{method}/{system}", **base, "system": system}
        entries.append(entry)
        extra = compiling.GPU.compile_s if system in COMPILED else 0.0
        why = skip or ctx.over_budget(ctx.expected_s(size) + extra)
        if system in COMPILED and ctx.compile:
            why = ctx.compile
        whole_logits = system in WHOLE_LOGITS
        if why is None and ctx.capacity_gib is not None:
            # The step this run will take on this device, planned before it starts: a run the
            # device cannot hold is recorded, not left to run out of memory.
            if system in STOCK:
                step = Step.from_record(stock_step(size, method, system))
                fit = plan(ctx, size, method, template, whole_logits=True, step=step)
            else:  # the step the trainer will choose, sized as it sizes it
                fit = plan(ctx, size, method, template, whole_logits=False)
                if whole_logits:  # the plain loss: that step, with the whole logits
                    step = Step.from_record(fit["step"])
                    fit = plan(ctx, size, method, template, whole_logits=True, step=step)
            if fit["peak_gib"] > ctx.capacity_gib:
                entry["plan"] = fit
                shown = {**fit["step"], "compiled": system in COMPILED}
                why = (
                    f"does not fit the device: planned {fit['peak_gib']:.1f} GiB "
                    f"({step_cell(shown)}) over {ctx.capacity_gib:.1f} GiB usable (its "
                    f"memory less CUDA_RESERVE_GIB {CUDA_RESERVE_GIB:g})"
                )
        if system in STOCK and tunepack_cfg is None and why is None:
            why = "its config derives from tunepack's run, which did not run"
        if why:
            entry["skipped"] = why
            continue
        log(f"{entry['name']} ...")
        try:
            if system in STOCK:
                figures = run_stock(ctx, size, method, system, tunepack_cfg)
            else:
                figures = run_tunepack(ctx, size, method, system, template)
            ctx.walls.setdefault(size.name, []).append(figures["process_wall_s"])
            config = figures.pop("config", None)
            if system == "tunepack":
                tunepack_cfg = config
            # The plan of exactly the step the run took (the trainer's record, the stock
            # config's settings); the whole logits where the run holds them.
            step = Step.from_record(figures["step_plan"])
            planned = plan(ctx, size, method, template, whole_logits=whole_logits, step=step)
            entry.update(finish(ctx, figures, flops, planned))
        except Exception as err:  # recorded; the other runs go on
            entry["skipped"] = f"failed: {type(err).__name__}: {err}"
            log(f"{entry['name']}: {entry['skipped'][:2000]}")
            continue
        entry["flops_per_token"] = flops
        entry["plan"] = planned
    return entries


def compile_figures(ctx: Context, eager: dict, compiled: dict, warmup: int) -> dict:
    """``compile=auto``'s two constants, measured from the two runs' per-step clocks."""
    from tunepack.trainers.process import compiling

    cost = compiling.GPU if ctx.device == "cuda" else compiling.CPU
    name = "GPU" if ctx.device == "cuda" else "CPU"
    out = {
        "constants": {"compile_s": cost.compile_s, "saving": cost.saving},
        "replaces": {
            "compile_s": f"trainers/process/compiling.py {name}.compile_s = {cost.compile_s}",
            "saving": f"trainers/process/compiling.py {name}.saving = {cost.saving}",
        },
    }
    if "skipped" in eager or "skipped" in compiled:
        out["skipped"] = compiled.get("skipped") or eager.get("skipped")
        return out

    def split(elapsed: list[float]) -> tuple[float, float]:
        steps = [b - a for a, b in zip([0.0, *elapsed], elapsed, strict=False)]
        steady_s = statistics.median(steps[warmup:] or steps)
        return elapsed[warmup - 1] if warmup else 0.0, steady_s

    e_warm, e_step = split(eager["step_elapsed_s"])
    c_warm, c_step = split(compiled["step_elapsed_s"])
    out.update(
        {
            "compile_s": (c_warm - warmup * c_step) - (e_warm - warmup * e_step),
            "saving": 1 - c_step / e_step,
            "eager_step_s": e_step,
            "compiled_step_s": c_step,
            "warmup_steps": warmup,
        }
    )
    if ctx.device == "cpu":
        out["note"] = "dry-run model: the figures check the harness, they replace nothing"
    return out


def fused_loss_figures(fused: dict, plain: dict, step: str = "step_s") -> dict:
    """The fused loss against the plain cross-entropy: peak memory and steady step time
    (``step``: ``step_s``, wall seconds; ``step_cpu_s`` on CPU, where other work shares the
    cores)."""
    if "skipped" in fused or "skipped" in plain:
        return {"skipped": plain.get("skipped") or fused.get("skipped")}
    keys = ("peak_memory_gib", "step_s", "step_cpu_s", "tokens_per_s")
    return {
        "fused": {k: fused[k] for k in keys},
        "plain": {k: plain[k] for k in keys},
        "memory_saved_gib": plain["peak_memory_gib"] - fused["peak_memory_gib"],
        "step": step,
        "step_time_ratio": fused[step] / plain[step] if plain[step] else None,
        "memory_kind": fused["memory_kind"],
    }


# ----------------------------------------------------------------------------- FSDP2 resume
def _fsdp_config(ws: Path, argv: list[str]) -> tuple[Path, str]:
    """config.yaml of a run in ``ws``, derived as the launcher derives it (launch.run)."""
    from omegaconf import OmegaConf

    from tunepack.core import workspace
    from tunepack.runtimes.args import parse_trainer_args
    from tunepack.trainers.config import build_config, result_digest

    entry = custom.resolve(catalog.get(MODEL), ws / workspace.MODEL_DIR)
    cfg = build_config(
        entry,
        parse_trainer_args(argv, entry),
        model_dir=ws / workspace.MODEL_DIR,
        dataset_dir=ws / workspace.DATASET_DIR,
        output_dir=ws / workspace.OUTPUT_DIR,
        cache_dir=ws / workspace.CACHE_DIR / "datasets",
        checkpoint_dir=ws / workspace.CHECKPOINTS_DIR,
    )
    path = ws / "config.yaml"
    path.write_text(OmegaConf.to_yaml(cfg))
    return path, result_digest(cfg)


def _torchrun(ctx: Context, ws: Path, argv: list[str], log_path: Path, stop_at: int = 0) -> int:
    """One run through the launcher's torchrun command line, each worker being this script's
    ``--fsdp-worker`` (the trainer's worker, on the sharded path)."""
    from tunepack.trainers.launch import WORKER_MODULE, Layout, torchrun_command

    config, digest = _fsdp_config(ws, argv)
    layout = Layout(1, ctx.fsdp_nproc, 0, "127.0.0.1", free_port())
    cmd = torchrun_command(layout, config, digest)
    at = cmd.index(WORKER_MODULE)
    cmd[at - 1 : at + 1] = [str(HERE / "gpu_check.py"), "--fsdp-worker"]
    env = {**ctx.env, "TUNEPACK_WORKSPACE": str(ws), "GPU_CHECK_STOP_AT": str(stop_at)}
    with log_path.open("w") as out:
        proc = subprocess.Popen(
            cmd, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
        )
        try:
            return proc.wait(timeout=RUN_TIMEOUT_S)
        except BaseException:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            raise


def fsdp_resume(ctx: Context, size: Size, template: Path | None, skip: str | None = None) -> dict:
    """LoRA under FSDP2: an uninterrupted run, and a run stopped after a checkpoint and resumed;
    their adapters must be equal bit for bit."""
    steps = max(size.steps // 2, 4)
    stop_at = steps // 2 - 1  # SIGTERM after this step: it checkpoints after the next one
    argv = [
        *(a for a in trainer_args(ctx, size, "lora") if not a.startswith("max_steps=")),
        f"max_steps={steps}",
        "checkpoint_every_steps=2",
        "lora_dropout=0.1",  # the resumed run's random state matters too
        *(["deterministic=true"] if ctx.deterministic else []),
    ]
    entry = {
        "name": f"{size.name}/lora/fsdp2-resume",
        "size": size.name,
        "backend": "nccl" if ctx.device == "cuda" else "gloo",
        "world_size": ctx.fsdp_nproc,
        "steps": steps,
        "sharded_path_forced": ctx.fsdp_nproc == 1,
        "deterministic": ctx.deterministic,
    }
    if why := skip or ctx.over_budget(4 * ctx.expected_s(size)):
        return {**entry, "skipped": why}
    log(f"{entry['name']} ...")
    try:
        return {**entry, **_fsdp_runs(ctx, template, argv, stop_at, entry["name"])}
    except Exception as err:  # recorded; the other runs go on
        log(f"{entry['name']}: failed: {err}")
        return {**entry, "skipped": f"failed: {type(err).__name__}: {err}"}


def _fsdp_runs(ctx: Context, template: Path, argv: list[str], stop_at: int, name: str) -> dict:
    import torch
    from safetensors.torch import load_file

    run = ctx.run_dir(name)
    for sub in ("reference", "again", "interrupted"):
        (run / sub).mkdir()
    reference = _workspace(run / "reference", template)
    again = _workspace(run / "again", template)
    interrupted = _workspace(run / "interrupted", template)
    codes = {
        "reference": _torchrun(ctx, reference, argv, run / "reference.log"),
        # The same run once more: on a GPU, kernels that accumulate with atomics can make two
        # uninterrupted runs differ; a resume is exact only if it differs no more than they do.
        "again": _torchrun(ctx, again, argv, run / "again.log"),
        "stopped": _torchrun(ctx, interrupted, argv, run / "stopped.log", stop_at=stop_at),
    }
    checkpoints = sorted(p.name for p in (interrupted / "checkpoints").glob("step-*"))
    stopped_result = (interrupted / "output" / "result.json").exists()
    codes["resumed"] = _torchrun(ctx, interrupted, argv, run / "resumed.log")
    failed = [k for k in ("reference", "again", "resumed") if codes[k] != 0]
    if failed:
        tail = (run / f"{failed[0]}.log").read_text(errors="replace")[-3000:]
        return {"exit_codes": codes, "skipped": f"failed: {failed[0]} run:\n{tail}"}
    result = json.loads((interrupted / "output" / "result.json").read_text())
    counted = [
        line.split(FSDP_MARK)[1].split()
        for line in (run / "reference.log").read_text(errors="replace").splitlines()
        if FSDP_MARK in line
    ]
    sharded, params = map(int, counted[0]) if counted else (0, 0)

    def adapter(ws: Path) -> dict:
        return load_file(ws / "output" / "adapter" / "adapter_model.safetensors")

    def compare(want: dict, got: dict) -> tuple[bool, float]:
        same = want.keys() == got.keys() and all(torch.equal(want[k], got[k]) for k in want)
        diff = max(
            ((want[k].float() - got[k].float()).abs().max().item() for k in want if k in got),
            default=math.nan,
        )
        return bool(same), diff

    want = adapter(reference)
    same, diff = compare(want, adapter(interrupted))
    repeatable, run_to_run = compare(want, adapter(again))
    return {
        "exit_codes": codes,
        "stopped_before_the_end": not stopped_result and codes["stopped"] != 0,
        "checkpoints_at_stop": checkpoints,
        "resumed_from_step": result.get("resumed_from_step"),
        "restarts": result.get("restarts"),
        "tensors": len(want),
        "dtensor_parameters": sharded,
        "parameters": params,
        "fsdp2_sharded": params > 0 and sharded == params,
        "bit_exact": same and not stopped_result and bool(result.get("resumed_from_step")),
        "max_abs_diff": diff,
        "uninterrupted_runs_equal": repeatable,
        "uninterrupted_max_abs_diff": run_to_run,
    }


def _skipped_line(what: str, entry: dict, limit: int | None = None) -> str:
    """The table's line for a figure that was not measured: its reason's first line."""
    return f"{what} ({entry['size']}): skipped: {entry['skipped'].splitlines()[0][:limit]}"


def fsdp_worker(argv: list[str]) -> int:
    """torchrun's worker for ``fsdp_resume``: tunepack's recipe, which shards whenever the run is
    distributed; here it is distributed (a process group, FSDP2) even with one process. With
    ``GPU_CHECK_STOP_AT=N`` it sends itself SIGTERM after step N, the signal a Pod's eviction
    sends: the trainer checkpoints after the step it is in and exits 75."""
    from tunepack.core import lifetime

    lifetime.die_with_shimmed_parent()
    from tunepack.trainers.process import distributed, noise

    noise.quiet()
    from tunepack.trainers import recipe, worker

    distributed.Topology.distributed = property(lambda self: True)
    setup_model = recipe.FineTuneRecipe._setup_model

    def setup_and_count(self, *args, **kwargs):
        model = setup_model(self, *args, **kwargs)
        from torch.distributed.tensor import DTensor

        params = list(model.parameters())
        sharded = sum(isinstance(p, DTensor) for p in params)
        print(f"{FSDP_MARK} {sharded} {len(params)}", flush=True)
        return model

    recipe.FineTuneRecipe._setup_model = setup_and_count
    stop_at = int(os.environ.get("GPU_CHECK_STOP_AT") or 0)
    if stop_at:
        report = recipe.FineTuneRecipe._report

        def report_then_stop(self, *args, **kwargs):
            report(self, *args, **kwargs)
            if self.global_step == stop_at:
                os.kill(os.getpid(), signal.SIGTERM)

        recipe.FineTuneRecipe._report = report_then_stop
    return worker.main(argv)


def plain_loss_child(argv: list[str]) -> None:
    """sbs_probe's process entry, with the trainer's fused loss switched off (plain logits and
    cross-entropy over every position, the path a LoRA-trained output projection takes)."""
    from tunepack.trainers.objectives import vocab_loss

    vocab_loss.supports = lambda model: False
    import sbs_probe

    sbs_probe.main(argv)


# ----------------------------------------------------------------------------- the device
def gpu_info(peak_tflops: float | None) -> dict:
    """The GPU's name and memory, and a bf16 matmul rate for reference, from a child process
    (CUDA stays uninitialized here, so no context of this process takes GPU memory)."""
    code = (
        "import json, time, torch\n"
        "p = torch.cuda.get_device_properties(0)\n"
        "n = 8192\n"
        "a = torch.randn(n, n, device='cuda', dtype=torch.bfloat16)\n"
        "b = torch.randn(n, n, device='cuda', dtype=torch.bfloat16)\n"
        "best = 1e9\n"
        "for _ in range(12):\n"
        "    torch.cuda.synchronize(); t = time.perf_counter(); a @ b; torch.cuda.synchronize()\n"
        "    best = min(best, time.perf_counter() - t)\n"
        "print(json.dumps({'name': p.name, 'memory_gib': p.total_memory / 2**30,\n"
        "    'capability': f'{p.major}.{p.minor}', 'count': torch.cuda.device_count(),\n"
        "    'cuda': torch.version.cuda, 'matmul_bf16_tflops': 2 * n**3 / best / 1e12}))\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    if done.returncode:
        raise SystemExit(f"gpu_check: cannot read the GPU: {done.stderr[-2000:]}")
    info = json.loads(done.stdout.strip().splitlines()[-1])
    table = next((v for k, v in GPU_PEAK_TFLOPS if k in info["name"]), None)
    info["peak_tflops"] = peak_tflops or table
    info["peak_source"] = (
        "--peak-tflops" if peak_tflops else "GPU_PEAK_TFLOPS (dense bf16)" if table else None
    )
    return info


# ----------------------------------------------------------------------------- the report
def render(report: dict) -> str:
    dev = report["device"]
    peak = report["peak"]
    cpu = dev["kind"] == "cpu"
    rate, rate_key = ("tok/CPU-s", "tokens_per_cpu_s") if cpu else ("tok/s", "tokens_per_s")
    unit, scale = ("GFLOP/s", 1e9) if cpu else ("TFLOP/s", 1e12)
    lines = [
        f"gpu_check ({report['mode']}) on {dev['name']}: {report['wall_s']:.0f} s; "
        + (
            f"MFU against {peak['flops_per_s'] / scale:.1f} {unit} ({peak['what']})"
            if peak["flops_per_s"]
            else f"MFU: none ({peak['why']})"
        ),
        "",
        f"{'workload':<36}{rate:>10}{'MFU':>8}{'peak GiB':>10}{'plan GiB':>10}"
        f"{'mem/plan':>9}{'loss':>8}  step",
    ]

    def cell(value, fmt, width):
        return format(value, fmt) if isinstance(value, int | float) else "-".rjust(width)

    for w in report["workloads"]:
        if "skipped" in w:
            lines.append(f"{w['name']:<36}skipped: {w['skipped'].splitlines()[0][:120]}")
            continue
        # The step as planned (the plain-loss run: the trainer's step with the whole logits).
        step = {**w["plan"]["step"], "compiled": w["step_plan"].get("compiled")}
        lines.append(
            f"{w['name']:<36}{cell(w[rate_key], '10.1f', 10)}{cell(w['mfu'], '8.1%', 8)}"
            f"{cell(w['peak_memory_gib'], '10.3f', 10)}{cell(w['plan_gib'], '10.3f', 10)}"
            f"{cell(w['memory_vs_plan'], '9.2f', 9)}{cell(w['loss'], '8.3f', 8)}  "
            f"{step_cell(step)}"
        )
    kind = "the process's peak resident set" if cpu else "the trainer's peak allocated memory"
    lines.append(
        f"{rate}: real tokens per {'CPU ' if cpu else ''}second after the warm-up; MFU: that x "
        f"model FLOPs per token / the peak; peak GiB: {kind}; plan GiB: the memory planner's "
        "estimate of the same job with the same step; step: rN/L recomputes the first N of L "
        "layers, cR computes R rows of logits at a time (whole: the whole logits, unfused), +C "
        "compiled"
    )

    def ratios(r: dict) -> str:
        return (
            f"{rate} {cell(r['tokens_ratio'], '.2f', 1)}x, peak memory "
            f"{cell(r['memory_ratio'], '.2f', 1)}x"
        )

    for pair in report["tunepack_vs_stock"]:
        lines.append(
            f"tunepack / stock, {pair['size']}/{pair['method']}: {ratios(pair)}"
            + (
                f"; vs compiled stock: {ratios(pair['vs_compiled_stock'])}"
                if "vs_compiled_stock" in pair
                else ""
            )
        )
    for c in report["compile"]:
        if "skipped" in c:
            lines.append(_skipped_line("compile", c, limit=120))
            continue
        lines.append(
            f"compile ({c['size']}): compile time {c['compile_s']:.1f} s (replaces "
            f"{c['replaces']['compile_s']}), per-step saving {c['saving']:.1%} (replaces "
            f"{c['replaces']['saving']})" + (f"; {c['note']}" if c.get("note") else "")
        )
    for f in report["fused_loss"]:
        if "skipped" in f:
            lines.append(_skipped_line("fused loss", f))
            continue
        lines.append(
            f"fused loss vs plain cross-entropy ({f['size']}/lora): peak "
            f"{f['fused']['peak_memory_gib']:.3f} vs {f['plain']['peak_memory_gib']:.3f} GiB "
            f"({f['memory_saved_gib']:+.3f} GiB saved), step "
            f"{f['fused'][f['step']]:.3f} vs {f['plain'][f['step']]:.3f} "
            f"{'CPU-s' if f['step'] == 'step_cpu_s' else 's'} "
            f"({cell(f['step_time_ratio'], '.2f', 1)}x)"
        )
    for r in report["fsdp2"]:
        if "skipped" in r:
            lines.append(_skipped_line("FSDP2 resume", r))
            continue
        lines.append(
            f"FSDP2 resume ({r['size']}/lora, {r['backend']}, {r['world_size']} process(es)"
            f"{', sharded path forced' if r['sharded_path_forced'] else ''}"
            f"{', deterministic=true' if r.get('deterministic') else ''}; "
            f"{r['dtensor_parameters']} of {r['parameters']} parameters sharded): stopped with "
            f"{', '.join(r['checkpoints_at_stop']) or 'no checkpoint'}, resumed from step "
            f"{r['resumed_from_step']}; adapter bit-exact: {'yes' if r['bit_exact'] else 'NO'} "
            f"({r['tensors']} tensors, max |diff| {r['max_abs_diff']:.3g}); two uninterrupted "
            f"runs equal: {'yes' if r['uninterrupted_runs_equal'] else 'NO'} (max |diff| "
            f"{r['uninterrupted_max_abs_diff']:.3g})"
        )
    v = report["versions"]
    lines.append(
        "versions: " + ", ".join(f"{k} {v.get(k)}" for k in ("tunepack", "torch", "torchtune"))
    )
    return "\n".join(lines)


def _pairs(workloads: list[dict], rate: str) -> list[dict]:
    """tunepack's default run against the stock recipe's, and against the compiled stock
    recipe's where that ran."""
    found = {(w["size"], w["method"], w["system"]): w for w in workloads if "skipped" not in w}

    def ratios(ours: dict, theirs: dict) -> dict:
        tokens = ours[rate], theirs[rate]
        memory = ours["peak_memory_gib"], theirs["peak_memory_gib"]
        return {
            "tokens_ratio": tokens[0] / tokens[1] if all(tokens) else None,
            "memory_ratio": memory[0] / memory[1] if all(memory) else None,
        }

    pairs = []
    for (size, method, system), ours in found.items():
        stock = found.get((size, method, "torchtune-stock"))
        if system != "tunepack" or stock is None:
            continue
        pair = {"size": size, "method": method, **ratios(ours, stock)}
        if compiled := found.get((size, method, "torchtune-stock-compiled")):
            pair["vs_compiled_stock"] = ratios(ours, compiled)
        pairs.append(pair)
    return pairs


@dataclasses.dataclass(frozen=True)
class Task:
    """One part of a check: a size's model and rows (``prepare``), the runs of one of its
    methods (``method``: ``systems`` in order) or the FSDP2 resume check (``fsdp``)."""

    kind: str
    size: Size
    method: str | None = None
    systems: tuple[str, ...] = ()


def select(sizes: list[Size], methods: set[str], fsdp_only: bool = False) -> list[Task]:
    """Every run of ``sizes`` x ``methods``, the most telling first (each size's LoRA runs, the
    FSDP2 check on the first size after its LoRA runs; then QLoRA, DoRA and full, size after
    size), so that a time budget leaves out the least; ``fsdp_only``: the FSDP2 check alone."""
    if fsdp_only:  # the FSDP2 resume check alone (e.g. again, with --deterministic)
        return _prepared([Task("fsdp", sizes[0])])

    def runs(size: Size, method: str) -> list[Task]:
        if method not in methods or method not in size.methods:
            return []
        systems = tuple(s for s in SYSTEMS if method == "lora" or s not in LORA_ONLY)
        return [Task("method", size, method, systems)]

    tasks = []
    for i, size in enumerate(sizes):
        tasks += runs(size, "lora")
        if i == 0 and tasks:
            tasks.append(Task("fsdp", size))
    for method in METHODS[1:]:
        tasks += [task for size in sizes for task in runs(size, method)]
    return _prepared(tasks)


def loan() -> list[Task]:
    """--loan's runs (LOAN), in its order."""
    return _prepared([Task("method", SIZES[size], m, systems) for size, m, systems in LOAN])


def _prepared(runs: list[Task]) -> list[Task]:
    """``runs`` with each size's ``prepare`` before its first run."""
    tasks, made = [], set()
    for task in runs:
        if task.size.name not in made:
            made.add(task.size.name)
            tasks.append(Task("prepare", task.size))
        tasks.append(task)
    return tasks


def estimated_s(tasks: list[Task]) -> tuple[float, list[str]]:
    """How long ``tasks`` took on one H100 (H100_S), and what of them was never timed there."""
    from tunepack.trainers.process import compiling

    parts: dict[str, float | None] = {}
    for task in tasks:
        name = task.size.name
        if task.kind == "prepare":
            parts[f"{name} start"] = H100_S.get((name, "start"))
        elif task.kind == "fsdp":
            parts[f"{name}/lora/fsdp2-resume"] = H100_S.get((name, "fsdp"))
        for system in task.systems:
            value = H100_S.get((name, task.method, system))
            stock = H100_S.get((name, task.method, "torchtune-stock"))
            if system == "torchtune-stock-compiled" and stock is not None:
                value = stock + compiling.GPU.compile_s
            parts[f"{name}/{task.method}/{system}"] = value
    untimed = [part for part, value in parts.items() if value is None]
    return sum(value for value in parts.values() if value is not None), untimed


def check(ctx: Context, tasks: list[Task]) -> dict:
    """Every workload of ``tasks`` in their order (``select``, ``loan``); then the comparisons
    derived from them."""
    templates: dict[str, concurrent.futures.Future] = {}

    def make(size: Size) -> Path:
        if why := ctx.over_budget(10 + size.entry.parameter_count / 1e8):
            raise RuntimeError(why)
        return prepare(ctx, size)

    def run(task: Task):
        try:
            template, skip = templates[task.size.name].result(), None
        except Exception as err:  # the model could not be made, or the budget said no
            template, skip = None, f"no model: {err}"
        if task.kind == "fsdp":
            return fsdp_resume(ctx, task.size, template, skip)
        return method_workloads(ctx, task.size, task.method, task.systems, template, skip)

    # Runs one at a time on a GPU (each measures the device alone); two at a time on CPU.
    jobs = int(os.environ.get("GPU_CHECK_JOBS") or (2 if ctx.device == "cpu" else 1))
    workloads, fsdp = [], []
    with concurrent.futures.ThreadPoolExecutor(max_workers=jobs) as pool:
        futures = []
        for task in tasks:  # FIFO: a size's model is made before its runs start
            if task.kind == "prepare":
                templates[task.size.name] = pool.submit(make, task.size)
            else:
                futures.append((task.kind, pool.submit(run, task)))
        for kind, future in futures:
            if kind == "fsdp":
                fsdp.append(future.result())
            else:
                workloads.extend(future.result())
    sizes = list(dict.fromkeys(t.size.name for t in tasks))
    order = {f"{s}/{m}": i for i, (s, m) in enumerate(itertools.product(sizes, METHODS))}
    workloads.sort(key=lambda w: (order[f"{w['size']}/{w['method']}"], SYSTEMS.index(w["system"])))

    compiled, fused = [], []
    found = {w["name"]: w for w in workloads}
    for size in (t.size for t in tasks if t.kind == "prepare"):
        eager = found.get(f"{size.name}/lora/tunepack")
        if eager is None:
            continue
        if other := found.get(f"{size.name}/lora/tunepack-compiled"):
            comp = compile_figures(ctx, eager, other, size.warmup)
            compiled.append({"size": size.name, **comp})
        if plain := found.get(f"{size.name}/lora/tunepack-plain-loss"):
            step = "step_cpu_s" if ctx.device == "cpu" else "step_s"
            fused.append({"size": size.name, **fused_loss_figures(eager, plain, step)})
    for w in workloads:
        w.pop("step_elapsed_s", None)
    return {
        "workloads": workloads,
        "tunepack_vs_stock": _pairs(
            workloads, "tokens_per_cpu_s" if ctx.device == "cpu" else "tokens_per_s"
        ),
        "compile": compiled,
        "fused_loss": fused,
        "fsdp2": fsdp,
    }


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--fsdp-worker"]:
        return fsdp_worker(argv[1:])
    if argv[:1] == ["--plain-loss-child"]:
        plain_loss_child(argv[1:])
        return 0
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dry-run", action="store_true", help="CPU, tiny model, a few steps")
    parser.add_argument(
        "--loan",
        action="store_true",
        help="the most telling runs only, within a 15-minute device loan with a rerun's margin "
        f"(--budget-s {LOAN_BUDGET_S:.0f} unless given)",
    )
    parser.add_argument("--sizes", help="comma-separated: 1b, 8b (default: both)")
    parser.add_argument("--methods", help="comma-separated subset (default: all)")
    parser.add_argument("--out", type=Path, help="the JSON report (default under .tunepack/)")
    parser.add_argument(
        "--budget-s",
        type=float,
        help=f"start no run after this many seconds (GPU; default {DEFAULT_BUDGET_S:.0f}, "
        f"with --loan {LOAN_BUDGET_S:.0f})",
    )
    parser.add_argument(
        "--compile-run",
        choices=("yes", "no"),
        help="the compile=true runs (tunepack-compiled, torchtune-stock-compiled) too "
        "(default: yes on a GPU, no with --dry-run)",
    )
    parser.add_argument("--peak-tflops", type=float, help="the GPU's dense bf16 peak")
    parser.add_argument("--fsdp-nproc", type=int, default=1, help="FSDP2 processes (GPUs)")
    parser.add_argument("--keep", type=Path, help="keep the runs' directories here")
    parser.add_argument("--fsdp-only", action="store_true", help="only the FSDP2 resume check")
    parser.add_argument(
        "--deterministic",
        action="store_true",
        help="the FSDP2 check's runs with the trainer's deterministic=true (math attention, "
        "torch's deterministic algorithms: flash attention's backward accumulates with atomics, "
        "so two identical GPU runs differ without it)",
    )
    args = parser.parse_args(argv)
    began = time.monotonic()
    if args.loan:
        given = [f for f, v in (("--dry-run", args.dry_run), ("--sizes", args.sizes),
                 ("--methods", args.methods), ("--fsdp-only", args.fsdp_only)) if v]  # fmt: skip
        if given:
            parser.error(f"--loan chooses its own runs: leave out {', '.join(given)}")
    methods = {m for m in (args.methods or ",".join(METHODS)).split(",") if m}
    if not methods <= set(METHODS):
        parser.error(f"--methods: choose from {', '.join(METHODS)}")
    budget_s = args.budget_s
    if budget_s is None:
        budget_s = LOAN_BUDGET_S if args.loan else DEFAULT_BUDGET_S
    if not args.dry_run:
        names = [s for s in (args.sizes or ",".join(SIZES)).split(",") if s]
        unknown = [s for s in names if s not in SIZES]
        if unknown:
            parser.error(f"--sizes: unknown {unknown}; choose from {', '.join(SIZES)}")
        sizes = [SIZES[s] for s in names]
        tasks = loan() if args.loan else select(sizes, methods, fsdp_only=args.fsdp_only)
        total, untimed = estimated_s(tasks)
        print(
            f"gpu_check: about {total:.0f} s by the H100 runs of 2026-11-26/27"
            + (f" (not timed there: {', '.join(untimed)})" if untimed else "")
            + f"; --budget-s {budget_s:.0f}",
            flush=True,
        )

    import torch

    if args.dry_run:
        tasks, device, dtype = select([DRY], methods, fsdp_only=args.fsdp_only), "cpu", "fp32"
        # The trainers run one thread each; the limit is one thread's.
        peak = sgemm_peak(threads=1)
        info = {
            "name": platform.processor() or platform.machine(),
            "cpus": os.cpu_count(),
            "loadavg": list(os.getloadavg()),
        }
        peak_flops, why = peak["flops_per_s"], None
    else:
        if not torch.cuda.is_available():
            print("gpu_check: no CUDA GPU here; --dry-run runs the check on CPU", file=sys.stderr)
            return 2
        device, dtype = "cuda", "bf16"
        info = gpu_info(args.peak_tflops)
        why = None if info["peak_tflops"] else (
            f"no dense bf16 peak known for {info['name']!r}; pass --peak-tflops"
        )  # fmt: skip
        peak_flops = info["peak_tflops"] * 1e12 if info["peak_tflops"] else None
        peak = {
            "flops_per_s": peak_flops,
            "what": f"{info['name']} dense bf16, {info['peak_source']}",
            "why": why,
            "measured_matmul_bf16_tflops": info["matmul_bf16_tflops"],
        }
    compile_why = None
    if (args.compile_run or ("no" if args.dry_run else "yes")) == "no":
        compile_why = (
            "left out (--compile-run no)"
            if args.compile_run
            else "left out of --dry-run: compiling even the tiny model takes about a minute of "
            "CPU (--compile-run yes includes it)"
        )
    if args.fsdp_nproc > 1 and device == "cpu":
        parser.error("--fsdp-nproc: the dry run uses one process")

    env = {
        **os.environ,
        "TUNEPACK_MODEL": MODEL,
        "TOKENIZERS_PARALLELISM": "false",
        "PYTHONPATH": os.pathsep.join([str(HERE), *filter(None, [os.environ.get("PYTHONPATH")])]),
    }
    if device == "cpu":
        env.update(OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
    for name in ("TUNEPACK_BENCH_PROBE", "TUNEPACK_BENCH_WORKLOAD"):
        env.pop(name, None)
    mode = "dry-run" if args.dry_run else "gpu"
    out = args.out or ROOT / ".tunepack" / "gpu-check" / f"{mode}.json"
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    # The trainer sizes its step to the device's memory less CUDA_RESERVE_GIB; so does the check.
    from tunepack.runtimes.planner import CUDA_RESERVE_GIB

    capacity = None if device == "cpu" else info["memory_gib"] - CUDA_RESERVE_GIB
    root = Path(tempfile.mkdtemp(prefix="tunepack-gpu-check-"))
    try:
        ctx = Context(
            root=root, device=device, dtype=dtype, env=env, started=began,
            budget_s=math.inf if args.dry_run else budget_s, peak_flops=peak_flops,
            peak_why=why, compile=compile_why, fsdp_nproc=args.fsdp_nproc,
            deterministic=args.deterministic, capacity_gib=capacity,
        )  # fmt: skip
        results = check(ctx, tasks)
    finally:
        if args.keep:
            shutil.copytree(root, args.keep, symlinks=True, dirs_exist_ok=True)
        shutil.rmtree(root, ignore_errors=True)
    report = {
        "tool": "benchmarks/gpu_check.py",
        "mode": mode,
        "device": {"kind": device, "dtype": dtype, **info},
        "peak": {**peak, "why": why},
        "sizes": {
            t.size.name: {**dataclasses.asdict(t.size), "title": t.size.title}
            for t in tasks
            if t.kind == "prepare"
        },
        "loan": args.loan,
        "budget_s": None if args.dry_run else budget_s,
        "capacity_gib": capacity,
        **results,
        "versions": versions([]),
        "wall_s": time.monotonic() - began,
    }
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2, default=str) + "\n")
    print(render(report))
    print(f"report: {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
