"""tunepack's trainer side by side with its peers, on one CPU workload, in one run, as ratios.

    python benchmarks/side_by_side.py                # the issue's workload (long at 1 thread)
    python benchmarks/side_by_side.py --steps 6      # the same workload, fewer steps
    python benchmarks/side_by_side.py --size smoke   # seconds per trainer: checks the harness
    python benchmarks/side_by_side.py --profile      # also: where tunepack's step spends its time

Trainers (each a fresh process, one CPU thread, the same model, rows and settings):

- ``tunepack``: tunepack's launcher, default settings (examples of similar length batched
  together, each batch padded to its longest row; the loss fused with the output projection);
- ``tunepack-shuffled``: the same with ``group_by_length=false`` (batches in random order);
- ``tunepack-packed``: the same with ``packed=true`` (best-fit-decreasing packs);
- ``tunepack-compiled``: the default with ``compile=true`` (its compilation falls in the warm-up
  steps, left out of the figures; the whole process's CPU time includes it);
- ``torchtune-stock``: torchtune 0.6.1's stock ``lora_finetune_single_device`` recipe, with a
  config derived from the one tunepack wrote (``trainer_bench.stock_config``);
- ``trl``: HF TRL's ``SFTTrainer`` + PEFT LoRA, no packing (``sbs_trl.py``), in a virtual
  environment of its own that the benchmark creates under ``~/.cache/tunepack/bench/trl-<ver>``
  (TRL and what it pins; torch and the rest come from the project's environment);
- ``trl-packed``: TRL with its best-fit-decreasing, padding-free packing.

Workload (``sbs_workload.ISSUE``): a random-weight Llama-3-architecture model of 58.7M
parameters (8 layers, width 512, a 32,768-id BPE vocabulary learned from a generated corpus),
512 alpaca-style rows of about 131 to 512 tokens, max_seq_len 512, batch 4, LoRA r=8 (alpha 16)
on attention and MLP, AdamW, fp32, cosine schedule without warm-up.

Measurement (``sbs_probe``): every batch a trainer collates is counted (real tokens, computed
positions) and stamped with the process CPU time and the wall clock; the steps after
``--warmup`` give CPU seconds and wall seconds per real token. Rounds are interleaved (each
round runs every trainer, in a rotated order) and the median over rounds is reported. Also: the
fill fraction (real tokens / computed positions), the process tree's CPU time over the whole run
and its peak RSS (wait4), the trainer's last logged loss (each trainer's own, over its own
labelled tokens), versions and the load average. Ratios are throughputs (real tokens per CPU
second) relative to tunepack default in the same run: above 1 is faster. Nothing here asserts a
speed; on a shared machine the figures are indicative.

The physical limit, measured in the same run: the peak of this machine's fp32 matrix product on
``--threads`` threads (one by default: ``sgemm_peak``, the best of several 2048 x 2048 x 2048
products). Each system's MFU (model FLOPs utilization) is its real tokens per CPU second times
the model FLOPs per real token (``model_flops_per_token``) over that peak: how far each trainer
is from what the hardware can do, not only from the others. The FLOP count is the model's, not
what a trainer executes: tunepack's fused loss skips the output projection on positions without a
label and still gets the whole count.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import re
import statistics
import sys
import time
from pathlib import Path

import yaml

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from sbs_harness import (  # noqa: E402
    TRL_VERSION,  # noqa: F401  (the TRL version the benchmarks pin; the tests read it here)
    RunDirs,
    add_run_arguments,
    chosen_systems,
    emit,
    log,
    measure,
    median_row,
    read_records,
    run_rounds,
    scratch,
    system_lines,
    trl_or_skipped,
)
from sbs_harness import versions as harness_versions  # noqa: E402
from sbs_workload import ISSUE, SMOKE, Workload, _encoding, prepare  # noqa: E402
from trainer_bench import stock_config, stock_recipe_file  # noqa: E402

from tunepack.runtimes import methods  # noqa: E402
from tunepack.runtimes.catalog import Shape  # noqa: E402
from tunepack.runtimes.planner import LORA_TARGETS_ALL, lora_parameters  # noqa: E402

SYSTEMS = (
    "tunepack",
    "tunepack-shuffled",
    "tunepack-packed",
    "tunepack-compiled",
    "torchtune-stock",
    "trl",
    "trl-packed",
)
# tunepack's modes: the trainer arguments each adds to the default run's.
TUNEPACK_MODES = {
    "tunepack": (),
    "tunepack-shuffled": ("group_by_length=false",),
    "tunepack-packed": ("packed=true",),
    "tunepack-compiled": ("compile=true",),
}
BASELINE = "tunepack"
SIZES = {"issue": ISSUE, "smoke": SMOKE}
PROBE = HERE / "sbs_probe.py"
# The figures each system's row gives as medians over the rounds.
FIGURES = (
    "tokens_per_cpu_s",
    "tokens_per_wall_s",
    "fill",
    "peak_rss_gib",
    "loss",
    "process_cpu_s",
    "real_tokens",
    "steady_steps",
)
PACKAGES = ("tunepack", "torch", "torchtune", "torchao", "transformers", "peft")


@dataclasses.dataclass
class Settings:
    steps: int
    warmup: int
    batch_size: int
    lr: float
    threads: int
    seed: int = 0
    lora_rank: int = 8
    lora_alpha: float = 16.0
    lora_dropout: float = 0.0
    weight_decay: float = 0.01


# ----------------------------------------------------------------------------- the limit
def base_matmul_parameters(shape: Shape) -> int:
    """Weights the base model multiplies each token by: every layer's q, k, v and output
    projections and its three MLP matrices, and the output projection over the vocabulary (the
    embedding matrix itself when tied). The embedding lookup, norms and biases do no matmul."""
    d, i = shape.embed_dim, shape.intermediate_dim
    q, kv = shape.num_heads * shape.head_dim, shape.num_kv_heads * shape.head_dim
    per_layer = d * q + 2 * d * kv + q * d + 3 * d * i
    return shape.num_layers * per_layer + shape.vocab_size * d


def model_flops_per_token(
    shape: Shape,
    seq_len: float,
    *,
    method: str = "lora",
    lora_rank: int = 0,
    lora_attn_modules: tuple[str, ...] = LORA_TARGETS_ALL,
    lora_mlp: bool = True,
) -> dict[str, float]:
    """Model FLOPs of one real token's training step, by part (one multiply-add = 2 FLOPs).

    With ``N`` = ``base_matmul_parameters(shape)``, ``A`` = the LoRA parameters (the planner's
    ``lora_parameters``; 0 for ``full``), ``L`` layers, ``q`` = heads x head_dim and ``s`` =
    ``seq_len``, the length each token's attention spans (full, not halved for causality, the
    usual convention; callers pass the token-weighted mean row length):

    - forward: ``2 (N + A)`` for the matmuls, ``4 L q s`` for attention (scores and values);
    - backward to the activations: ``2 (N + A)``, and ``8 L q s`` for attention (twice its
      forward: the gradients of queries, keys, values and probabilities);
    - backward to the weights: ``2 N`` for ``full``; for the LoRA methods ``2 A`` only, since the
      frozen weights get no gradient.

    Full fine-tuning is the familiar ``6 N + 12 L q s``. Left out, as usual: norms, RoPE, the
    activation function, softmax, the loss, QLoRA's dequantization, DoRA's per-step weight norms
    (once per step, not per token) and activation checkpointing's recomputation (hardware FLOPs,
    not model FLOPs).
    """
    n = base_matmul_parameters(shape)
    trains_adapters = methods.get(method).adapters
    adapters = 0
    if trains_adapters:
        adapters = lora_parameters(shape, lora_rank, lora_attn_modules, lora_mlp)
    attention = 4 * shape.num_layers * shape.num_heads * shape.head_dim * seq_len
    parts = {
        "forward": 2 * (n + adapters) + attention,
        "backward_activations": 2 * (n + adapters) + 2 * attention,
        "backward_weights": 2 * (adapters if trains_adapters else n),
    }
    parts["total"] = sum(parts.values())
    return parts


def sgemm_peak(threads: int = 1, n: int = 2048, repeats: int = 5) -> dict:
    """This machine's fp32 matrix-product rate on ``threads`` threads: the best of ``repeats``
    ``n x n x n`` products (``2 n^3`` FLOPs each) after one warm-up, in FLOP/s."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        a, b = torch.randn(n, n), torch.randn(n, n)
        out = torch.empty(n, n)
        torch.mm(a, b, out=out)  # warm-up: first-touch pages, the BLAS's own set-up
        best = math.inf
        for _ in range(repeats):
            began = time.perf_counter()
            torch.mm(a, b, out=out)
            best = min(best, time.perf_counter() - began)
    finally:
        torch.set_num_threads(before)
    return {
        "flops_per_s": 2 * n**3 / best,
        "what": f"fp32 matmul {n}x{n}x{n}, {threads} thread(s), best of {repeats}",
        "threads": threads,
        "n": n,
        "repeats": repeats,
        "best_s": best,
    }


def attention_span(lengths: list[int], max_seq_len: int) -> float:
    """The token-weighted mean row length (each row cut to ``max_seq_len``): what one real
    token's attention spans on average, for ``model_flops_per_token``."""
    cut = [min(n, max_seq_len) for n in lengths]
    return sum(n * n for n in cut) / max(sum(cut), 1)


# Where a step's time goes (--profile): each operator's time in one of these parts.
PARTS = (
    "frozen projections",
    "vocabulary projection",
    "LoRA's rank-wide products",
    "attention",
    "elementwise, norms, optimizer and the rest",
)
_MATMULS = {"aten::mm": 0, "aten::addmm": 1, "aten::addmm_": 1}  # where the two factors start


def _op_flops(op: dict) -> float:
    """The FLOPs an operator's shapes say it computed: 2 M K N for a matrix product; for
    attention (causal, as the trainers run it) 2 B H S^2 D forward, twice that backward."""
    shapes = op["shapes"]
    if op["name"] in _MATMULS:
        first = _MATMULS[op["name"]]
        (m, k), (_, n) = shapes[first], shapes[first + 1]
        return 2.0 * m * k * n * op["calls"]
    if op["name"].startswith("aten::_scaled_dot_product") and shapes and len(shapes[0]) == 4:
        b, h, q, d = shapes[0]
        forward = 2.0 * b * h * q * shapes[1][2] * d  # QK^T and PV: 4 b h q k d, causal half
        return forward * (2 if "backward" in op["name"] else 1) * op["calls"]
    return 0.0


def _part(op: dict, vocab: int, rank: int) -> str:
    if op["name"].startswith("aten::_scaled_dot_product"):
        return PARTS[3]
    if op["name"] in _MATMULS:
        first = _MATMULS[op["name"]]
        dims = {d for shape in op["shapes"][first : first + 2] for d in shape}
        if vocab in dims:
            return PARTS[1]
        return PARTS[2] if rank in dims else PARTS[0]
    return PARTS[4]


def breakdown(ops: list[dict], vocab: int, rank: int, peak_flops: float) -> list[dict]:
    """The profiled steps' operator time by part: seconds, share, GFLOP and rate against the
    peak. Only operators' own (self) time is counted, so nothing is counted twice."""
    parts = {name: {"part": name, "s": 0.0, "flops": 0.0} for name in PARTS}
    for op in ops:
        part = parts[_part(op, vocab, rank)]
        part["s"] += op["self_cpu_us"] / 1e6
        part["flops"] += _op_flops(op)
    total = sum(p["s"] for p in parts.values()) or 1.0
    for p in parts.values():
        p["share"] = p["s"] / total
        rate = p["flops"] / p["s"] if p["s"] and p["flops"] else None
        p["gflop_per_s"] = rate / 1e9 if rate else None
        p["of_peak"] = rate / peak_flops if rate else None
    return list(parts.values())


# ----------------------------------------------------------------------------- runs
def steady(records: list[dict], warmup: int, prefetch: int) -> dict:
    """CPU and wall seconds of the steps after ``warmup``, and their real tokens.

    The stamp before step k's compute is record k + prefetch (a loader that collates one batch
    ahead, as accelerate's does, has prefetch 1); step k's batch is record k.
    """
    last = len(records) - 2 - prefetch  # the last step whose end is stamped
    first = min(warmup, max(last, 0))
    if last < first:
        return {"steps": 0, "cpu_s": 0.0, "wall_s": 0.0, "real": 0}
    start, end = records[first + prefetch], records[last + 1 + prefetch]
    return {
        "steps": last - first + 1,
        "cpu_s": end["cpu_s"] - start["cpu_s"],
        "wall_s": end["wall_s"] - start["wall_s"],
        "real": sum(r["real"] for r in records[first : last + 1]),
    }


def summarize(
    name: str, records: list[dict], settings: Settings, prefetch: int, usage: dict, loss
) -> dict:
    window = steady(records, settings.warmup, prefetch)
    note = None
    if len(records) != settings.steps + prefetch:
        # An epoch ended inside the run: the loader's stamps no longer bracket single steps.
        window = {"steps": 0, "cpu_s": 0.0, "wall_s": 0.0, "real": 0}
        note = f"{len(records)} batches for {settings.steps} steps: use more rows or fewer steps"
    real = sum(r["real"] for r in records)
    positions = sum(r["positions"] for r in records)
    return {
        "system": name,
        "batches": len(records),
        "steady_steps": window["steps"],
        "real_tokens": real,
        "positions": positions,
        "fill": real / positions if positions else None,
        "tokens_per_cpu_s": window["real"] / window["cpu_s"] if window["cpu_s"] > 0 else None,
        "tokens_per_wall_s": window["real"] / window["wall_s"] if window["wall_s"] > 0 else None,
        "process_cpu_s": usage["cpu_s"],
        "process_wall_s": usage["wall_s"],
        "peak_rss_gib": usage["rss_gib"],
        "loss": loss,
        "note": note,
    }


class Bench(RunDirs):
    def __init__(self, root: Path, workload: Workload, settings: Settings, trl: Path | None):
        self.root, self.workload, self.settings, self.trl = root, workload, settings, trl
        self.entry, self.model_dir, self.data = prepare(workload, log=self.log)
        self.env = {
            **os.environ,
            "OMP_NUM_THREADS": str(settings.threads),
            "MKL_NUM_THREADS": str(settings.threads),
            "TOKENIZERS_PARALLELISM": "false",
            "TUNEPACK_MODEL": self.entry.name,
            "TUNEPACK_BENCH_WORKLOAD": json.dumps(dataclasses.asdict(workload)),
            "PYTHONPATH": os.pathsep.join(
                [str(HERE), *filter(None, [os.environ.get("PYTHONPATH")])]
            ),
        }
        self.env.pop("TUNEPACK_BENCH_PROBE", None)
        self.template = root / "ws-template"
        self.runs = 0
        self.tunepack_cfg: dict | None = None
        self._initialize()

    log = staticmethod(log)

    def _initialize(self) -> None:
        for module, uri in (
            ("tunepack.initializers.dataset", f"file://{self.data}"),
            ("tunepack.initializers.model", f"file://{self.model_dir}"),
        ):
            env = {**self.env, "TUNEPACK_WORKSPACE": str(self.template), "STORAGE_URI": uri}
            log = self.root / f"{module.rsplit('.', 1)[1]}-initializer.log"
            measure([sys.executable, PROBE, "module", module], env, log)

    def run(self, name: str) -> dict:
        if name in TUNEPACK_MODES:
            return self._tunepack(name, TUNEPACK_MODES[name])
        return getattr(self, "_" + name.replace("-", "_"))(name)

    def _tunepack(
        self, name: str, extra: tuple[str, ...] = (), profile: Path | None = None
    ) -> dict:
        s, run = self.settings, self._run_dir(name)
        ws = run / "ws"
        ws.mkdir()
        for part in ("dataset", "model"):
            (ws / part).symlink_to(self.template / part)
        args = [
            "method=lora",
            f"max_steps={s.steps}",
            f"batch_size={s.batch_size}",
            f"max_seq_len={self.workload.max_seq_len}",
            f"lr={s.lr}",
            f"weight_decay={s.weight_decay}",
            f"lora_rank={s.lora_rank}",
            f"lora_alpha={s.lora_alpha}",
            f"lora_dropout={s.lora_dropout}",
            f"seed={s.seed}",
            "device=cpu",
            "dtype=fp32",
            "warmup_steps=0",
            "activation_checkpointing=false",
            "checkpoint_every_minutes=0",
            *extra,
        ]
        probe = run / "probe.jsonl"
        env = {**self.env, "TUNEPACK_WORKSPACE": str(ws), "TUNEPACK_BENCH_PROBE": str(probe)}
        if profile is not None:
            env["TUNEPACK_BENCH_PROFILE"] = str(profile)
            env["TUNEPACK_BENCH_PROFILE_AFTER"] = str(s.warmup)
        cmd = [sys.executable, PROBE, "module", "tunepack.trainers.launch", *args]
        usage = measure(cmd, env, run / "train.log")
        metrics = [
            json.loads(line)
            for line in (ws / "output" / "metrics.jsonl").read_text().splitlines()
            if line.strip()
        ]
        steps = [m for m in metrics if m.get("event", "step") == "step"]
        if not extra and self.tunepack_cfg is None:
            self.tunepack_cfg = yaml.safe_load((ws / "output" / "config.yaml").read_text())
        records = read_records(probe)
        result = summarize(name, records, s, 0, usage, steps[-1]["loss"])
        # The trainer's own fill metric per step, beside the probe's count of the same batches.
        result["metrics_fill"] = [m.get("fill") for m in steps]
        result["probe_fill"] = [r["real"] / r["positions"] for r in records]
        return result

    def profile(self) -> list[dict]:
        """One more run of tunepack's default, its steady steps under torch's profiler: the
        time of each operator and input shapes (sbs_probe)."""
        path = self.root / "profile.jsonl"
        self._tunepack("tunepack-profiled", profile=path)
        return read_records(path)

    def _torchtune_stock(self, name: str) -> dict:
        if self.tunepack_cfg is None:  # its config is derived from tunepack's
            self._tunepack("tunepack-config")
        s, run = self.settings, self._run_dir(name)
        cfg = stock_config(self.tunepack_cfg, run / "out", s.steps, "cpu")
        cfg["collate_fn"] = "sbs_probe.counting_collate_sft"
        (run / "out").mkdir()
        (run / "config.yaml").write_text(yaml.safe_dump(cfg))
        probe = run / "probe.jsonl"
        env = {**self.env, "TUNEPACK_BENCH_PROBE": str(probe)}
        cmd = [
            sys.executable,
            PROBE,
            "script",
            stock_recipe_file(),
            "--config",
            run / "config.yaml",
        ]
        usage = measure(cmd, env, run / "train.log")
        text = "".join(p.read_text() for p in (run / "out" / "logs").glob("*.txt"))
        losses = re.findall(r"\bloss:(\S+)", text)
        loss = float(losses[-1]) if losses else None
        return summarize(name, read_records(probe), s, 0, usage, loss)

    def _trl(self, name: str, packing: bool = False) -> dict:
        s, run = self.settings, self._run_dir(name)
        settings = {
            **dataclasses.asdict(s),
            "model_dir": str(self.model_dir),
            "data": str(self.data),
            "out": str(run / "out"),
            "max_seq_len": self.workload.max_seq_len,
            "packing": packing,
        }
        (run / "settings.json").write_text(json.dumps(settings))
        probe = run / "probe.jsonl"
        env = {**self.env, "TUNEPACK_BENCH_PROBE": str(probe)}
        # TRL's venv, not the project's: its own packages first.
        env.pop("VIRTUAL_ENV", None)
        cmd = [self.trl, HERE / "sbs_trl.py", run / "settings.json"]
        usage = measure(cmd, env, run / "train.log")
        out = json.loads((run / "out" / "result.json").read_text())
        # accelerate's loader collates the next batch before it hands out the current one.
        result = summarize(name, read_records(probe), s, 1, usage, out["loss"])
        result["versions"] = out["versions"]
        result["paths"] = out["paths"]
        return result

    def _trl_packed(self, name: str) -> dict:
        return self._trl(name, packing=True)


# ----------------------------------------------------------------------------- report
def combine(rounds: list[dict[str, dict]], systems: list[str]) -> dict[str, dict]:
    """Per system: the median over rounds of every figure, and the ratio to the baseline."""
    table = {}
    for name in systems:
        runs = [r[name] for r in rounds if name in r]
        table[name] = median_row(name, runs, FIGURES, per_round="tokens_per_cpu_s")
    base = table.get(BASELINE, {})
    for row in table.values():
        for key, ratio in (("tokens_per_cpu_s", "ratio_cpu"), ("tokens_per_wall_s", "ratio_wall")):
            b, v = base.get(key), row.get(key)
            row[ratio] = v / b if b and v else None
    return table


def versions(trl_runs: list[dict]) -> dict:
    return harness_versions(trl_runs, PACKAGES)


def render(report: dict) -> str:
    w = report["workload"]
    lines = [
        f"workload: {report['model']} ({report['parameters'] / 1e6:.1f}M parameters, "
        f"{w['num_layers']} layers, width {w['embed_dim']}, vocab {w['vocab_size']}), "
        f"{w['rows']} rows of {report['row_tokens']['min']}-{report['row_tokens']['max']} text "
        f"tokens, max_seq_len {w['max_seq_len']}, batch {report['settings']['batch_size']}, "
        f"LoRA r={report['settings']['lora_rank']}, {report['settings']['threads']} thread(s)",
        f"{report['settings']['steps']} steps per run, median after {report['settings']['warmup']}"
        f"; {report['rounds']} interleaved round(s); load average "
        f"{' '.join(f'{x:.2f}' for x in report['loadavg_before'])} before, "
        f"{' '.join(f'{x:.2f}' for x in report['loadavg_after'])} after",
        "",
        f"{'system':<18}{'tok/CPU-s':>11}{'tok/wall-s':>12}{'ratio':>7}{'MFU':>7}{'fill':>7}"
        f"{'RSS GiB':>9}{'loss':>8}",
    ]
    lines += system_lines(
        report,
        18,
        lambda f: (
            f"{f('tokens_per_cpu_s', '11.1f')}{f('tokens_per_wall_s', '12.1f')}"
            f"{f('ratio_cpu', '7.2f')}{f('mfu', '7.1%')}{f('fill', '7.2f')}"
            f"{f('peak_rss_gib', '9.3f')}{f('loss', '8.3f')}"
        ),
    )
    lines.append("ratio: real tokens per CPU second relative to tunepack default (above 1: faster)")
    peak, flops = report["peak"], report["flops_per_token"]
    lines.append(
        f"MFU: real tokens per CPU second x {flops['total'] / 1e6:.1f} MFLOP per real token "
        f"(forward + backward to the activations + LoRA weight gradients, attention over "
        f"{flops['seq_len']:.0f} tokens) / this machine's {peak['flops_per_s'] / 1e9:.1f} GFLOP/s "
        f"peak ({peak['what']}, measured in this run)"
    )
    if report.get("profile"):
        lines += ["", "where tunepack's steady steps spend their time (one more run, profiled):"]
        lines.append(f"{'part':<44}{'s':>7}{'share':>7}{'GFLOP/s':>9}{'of peak':>9}")
        for p in report["profile"]:
            rate = f"{p['gflop_per_s']:9.1f}{p['of_peak']:9.0%}" if p["gflop_per_s"] else ""
            lines.append(f"{p['part']:<44}{p['s']:7.2f}{p['share']:7.0%}{rate}")
    v = report["versions"]
    lines.append(
        "versions: "
        + ", ".join(
            f"{k} {v[k]}" for k in ("tunepack", "torch", "torchtune", "transformers", "peft")
        )
        + (
            ", TRL env: " + ", ".join(f"{k} {x}" for k, x in v["trl_env"].items())
            if "trl_env" in v
            else ""
        )
    )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", choices=tuple(SIZES), default="issue")
    parser.add_argument("--steps", type=int, help="optimizer steps per run (issue 12, smoke 4)")
    parser.add_argument("--warmup", type=int, help="steps left out of the figures (2; smoke 1)")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--rows", type=int, help="dataset rows (default: the size's)")
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument(
        "--profile",
        action="store_true",
        help="also run tunepack's default once under torch's profiler and show where its "
        "steady steps spend their time, part by part, against the peak",
    )
    add_run_arguments(parser, SYSTEMS)
    args = parser.parse_args(argv)

    systems = chosen_systems(parser, args, SYSTEMS)
    workload = SIZES[args.size]
    if args.rows:
        workload = dataclasses.replace(workload, rows=args.rows)
    smoke = args.size == "smoke"
    settings = Settings(
        steps=args.steps or (4 if smoke else 12),
        warmup=args.warmup if args.warmup is not None else (1 if smoke else 2),
        batch_size=args.batch_size,
        lr=args.lr,
        threads=args.threads,
    )

    trl, skipped, systems = trl_or_skipped(systems, args, log)
    load_before = os.getloadavg()
    # The limit, before and after the trainers: the better of the two is the machine's.
    peaks = [sgemm_peak(settings.threads)]
    with scratch("tunepack-sbs-", args.keep) as root:
        bench = Bench(root, workload, settings, trl)
        rounds = run_rounds(bench, systems, args.rounds, log)
        ops = bench.profile() if args.profile else []
        enc = _encoding(bench.model_dir)
        row_tokens = [
            sum(len(enc.encode(v)) for v in r.values())
            for r in map(json.loads, bench.data.read_text().splitlines())
        ]
        peaks.append(sgemm_peak(settings.threads))
        peak = max(peaks, key=lambda p: p["flops_per_s"])
        span = attention_span(row_tokens, workload.max_seq_len)
        flops = model_flops_per_token(
            bench.entry.shape, span, method="lora", lora_rank=settings.lora_rank
        )
        table = combine(rounds, systems)
        for row in table.values():
            tps = row.get("tokens_per_cpu_s")
            row["mfu"] = tps * flops["total"] / peak["flops_per_s"] if tps else None
        report = {
            "model": bench.entry.name,
            "parameters": bench.entry.parameter_count,
            "workload": dataclasses.asdict(workload),
            "row_tokens": {
                "min": min(row_tokens),
                "max": max(row_tokens),
                "mean": statistics.fmean(row_tokens),
            },
            "settings": dataclasses.asdict(settings),
            "rounds": args.rounds,
            "systems": table,
            "peak": {**peak, "measured": [p["flops_per_s"] for p in peaks]},
            "flops_per_token": {**flops, "seq_len": span},
            "runs": rounds,
            "skipped": skipped,
            "versions": versions([r[s] for r in rounds for s in r if s.startswith("trl")]),
            "loadavg_before": list(load_before),
            "loadavg_after": list(os.getloadavg()),
            "cpu_count": os.cpu_count(),
            "profile": breakdown(ops, workload.vocab_size, settings.lora_rank, peak["flops_per_s"])
            if ops
            else None,
        }
    emit(render(report), report, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
