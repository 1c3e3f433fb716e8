"""benchmarks/gpu_check.py's arithmetic and choices: the figures it derives (model FLOPs per token,
compile=auto's constants) and the runs it picks. Its --dry-run report:
tests/integration/test_gpu_check.py. No speed is asserted."""

from __future__ import annotations

import argparse
import math
import sys

import pytest

from tests import REPO
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
