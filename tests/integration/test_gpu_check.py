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
from tunepack.runtimes.catalog import Shape
from tunepack.trainers import compiling

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
    assert got["replaces"]["compile_s"] == f"trainers/compiling.py GPU.compile_s = {cost.compile_s}"
    assert got["replaces"]["saving"] == f"trainers/compiling.py GPU.saving = {cost.saving}"
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
            elif w.get("system") != "tunepack-compiled":  # the one run a dry run leaves out
                found.append(f"{name}: did not run: {w['skipped'][:300]}")
            continue
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

    # The checks above fail a report that lacks what they look for.
    broken = copy.deepcopy(report)
    ran = next(w for w in broken["workloads"] if "skipped" not in w)
    del ran["tokens_per_s"]
    ran["mfu"] = None
    broken["fsdp2"][0]["bit_exact"] = False
    broken["workloads"].pop()
    found = problems(broken)
    assert any("tokens_per_s" in p for p in found)
    assert any("MFU None without a reason" in p for p in found)
    assert any("not bit-exact" in p for p in found)
    assert any(p.startswith("workloads ") for p in found)
