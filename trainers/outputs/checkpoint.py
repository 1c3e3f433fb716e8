"""Resumable training checkpoints: complete or absent, coordinated across ranks.

Under the checkpoint root, ``step-NNNNNNNN/`` holds the trainable weights and optimizer
(torch.distributed.checkpoint files), ``rank-NNNNN.pt`` (each rank's RNG states),
``trainer.pt`` (the LR scheduler) and, written last, ``manifest.json`` (the progress, the run's
identity, every other file's size and sha256). Why each rule (the ``.partial`` directory
renamed into place, verification, ``.corrupt-*``): docs/trainer.md, "Checkpoints and resume".
"""

from __future__ import annotations

import hashlib
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

from tunepack.core import durable
from tunepack.trainers.config import identity_changes
from tunepack.trainers.process import distributed
from tunepack.trainers.process.distributed import Topology

log = logging.getLogger("tunepack.trainer")

PREFIX = "step-"
MANIFEST = "manifest.json"
TRAINER_STATE = "trainer.pt"
CORRUPT_PREFIX = ".corrupt-"
# Frozen parameters (a LoRA base) come from the model directory, not the checkpoint.
_OPTIONS = StateDictOptions(ignore_frozen_params=True)
_LOAD_OPTIONS = StateDictOptions(ignore_frozen_params=True, strict=False)


def _step_of(path: Path) -> int:
    return int(path.name.removeprefix(PREFIX))


def _checkpoint_dirs(root: Path) -> list[Path]:
    """The ``step-NNNNNNNN`` directories under ``root``, with or without their manifest, oldest
    first."""
    if not root.is_dir():
        return []
    found = [
        p
        for p in root.iterdir()
        if p.is_dir() and p.name.startswith(PREFIX) and p.name.removeprefix(PREFIX).isdigit()
    ]
    return sorted(found, key=_step_of)


def complete_checkpoints(root: Path) -> list[Path]:
    """Complete checkpoints under ``root``, oldest first."""
    return [p for p in _checkpoint_dirs(root) if (p / MANIFEST).is_file()]


def without_manifest(root: Path) -> list[Path]:
    """``step-*`` directories under ``root`` with no manifest, oldest first: never a save's
    (it renames a directory into place with its manifest written last), so a copy cut short, a
    removal killed half-way or a manifest deleted by hand."""
    return [p for p in _checkpoint_dirs(root) if not (p / MANIFEST).is_file()]


def read_manifest(path: Path) -> dict:
    return json.loads((path / MANIFEST).read_text())


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


def file_sums(directory: Path) -> dict[str, dict]:
    """Size and sha256 of every file in a checkpoint directory but the manifest."""
    return {
        p.name: {"size": p.stat().st_size, "sha256": _sha256(p)}
        for p in sorted(directory.iterdir())
        if p.is_file() and p.name != MANIFEST
    }


def damage(path: Path) -> str | None:
    """What is wrong with a complete checkpoint's files, or None when it verifies."""
    try:
        manifest = read_manifest(path)
    except (OSError, ValueError) as err:
        return f"{MANIFEST} is unreadable ({err.__class__.__name__})"
    files = manifest.get("files") if isinstance(manifest, dict) else None
    if not isinstance(files, dict):
        return f"{MANIFEST} lists no file checksums"
    world_size = manifest.get("world_size")
    if isinstance(world_size, int):  # the random states are part of a complete checkpoint
        for rank in range(world_size):
            if f"rank-{rank:05d}.pt" not in files:
                return f"{MANIFEST} lists no random state of rank {rank}"
    for name, expected in sorted(files.items()):
        file = path / name
        if not file.is_file():
            return f"{name} is missing"
        if file.stat().st_size != expected.get("size"):
            return f"{name} has {file.stat().st_size} bytes, {expected.get('size')} were written"
        if _sha256(file) != expected.get("sha256"):
            return f"{name} does not match its checksum"
    return None


def set_aside(path: Path, why: str) -> Path:
    """Rename a damaged checkpoint out of the way (kept for inspection, never loaded again)."""
    target = path.with_name(f"{CORRUPT_PREFIX}{path.name}")
    n = 1
    while target.exists():
        n += 1
        target = path.with_name(f"{CORRUPT_PREFIX}{path.name}.{n}")
    path.rename(target)
    durable.fsync_dir(path.parent)
    log.warning("checkpoint %s is damaged (%s): set aside as %s", path, why, target.name)
    return target


def choose(root: Path, digest: str) -> tuple[Path | None, dict | None]:
    """Rank 0: the newest verified checkpoint of this run (damaged ones set aside on the way).

    Also returns the newest other checkpoint's manifest when none matches, to say why the run
    starts fresh.
    """
    for path in without_manifest(root):  # never loaded: said once, and out of the way
        set_aside(path, f"{MANIFEST} is missing")
    other = None
    for path in reversed(complete_checkpoints(root)):
        try:
            manifest = read_manifest(path)
        except (OSError, ValueError):
            set_aside(path, damage(path) or f"{MANIFEST} is unreadable")
            continue
        if not isinstance(manifest, dict) or manifest.get("digest") != digest:
            other = other or (manifest if isinstance(manifest, dict) else {})
            continue
        why = damage(path)
        if why is None:
            return path, None
        set_aside(path, why)
    return None, other


def find_or_clear(root: Path, digest: str, identity: dict, *, resume: bool) -> Path | None:
    """Rank 0: the checkpoint to resume from, or None after clearing the way for a fresh run
    (``identity``: the run's, to say why another run's checkpoints do not fit)."""
    if resume:
        found, other = choose(root, digest)
        if found is not None:
            return found
        why = (
            identity_changes(other.get("identity"), identity, "checkpoint")
            if other is not None
            else "no checkpoint of this run verifies"
        )
    else:
        why = "resume=false"
    # A fresh run: checkpoints of another identity (or resume=false) would only confuse the
    # next restart's choice, so they go (damaged ones were set aside, not removed).
    if _checkpoint_dirs(root):
        log.info("%s: starting fresh, removing earlier checkpoints under %s", why, root)
        clear(root)
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
    """Write a checkpoint for ``manifest["step"]`` on every rank; keep the newest ``keep``.

    A full disk (or quota) raises ``DiskFullError`` naming the checkpoint and its size, after the
    partial directory is removed: only complete checkpoints are left.
    """
    name = f"{PREFIX}{manifest['step']:08d}"
    final, staging = root / name, root / f".{name}.partial"
    aside = root / f".{name}.old"  # the same step saved before, while it is replaced
    with own_names(model):
        model_state, optim_state = get_state_dict(model, optimizer, options=_OPTIONS)
    needed = nbytes(model_state) + nbytes(optim_state)
    try:
        with durable.disk_full_as_error(final, needed):
            if topo.is_main:
                for stale in (staging, aside):  # left by a run killed while writing
                    shutil.rmtree(stale, ignore_errors=True)
                staging.mkdir(parents=True)
            distributed.barrier()
            with _quiet_single_process():
                dcp.save({"model": model_state, "optimizer": optim_state}, checkpoint_id=staging)
            torch.save(_rng_state(), staging / f"rank-{topo.rank:05d}.pt")
            distributed.barrier()

            if topo.is_main:
                torch.save({"lr_scheduler": lr_scheduler.state_dict()}, staging / TRAINER_STATE)
                # Checksums of what every rank wrote (one shared directory), verified on resume.
                durable.write_json(staging / MANIFEST, {**manifest, "files": file_sums(staging)})
                # A step saved again (a stop request right after resume) replaces the first.
                durable.rename_dir(staging, final, aside=aside)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    if topo.is_main:
        for old in complete_checkpoints(root)[:-keep]:
            shutil.rmtree(old, ignore_errors=True)
    distributed.barrier()
    return final


def nbytes(state) -> int:
    """Bytes of the tensors in a (nested) state dict: about what a checkpoint of it takes."""
    if isinstance(state, torch.Tensor):
        return state.numel() * state.element_size()
    if isinstance(state, dict):
        return sum(nbytes(v) for v in state.values())
    if isinstance(state, list | tuple):
        return sum(nbytes(v) for v in state)
    return 0


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
    with own_names(model):
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


def _is_fusion_hook(hook) -> bool:
    function = getattr(hook, "hook", hook)  # with_module hooks are wrapped
    function = getattr(function, "__func__", function)
    return getattr(function, "__qualname__", "").startswith(("FusionLayer.", "FusionEmbedding."))


@contextmanager
def own_names(model: nn.Module):
    """Within it, the state-dict keys of torchtune's fusion modules (Llama 3.2 Vision) are their
    attributes' names. Their hooks rename the keys for HF checkpoints (``FusionLayer`` drops
    ``layer.``, ``FusionEmbedding`` joins its two tables into one ``weight``), which
    torch.distributed.checkpoint cannot map back to parameters; resumable checkpoints keep the
    modules' own names (saved and loaded the same way, so they need no renaming)."""
    from torchtune.modules.model_fusion import FusionEmbedding, FusionLayer

    removed = []
    for module in model.modules():
        if not isinstance(module, FusionLayer | FusionEmbedding):
            continue
        for hooks in (module._state_dict_hooks, module._load_state_dict_pre_hooks):
            for key, hook in list(hooks.items()):
                if _is_fusion_hook(hook):
                    removed.append((hooks, key, hook))
                    del hooks[key]
    try:
        yield
    finally:
        for hooks, key, hook in removed:
            hooks[key] = hook


def to_own_names(model: nn.Module, state: dict) -> dict:
    """A full state dict in the fusion modules' hook-renamed keys (as a checkpointer gives it)
    under their own names (``own_names``), as their load hooks rename it: FSDP's sharded load
    maps keys to parameters by attribute, as torch.distributed.checkpoint does."""
    out = dict(state)
    for module, prefix, part in _fusion_parts(model, out):
        module._load_state_dict_hook(part, prefix)
    return out


def to_hook_names(model: nn.Module, state: dict) -> dict:
    """The inverse of ``to_own_names``: a state dict taken under ``own_names`` in the keys the
    fusion modules' hooks give (the checkpointer's and the adapter export's)."""
    from torchtune.modules.model_fusion import FusionLayer

    out = dict(state)
    for module, prefix, part in _fusion_parts(model, out):
        if isinstance(module, FusionLayer) or prefix + "embedding.weight" in part:
            module._state_dict_hook(part, prefix, False)
    return out


def _fusion_parts(model: nn.Module, state: dict):
    """Each fusion module of ``model`` with its key prefix and its keys, taken out of ``state``
    (a hook sees a module's own keys only, as load_state_dict hands them to it) and put back,
    renamed in place by the caller, once the caller is done with them."""
    from torchtune.modules.model_fusion import FusionEmbedding, FusionLayer

    for name, module in model.named_modules():
        if not isinstance(module, FusionLayer | FusionEmbedding):
            continue
        path = [p for p in name.split(".") if p not in ("_checkpoint_wrapped_module", "_orig_mod")]
        prefix = ".".join(path) + "."
        part = {key: state.pop(key) for key in list(state) if key.startswith(prefix)}
        yield module, prefix, part
        state.update(part)


@contextmanager
def _quiet_single_process():
    # Without a process group DCP warns that it "assumes" one process: that is the intent here.
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield
