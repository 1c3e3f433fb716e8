"""benchmarks/gpu_check.py's --dry-run (what make test can run) writes a complete report. Its
arithmetic and choices: tests/unit/test_gpu_check.py. No speed is asserted."""

from __future__ import annotations

import copy
import json
import math
import sys

import pytest

from tests import REPO
from tests.helpers import run_benchmark
from tunepack.runtimes import planner

ROOT = REPO
sys.path.insert(0, str(ROOT / "benchmarks"))

import gpu_check  # noqa: E402


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
    done = run_benchmark("gpu_check.py", "--dry-run", "--out", str(out))
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
