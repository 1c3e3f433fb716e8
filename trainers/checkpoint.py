"""Resumable training checkpoints: complete or absent, coordinated across ranks.

Layout under the checkpoint root (``/workspace/checkpoints`` in a Pod)::

    step-00000040/
        .metadata, __0_0.distcp, ...  trainable weights + optimizer (torch.distributed.checkpoint)
        rank-00000.pt ...             each rank's RNG states
        trainer.pt                    LR scheduler state
        manifest.json                 written last: step, data position, counters, run digest

Every rank writes into ``.step-00000040.partial/``; after a barrier rank 0 writes the manifest and
renames the directory into place. A rename is atomic, so a directory named ``step-*`` is always
complete, whatever killed the run and when. Only trainable parameters are saved (the adapter for
the LoRA family): the frozen base is re-read from the model directory on resume.
"""

from __future__ import annotations

import json
import logging
import random
import shutil
import warnings
from contextlib import contextmanager
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_state_dict,
    set_state_dict,
)

from tunepack import durable
from tunepack.trainers import distributed
from tunepack.trainers.distributed import Topology

log = logging.getLogger("tunepack.trainer")

PREFIX = "step-"
MANIFEST = "manifest.json"
TRAINER_STATE = "trainer.pt"
# Frozen parameters (a LoRA base) come from the model directory, not the checkpoint.
_OPTIONS = StateDictOptions(ignore_frozen_params=True)
_LOAD_OPTIONS = StateDictOptions(ignore_frozen_params=True, strict=False)


def _step_of(path: Path) -> int:
    return int(path.name.removeprefix(PREFIX))


def complete_checkpoints(root: Path) -> list[Path]:
    """Complete checkpoints under ``root``, oldest first."""
    if not root.is_dir():
        return []
    found = [
        p
        for p in root.iterdir()
        if p.is_dir()
        and p.name.startswith(PREFIX)
        and p.name.removeprefix(PREFIX).isdigit()
        and (p / MANIFEST).is_file()
    ]
    return sorted(found, key=_step_of)


def read_manifest(path: Path) -> dict:
    return json.loads((path / MANIFEST).read_text())


def find_resumable(root: Path, digest: str) -> Path | None:
    """The newest complete checkpoint written by a run with this configuration digest."""
    for path in reversed(complete_checkpoints(root)):
        if read_manifest(path).get("digest") == digest:
            return path
    return None


def clear(root: Path) -> None:
    """Remove every checkpoint (complete or partial): the start of a fresh run."""
    if not root.is_dir():
        return
    for path in root.iterdir():
        if path.name.startswith((PREFIX, f".{PREFIX}")):
            shutil.rmtree(path, ignore_errors=True)


def _rng_state() -> dict:
    # numpy's global RNG is not used by the recipe, torchtune's datasets or the sampler.
    state = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def _set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def save(
    root: Path,
    *,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    lr_scheduler,
    manifest: dict,
    topo: Topology,
    keep: int,
) -> Path:
    """Write a checkpoint for ``manifest["step"]`` on every rank; keep the newest ``keep``."""
    name = f"{PREFIX}{manifest['step']:08d}"
    final, staging = root / name, root / f".{name}.partial"
    if topo.is_main:
        shutil.rmtree(staging, ignore_errors=True)  # left by a run killed while writing
        staging.mkdir(parents=True)
    distributed.barrier()

    model_state, optim_state = get_state_dict(model, optimizer, options=_OPTIONS)
    with _quiet_single_process():
        dcp.save({"model": model_state, "optimizer": optim_state}, checkpoint_id=staging)
    torch.save(_rng_state(), staging / f"rank-{topo.rank:05d}.pt")
    distributed.barrier()

    if topo.is_main:
        torch.save({"lr_scheduler": lr_scheduler.state_dict()}, staging / TRAINER_STATE)
        durable.write_json(staging / MANIFEST, manifest)
        if final.exists():  # the same step saved again (e.g. a stop request right after resume)
            shutil.rmtree(final)
        staging.rename(final)
        durable.fsync_dir(root)
        for old in complete_checkpoints(root)[:-keep]:
            shutil.rmtree(old, ignore_errors=True)
    distributed.barrier()
    return final


def load(
    path: Path,
    *,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    lr_scheduler,
    topo: Topology,
) -> dict:
    """Restore model, optimizer, scheduler and (same world size) RNG; return the manifest."""
    manifest = read_manifest(path)
    # get_state_dict gives the structure (and shards) to load into; DCP reshards if needed.
    model_state, optim_state = get_state_dict(model, optimizer, options=_OPTIONS)
    state = {"model": model_state, "optimizer": optim_state}
    with _quiet_single_process():
        dcp.load(state, checkpoint_id=path)
    set_state_dict(
        model,
        optimizer,
        model_state_dict=state["model"],
        optim_state_dict=state["optimizer"],
        options=_LOAD_OPTIONS,
    )
    trainer_state = torch.load(path / TRAINER_STATE, weights_only=True)
    lr_scheduler.load_state_dict(trainer_state["lr_scheduler"])

    rng_file = path / f"rank-{topo.rank:05d}.pt"
    if manifest.get("world_size") == topo.world_size and rng_file.is_file():
        _set_rng_state(torch.load(rng_file, weights_only=True))
    elif topo.is_main:
        log.warning(
            "checkpoint %s was written by %s processes, this run has %d: weights, optimizer "
            "and data position are restored, random states start fresh",
            path,
            manifest.get("world_size"),
            topo.world_size,
        )
    return manifest


@contextmanager
def _quiet_single_process():
    # Without a process group DCP warns that it "assumes" one process: that is the intent here.
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield
