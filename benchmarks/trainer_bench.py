"""Throughput and peak memory of tunepack's trainer against torchtune's stock LoRA recipe.

    python benchmarks/trainer_bench.py                              # CPU, tiny-llama3
    python benchmarks/trainer_bench.py --device cuda --model-size 1b  # GPU, 1B-class, with MFU

Both trainers get the same random-weight model, the same data and the same settings (LoRA,
batch size, sequence length, optimizer, plain cross-entropy, no compile, no activation
checkpointing); each runs in a fresh process so its peak memory is its own. tunepack's trainer
runs through its launcher (``python -m tunepack.trainers.launch``); the stock recipe through its
Python entry (``recipes.lora_finetune_single_device.recipe_main``) with a config derived from the
one tunepack wrote. Throughput is the median tokens/s of the steps after ``--warmup``.

Peak memory: on CPU the peak resident set of each process (wait4's ru_maxrss); on CUDA the
trainers' own peak allocated-memory figures. MFU (CUDA): tokens/s x FLOPs per token / peak
FLOP/s, with FLOPs per token = 4 x all parameters (forward, and backward to the activations)
+ 2 x trainable parameters (weight gradients) + attention's 12 x layers x dim x sequence length.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import socket
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import yaml

from tunepack.runtimes import catalog
from tunepack.tiny import write_tiny_dataset, write_tiny_model

SIZES = {"tiny": "tiny-llama3", "1b": "llama3.2-1b"}
# Dense bf16 peak FLOP/s by GPU name; --peak-tflops overrides.
PEAK_TFLOPS = {"H100": 989.0, "H200": 989.0, "A100": 312.0, "L40S": 362.0}


def run_measured(cmd: list[str], env: dict, log: Path) -> tuple[int, float, float]:
    """Run a command; return its exit code, its peak resident memory in GiB and its CPU seconds
    (user + system; wait4 counts the process and every descendant it waited for)."""
    with log.open("w") as out:
        proc = subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT)
        try:
            _, status, usage = os.wait4(proc.pid, 0)
        except BaseException:  # interrupted: the measured run does not outlive the benchmark
            proc.terminate()
            proc.wait()
            raise
    cpu_s = usage.ru_utime + usage.ru_stime
    return os.waitstatus_to_exitcode(status), usage.ru_maxrss / 2**20, cpu_s


def free_port() -> int:
    """A loopback port nothing listens on: torchrun's rendezvous (the benchmarks' one copy of
    tests/helpers.py's, as they run without the test suite)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def prepare_workspace(root: Path, model_name: str, env: dict) -> Path:
    entry = catalog.get(model_name)
    model = write_tiny_model(root / "src" / "model", dataclasses.replace(entry))
    data = write_tiny_dataset(root / "src" / "data.jsonl")
    ws = root / "ws"
    for module, uri in (
        ("tunepack.initializers.dataset", f"file://{data}"),
        ("tunepack.initializers.model", f"file://{model}"),
    ):
        done = subprocess.run(
            [sys.executable, "-m", module],
            env={**env, "TUNEPACK_WORKSPACE": str(ws), "STORAGE_URI": uri},
            capture_output=True,
            text=True,
        )
        if done.returncode:
            sys.exit(f"{module} failed:\n{done.stderr}")
    return ws


def stock_config(tunepack_cfg: dict, out: Path, steps: int, device: str) -> dict:
    """torchtune's single-device LoRA recipe config equivalent to tunepack's."""
    checkpointer = {**tunepack_cfg["checkpointer"], "output_dir": str(out / "ckpt")}
    return {
        "output_dir": str(out),
        "model": tunepack_cfg["model"],
        "tokenizer": tunepack_cfg["tokenizer"],
        "checkpointer": checkpointer,
        "resume_from_checkpoint": False,
        "save_adapter_weights_only": True,
        "dataset": tunepack_cfg["dataset"],
        "seed": tunepack_cfg["seed"],
        "shuffle": True,
        "batch_size": tunepack_cfg["batch_size"],
        "optimizer": tunepack_cfg["optimizer"],
        "lr_scheduler": tunepack_cfg["lr_scheduler"],
        "loss": {"_component_": "torch.nn.CrossEntropyLoss"},
        "epochs": 1,
        "max_steps_per_epoch": steps,
        "gradient_accumulation_steps": 1,
        "compile": False,
        "device": device,
        "dtype": tunepack_cfg["dtype"],
        "enable_activation_checkpointing": False,
        "enable_activation_offloading": False,
        "metric_logger": {
            "_component_": "torchtune.training.metric_logging.DiskLogger",
            "log_dir": str(out / "logs"),
        },
        "log_every_n_steps": 1,
        "log_peak_memory_stats": device == "cuda",
        "profiler": {"_component_": "torchtune.training.setup_torch_profiler", "enabled": False},
    }


def stock_recipe_file() -> Path:
    """torchtune ships its recipes as scripts beside the package (not importable)."""
    import torchtune

    return Path(torchtune.__file__).parent.parent / "recipes" / "lora_finetune_single_device.py"


def median_after(values: list[float], warmup: int) -> float:
    kept = values[warmup:] or values
    return statistics.median(kept)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--model-size", choices=tuple(SIZES), default="tiny")
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--warmup", type=int, default=2, help="steps left out of the median")
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--max-seq-len", type=int, default=256)
    parser.add_argument("--threads", type=int, default=1, help="CPU math threads per trainer")
    parser.add_argument("--peak-tflops", type=float, default=None)
    args = parser.parse_args(argv)

    model_name = SIZES[args.model_size]
    env = {**os.environ, "TUNEPACK_MODEL": model_name, "OMP_NUM_THREADS": str(args.threads)}
    with tempfile.TemporaryDirectory(prefix="tunepack-bench-") as tmp:
        root = Path(tmp)
        ws = prepare_workspace(root, model_name, env)

        # tunepack, through its launcher (one process).
        trainer_args = [
            "method=lora",
            f"max_steps={args.steps}",
            f"batch_size={args.batch_size}",
            f"max_seq_len={args.max_seq_len}",
            f"device={args.device}",
            "warmup_steps=0",
            "activation_checkpointing=false",
            "checkpoint_every_minutes=0",
        ]
        code, tp_rss, _ = run_measured(
            [sys.executable, "-m", "tunepack.trainers.launch", *trainer_args],
            {**env, "TUNEPACK_WORKSPACE": str(ws)},
            root / "tunepack.log",
        )
        if code:
            sys.exit(f"tunepack failed ({code}):\n{(root / 'tunepack.log').read_text()[-3000:]}")
        steps = [json.loads(x) for x in (ws / "output" / "metrics.jsonl").read_text().splitlines()]
        tp_tps = median_after([s["tokens_per_second"] for s in steps], args.warmup)
        tp_mem = steps[-1]["peak_memory_gib"] if args.device == "cuda" else tp_rss

        # torchtune's stock recipe, same model/data/settings.
        cfg = yaml.safe_load((ws / "output" / "config.yaml").read_text())
        stock_out = root / "stock"
        stock_out.mkdir()
        stock_yaml = stock_out / "config.yaml"
        stock_yaml.write_text(yaml.safe_dump(stock_config(cfg, stock_out, args.steps, args.device)))
        code, st_rss, _ = run_measured(
            [sys.executable, str(stock_recipe_file()), "--config", str(stock_yaml)],
            env,
            root / "stock.log",
        )
        if code:
            sys.exit(f"stock recipe failed ({code}):\n{(root / 'stock.log').read_text()[-3000:]}")
        log_text = "".join(p.read_text() for p in (stock_out / "logs").glob("*.txt"))
        st_tps = median_after(
            [float(x) for x in re.findall(r"tokens_per_second_per_gpu:([0-9.e+-]+)", log_text)],
            args.warmup,
        )
        st_mem = st_rss
        if args.device == "cuda":
            peaks = re.findall(r"peak_memory_alloc:([0-9.e+-]+)", log_text)
            st_mem = float(peaks[-1]) if peaks else float("nan")

    memory_kind = "peak allocated GiB" if args.device == "cuda" else "peak RSS GiB"
    print(
        f"model {model_name}, device {args.device}, LoRA, batch {args.batch_size}, "
        f"{args.steps} steps (median after {args.warmup}), {args.threads} CPU thread(s)"
    )
    print(f"{'trainer':<28}{'tokens/s':>12}{memory_kind:>22}")
    print(f"{'tunepack':<28}{tp_tps:>12.1f}{tp_mem:>22.3f}")
    print(f"{'torchtune stock (single)':<28}{st_tps:>12.1f}{st_mem:>22.3f}")
    print(f"ratio tunepack/stock: tokens/s {tp_tps / st_tps:.2f}x, memory {tp_mem / st_mem:.2f}x")

    if args.device == "cuda":
        import torch

        entry = catalog.get(model_name)
        s = entry.shape
        params = entry.parameter_count
        trainable = _lora_params(cfg, entry)
        flops_per_token = (
            4 * params + 2 * trainable + 12 * s.num_layers * s.embed_dim * args.max_seq_len
        )
        name = torch.cuda.get_device_name()
        peak = args.peak_tflops or next((v for k, v in PEAK_TFLOPS.items() if k in name), None)
        if peak is None:
            print(f"MFU: unknown peak FLOP/s for {name}; pass --peak-tflops")
        else:
            for label, tps in (("tunepack", tp_tps), ("stock", st_tps)):
                print(
                    f"MFU {label}: {tps * flops_per_token / (peak * 1e12):.1%} of "
                    f"{peak:.0f} TFLOP/s ({name}; {trainable} trainable parameters)"
                )
    return 0


def _lora_params(cfg: dict, entry) -> int:
    """LoRA parameters: rank x (in + out) per adapted projection per layer."""
    s, m = entry.shape, cfg["model"]
    q, kv = s.num_heads * s.head_dim, s.num_kv_heads * s.head_dim
    dims = {
        "q_proj": (s.embed_dim, q),
        "k_proj": (s.embed_dim, kv),
        "v_proj": (s.embed_dim, kv),
        "output_proj": (q, s.embed_dim),
    }
    per_layer = sum(sum(dims[name]) for name in m["lora_attn_modules"])
    if m["apply_lora_to_mlp"]:
        per_layer += 3 * (s.embed_dim + s.intermediate_dim)
    return m["lora_rank"] * per_layer * s.num_layers


if __name__ == "__main__":
    sys.exit(main())
