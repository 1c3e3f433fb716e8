"""Measure the real peak GPU memory of training steps and compare it with the planner.

    python benchmarks/planner_accuracy.py                 # on a CUDA GPU: the configs below
    python benchmarks/planner_accuracy.py --dry           # on CPU: tiny model, no measurement

For each config it builds the catalog model with its torchtune builder (random weights, bf16),
trains it as tunepack's trainer does (activation checkpointing per layer, the fused loss of
``tunepack.trainers.objectives.vocab_loss``, AdamW) for two steps on random tokens, the second one
with the optimizer's states as every later step has them, and reads
``torch.cuda.max_memory_allocated``. Target: the estimate within 10% of the measurement.
``--dry`` runs the same code path on CPU with the tiny model (what CI can do); it cannot measure
GPU memory and says so (``measured_bytes: null``).
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import torch
from omegaconf import OmegaConf
from torchtune import config as tt_config
from torchtune import training
from torchtune.modules import TransformerSelfAttentionLayer
from torchtune.modules.peft import get_adapter_params, set_trainable_params

from tunepack.runtimes import catalog, methods
from tunepack.runtimes.planner import LOSS_CHUNK_ELEMENTS, estimate
from tunepack.trainers.config import model_component
from tunepack.trainers.objectives import vocab_loss

GPU_CONFIGS = [  # model, method, seq_len, batch size
    ("llama3.2-1b", "lora", 2048, 4),
    ("llama3.2-1b", "full", 1024, 2),
    ("qwen2.5-1.5b", "lora", 2048, 2),
    ("llama3.1-8b", "lora", 2048, 1),
]
DRY_CONFIGS = [("tiny-llama3", "lora", 128, 2)]
LORA_RANK = 16
STEPS = 2  # the second step holds the optimizer's states through its forward and backward


def build(entry: catalog.ModelEntry, method: str) -> torch.nn.Module:
    how = methods.get(method)
    cfg = model_component(entry, how)
    if how.adapters:
        cfg.update(
            lora_attn_modules=["q_proj", "k_proj", "v_proj", "output_proj"],
            apply_lora_to_mlp=True,
            lora_rank=LORA_RANK,
            lora_alpha=2 * LORA_RANK,
        )
    return tt_config.instantiate(OmegaConf.create(cfg))


def chunk_rows(entry) -> int:
    """The rows of logits the fused loss computes at once here: the smallest chunk (8M logits),
    which the reports of this benchmark were measured with (the trainer chooses larger ones
    where they fit: runtimes/planner.py, choose_step)."""
    return max(1, LOSS_CHUNK_ELEMENTS // entry.shape.vocab_size)


def one_step(entry, method, seq_len, batch, device, dtype) -> dict:
    """``STEPS`` training steps as the trainer takes them; the peak over all of them."""
    with torch.device(device):
        torch.set_default_dtype(dtype)
        model = build(entry, method)
        torch.set_default_dtype(torch.float32)
    if methods.get(method).adapters:
        set_trainable_params(model, get_adapter_params(model))
    training.set_activation_checkpointing(
        model, auto_wrap_policy={TransformerSelfAttentionLayer}
    )  # the trainer's default on a GPU
    fused = vocab_loss.supports(model)
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=1e-4)
    # Every position but each row's last predicts the next token.
    rows = torch.arange(batch * seq_len, device=device).view(batch, seq_len)[:, :-1].reshape(-1)
    if device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    started = time.perf_counter()
    for _ in range(STEPS):
        tokens = torch.randint(0, entry.shape.vocab_size, (batch, seq_len), device=device)
        targets = tokens[:, 1:].reshape(-1)
        if fused:
            with vocab_loss.loss_instead_of_logits(model, rows, targets, chunk_rows(entry)):
                loss = model(tokens) / targets.numel()
        else:
            logits = model(tokens)
            loss = torch.nn.functional.cross_entropy(
                logits[:, :-1].reshape(-1, logits.size(-1)).float(), targets
            )
            del logits
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    measured = None
    if device == "cuda":
        torch.cuda.synchronize()
        measured = torch.cuda.max_memory_allocated()
    return {
        "loss": loss.item(),
        "seconds": time.perf_counter() - started,
        "measured": measured,
        "fused_loss": fused,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dry", action="store_true", help="CPU, tiny model, no measurement")
    parser.add_argument("--json", help="write the report here")
    args = parser.parse_args(argv)
    if not args.dry and not torch.cuda.is_available():
        print("no CUDA GPU: run with --dry to exercise the code path on CPU", file=sys.stderr)
        return 2
    device = "cpu" if args.dry else "cuda"
    dtype = torch.float32 if args.dry else torch.bfloat16
    rows = []
    for model, method, seq_len, batch in DRY_CONFIGS if args.dry else GPU_CONFIGS:
        entry = catalog.get(model)
        step = one_step(entry, method, seq_len, batch, device, dtype)
        plan = estimate(entry, method, seq_len, batch, lora_rank=LORA_RANK,
                        dtype="fp32" if args.dry else "bf16", activation_checkpointing=True,
                        loss_chunk=chunk_rows(entry), fused_loss=step["fused_loss"])  # fmt: skip
        error = None
        if step["measured"]:
            error = (plan.peak_bytes - step["measured"]) / step["measured"]
        rows.append(
            {
                "model": model,
                "method": method,
                "seq_len": seq_len,
                "batch_size": batch,
                "estimate_bytes": plan.peak_bytes,
                "measured_bytes": step["measured"],
                "relative_error": error,
                "steps_run": STEPS,
                "fused_loss": step["fused_loss"],
                "loss": step["loss"],
            }
        )
        shown = "n/a (dry)" if error is None else f"{error:+.1%}"
        measured = step["measured"] / 2**30 if step["measured"] else float("nan")
        print(f"{model:14} {method:5} s={seq_len:5} b={batch}  estimate "
              f"{plan.peak_gib:7.2f} GiB  measured {measured:7.2f} GiB  error {shown}")  # fmt: skip
        del step
        if device == "cuda":
            torch.cuda.empty_cache()
    report = {"mode": "dry" if args.dry else "gpu", "device": device, "rows": rows}
    if not args.dry:
        report["gpu"] = torch.cuda.get_device_name()
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)
    bad = [r for r in rows if r["relative_error"] is not None and abs(r["relative_error"]) > 0.10]
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
