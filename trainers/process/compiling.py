"""``compile=auto``: compile the model's layers when the planned run amortizes the compilation.

torch.compile costs a fixed time before the first step (the layers' graphs, compiled once and
reused by every layer of the same shape; one recompilation when the sequence length first changes,
after which the length is a dynamic dimension) and then saves a fraction of every step. It pays
when ``planned training time x saving > compile time``. The planned training time is estimated
before the model is built, from what is known then: the examples' lengths, the steps, the model's
parameters, and the device's measured matmul rate (a fraction of a second to measure).

The constants:
- CPU, measured (benchmarks/side_by_side.py, ``tunepack-compiled`` against ``tunepack``, the
  issue's 58.7M-parameter Llama 3 workload, 1 thread, 2-core machine under load): the first two
  steps took about 60 s each (the static graphs, then the dynamic-length ones), and the steps after
  them used 10% less CPU time per token than eager ones on a quiet machine (4% under load). Much
  of what compilation used to save on CPU was the elementwise work over the vocabulary, which the
  fused loss (vocab_loss.py) no longer does; so on CPU compilation pays for runs of an hour or
  more.
- GPU, measured once (benchmarks/gpu_check.py on one H100 80GB, torch 2.11, 2026-11-26;
  docs/gpu.md): a Llama 3.2 1B-shaped LoRA run in bf16 spent 17.2 s compiling and then took
  29% less time per step (0.244 s against 0.344 s). Until then these were guesses (90 s, 10%).
  The constants are rounded towards not compiling (20 s, 25%): a larger model's step is more
  matmul, which compilation does not speed up, and one measurement on one card is a thin base.

The choice made when a run starts is kept in its checkpoints, so a resumed run computes exactly
as it did before the interruption whatever the clock says the second time.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Cost:
    compile_s: float  # seconds spent compiling before (and just after) the first step
    saving: float  # the fraction of each step's time compilation saves


CPU = Cost(compile_s=120.0, saving=0.08)
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
