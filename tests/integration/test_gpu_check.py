"""benchmarks/gpu_check.py: its --dry-run (what make test can run) writes a complete report, and
the figures it derives (model FLOPs per token, compile=auto's constants) are computed right.
No speed is asserted."""

from __future__ import annotations

import argparse
import copy
import json
import math
import subprocess
import sys

import pytest

from tests import REPO
from tunepack.runtimes import planner
from tunepack.runtimes.catalog import Shape
from tunepack.trainers.process import compiling

ROOT = REPO
sys.path.insert(0, str(ROOT / "benchmarks"))

import gpu_check  # noqa: E402
import side_by_side  # noqa: E402

# One layer, width 4, 2 heads of 2 (1 key/value head), MLP 8, vocabulary 10.
TOY = Shape(10, num_layers=1, num_heads=2, num_kv_heads=1, embed_dim=4, intermediate_dim=8,
            max_seq_len=16)  # fmt: skip


def test_model_flops_per_token_by_hand():
    # Matmul weights: q 4x4 + k 4x2 + v 4x2 + o 4x4 + MLP 3 x 4x8 = 144, output 10x4 = 40.
    assert side_by_side.base_matmul_parameters(TOY) == 184
    # Attention over 6 tokens: 4 x 1 layer x (2 heads x 2) x 6 = 96 forward, twice that back.
    full = side_by_side.model_flops_per_token(TOY, 6, method="full")
    assert full == {
        "forward": 2 * 184 + 96,
        "backward_activations": 2 * 184 + 192,
        "backward_weights": 2 * 184,
        "total": 1392,
    }
    assert full["total"] == 6 * 184 + 12 * 1 * 4 * 6  # the familiar 6N + 12 L d s
    # LoRA rank 1 on q, k, v, o and the MLP: 8 + 6 + 6 + 8 + 3 x 12 = 64 adapter weights; the
    # frozen weights get no gradient.
    lora = side_by_side.model_flops_per_token(TOY, 6, method="lora", lora_rank=1)
    assert lora == {
        "forward": 2 * (184 + 64) + 96,
        "backward_activations": 2 * (184 + 64) + 192,
        "backward_weights": 2 * 64,
        "total": 1408,
    }
    # Tied embeddings: the output projection is still a matmul, the lookup is none.
    tied = Shape(**{**TOY.__dict__, "tied_embeddings": True})
    assert side_by_side.model_flops_per_token(tied, 6, method="full")["total"] == 1392
    # Rows of 2 and 4 tokens cut to 3: token-weighted mean (2*2 + 3*3) / (2 + 3).
    assert side_by_side.attention_span([2, 4], 3) == pytest.approx(2.6)


def test_compile_figures_measure_what_compile_auto_assumes():
    gpu = argparse.Namespace(device="cuda")
    eager = {"step_elapsed_s": [1.0, 1.5, 2.0, 2.5]}  # 1 s first step, then 0.5 s steps
    compiled = {"step_elapsed_s": [31.0, 31.4, 31.8, 32.2]}  # compiles in step 1, 0.4 s steps
    got = gpu_check.compile_figures(gpu, eager, compiled, warmup=1)
    # (31 - 0.4) - (1 - 0.5): the first step's time beyond a steady step, less eager's.
    assert got["compile_s"] == pytest.approx(30.1)
    assert got["saving"] == pytest.approx(0.2)
    cost = compiling.GPU  # the constants a GPU run's figures would replace
    assert got["constants"] == {"compile_s": cost.compile_s, "saving": cost.saving}
    assert (
        got["replaces"]["compile_s"]
        == f"trainers/process/compiling.py GPU.compile_s = {cost.compile_s}"
    )
    assert got["replaces"]["saving"] == f"trainers/process/compiling.py GPU.saving = {cost.saving}"
    skipped = gpu_check.compile_figures(gpu, eager, {"skipped": "left out"}, warmup=1)
    assert skipped["skipped"] == "left out" and "compile_s" in skipped["replaces"]


def test_gpu_peaks_match_device_names():
    def peak(name):
        return next((v for k, v in gpu_check.GPU_PEAK_TFLOPS if k in name), None)

    assert peak("NVIDIA H100 80GB HBM3") == 989.0  # SXM
    assert peak("NVIDIA H100 PCIe") == 756.0
    assert peak("NVIDIA H200") == 989.0
    assert peak("NVIDIA GH200 480GB") == 989.0
    assert peak("NVIDIA GeForce RTX 4090") is None  # unknown: MFU null, with the reason


# ----------------------------------------------------------------------------- the report
def _positive(value) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and value > 0


def problems(report: dict) -> list[str]:
    """What a dry-run report lacks; empty when it is complete."""
    found = []
    expected = {
        f"dry/{method}/{system}"
        for method in gpu_check.METHODS
        for system in gpu_check.SYSTEMS
        if method == "lora" or system not in gpu_check.LORA_ONLY
    }
    names = [w.get("name") for w in report.get("workloads", [])]
    if set(names) != expected or len(names) != len(expected):
        found.append(f"workloads {sorted(map(str, names))} are not {sorted(expected)}")
    for w in report.get("workloads", []):
        name = w.get("name")
        if "skipped" in w:
            if not (isinstance(w["skipped"], str) and w["skipped"].strip()):
                found.append(f"{name}: skipped without a reason")
            elif w.get("system") not in gpu_check.COMPILED:  # the runs a dry run leaves out
                found.append(f"{name}: did not run: {w['skipped'][:300]}")
            elif not w["skipped"].startswith("left out of --dry-run: compiling"):
                found.append(f"{name}: skipped for another reason: {w['skipped'][:300]}")
            continue
        # The step each run took: tunepack's from its result.json, the stock config's; the plan
        # computed with exactly that step (the whole logits where the run holds them).
        step = w.get("step_plan") or {}
        if set(step) != {"layers", "recompute_layers", "loss_chunk_rows", "compiled"}:
            found.append(f"{name}: step_plan {step!r}")
        else:
            want = {k: v for k, v in step.items() if k != "compiled"}
            if w.get("system") in gpu_check.WHOLE_LOGITS:
                want["loss_chunk_rows"] = None
            if w.get("plan", {}).get("step") != want:
                found.append(f"{name}: planned with {w.get('plan', {}).get('step')}, not {want}")
        for key in ("tokens_per_s", "tokens_per_cpu_s", "peak_memory_gib", "plan_gib"):
            if not _positive(w.get(key)):
                found.append(f"{name}: {key} is {w.get(key)!r}")
        if not _positive(w.get("memory_vs_plan")):
            found.append(f"{name}: no memory-vs-plan ratio")
        reason = w.get("mfu_null_reason")
        if not (_positive(w.get("mfu")) or (w.get("mfu") is None and reason)):
            found.append(f"{name}: MFU {w.get('mfu')!r} without a reason")
        if not (isinstance(w.get("loss"), float) and math.isfinite(w["loss"])):
            found.append(f"{name}: loss {w.get('loss')!r}")
        if not _positive(w.get("flops_per_token", {}).get("total")):
            found.append(f"{name}: no FLOPs per token")
    fsdp = report.get("fsdp2", [])
    if len(fsdp) != 1:
        found.append(f"{len(fsdp)} FSDP2 entries")
    for r in fsdp:
        if r.get("bit_exact") is not True:
            found.append(f"FSDP2 resume not bit-exact: {r}")
        if r.get("uninterrupted_runs_equal") is not True:  # gloo on CPU: no atomics
            found.append(f"two uninterrupted FSDP2 runs differ: {r}")
        if r.get("fsdp2_sharded") is not True or not _positive(r.get("resumed_from_step")):
            found.append(f"FSDP2 run not sharded or not resumed: {r}")
    for c in report.get("compile", [None]):
        if not c or not (c.get("skipped") or _positive(c.get("compile_s"))):
            found.append(f"compile entry {c!r} has neither figures nor a reason")
    for f in report.get("fused_loss", [None]):
        if not f or not (_positive(f.get("fused", {}).get(f.get("step"))) and "plain" in f):
            found.append(f"fused-loss entry {f!r} lacks its figures")
    if len(report.get("tunepack_vs_stock", [])) != len(gpu_check.METHODS):
        found.append("tunepack vs stock: not every method compared")
    if not _positive(report.get("peak", {}).get("flops_per_s")):
        found.append("no measured peak")
    for key in ("torch", "torchtune", "tunepack"):
        if not report.get("versions", {}).get(key):
            found.append(f"no {key} version")
    if report.get("device", {}).get("kind") != "cpu" or report.get("mode") != "dry-run":
        found.append("not a dry-run report")
    return found


@pytest.mark.slow
def test_dry_run_writes_a_complete_report(tmp_path):
    """The dry run (about a minute of CPU: fourteen trainer processes on a tiny model) leaves a
    report with figures for every method and system, a bit-exact FSDP2 resume, and a table."""
    out = tmp_path / "report.json"
    done = subprocess.run(
        [sys.executable, "benchmarks/gpu_check.py", "--dry-run", "--out", str(out)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(out.read_text())
    assert problems(report) == [], done.stderr[-3000:]
    assert "workload" in done.stdout and f"report: {out}" in done.stdout
    for w in report["workloads"]:
        assert w["name"] in done.stdout
    assert "adapter bit-exact: yes" in done.stdout

    # The step per run, in the report and the table's last column: on CPU tunepack recomputes no
    # layer and computes 8192 rows of logits at once (its CPU chunk at a vocabulary of 1024);
    # the stock recipe keeps torchtune's Llama 3.2 1B configs' setting (no activation
    # checkpointing) and the whole logits, as does the plain-loss run.
    runs = {w["name"]: w for w in report["workloads"]}
    lines = {line.split()[0]: line for line in done.stdout.splitlines() if line.startswith("dry/")}
    for method in gpu_check.METHODS:
        ours = runs[f"dry/{method}/tunepack"]
        assert ours["step_plan"] == {
            "layers": 2, "recompute_layers": 0, "loss_chunk_rows": 8192, "compiled": False,
        }  # fmt: skip
        assert lines[f"dry/{method}/tunepack"].endswith("  r0/2 c8192")
        assert lines[f"dry/{method}/torchtune-stock"].endswith("  r0/2 whole")
        assert runs[f"dry/{method}/torchtune-stock"]["stock_config"].startswith("llama3_2/1B_")
        assert lines[f"dry/{method}/torchtune-stock-compiled"].endswith(
            "skipped: left out of --dry-run: compiling even the tiny model takes about a minute "
            "of CPU (--compile-run yes includes it)"
        )
    assert lines["dry/lora/tunepack-plain-loss"].endswith("  r0/2 whole")
    for w in runs.values():  # each plan is the planner's for exactly that step
        if "skipped" not in w:
            step = planner.Step.from_record(w["plan"]["step"])
            whole = w["system"] in gpu_check.WHOLE_LOGITS
            size = gpu_check.DRY
            want = planner.estimate(
                size.entry, w["method"], size.seq_len, size.batch_size, dtype="fp32",
                lora_rank=size.lora_rank, fused_loss=not whole, step=step,
            )  # fmt: skip
            assert w["plan_gib"] == pytest.approx(want.peak_gib), w["name"]
    assert not any("vs_compiled_stock" in pair for pair in report["tunepack_vs_stock"])

    # Where the compiled stock recipe ran, the ratio line adds tunepack against it.
    ran = copy.deepcopy(report)
    ours = next(w for w in ran["workloads"] if w["name"] == "dry/lora/tunepack")
    stock = next(w for w in ran["workloads"] if w["name"] == "dry/lora/torchtune-stock")
    compiled = next(w for w in ran["workloads"] if w["name"] == "dry/lora/torchtune-stock-compiled")
    compiled.update({k: v for k, v in stock.items() if k not in ("name", "system")})
    compiled.pop("skipped")
    compiled["tokens_per_cpu_s"] = 2 * ours["tokens_per_cpu_s"]
    compiled["peak_memory_gib"] = ours["peak_memory_gib"]
    ran["tunepack_vs_stock"] = gpu_check._pairs(ran["workloads"], "tokens_per_cpu_s")
    pair = next(p for p in ran["tunepack_vs_stock"] if p["method"] == "lora")
    assert pair["vs_compiled_stock"] == {"tokens_ratio": 0.5, "memory_ratio": 1.0}
    assert "; vs compiled stock: tok/CPU-s 0.50x, peak memory 1.00x" in gpu_check.render(ran)

    # The checks above fail a report that lacks what they look for.
    broken = copy.deepcopy(report)
    ran = next(w for w in broken["workloads"] if "skipped" not in w)
    del ran["tokens_per_s"]
    ran["mfu"] = None
    broken["fsdp2"][0]["bit_exact"] = False
    broken["workloads"].pop()
    ours = next(w for w in broken["workloads"] if w["name"] == "dry/qlora/tunepack")
    del ours["step_plan"]
    stock = next(w for w in broken["workloads"] if w["name"] == "dry/qlora/torchtune-stock")
    stock["plan"]["step"]["recompute_layers"] = 2
    compiled = next(w for w in broken["workloads"] if w["system"] == "torchtune-stock-compiled")
    compiled["skipped"] = "failed: OOM"
    found = problems(broken)
    assert any("tokens_per_s" in p for p in found)
    assert any("MFU None without a reason" in p for p in found)
    assert any("not bit-exact" in p for p in found)
    assert any(p.startswith("workloads ") for p in found)
    assert "dry/qlora/tunepack: step_plan {}" in found
    assert any(p.startswith("dry/qlora/torchtune-stock: planned with ") for p in found)
    assert any(p.endswith("skipped for another reason: failed: OOM") for p in found)


# ----------------------------------------------------------------------------- what runs
def _tasks(tasks: list) -> list[tuple]:
    return [(t.kind, t.size.name, t.method, t.systems) for t in tasks]


def test_loan_picks_the_most_telling_runs_within_its_budget():
    """--loan: 1B LoRA (tunepack, stock, compiled stock), 1B full and 8B LoRA (tunepack,
    stock), each size's model made before its runs; no FSDP2 check, no plain-loss run; by the
    H100 runs' times it ends within its budget, which twice leaves room in 15 minutes."""
    both = ("tunepack", "torchtune-stock")
    assert _tasks(gpu_check.loan()) == [
        ("prepare", "1b", None, ()),
        ("method", "1b", "lora", (*both, "torchtune-stock-compiled")),
        ("method", "1b", "full", both),
        ("prepare", "8b", None, ()),
        ("method", "8b", "lora", both),
    ]
    total, untimed = gpu_check.estimated_s(gpu_check.loan())
    # 21 + 29 + 25 + (25 + compile 20) + 26 + 25 + 65 + 33 + 29
    assert (total, untimed) == (298.0, [])
    assert total < gpu_check.LOAN_BUDGET_S and 2 * gpu_check.LOAN_BUDGET_S < 15 * 60


def test_every_method_at_both_sizes_lora_first():
    tasks = gpu_check.select(list(gpu_check.SIZES.values()), set(gpu_check.METHODS))
    lora = gpu_check.SYSTEMS
    others = ("tunepack", "torchtune-stock", "torchtune-stock-compiled")
    assert _tasks(tasks) == [
        ("prepare", "1b", None, ()),
        ("method", "1b", "lora", lora),
        ("fsdp", "1b", None, ()),
        ("prepare", "8b", None, ()),
        ("method", "8b", "lora", lora),
        *(("method", size, m, others) for m in ("qlora", "dora", "full") for size in ("1b", "8b")),
    ]
    # 8B DoRA and full and the compiled runs at 8B have no time measured yet.
    assert gpu_check.estimated_s(tasks)[1] == [
        "8b/lora/tunepack-compiled",
        *(f"8b/{m}/{s}" for m in ("dora", "full") for s in others),
    ]


def test_loan_prints_its_estimate_and_keeps_its_runs(monkeypatch, capsys):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert gpu_check.main(["--loan"]) == 2  # no GPU here: after the estimate, nothing runs
    out, err = capsys.readouterr()
    assert out == "gpu_check: about 298 s by the H100 runs of 2026-11-26/27; --budget-s 330\n"
    assert err == "gpu_check: no CUDA GPU here; --dry-run runs the check on CPU\n"
    assert gpu_check.main(["--loan", "--budget-s", "300"]) == 2
    assert capsys.readouterr().out.endswith("; --budget-s 300\n")
    with pytest.raises(SystemExit) as stop:
        gpu_check.main(["--loan", "--sizes", "1b", "--fsdp-only"])
    assert stop.value.code == 2
    assert capsys.readouterr().err.endswith(
        ": error: --loan chooses its own runs: leave out --sizes, --fsdp-only\n"
    )


def test_a_run_the_device_cannot_hold_is_skipped_with_its_plan(tmp_path):
    """8B full fine-tuning at batch 2 plans about 75 GiB: on a 40 GB card (37.4 GiB usable)
    every system of it is recorded as skipped with the plan's reason; nothing runs."""
    size = gpu_check.SIZES["8b"]
    gpu_check.write_config(tmp_path / "ws" / "model", size, dtype="bf16")
    ctx = gpu_check.Context(
        root=tmp_path, device="cuda", dtype="bf16", env={}, started=0.0, budget_s=math.inf,
        peak_flops=None, peak_why="none", compile=None, fsdp_nproc=1, capacity_gib=37.4,
    )  # fmt: skip
    systems = ("tunepack", "torchtune-stock", "torchtune-stock-compiled")
    entries = gpu_check.method_workloads(ctx, size, "full", systems, tmp_path / "ws")
    assert [(e["name"], e["skipped"]) for e in entries] == [
        (
            f"8b/full/{system}",
            f"does not fit the device: planned 74.9 GiB ({cell}) over 37.4 GiB usable (its "
            "memory less CUDA_RESERVE_GIB 2)",
        )
        for system, cell in zip(
            systems, ("r32/32 c65", "r32/32 whole", "r32/32 whole +C"), strict=True
        )
    ]
    assert not (tmp_path / "runs").exists()
