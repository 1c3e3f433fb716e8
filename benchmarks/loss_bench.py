"""The fused loss (trainers/objectives/vocab_loss.py) against the plain one, forward and backward,
one process.

    python benchmarks/loss_bench.py                 # CPU, fp32, a scaled-down Llama 3 head
    python benchmarks/loss_bench.py --device cuda   # a GPU, bf16, Llama 3.2 1B's head

Each variant computes the summed next-token loss of ``--rows`` hidden states through the output
projection and its gradients w.r.t. the hidden states and (``--weight-trains``: full fine-tuning)
the output weight: ``plain`` is autograd over ``cross_entropy(logits.float(), ...)`` with the whole
logits held (torchtune's recipes); ``fused/N`` is tunepack's loss computing N rows of logits at a
time (the CPU's chunk of 8M logits, the GPU's 4096-row chunk, all rows at once). The figure is the
median time of ``--repeats`` runs after a warm-up, each variant's over the plain one's, measured in
the same run; on a GPU also the peak allocated memory. It reports; it asserts nothing.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
import torch.nn.functional as F

from tunepack.runtimes.planner import LOSS_CHUNK_ELEMENTS, LOSS_EFFICIENT_ROWS
from tunepack.trainers.objectives import vocab_loss


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def plain(hidden, weight, targets, _rows):
    return F.cross_entropy((hidden @ weight.T).float(), targets, reduction="sum")


def fused(hidden, weight, targets, rows):
    return vocab_loss.LinearCrossEntropy.apply(hidden, weight, targets, rows)


def measure(fn, rows, args, device, repeats: int) -> dict:
    hidden, weight, targets = args
    times = []
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    for i in range(repeats + 1):  # the first is the warm-up
        hidden.grad = weight.grad = None
        _sync(device)
        began = time.perf_counter()
        fn(hidden, weight, targets, rows).backward()
        _sync(device)
        if i:
            times.append(time.perf_counter() - began)
    peak = torch.cuda.max_memory_allocated() / 2**30 if device.type == "cuda" else None
    return {"seconds": statistics.median(times), "peak_gib": peak}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    parser.add_argument("--rows", type=int, help="hidden states (default: 8192 GPU, 2048 CPU)")
    parser.add_argument("--width", type=int, help="model width (default: 2048 GPU, 512 CPU)")
    parser.add_argument("--vocab", type=int, default=128_256, help="vocabulary (Llama 3's)")
    parser.add_argument("--weight-trains", action="store_true", help="full fine-tuning's head")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--json", help="write the report here")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    gpu = device.type == "cuda"
    rows = args.rows or (8192 if gpu else 2048)
    width = args.width or (2048 if gpu else 512)
    dtype = torch.bfloat16 if gpu else torch.float32
    torch.manual_seed(0)
    hidden = (torch.randn(rows, width, device=device) / width**0.5).to(dtype).requires_grad_()
    weight = torch.randn(args.vocab, width, device=device).to(dtype)
    weight.requires_grad_(args.weight_trains)
    targets = torch.randint(0, args.vocab, (rows,), device=device)
    tensors = (hidden, weight, targets)

    cpu_rows = max(1, LOSS_CHUNK_ELEMENTS // args.vocab)
    variants = [("plain", plain, None)]
    for chunk in dict.fromkeys((cpu_rows, min(LOSS_EFFICIENT_ROWS, rows), rows)):
        variants.append((f"fused/{chunk}", fused, chunk))
    results = {
        name: measure(fn, chunk, tensors, device, args.repeats) for name, fn, chunk in variants
    }
    base = results["plain"]["seconds"]
    print(
        f"loss over {rows} rows x {args.vocab} vocabulary, width {width}, {dtype}, {device.type}"
        + (", the weight trains" if args.weight_trains else "")
    )
    for name, figures in results.items():
        figures["vs_plain"] = figures["seconds"] / base
        memory = f"  peak {figures['peak_gib']:.2f} GiB" if figures["peak_gib"] else ""
        print(
            f"  {name:<14}{figures['seconds'] * 1e3:9.1f} ms  {figures['vs_plain']:5.2f}x{memory}"
        )
    if args.json:
        report = {
            "device": device.type, "dtype": str(dtype), "rows": rows, "width": width,
            "vocab": args.vocab, "weight_trains": args.weight_trains, "results": results,
        }  # fmt: skip
        with open(args.json, "w") as out:
            json.dump(report, out, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
