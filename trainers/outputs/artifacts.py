"""What a training run leaves in its output directory, written in one place.

The functions take what they need (state dicts, the config, the paths), not the recipe, so the
result's layout (docs/trainer.md, "Result layout") is written here alone; all of them but
``gather_state`` run on rank 0 only.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import torch
from omegaconf import DictConfig, OmegaConf
from safetensors import safe_open
from safetensors.torch import save_file
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torchtune import config, training
from torchtune.modules.peft import get_adapter_state_dict, get_merged_lora_ckpt

from tunepack.core import durable
from tunepack.core.workspace import ADAPTER_DIR, FULL_MODEL_DIR, MERGED_DIR, RESULT_FILE
from tunepack.runtimes import methods
from tunepack.trainers.config import result_digest, result_identity
from tunepack.trainers.models import moe
from tunepack.trainers.outputs import checkpoint
from tunepack.trainers.outputs.peft_export import export_adapter

BEST_DIR = ".best"  # the weights of the best validation loss so far (keep_best=true)
BEST_WEIGHTS = "weights.safetensors"
BEST_RECORD = "best.json"

State = dict[str, torch.Tensor]


# ---------------------------------------------------------------- the weights
def gather_state(model: nn.Module, *, trainable_only: bool, sharded: bool) -> State:
    """Full (unsharded) CPU copies of the weights on rank 0; an empty dict on other ranks.

    A collective when ``sharded``: every rank calls it.
    """
    if sharded:
        options = StateDictOptions(
            full_state_dict=True, cpu_offload=True, ignore_frozen_params=trainable_only
        )
        # Llama 3.2 Vision's fusion modules: gathered by attribute, then in their HF-facing keys.
        with checkpoint.own_names(model):
            state = get_model_state_dict(model, options=options)
        return checkpoint.to_hook_names(model, state)
    state = model.state_dict()
    if trainable_only:
        state = get_adapter_state_dict(state)
    # Copies: on CPU ``.to("cpu")`` would alias the live weights that training still owns.
    return {k: v.detach().to("cpu", copy=True) for k, v in state.items()}


def weights_dir(output_dir: Path, method: methods.Method) -> Path:
    """Where the published weights go: ``adapter/`` for the LoRA family, ``model/`` for full."""
    return output_dir / (ADAPTER_DIR if method.adapters else FULL_MODEL_DIR)


def publish_weights(
    state: State, cfg: DictConfig, method: methods.Method, output_dir: Path
) -> Path:
    """Publish the adapter (and the merged model, ``merge=true``) or the HF model; its path.
    ``method``: the record of ``cfg.method``."""
    artifact = weights_dir(output_dir, method)
    needed = checkpoint.nbytes(state)  # about what the weights take on disk
    if method.adapters:
        adapter = partial(write_adapter, state, cfg, method)
        durable.publish_dir(artifact, adapter, needed=needed)
        if cfg.merge:
            merged = partial(write_merged, state, cfg)
            durable.publish_dir(output_dir / MERGED_DIR, merged, needed=base_nbytes(cfg))
    else:
        durable.publish_dir(artifact, partial(write_hf_model, state, cfg), needed=needed)
    return artifact


def base_nbytes(cfg: DictConfig) -> int:
    """About what a whole model takes on disk: the base checkpoint's weight files (a merged
    model is written in the base's shards and dtype)."""
    directory = Path(cfg.checkpointer.checkpoint_dir)
    return sum((directory / name).stat().st_size for name in cfg.checkpointer.checkpoint_files)


def hf_config(cfg: DictConfig) -> dict:
    """The base model's Hugging Face ``config.json``."""
    return json.loads((Path(cfg.checkpointer.checkpoint_dir) / "config.json").read_text())


def write_adapter(state: State, cfg: DictConfig, method: methods.Method, directory: Path) -> None:
    """``adapter_model.safetensors`` and ``adapter_config.json``: a PEFT adapter of the base."""
    m = cfg.model
    adapter = {k: v.to(torch.float32) for k, v in get_adapter_state_dict(state).items()}
    # torchtune's own exporter assumes Llama's layout for every family (and leaves DoRA's
    # magnitude unpermuted); export_adapter follows each family's HF layout.
    weights, targets = export_adapter(
        adapter,
        model_type=cfg.checkpointer.model_type,
        hf_config=hf_config(cfg),
        rank=m.lora_rank,
        alpha=m.lora_alpha,
    )
    weights = {k: v.contiguous() for k, v in weights.items()}
    save_file(weights, directory / "adapter_model.safetensors", metadata={"format": "pt"})
    # QLoRA's adapter is an ordinary LoRA adapter: it applies to the unquantized base too.
    adapter_config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": cfg.hub_id,
        "r": m.lora_rank,
        "lora_alpha": m.lora_alpha,
        "lora_dropout": m.lora_dropout,
        "bias": "none",
        "fan_in_fan_out": False,
        "inference_mode": True,
        "use_dora": method.dora,
        "use_rslora": False,
        "modules_to_save": None,
        **targets,
    }
    (directory / "adapter_config.json").write_text(json.dumps(adapter_config, indent=2))


def write_merged(adapter_state: State, cfg: DictConfig, directory: Path) -> None:
    """Fold the adapter into a fresh copy of the base read from disk, never the live model."""
    merged = config.instantiate(cfg.checkpointer).load_checkpoint()[training.MODEL_KEY]
    merged.update(get_adapter_state_dict(adapter_state))
    moe.merge_expert_adapters(merged, cfg.model.lora_alpha / cfg.model.lora_rank)  # experts
    merged = get_merged_lora_ckpt(merged, rank=cfg.model.lora_rank, alpha=cfg.model.lora_alpha)
    write_hf_model(merged, cfg, directory)


def write_hf_model(state: State, cfg: DictConfig, directory: Path) -> None:
    """A Hugging Face model: the weights sharded like the base's, with its config/tokenizer."""
    ckpt = dict(cfg.checkpointer)
    ckpt["output_dir"] = str(directory / ".staging")
    checkpointer = config.instantiate(OmegaConf.create(ckpt))
    # torchtune's HF checkpointer learns which shard file each weight belongs in while it
    # loads; it never loaded here. Read the same map from the shards' headers rather than
    # load a second full copy of the model.
    weight_map = {}
    for index, name in enumerate(cfg.checkpointer.checkpoint_files, start=1):
        with safe_open(Path(cfg.checkpointer.checkpoint_dir) / name, "pt") as shard:
            weight_map.update(dict.fromkeys(shard.keys(), f"{index:04}"))
    checkpointer._weight_map = weight_map
    checkpointer.save_checkpoint({training.MODEL_KEY: state}, epoch=0)
    # torchtune writes weights plus the source's config/tokenizer files under epoch_0/.
    staged = directory / ".staging" / "epoch_0"
    for item in staged.iterdir():
        shutil.move(str(item), directory / item.name)
    shutil.rmtree(directory / ".staging")


# ---------------------------------------------------------------- the best weights (keep_best)
def write_best(output_dir: Path, state: State, *, step: int, val_loss: float, digest: str) -> None:
    """Keep ``state`` as the best weights so far, replacing the previous best."""

    def write(directory: Path) -> None:
        weights = {k: v.contiguous() for k, v in state.items()}
        save_file(weights, directory / BEST_WEIGHTS)
        (directory / BEST_RECORD).write_text(
            json.dumps({"step": step, "val_loss": val_loss, "digest": digest})
        )

    durable.publish_dir(output_dir / BEST_DIR, write, needed=checkpoint.nbytes(state))


def read_best(output_dir: Path, *, step: int, digest: str) -> State | None:
    """The kept best weights when they are of ``step`` of the run ``digest``, else None."""
    directory = output_dir / BEST_DIR
    try:
        kept = json.loads((directory / BEST_RECORD).read_text())
    except (FileNotFoundError, ValueError):
        return None
    if kept.get("step") != step or kept.get("digest") != digest:
        return None
    state = {}
    with safe_open(directory / BEST_WEIGHTS, "pt") as f:
        for key in f.keys():
            state[key] = f.get_tensor(key)
    return state


# ---------------------------------------------------------------- result.json
@dataclass(frozen=True)
class Outcome:
    """What the run did, as the recipe measured it (the rest of result.json is the config)."""

    steps: int
    first_loss: float | None
    final_loss: float | None
    tokens_seen: int
    wall_time_s: float
    world_size: int
    device: str
    peak_memory_gib: float
    resumed_from_step: int | None
    restarts: int
    val_loss: float | None
    val_perplexity: float | None
    best_val_loss: float | None
    best_step: int | None
    val_rows: int
    keep_best: bool
    published_step: int
    eval_time_s: float
    evaluations: int
    method_metrics: dict  # DPO's or GRPO's metrics of the last step (empty for the others)
    step_plan: dict  # how the step spent memory (runtimes/planner.py: Step.record) and compiled


def _method_section(cfg: DictConfig, method: methods.Method, run: Outcome) -> dict:
    """A method with a loss of its own (DPO, GRPO): its settings and last step's metrics, under
    the loss's name (the config node of the same name holds the settings)."""
    loss = method.loss
    if loss is methods.Loss.CROSS_ENTROPY:
        return {}
    return {loss.value: {**OmegaConf.to_container(cfg[loss.value]), **run.method_metrics}}


def write_result(
    output_dir: Path,
    cfg: DictConfig,
    method: methods.Method,
    run: Outcome,
    artifact: Path,
    extra: dict | None = None,
) -> dict:
    """Write ``result.json`` (``extra`` is added to it) and return the record. ``method``: the
    record of ``cfg.method``; result.json names it by ``cfg.method``, its name."""
    result = {
        "model": cfg.model_name,
        "base_model": cfg.hub_id,
        "method": cfg.method,
        "steps": run.steps,
        "epochs": cfg.epochs,
        "first_loss": run.first_loss,
        "final_loss": run.final_loss,
        "tokens_seen": run.tokens_seen,
        "wall_time_s": round(run.wall_time_s, 3),
        "world_size": run.world_size,
        "device": run.device,
        "dtype": cfg.dtype,
        "peak_memory_gib": round(run.peak_memory_gib, 3),
        "step_plan": run.step_plan,
        "resumed_from_step": run.resumed_from_step,
        "restarts": run.restarts,
        "val_loss": run.val_loss,
        "val_perplexity": run.val_perplexity,
        "best_val_loss": run.best_val_loss,
        "best_step": run.best_step,
        "val_rows": run.val_rows,
        "keep_best": run.keep_best,
        "published_step": run.published_step,
        "eval_time_s": round(run.eval_time_s, 3),
        "evaluations": run.evaluations,
        "artifact": str(artifact),
        "merged_model": str(output_dir / MERGED_DIR) if cfg.merge else None,
        "trainer_args": OmegaConf.to_container(cfg.trainer_args),
        # The chat format it was trained in (trainers/data/prompt_format.py): generate() and
        # the vLLM manifest prompt the model the same way.
        "chat_template": cfg.tokenizer.get("chat_template"),
        "system_prompt": cfg.tokenizer.get("system_prompt"),
        **_method_section(cfg, method, run),
        "config_digest": result_digest(cfg),
        "identity": result_identity(cfg),
        **(extra or {}),
    }
    durable.write_json(output_dir / RESULT_FILE, result)
    return result
