"""The benchmarks as programs: the side-by-side benchmarks (benchmarks/side_by_side.py,
grpo_side_by_side.py) at their smoke size produce a complete report with each system's figures
(no speed is asserted), and loss_bench.py reports each variant. Their pure parts:
tests/unit/test_benchmarks.py; side_by_side's FLOP count: tests/unit/test_gpu_check.py."""

from __future__ import annotations

import dataclasses
import json
import math
import sys

import pytest

from tests import REPO
from tests.helpers import run_benchmark

sys.path.insert(0, str(REPO / "benchmarks"))

import sbs_workload  # noqa: E402
import side_by_side  # noqa: E402

SMOKE_SYSTEMS = [s for s in side_by_side.SYSTEMS if s != "tunepack-compiled"]


@pytest.mark.slow
def test_side_by_side_smoke_report(tmp_path):
    """Every trainer at the smoke size, one round: a report with every system, its ratio, fill,
    memory, loss and the versions. TRL runs where its environment was created earlier (the full
    benchmark creates it); otherwise the report says it was skipped."""
    out = tmp_path / "report.json"
    done = run_benchmark(
        "side_by_side.py", "--size", "smoke", "--rounds", "1", "--trl", "if-ready",
        # Compiling takes minutes of CPU; the smoke run checks the harness, not compilation.
        "--systems", ",".join(SMOKE_SYSTEMS), "--json", str(out), "--profile",
    )  # fmt: skip
    report = json.loads(out.read_text())
    ran, skipped = report["systems"], report["skipped"]
    assert set(ran) | set(skipped) == set(SMOKE_SYSTEMS)
    assert {"tunepack", "tunepack-shuffled", "tunepack-packed", "torchtune-stock"} <= set(ran)
    for name, why in skipped.items():
        assert name.startswith("trl") and "TRL" in why, (name, why)
        assert f"{name:<18}skipped: {why}" in done.stdout
    for name, row in ran.items():
        assert row["tokens_per_cpu_s"] > 0 and row["tokens_per_wall_s"] > 0, name
        assert row["ratio_cpu"] == pytest.approx(
            row["tokens_per_cpu_s"] / ran["tunepack"]["tokens_per_cpu_s"]
        )
        assert 0 < row["fill"] <= 1 and row["peak_rss_gib"] > 0, name
        assert math.isfinite(row["loss"]) and row["steady_steps"] == 2, name
        assert row["mfu"] > 0, name  # against the single-thread matmul peak of the same run
        assert row["system"] in done.stdout
    assert ran["tunepack"]["ratio_cpu"] == 1.0
    assert report["peak"]["flops_per_s"] > 0 and report["peak"]["threads"] == 1
    assert report["flops_per_token"]["total"] > 0 and "MFU:" in done.stdout
    # Rows of 20 to 100 tokens in random batches of 4 leave padding, batches of similar length
    # less; padding-free packing leaves none.
    assert ran["tunepack-shuffled"]["fill"] < ran["tunepack"]["fill"]
    if "trl-packed" in ran:
        assert ran["trl-packed"]["fill"] == 1.0
        assert report["versions"]["trl_env"]["trl"] == side_by_side.TRL_VERSION
    # tunepack's own fill metric agrees with the probe's count, step by step.
    for name in ("tunepack", "tunepack-shuffled", "tunepack-packed"):
        run = report["runs"][0][name]
        assert run["metrics_fill"] == pytest.approx(run["probe_fill"], abs=1e-4), name
    for package in ("tunepack", "torch", "torchtune"):
        assert report["versions"][package], package
    assert report["parameters"] == dataclasses.replace(sbs_workload.SMOKE).entry().parameter_count
    assert len(report["loadavg_before"]) == 3
    # --profile: the steady steps of one more run, by part; the projections ran and were timed.
    parts = {p["part"]: p for p in report["profile"]}
    assert list(parts) == list(side_by_side.PARTS)
    assert sum(p["share"] for p in parts.values()) == pytest.approx(1.0)
    for name in ("frozen projections", "vocabulary projection", "attention"):
        assert parts[name]["s"] > 0 and parts[name]["gflop_per_s"] > 0, name
    assert "where tunepack's steady steps spend their time" in done.stdout


@pytest.mark.slow
def test_grpo_side_by_side_smoke_report(tmp_path):
    """The GRPO side by side (benchmarks/grpo_side_by_side.py) at the smoke size: tunepack and
    TRL's GRPOTrainer each run and the report has every figure (steps and answer tokens per
    second and per CPU second, peak memory, CPU time, reward over the first and last steps) and
    the ratios. TRL runs where its environment was created earlier; otherwise it is skipped."""
    import grpo_side_by_side

    out = tmp_path / "report.json"
    done = run_benchmark(
        "grpo_side_by_side.py", "--size", "smoke", "--trl", "if-ready", "--json", str(out)
    )
    report = json.loads(out.read_text())
    ran, skipped = report["systems"], report["skipped"]
    assert set(ran) | set(skipped) == set(grpo_side_by_side.SYSTEMS) and "tunepack" in ran
    for name, why in skipped.items():
        assert name == "trl" and "TRL" in why, (name, why)
        assert f"{name:<10}skipped: {why}" in done.stdout
    steps, warmup = report["settings"]["steps"], report["settings"]["warmup"]
    for name, row in ran.items():
        for key in ("steps_per_s", "steps_per_cpu_s", "tokens_per_s", "tokens_per_cpu_s"):
            assert row[key] > 0, (name, key)
        assert row["peak_rss_gib"] > 0 and row["process_cpu_s"] > 0, name
        assert 0 <= row["reward_first"] <= 1 and 0 <= row["reward_last"] <= 1, name
        assert row["steady_steps"] == steps - warmup and not row["notes"], name
        run = report["runs"][0][name]
        assert len(run["rewards"]) == steps and run["answer_tokens"] > 0, name
        assert 0 < run["completion_length"] <= report["settings"]["max_new_tokens"], name
        assert row["system"] in done.stdout
    if "trl" in ran:
        assert report["ratio"]["steps_per_s"] == pytest.approx(
            ran["tunepack"]["steps_per_s"] / ran["trl"]["steps_per_s"]
        )
        assert "tunepack / TRL: steps/s" in done.stdout
        assert report["versions"]["trl_env"]["trl"] == side_by_side.TRL_VERSION
        resolved = report["runs"][0]["trl"]["resolved"]
        assert (resolved["loss_type"], resolved["scale_rewards"]) == ("grpo", "group")
    # The LoRA targets TRL gets are tunepack's own for the model (its config.yaml).
    lora = report["tunepack_lora"]
    mlp = ("w1", "w2", "w3") if lora["apply_lora_to_mlp"] else ()
    assert (*lora["lora_attn_modules"], *mlp) == tuple(report["settings"]["lora_modules"])
    assert (lora["lora_rank"], lora["lora_alpha"]) == (8, 16)
    assert len(report["loadavg_before"]) == 3
    assert len(report["tunepack_sources"]) >= 1 and report["versions"]["commit"]


def test_loss_bench_reports_each_chunk_against_the_plain_loss(tmp_path):
    """benchmarks/loss_bench.py at a toy size: every variant timed against the plain loss in one
    run (a report, no speed asserted)."""
    out = tmp_path / "loss.json"
    done = run_benchmark(
        "loss_bench.py", "--rows", "96", "--width", "32", "--vocab", "500000", "--repeats", "1",
        "--weight-trains", "--json", str(out), timeout=300,
    )  # fmt: skip
    report = json.loads(out.read_text())
    # 8M logits at 500k words are 16 rows: the CPU's chunk, then all 96 rows at once.
    assert list(report["results"]) == ["plain", "fused/16", "fused/96"]
    assert report["results"]["plain"]["vs_plain"] == 1.0
    assert all(r["seconds"] > 0 for r in report["results"].values())
    assert "fused/16" in done.stdout and "the weight trains" in done.stdout
