"""``compile=auto``: compile the model's layers when the planned run amortizes the compilation
(docs/trainer.md, "Throughput").

torch.compile costs a fixed time before the first step and then saves a fraction of every step;
it pays when ``planned training time x saving > compile time``, the planned time estimated before
the model is built (the examples' lengths, the steps, the parameters, the device's measured matmul
rate). The choice is kept in the run's checkpoints, so a resumed run computes exactly as before.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Cost:
    compile_s: float  # seconds spent compiling before (and just after) the first step
    saving: float  # the fraction of each step's time compilation saves


# CPU, measured (benchmarks/side_by_side.py, the 58.7M-parameter Llama 3 workload, 1 thread, a
# 2-core machine under load): the first two steps took about 60 s each (the static graphs, then the
# dynamic-length ones), the steps after them 10% less CPU time per token (4% under load); the fused
# loss (objectives/vocab_loss.py) already does the elementwise work compilation used to save.
CPU = Cost(compile_s=120.0, saving=0.08)
# GPU, measured once (benchmarks/gpu_check.py, one H100 80GB, torch 2.11; docs/gpu.md): 17.2 s
# compiling, then 29% less time per step for a 1B LoRA run in bf16. Rounded towards not compiling:
# a larger model's step is more matmul, which compilation does not speed up, and one measurement
# on one card is a thin base.
GPU = Cost(compile_s=20.0, saving=0.25)
# Compile only with a clear margin: the estimate of the training time is rough.
MARGIN = 2.0


def matmul_rate(device: torch.device, dtype: torch.dtype) -> float:
    """Floating-point operations per second of a square matmul on ``device``, measured."""
    n = 512 if device.type == "cpu" else 4096
    a = torch.randn(n, n, device=device, dtype=torch.float32).to(dtype)
    b = torch.randn(n, n, device=device, dtype=torch.float32).to(dtype)
    (a @ b).sum().item()  # warm-up
    runs, began = 0, time.perf_counter()
    while runs < 3 or time.perf_counter() - began < 0.05:
        (a @ b).sum().item()
        runs += 1
    return 2 * n**3 * runs / (time.perf_counter() - began)


def estimated_training_s(*, tokens: float, parameters: int, trains_all: bool, rate: float) -> float:
    """Forward and backward time of ``tokens`` positions: 2 operations per parameter and
    position forward, 2 more for the input gradients, 2 more when every weight trains."""
    per_token = (6 if trains_all else 4) * parameters
    return tokens * per_token / rate


def choose(
    setting: str | bool, *, device: torch.device, estimate_s: float | None
) -> tuple[bool, str]:
    """Whether to compile (``setting``: "auto", True or False), and a line saying why."""
    if setting != "auto":
        return bool(setting), f"compile={str(setting).lower()}"
    cost = GPU if device.type == "cuda" else CPU
    saving = (estimate_s or 0.0) * cost.saving
    worth = saving > MARGIN * cost.compile_s
    return worth, (
        f"compile=auto: about {estimate_s / 60:.1f} min of training planned; compiling "
        f"(about {cost.compile_s:.0f} s) would save about {saving:.0f} s: "
        f"{'compiling' if worth else 'not compiling'}"
    )
