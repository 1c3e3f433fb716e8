"""tunepack's fine-tuning recipe: LoRA or full fine-tuning on one device.

Read it top to bottom: ``setup`` builds the tokenizer, model, data, optimizer and schedule from
the config (see ``trainers/config.py``); ``train`` runs the loop and logs one JSON line per
logging step; ``save`` writes the result to the output directory.

Unlike torchtune's stock ``lora_finetune_single_device``, saving never merges the adapter into
the live model: on CPU ``tensor.cpu()`` is not a copy, so the stock recipe's merge corrupts the
base weights it keeps training on. Here the adapter is copied out and the base stays frozen.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import tempfile
import time
from functools import partial
from pathlib import Path

import torch
from omegaconf import DictConfig, OmegaConf
from safetensors.torch import save_file
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler
from torchtune import config, training
from torchtune.data import CROSS_ENTROPY_IGNORE_IDX, padded_collate_sft
from torchtune.modules.peft import (
    get_adapter_params,
    get_adapter_state_dict,
    set_trainable_params,
    validate_missing_and_unexpected_for_lora,
)

from tunepack.errors import BadInputError
from tunepack.trainers.peft_export import export_adapter

log = logging.getLogger("tunepack.trainer")

ADAPTER_DIR = "adapter"
MODEL_DIR = "model"
METRICS_FILE = "metrics.jsonl"
RESULT_FILE = "result.json"


class FineTuneRecipe:
    def __init__(self, cfg: DictConfig) -> None:
        self.cfg = cfg
        self.device = torch.device(cfg.device)
        self.dtype = training.get_dtype(cfg.dtype, device=self.device)
        self.output_dir = Path(cfg.output_dir)
        self.is_lora = cfg.method == "lora"
        self.global_step = 0
        self.tokens_seen = 0
        self.losses: list[float] = []

    # ---------------------------------------------------------------- setup
    def setup(self) -> None:
        cfg = self.cfg
        training.set_seed(seed=cfg.seed)
        self.tokenizer = config.instantiate(cfg.tokenizer)
        self.model = self._setup_model(self._load_base_weights())
        self.loss_fn = nn.CrossEntropyLoss(ignore_index=CROSS_ENTROPY_IGNORE_IDX, reduction="sum")
        self.dataloader = self._setup_data()

        self.steps_per_epoch = len(self.dataloader) // cfg.gradient_accumulation_steps
        if self.steps_per_epoch == 0:
            raise BadInputError(
                f"the dataset has {len(self.dataloader.dataset)} examples, fewer than one "
                f"optimizer step needs (batch_size={cfg.batch_size} x "
                f"grad_accum={cfg.gradient_accumulation_steps}); lower batch_size or add data"
            )
        self.total_steps = self.steps_per_epoch * cfg.epochs
        if cfg.max_steps is not None:
            self.total_steps = min(self.total_steps, cfg.max_steps)

        trainable = [p for p in self.model.parameters() if p.requires_grad]
        self.optimizer = config.instantiate(cfg.optimizer, trainable)
        self.lr_scheduler = config.instantiate(
            cfg.lr_scheduler, self.optimizer, num_training_steps=self.total_steps
        )
        log.info(
            "model %s (%s): %d trainable of %d parameters; %d examples, %d steps",
            cfg.model_name,
            cfg.method,
            sum(p.numel() for p in trainable),
            sum(p.numel() for p in self.model.parameters()),
            len(self.dataloader.dataset),
            self.total_steps,
        )

    def _load_base_weights(self) -> dict[str, torch.Tensor]:
        checkpointer = config.instantiate(self.cfg.checkpointer)
        return checkpointer.load_checkpoint()[training.MODEL_KEY]

    def _setup_model(self, base_state: dict[str, torch.Tensor]) -> nn.Module:
        with training.set_default_dtype(self.dtype), self.device:
            model = config.instantiate(self.cfg.model)
        if not self.is_lora:
            model.load_state_dict(base_state, strict=True)
            return model

        set_trainable_params(model, get_adapter_params(model))
        missing, unexpected = model.load_state_dict(base_state, strict=False)
        m = self.cfg.model
        validate_missing_and_unexpected_for_lora(
            lora_attn_modules=list(m.lora_attn_modules),
            apply_lora_to_mlp=m.apply_lora_to_mlp,
            apply_lora_to_output=m.apply_lora_to_output,
            base_missing=missing,
            base_unexpected=unexpected,
        )
        return model

    def _setup_data(self) -> DataLoader:
        cfg = self.cfg
        dataset = config.instantiate(cfg.dataset, self.tokenizer)
        if len(dataset) == 0:
            raise BadInputError(f"the dataset in {cfg.dataset.data_files} has no examples")
        # One replica for now; the sampler's (seed, epoch) makes the order reproducible.
        sampler = DistributedSampler(dataset, num_replicas=1, rank=0, shuffle=True, seed=cfg.seed)
        collate = partial(
            padded_collate_sft,
            padding_idx=self.tokenizer.pad_id,
            ignore_idx=CROSS_ENTROPY_IGNORE_IDX,
        )
        return DataLoader(dataset, batch_size=cfg.batch_size, sampler=sampler, collate_fn=collate)

    # ---------------------------------------------------------------- train
    def _loss_and_tokens(self, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, int]:
        """Summed next-token loss over the batch and the number of tokens it counts."""
        tokens = batch["tokens"].to(self.device)
        labels = batch["labels"].to(self.device)
        # Predict token t+1 from position t: shift labels left, ignore the last position.
        ignore = torch.full_like(labels[:, :1], CROSS_ENTROPY_IGNORE_IDX)
        labels = torch.cat([labels[:, 1:], ignore], dim=1)
        logits = self.model(tokens)
        loss = self.loss_fn(logits.reshape(-1, logits.size(-1)).float(), labels.reshape(-1))
        return loss, int((labels != CROSS_ENTROPY_IGNORE_IDX).sum())

    def train(self) -> None:
        cfg = self.cfg
        accum = cfg.gradient_accumulation_steps
        metrics_path = self.output_dir / METRICS_FILE
        metrics_path.parent.mkdir(parents=True, exist_ok=True)
        started = time.perf_counter()

        self.model.train()
        with metrics_path.open("w") as metrics:
            for epoch in range(cfg.epochs):
                self.dataloader.sampler.set_epoch(epoch)
                step_loss, step_tokens, step_started = 0.0, 0, time.perf_counter()
                for index, batch in enumerate(self.dataloader):
                    loss, n_tokens = self._loss_and_tokens(batch)
                    loss.backward()
                    step_loss += loss.item()
                    step_tokens += n_tokens
                    if (index + 1) % accum:
                        continue
                    # Normalise by every token in the accumulated step, as one big batch would.
                    training.scale_grads(self.model, torch.tensor(1.0 / max(step_tokens, 1)))
                    self.optimizer.step()
                    self.optimizer.zero_grad(set_to_none=True)
                    self.lr_scheduler.step()
                    self.global_step += 1
                    self.tokens_seen += step_tokens
                    self.losses.append(step_loss / max(step_tokens, 1))

                    if self.global_step % cfg.log_every_n_steps == 0:
                        elapsed = time.perf_counter() - step_started
                        record = {
                            "event": "step",
                            "step": self.global_step,
                            "total_steps": self.total_steps,
                            "epoch": epoch + 1,
                            "loss": round(self.losses[-1], 6),
                            "lr": self.optimizer.param_groups[0]["lr"],
                            "tokens_per_second": round(step_tokens / max(elapsed, 1e-9), 1),
                            "elapsed_s": round(time.perf_counter() - started, 3),
                        }
                        metrics.write(json.dumps(record) + "\n")
                        metrics.flush()
                        print(json.dumps(record), flush=True)
                    step_loss, step_tokens, step_started = 0.0, 0, time.perf_counter()
                    if self.global_step >= self.total_steps:
                        break
                if self.global_step >= self.total_steps:
                    break
        self.wall_time = time.perf_counter() - started

    # ---------------------------------------------------------------- save
    def save(self, extra: dict | None = None) -> Path:
        """Write the adapter (LoRA) or HF model (full), then ``result.json`` (plus ``extra``)."""
        if self.is_lora:
            artifact = _publish(self.output_dir / ADAPTER_DIR, self._write_adapter)
        else:
            artifact = _publish(self.output_dir / MODEL_DIR, self._write_full_model)
        result = {
            "model": self.cfg.model_name,
            "base_model": self.cfg.hub_id,
            "method": self.cfg.method,
            "steps": self.global_step,
            "epochs": self.cfg.epochs,
            "first_loss": self.losses[0] if self.losses else None,
            "final_loss": self.losses[-1] if self.losses else None,
            "tokens_seen": self.tokens_seen,
            "wall_time_s": round(getattr(self, "wall_time", 0.0), 3),
            "artifact": str(artifact),
            "trainer_args": OmegaConf.to_container(self.cfg.trainer_args),
            **(extra or {}),
        }
        _write_json_atomic(self.output_dir / RESULT_FILE, result)
        return artifact

    def _hf_config(self) -> dict:
        return json.loads((Path(self.cfg.checkpointer.checkpoint_dir) / "config.json").read_text())

    def _write_adapter(self, directory: Path) -> None:
        m = self.cfg.model
        # Copy out of the live model: the exported tensors must not alias training state.
        adapter = {
            k: v.detach().to("cpu", dtype=torch.float32, copy=True)
            for k, v in get_adapter_state_dict(self.model.state_dict()).items()
        }
        weights, targets = export_adapter(
            adapter,
            model_type=self.cfg.checkpointer.model_type,
            hf_config=self._hf_config(),
            rank=m.lora_rank,
            alpha=m.lora_alpha,
        )
        weights = {k: v.contiguous() for k, v in weights.items()}
        save_file(weights, directory / "adapter_model.safetensors", metadata={"format": "pt"})
        adapter_config = {
            "peft_type": "LORA",
            "task_type": "CAUSAL_LM",
            "base_model_name_or_path": self.cfg.hub_id,
            "r": m.lora_rank,
            "lora_alpha": m.lora_alpha,
            "lora_dropout": m.lora_dropout,
            "bias": "none",
            "fan_in_fan_out": False,
            "inference_mode": True,
            "use_dora": False,
            "use_rslora": False,
            "modules_to_save": None,
            **targets,
        }
        (directory / "adapter_config.json").write_text(json.dumps(adapter_config, indent=2))

    def _write_full_model(self, directory: Path) -> None:
        ckpt = dict(self.cfg.checkpointer)
        ckpt["output_dir"] = str(directory / ".staging")
        checkpointer = config.instantiate(OmegaConf.create(ckpt))
        state = {k: v.detach().to("cpu", copy=True) for k, v in self.model.state_dict().items()}
        checkpointer.save_checkpoint({training.MODEL_KEY: state}, epoch=0)
        # torchtune writes weights plus the source's config/tokenizer files under epoch_0/.
        staged = directory / ".staging" / "epoch_0"
        for item in staged.iterdir():
            shutil.move(str(item), directory / item.name)
        shutil.rmtree(directory / ".staging")


def _publish(destination: Path, write) -> Path:
    """Run ``write(tmpdir)`` and move the result to ``destination`` only once it is complete."""
    destination.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{destination.name}.partial-", dir=destination.parent))
    try:
        write(staging)
        if destination.exists():
            old = destination.with_name(f".{destination.name}.old-{os.getpid()}")
            destination.rename(old)
            staging.rename(destination)
            shutil.rmtree(old)
        else:
            staging.rename(destination)
    finally:
        if staging.exists():
            shutil.rmtree(staging)
    return destination


def _write_json_atomic(path: Path, data: dict) -> None:
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.write_text(json.dumps(data, indent=2) + "\n")
    os.replace(tmp, path)


def run(cfg: DictConfig, extra: dict | None = None) -> dict:
    """Set up, train and save; return the result record (``extra`` is added to it)."""
    recipe = FineTuneRecipe(cfg)
    recipe.setup()
    recipe.train()
    recipe.save(extra)
    return json.loads((recipe.output_dir / RESULT_FILE).read_text())
