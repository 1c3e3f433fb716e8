"""The trainer program: the ``node`` container command of every tunepack runtime.

    python -m tunepack.trainers.launch method=lora lora_rank=16 epochs=3 ...

It reads the catalog model from ``TUNEPACK_MODEL``, the workspace from ``TUNEPACK_WORKSPACE``
(``/workspace`` in a Pod), the process layout from the ``PET_*`` variables the Kubeflow torch
plugin injects, validates the ``key=value`` arguments against tunepack's vocabulary, writes the
torchtune config it derived to ``<output>/config.yaml`` and runs the recipe.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import sys

from omegaconf import OmegaConf

from tunepack import workspace
from tunepack.errors import BadInputError, TunepackError
from tunepack.runtimes import catalog
from tunepack.trainers.args import parse_trainer_args
from tunepack.trainers.config import build_config

PROGRAM = "trainer"


def _env_int(name: str, default: int) -> int:
    raw = os.environ.get(name, "")
    if not raw:
        return default
    if name == "PET_NPROC_PER_NODE" and raw == "auto":
        import torch

        return max(torch.cuda.device_count(), 1)
    try:
        value = int(raw)
    except ValueError:
        value = 0
    if value < 1:
        raise BadInputError(f"{name}={raw!r} is not valid: expected a positive integer")
    return value


def _config_digest(cfg) -> str:
    return hashlib.sha256(
        json.dumps(OmegaConf.to_container(cfg), sort_keys=True).encode()
    ).hexdigest()


def run(argv: list[str]) -> int:
    model_name = os.environ.get(workspace.MODEL_ENV)
    if not model_name:
        raise BadInputError(
            f"{workspace.MODEL_ENV} is not set: the runtime must name its catalog model"
        )
    entry = catalog.get(model_name)
    args = parse_trainer_args(argv, entry)

    nnodes, nproc = _env_int("PET_NNODES", 1), _env_int("PET_NPROC_PER_NODE", 1)
    if nnodes * nproc != 1:
        raise BadInputError(
            f"PET_NNODES={nnodes} x PET_NPROC_PER_NODE={nproc}: this tunepack version trains "
            "on one process; run with numNodes=1 and numProcPerNode=1"
        )

    root = workspace.workspace_root()
    output = workspace.output_dir()
    cfg = build_config(
        entry,
        args,
        model_dir=workspace.model_dir(),
        dataset_dir=workspace.dataset_dir(),
        output_dir=output,
        cache_dir=root / ".cache" / "datasets",
    )
    digest = _config_digest(cfg)
    result_path = output / "result.json"
    if result_path.exists() and json.loads(result_path.read_text()).get("config_digest") == digest:
        print(f"{PROGRAM}: {result_path} is complete for this configuration; nothing to do")
        return 0

    output.mkdir(parents=True, exist_ok=True)
    (output / "config.yaml").write_text(OmegaConf.to_yaml(cfg))
    print(
        f"{PROGRAM}: {entry.runtime_name} method={args.method} device={cfg.device} "
        f"dtype={cfg.dtype}; config written to {output / 'config.yaml'}",
        flush=True,
    )

    # tiktoken caches even local tokenizer files, keyed by path: a new model at the same
    # /workspace path would silently get the old vocabulary. Read the file itself.
    os.environ["TIKTOKEN_CACHE_DIR"] = ""
    from tunepack.trainers import recipe  # heavy imports only once the input is valid

    result = recipe.run(cfg, extra={"config_digest": digest})
    print(
        f"{PROGRAM}: done: {result['steps']} steps, loss {result['first_loss']:.4f} -> "
        f"{result['final_loss']:.4f}; result at {result['artifact']}",
        flush=True,
    )
    return 0


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    try:
        return run(sys.argv[1:] if argv is None else argv)
    except TunepackError as err:
        print(f"{PROGRAM}: error: {err}", file=sys.stderr)
        return err.exit_code


if __name__ == "__main__":
    sys.exit(main())
