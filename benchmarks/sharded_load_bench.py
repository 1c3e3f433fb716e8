"""Host memory of loading a model into FSDP2 shards: tunepack's sharded load vs every rank loading.

    python benchmarks/sharded_load_bench.py                  # 2 processes, ~0.5 GB random model
    python benchmarks/sharded_load_bench.py --layers 16      # a larger model

Both ways end with the same sharded model on 2 gloo processes (CPU), from the same random
Llama-3-architecture checkpoint in HF format:

- baseline: every rank reads the whole checkpoint, builds the whole model, loads it and then
  shards it (what tunepack did before, and how torchtune's recipes read the checkpoint);
- tunepack: the trainer's own ``FineTuneRecipe._setup_model``: built on the meta device and
  sharded, then rank 0 alone reads the checkpoint and streams each weight into the shards.

Each way runs in fresh processes under torchrun; each rank reports its peak resident set
(ru_maxrss), which includes the few hundred MB of importing torch. The figure to read is the sum
over ranks (a node's memory) and its ratio to the baseline's.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import resource
import subprocess
import sys
import tempfile
from pathlib import Path

from trainer_bench import free_port  # this folder: the script's own directory is on sys.path

from tunepack.runtimes import catalog
from tunepack.tiny import write_tiny_dataset, write_tiny_model

MODEL = "tiny-llama3"  # the family and tokenizer; the shape is scaled up below


def _entry(layers: int) -> catalog.ModelEntry:
    tiny = catalog.get(MODEL)
    shape = dataclasses.replace(
        tiny.shape,
        num_layers=layers,
        embed_dim=1024,
        num_heads=16,
        num_kv_heads=8,
        head_dim=64,
        intermediate_dim=4096,
    )
    return dataclasses.replace(tiny, shape=shape)


def _config(entry: catalog.ModelEntry, root: Path):
    from tunepack.runtimes.args import parse_trainer_args
    from tunepack.trainers.config import build_config

    return build_config(
        entry,
        parse_trainer_args(["method=full", "dtype=fp32"], entry),
        model_dir=root / "ws" / "model",
        dataset_dir=root / "ws" / "dataset",
        output_dir=root / "out",
        cache_dir=root / "cache",
    )


def worker(way: str, root: Path, layers: int) -> None:
    """One rank: build the sharded model the given way, then report this process's peak RSS."""
    import torch.distributed as dist
    from torchtune import config, modules, training

    from tunepack.trainers.recipe import FineTuneRecipe

    recipe = FineTuneRecipe(_config(_entry(layers), root))  # joins the process group
    if way == "tunepack":
        recipe.step = recipe._choose_step(None)  # setup's choice, which _setup_model applies
        model = recipe._setup_model(recipe._load_base_weights())
    else:
        state = config.instantiate(recipe.cfg.checkpointer).load_checkpoint()[training.MODEL_KEY]
        model = config.instantiate(recipe.cfg.model)
        model.load_state_dict(state, strict=True)
        del state
        training.shard_model(
            model,
            [lambda _name, m: isinstance(m, modules.TransformerSelfAttentionLayer)],
            cpu_offload=False,
            reshard_after_forward=True,
        )
    local = sum(p.to_local().numel() for p in model.parameters())
    peak_gib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    report = {"rank": dist.get_rank(), "peak_rss_gib": peak_gib, "local_params": local}
    (root / f"{way}-rank-{dist.get_rank()}.json").write_text(json.dumps(report))
    dist.barrier()
    dist.destroy_process_group()


def prepare(root: Path, layers: int) -> int:
    """A workspace holding the random model and a dataset, as the initializers leave it."""
    entry = _entry(layers)
    model = write_tiny_model(root / "src" / "model", entry)
    data = write_tiny_dataset(root / "src" / "data.jsonl")
    env = {**os.environ, "TUNEPACK_WORKSPACE": str(root / "ws"), "TUNEPACK_MODEL": MODEL}
    # The model initializer would refuse the scaled-up shape (not the catalog's): link it.
    (root / "ws").mkdir()
    os.symlink(model, root / "ws" / "model")
    done = subprocess.run(
        [sys.executable, "-m", "tunepack.initializers.dataset"],
        env={**env, "STORAGE_URI": f"file://{data}"},
        capture_output=True,
        text=True,
    )
    if done.returncode:
        sys.exit(done.stderr)
    return entry.parameter_count


def measure(way: str, root: Path, layers: int, nproc: int) -> list[dict]:
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--nnodes", "1",
        "--nproc-per-node", str(nproc), "--rdzv-backend", "static",
        "--rdzv-endpoint", f"127.0.0.1:{free_port()}", "--node-rank", "0",
        __file__, "--worker", way, "--root", str(root), "--layers", str(layers),
    ]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TIKTOKEN_CACHE_DIR": ""}
    done = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if done.returncode:
        sys.exit(f"{way} failed:\n{done.stdout}{done.stderr}")
    return [json.loads((root / f"{way}-rank-{r}.json").read_text()) for r in range(nproc)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--worker", choices=["baseline", "tunepack"], help=argparse.SUPPRESS)
    parser.add_argument("--root", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args.worker, args.root, args.layers)
        return

    with tempfile.TemporaryDirectory(prefix="tunepack-shard-bench-") as tmp:
        root = Path(tmp)
        params = prepare(root, args.layers)
        print(f"model: {params / 1e6:.0f}M parameters ({params * 4 / 2**30:.2f} GiB in fp32), "
              f"{args.nproc} processes (gloo, CPU)")  # fmt: skip
        ways = ("baseline", "tunepack")
        results = {way: measure(way, root, args.layers, args.nproc) for way in ways}
        for way, ranks in results.items():
            per_rank = ", ".join(f"rank {r['rank']} {r['peak_rss_gib']:.2f}" for r in ranks)
            total = sum(r["peak_rss_gib"] for r in ranks)
            print(f"{way:9s} peak RSS GiB: {per_rank}; sum {total:.2f}")
        assert [r["local_params"] for r in results["baseline"]] == [
            r["local_params"] for r in results["tunepack"]
        ], "the two ways sharded the model differently"
        base, ours = (sum(r["peak_rss_gib"] for r in results[w]) for w in ("baseline", "tunepack"))
        print(f"tunepack / baseline, summed peak RSS: {ours / base:.2f}x")


if __name__ == "__main__":
    main()
