"""tunepack's fine-tuning recipe: every method, on one process or many (FSDP2).

Read it top to bottom: ``setup``, ``train`` (``_step``, ``_after_step``), ``evaluate``,
``save_checkpoint``, ``save``; docs/architecture.md, "Trainer", says what each does and which
room it leans on.

Why not torchtune's stock recipes (0.6.1): the distributed ones hard-code NCCL and CUDA memory
calls, none checkpoints mid-epoch, the single-device one forgets the global step on resume, and
on CPU the LoRA ones merge the adapter into the live base weights at every save (``tensor.cpu()``
is not a copy there). This recipe keeps their components and never merges into live weights.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
import resource
import signal
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import BinaryIO

import torch
from omegaconf import DictConfig, OmegaConf
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
from torch.utils.data import DataLoader
from torchtune import config, modules, training
from torchtune.data import CROSS_ENTROPY_IGNORE_IDX, padded_collate_packed, padded_collate_sft
from torchtune.modules.peft import (
    DoRALinear,
    LoRALinear,
    get_adapter_params,
    set_trainable_params,
    validate_missing_and_unexpected_for_lora,
)

from tunepack.core import durable, lifetime
from tunepack.core.errors import (
    BadDatasetError,
    BadInputError,
    ConflictError,
    DoesNotFitError,
    NonFiniteLossError,
    StoppedError,
    TunepackError,
)
from tunepack.core.workspace import METRICS_FILE, RESULT_FILE
from tunepack.runtimes import methods, planner
from tunepack.trainers.config import (
    DATASET_BUILDERS,
    IMAGE_DATASET_BUILDER,
    run_digest,
    run_identity,
)
from tunepack.trainers.data import batching, vision_data
from tunepack.trainers.data.batching import real_positions
from tunepack.trainers.models import adapter_init, lora_product, mllama, moe
from tunepack.trainers.objectives import vocab_loss
from tunepack.trainers.objectives.base import Objective
from tunepack.trainers.objectives.table import OBJECTIVES
from tunepack.trainers.outputs import artifacts, checkpoint, metrics_file
from tunepack.trainers.outputs.progress import RunProgress
from tunepack.trainers.outputs.tracking import Tracker
from tunepack.trainers.outputs.trainjob_status import StatusReporter
from tunepack.trainers.process import allocator, compiling, distributed

log = logging.getLogger("tunepack.trainer")
TEXT_BUILDER = DATASET_BUILDERS["text"]  # torchtune keeps max_seq_len - 1 tokens of a text row


@dataclass(frozen=True)
class Step:
    """One optimizer step, summed over every rank: what the reports and checks after it read."""

    tokens: float  # tokens trained on (DPO: the real tokens of its pairs)
    seconds: float
    fill: float | None  # real tokens / computed positions (padding, a pack's unused tail)
    stop: bool  # some rank was asked to stop
    checkpoint_due: bool  # by rank 0's clock (checkpoint_every_minutes)


@dataclass
class _Attempt:
    """This process's run of the training loop (a restart is the next attempt): where it
    reports, and its clocks."""

    metrics: BinaryIO | None  # metrics.jsonl, rank 0 only
    reporter: StatusReporter | None  # the controller's status, rank 0 only
    tracker: Tracker
    first_step: int  # the global step it started from
    prior_wall_time_s: float  # training time of the earlier attempts
    started: float = field(default_factory=time.monotonic)  # moved on past each evaluation
    last_checkpoint: float = field(default_factory=time.monotonic)
    status: dict = field(default_factory=dict)  # the last step's, re-sent with an evaluation's

    def trained_s(self) -> float:
        """Seconds this attempt trained (evaluations left out)."""
        return time.monotonic() - self.started

    def wall_time_s(self) -> float:
        """Training time of the run so far, earlier attempts included."""
        return self.prior_wall_time_s + self.trained_s()

    def close(self) -> None:
        if self.metrics is not None:
            self.metrics.close()
        if self.reporter is not None:
            self.reporter.close()
        self.tracker.close()


def _deterministic_kernels() -> None:
    """deterministic=true on a GPU. Measured on one H100 (docs/gpu.md): two runs differed by 1e-3
    after 5 steps, all of it from flash attention's backward, which accumulates with atomics and
    which ``use_deterministic_algorithms(warn_only=True)`` still lets run; with the math kernel
    two runs and a resumed one ended bit-identical."""
    # cuBLAS reads this when it makes its first handle: before the first matmul.
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(True, warn_only=True)
    torch.backends.cudnn.benchmark = False
    torch.backends.cuda.enable_flash_sdp(False)
    torch.backends.cuda.enable_mem_efficient_sdp(False)
    torch.backends.cuda.enable_cudnn_sdp(False)


class FineTuneRecipe:
    def __init__(self, cfg: DictConfig) -> None:
        self.cfg = cfg
        self.topo, self.device = distributed.init(cfg.device)
        self.dtype = training.get_dtype(cfg.dtype, device=self.device)
        self.output_dir = Path(cfg.output_dir)
        self.method = methods.get(cfg.method)
        self.is_lora = self.method.adapters
        self.digest = run_digest(cfg)
        # The method's own loss (Objective), set up with the tokenizer; None: next-token
        # cross-entropy.
        self.objective: Objective | None = None
        self.stop_requested = False  # set by the SIGTERM handler; honoured after each step
        # compile=auto decides in setup, once the planned work is known; a resume keeps the choice
        # its checkpoint records.
        self.compiled = False
        # How the step spends memory (recomputed layers, rows of logits at once): chosen in setup
        # for the device from the memory plan; a resume keeps the choice too.
        self.step: planner.Step | None = None
        self.examples_per_batch = cfg.batch_size * self.topo.world_size  # every rank's, together
        self.progress = RunProgress()  # saved in checkpoints, restored on resume
        self.tracker_record: dict | None = None  # result.json's "tracker" (outputs/tracking.py)
        self.val_indices: list[int] = []
        # The fill of the last micro-batch: (real tokens, computed positions); padding and a
        # pack's unused tail are computed too.
        self.batch_fill = (0, 0)

    # The two facts of the progress its callers read (tests, benchmarks/gpu_check.py).
    @property
    def global_step(self) -> int:
        return self.progress.step

    @property
    def resumed_from(self) -> int | None:
        return self.progress.resumed_from

    # ---------------------------------------------------------------- setup
    def setup(self) -> None:
        cfg = self.cfg
        if self.device.type == "cpu":  # steps reuse their large blocks (process/allocator.py)
            allocator.keep_large_blocks()
        training.set_seed(seed=cfg.seed)  # seed + rank on each rank, as torchtune does
        if cfg.get("deterministic") and self.device.type == "cuda":
            _deterministic_kernels()
        self.tokenizer = config.instantiate(cfg.tokenizer)
        self.objective = self._objective()
        self.dataloader = self._setup_data()

        # Micro-batches that make whole optimizer steps; a ragged remainder is left out.
        self.steps_per_epoch = len(self.dataloader) // cfg.gradient_accumulation_steps
        if self.steps_per_epoch == 0:
            raise ConflictError(
                f"the dataset has {len(self.dataloader.dataset)} examples, fewer than one "
                f"optimizer step needs ({self.topo.world_size} processes x batch_size="
                f"{cfg.batch_size} x grad_accum={cfg.gradient_accumulation_steps}); "
                "lower batch_size or grad_accum, or add data"
            )
        self.total_steps = self.steps_per_epoch * cfg.epochs
        if cfg.max_steps is not None:
            self.total_steps = min(self.total_steps, cfg.max_steps)

        # Known before the model is built: whether this is a resumed run, and so whether it
        # compiles (a resumed run keeps the choice its checkpoints record).
        found = self._find_checkpoint()
        self.compiled = self._choose_compile(found)
        self.step = self._choose_step(found)
        self.model = self._setup_model(self._load_base_weights())
        if self.objective is not None and self.objective.needs_reference(adapters=self.is_lora):
            # E.g. GRPO of every weight: its KL reference is a frozen copy of the base, built and
            # sharded as the model is (the adapters' methods switch their adapters off instead).
            self.objective.reference = self._setup_model(self._load_base_weights())
            self.objective.reference.requires_grad_(False)
            self.objective.reference.eval()
        self.loss_fn = nn.CrossEntropyLoss(ignore_index=CROSS_ENTROPY_IGNORE_IDX, reduction="sum")
        # The loss fused with the output projection (objectives/vocab_loss.py) wherever the model
        # allows it; the methods with a loss of their own read log-probabilities from the logits.
        self.fused_loss = self.objective is None and vocab_loss.supports(self.model)
        if self.compiled and not self.fused_loss:
            self.loss_fn = training.compile_loss(self.loss_fn, verbose=self.topo.is_main)

        trainable = [p for p in self.model.parameters() if p.requires_grad]
        self.optimizer = config.instantiate(cfg.optimizer, trainable)
        self.lr_scheduler = config.instantiate(
            cfg.lr_scheduler, self.optimizer, num_training_steps=self.total_steps
        )
        if found is not None:
            self._resume(found)
        if self.topo.is_main:
            log.info(
                "model %s (%s, %s, %d process%s): %d trainable parameters; %d examples, "
                "%d steps, starting at step %d",
                cfg.model_name,
                cfg.method,
                cfg.dtype,
                self.topo.world_size,
                "" if self.topo.world_size == 1 else "es",
                sum(p.numel() for p in trainable),
                len(self.dataloader.dataset),
                self.total_steps,
                self.progress.step,
            )

    def _objective(self) -> Objective | None:
        """The method's own loss (trainers/objectives/table.py), or None: next-token
        cross-entropy."""
        declared = OBJECTIVES.get(self.method.loss)
        if declared is None:
            return None
        return declared.load().from_config(
            self.cfg, self.tokenizer, distributed=self.topo.distributed
        )

    def _load_base_weights(self) -> dict[str, torch.Tensor]:
        """The base model's full state dict, on the ranks that need it.

        A sharded run reads it on rank 0 only, which streams each weight to the other ranks'
        shards (``_load_shards``): one copy in host memory instead of one per process. QLoRA is
        the exception: torchtune quantizes each rank's NF4 shard from that rank's own full copy.
        """
        if self.topo.distributed and not self.topo.is_main and not self.method.quantize_base:
            return {}
        checkpointer = config.instantiate(self.cfg.checkpointer)
        return checkpointer.load_checkpoint()[training.MODEL_KEY]

    def _setup_model(self, base_state: dict[str, torch.Tensor]) -> nn.Module:
        if self.topo.distributed:
            return self._setup_sharded_model(base_state)
        cfg = self.cfg
        with training.set_default_dtype(self.dtype), self.device:
            model = config.instantiate(cfg.model)
        if self.is_lora:
            set_trainable_params(model, get_adapter_params(model))
        self._fuse_lora(model)
        missing, unexpected = model.load_state_dict(base_state, strict=not self.is_lora)
        del base_state
        self._check_loaded(model, missing, unexpected)
        self._recompute_layers(model)
        if self.compiled:
            training.compile_model(model, verbose=self.topo.is_main)
        return model

    def _fuse_lora(self, model: nn.Module) -> None:
        """LoRA's product in one autograd function where it was measured to pay (the CPU)."""
        if self.is_lora and lora_product.applies(self.device):
            lora_product.fuse(model)

    def _setup_sharded_model(self, base_state: dict[str, torch.Tensor]) -> nn.Module:
        """FSDP2: built on the meta device, sharded, then each rank fills only its shard, so no
        process ever holds the whole model on its GPU."""
        cfg = self.cfg
        with training.set_default_dtype(self.dtype), torch.device("meta"):
            model = config.instantiate(cfg.model)
        if self.is_lora:
            set_trainable_params(model, get_adapter_params(model))
        self._fuse_lora(model)
        self._recompute_layers(model)
        if self.compiled:
            training.compile_model(model, verbose=self.topo.is_main)
        # Each transformer layer is one unit of all-gather / reduce-scatter. LoRA's frozen base
        # and trainable adapters share units; only the adapters get gradients.
        training.shard_model(
            model,
            [lambda _name, m: isinstance(m, modules.TransformerSelfAttentionLayer)],
            cpu_offload=False,
            reshard_after_forward=True,
        )
        # What the checkpoint does not hold: fresh adapters and the RoPE tables.
        with training.set_default_dtype(self.dtype), self.device:
            for module in model.modules():
                if isinstance(module, LoRALinear | DoRALinear | moe.LoRAExperts):
                    module.to_empty(device=self.device)
                    module.initialize_parameters()
                if hasattr(module, "rope_init"):
                    module.rope_init()
                if hasattr(module, "init_tables"):  # Llama 3.2 Vision's aspect-ratio ids
                    module.init_tables()
        missing, unexpected = self._load_shards(model, base_state)
        del base_state
        self._check_loaded(model, missing, unexpected)
        training.validate_no_params_on_meta_device(model)
        on_meta = [name for name, buffer in model.named_buffers() if buffer.is_meta]
        if on_meta:
            raise RuntimeError(f"buffers left on the meta device: {on_meta}")
        return model

    def _load_shards(self, model: nn.Module, base_state: dict[str, torch.Tensor]):
        if self.method.quantize_base:
            return training.load_from_full_model_state_dict(
                model, base_state, self.device, strict=False
            )
        base_state = {k: v.to(self.dtype) for k, v in base_state.items()}
        options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True, strict=False)
        # Llama 3.2 Vision's fusion modules: keys by attribute (a no-op for the text models).
        with checkpoint.own_names(model):
            base_state = checkpoint.to_own_names(model, base_state)
            return set_model_state_dict(model, base_state, options=options)

    def _check_loaded(self, model: nn.Module, missing: list[str], unexpected: list[str]) -> None:
        """Every base weight found a place, and only adapters were left out of the checkpoint."""
        if not self.is_lora:
            if missing or unexpected:
                raise RuntimeError(
                    f"the checkpoint does not fit the model: missing {missing}, "
                    f"unexpected {unexpected}"
                )
            return
        # torchtune's check knows the text decoders' LoRA keys; the experts' adapters and the
        # vision projector's are tunepack's.
        missing = [
            k
            for k in missing
            if not (moe.EXPERT_ADAPTER_KEY.match(k) or k.startswith(mllama.PROJECTOR_ADAPTER))
        ]
        validate_missing_and_unexpected_for_lora(
            lora_attn_modules=list(self.cfg.model.lora_attn_modules),
            apply_lora_to_mlp=self.cfg.model.apply_lora_to_mlp,
            apply_lora_to_output=self.cfg.model.apply_lora_to_output,
            base_missing=missing,
            base_unexpected=unexpected,
        )
        # The same fresh adapters on one process or many (trainers/models/adapter_init.py).
        adapter_init.initialize(model, self.cfg.seed)
        # DoRA's magnitude starts as the norm of the base weight it scales: only now known.
        for module in model.modules():
            if hasattr(module, "initialize_dora_magnitude"):
                module.initialize_dora_magnitude()

    def _setup_data(self) -> DataLoader:
        cfg, topo = self.cfg, self.topo
        # Unpacked here: packing (below) comes after the validation rows are set aside.
        dataset = config.instantiate(cfg.dataset, self.tokenizer, packed=False)
        if len(dataset) == 0:
            raise BadDatasetError(f"the dataset in {cfg.dataset.data_files} has no examples")
        # Each row's length before max_seq_len cuts it: said once, and the sampler's lengths.
        with self.tokenizer.untruncated():
            if isinstance(dataset, vision_data.ImageChatDataset):  # tokens only, no images
                full = dataset.token_lengths()
            else:
                full = batching.example_lengths(dataset, "example lengths")
        kept = self.tokenizer.max_seq_len - (1 if cfg.dataset._component_ == TEXT_BUILDER else 0)
        line = batching.cut_rows_line(full, kept, self.tokenizer.max_seq_len)
        if topo.is_main and line:
            log.warning("%s", line)
        self.val_dataset = dataset
        validation = cfg.get("validation")
        if validation and validation.get("data_files"):  # the dataset's own split
            node = OmegaConf.merge(cfg.dataset, {"data_files": list(validation.data_files)})
            self.val_dataset = config.instantiate(node, self.tokenizer, packed=False)
            self.val_indices = list(range(len(self.val_dataset)))
        elif validation:
            dataset, self.val_indices = batching.hold_out(dataset, float(validation.fraction))
        collate = self._collate(dataset)
        self.collate = collate  # validation batches: the rows as they are, never packed
        dataset, self.sampler = batching.arrange(
            dataset,
            cfg.batching,
            lengths=[min(n, kept) for n in full],  # as the dataset cuts them
            batch_size=cfg.batch_size,
            max_seq_len=self.tokenizer.max_seq_len,
            padding_idx=self.tokenizer.pad_id,
            rank=topo.rank,
            world_size=topo.world_size,
            seed=cfg.seed,
        )
        if cfg.batching == "packed":
            collate = padded_collate_packed
        # A generator of its own: a DataLoader otherwise draws a seed from the global RNG each
        # time it starts an epoch, so a resumed run would see different dropout masks.
        return DataLoader(
            dataset,
            batch_size=cfg.batch_size,
            sampler=self.sampler,
            collate_fn=collate,
            generator=torch.Generator().manual_seed(cfg.seed),
        )

    def _collate(self, dataset):
        """How the method's rows make a batch (a method's own loss: its objective's batches)."""
        if self.objective is not None:
            return self.objective.collate(dataset, self.tokenizer.pad_id)
        if self.cfg.dataset._component_ == IMAGE_DATASET_BUILDER:  # (held-out rows: a Subset)
            return partial(vision_data.collate, padding_idx=self.tokenizer.pad_id)
        return partial(
            padded_collate_sft,
            padding_idx=self.tokenizer.pad_id,
            ignore_idx=CROSS_ENTROPY_IGNORE_IDX,
        )

    def _find_checkpoint(self) -> Path | None:
        """The checkpoint this run resumes from (the same on every rank), or None."""
        ckpt = self.cfg.checkpointing
        found = None
        if self.topo.is_main:  # verifies, sets damaged checkpoints aside; every rank follows
            found = checkpoint.find_or_clear(
                Path(ckpt.dir), self.digest, run_identity(self.cfg), resume=ckpt.resume
            )
        found = distributed.broadcast_from_main(None if found is None else str(found))
        if found is None:
            distributed.barrier()
        return None if found is None else Path(found)

    def _choose_compile(self, found: Path | None) -> bool:
        """compile=true/false as given; compile=auto from the planned work
        (trainers/process/compiling.py), or as the checkpoint resumed from records."""
        cfg = self.cfg
        if self.method.sequences_key:  # generation: a new shape at every token (args refuse true)
            return False
        if cfg.compile == "auto" and found is not None:
            recorded = checkpoint.read_manifest(found).get("compiled")
            if recorded is not None:
                return bool(recorded)
        estimate = None
        if cfg.compile == "auto":
            lengths = getattr(self.sampler, "lengths", None)
            per_example = sum(lengths) / len(lengths) if lengths else self.tokenizer.max_seq_len
            examples = cfg.batch_size * cfg.gradient_accumulation_steps * self.topo.world_size
            with torch.random.fork_rng(devices=[]):  # the run's random numbers stay untouched
                with torch.device("meta"):
                    parameters = sum(p.numel() for p in config.instantiate(cfg.model).parameters())
                rate = compiling.matmul_rate(self.device, self.dtype)
            estimate = compiling.estimated_training_s(
                tokens=self.total_steps * examples * per_example,
                parameters=parameters,
                trains_all=not self.is_lora,
                rate=rate,
            )
        compiled, why = compiling.choose(cfg.compile, device=self.device, estimate_s=estimate)
        if self.topo.is_main and cfg.compile == "auto":
            log.info("%s", why)
        return compiled

    def _choose_step(self, found: Path | None) -> planner.Step:
        """The step for this device (runtimes/planner.py: choose_step): on a GPU the fastest that
        the memory plan fits in the device's memory, ``auto`` settings only; on a CPU no
        recomputation and cache-sized chunks of logits. A resumed run keeps the step its
        checkpoint records, so it computes exactly as before."""
        settings = self.cfg.step
        auto = "auto" in (settings.activation_checkpointing, settings.loss_chunk)
        if auto and found is not None:
            recorded = checkpoint.read_manifest(found).get("step_plan")
            if recorded is not None:
                step = planner.Step.from_record(recorded)
                if settings.activation_checkpointing != "auto":  # an explicit setting wins
                    recompute = step.layers if settings.activation_checkpointing else 0
                    step = dataclasses.replace(step, recompute_layers=recompute)
                if settings.loss_chunk != "auto" and step.loss_chunk_rows is not None:
                    step = dataclasses.replace(step, loss_chunk_rows=settings.loss_chunk)
                if self.topo.is_main:
                    log.info("step: %s (as the checkpoint resumed from)", step.describe())
                return step
        if self.device.type != "cuda":
            step = planner.cpu_step(
                settings.layers,
                settings.vocab,
                settings.fused_loss,
                settings.activation_checkpointing,
                settings.loss_chunk,
            )
            if self.topo.is_main:
                log.info("step: %s (on the CPU)", step.describe())
            return step
        job = OmegaConf.to_container(settings.job)
        entry = planner.model_entry(job.pop("model"), job.pop("model_dir"))
        total = torch.cuda.get_device_properties(self.device).total_memory / planner.GIB
        if "lora_attn_modules" in job:
            job["lora_attn_modules"] = tuple(job["lora_attn_modules"])
        plan = planner.estimate(
            entry,
            **job,
            gpus_per_node=self.topo.world_size,  # FSDP shards over every process
            dtype=self.cfg.dtype,
            activation_checkpointing=settings.activation_checkpointing,
            loss_chunk=settings.loss_chunk,
            capacity_gib=total - planner.CUDA_RESERVE_GIB,
        )
        if self.topo.is_main:
            log.info(
                "step: %s; planned peak %.2f GiB of the device's %.1f GiB (%s)",
                plan.step.describe(plan.tokens),
                plan.peak_gib,
                total,
                "chosen for the device" if plan.step.chosen else "as given",
            )
        return plan.step

    def _recompute_layers(self, model: nn.Module) -> None:
        """Activation checkpointing on the step's first ``recompute_layers`` transformer layers
        (every layer where the model takes images: its vision tower's are not planned)."""
        wanted = self.step.recompute_layers
        if not wanted:
            return
        layer_type = modules.TransformerSelfAttentionLayer
        if wanted < self.step.layers:
            layers = [m for m in model.modules() if isinstance(m, layer_type)]
            chosen = {id(m) for m in layers[:wanted]}
            training.set_activation_checkpointing(
                model,
                auto_wrap_policy=lambda module, recurse, nonwrapped_numel: (
                    recurse or id(module) in chosen
                ),
            )
        else:
            training.set_activation_checkpointing(model, auto_wrap_policy={layer_type})

    def _resume(self, found: Path) -> None:
        manifest = checkpoint.load(
            found,
            model=self.model,
            optimizer=self.optimizer,
            lr_scheduler=self.lr_scheduler,
            topo=self.topo,
        )
        self.progress = RunProgress.from_manifest(manifest, self.examples_per_batch)
        if self.topo.is_main:
            log.info("resumed from %s (step %d)", found, self.progress.step)

    # ---------------------------------------------------------------- train
    def _loss_and_tokens(self, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, int]:
        """Summed next-token loss over the batch, on the device, and the number of tokens it
        counts, counted on the host from the collated batch (a method's own loss: the summed loss
        of its pairs or answers, and their number). Nothing here waits for the device."""
        if self.objective is not None and self.objective.fill is not None:
            loss_and_count = self.objective.forward(self.model, batch, self.device)
            self.batch_fill = self.objective.fill  # of the tokens it made (GRPO's answers)
            return loss_and_count
        self.batch_fill = (real_positions(batch["labels"]), batch["tokens"].numel())
        if self.objective is not None:
            return self.objective.forward(self.model, batch, self.device)
        # Predict token t+1 from position t: shift labels left, ignore the last position.
        labels = batch["labels"]
        ignore = torch.full_like(labels[:, :1], CROSS_ENTROPY_IGNORE_IDX)
        labels = torch.cat([labels[:, 1:], ignore], dim=1).reshape(-1)
        counted = labels != CROSS_ENTROPY_IGNORE_IDX
        n_tokens = int(counted.sum())
        tokens = batch["tokens"].to(self.device)
        extra = {}
        if "mask" in batch:  # packed: attend only within each example, positions restart
            extra = {"mask": batch["mask"].to(self.device), "input_pos": batch["input_pos"]}
            extra["input_pos"] = extra["input_pos"].to(self.device)
        if batch.get("encoder_input") is not None:  # images (trainers/data/vision_data.py)
            images = batch["encoder_input"]
            extra["encoder_input"] = {
                "images": images["images"].to(self.device, self.dtype),
                "aspect_ratio": images["aspect_ratio"].to(self.device),
            }
            extra["encoder_mask"] = batch["encoder_mask"].to(self.device)
        if self.fused_loss:  # the output projection on the counted positions only
            rows = counted.nonzero().squeeze(1)
            targets = labels[rows].to(self.device)
            chunk_rows = self.step.loss_chunk_rows
            with vocab_loss.loss_instead_of_logits(
                self.model, rows.to(self.device), targets, chunk_rows
            ):
                return self.model(tokens, **extra), n_tokens
        logits = self.model(tokens, **extra)
        loss = self.loss_fn(logits.reshape(-1, logits.size(-1)).float(), labels.to(self.device))
        return loss, n_tokens

    def train(self) -> None:
        """Optimizer steps up to the planned number, each followed by its report, evaluation,
        checkpoint and stop request (``_after_step``)."""
        progress = self.progress
        attempt = self._open_attempt()
        self.model.train()
        try:
            while progress.step < self.total_steps and progress.epoch < self.cfg.epochs:
                self.sampler.set_epoch(
                    progress.epoch, start=progress.batch_in_epoch * self.examples_per_batch
                )
                micro_batches = iter(self.dataloader)
                while True:
                    step = self._step(micro_batches, attempt)
                    self._after_step(step, attempt)
                    if progress.step >= self.total_steps or progress.batch_in_epoch == 0:
                        break  # done, or on to the next epoch (the remainder is left out)
        finally:
            progress.wall_time_s = attempt.wall_time_s()
            attempt.close()

    def _open_attempt(self) -> _Attempt:
        is_main = self.topo.is_main
        reporter = StatusReporter.from_env() if is_main else None
        metrics = (
            metrics_file.open_for(self.output_dir / METRICS_FILE, self.progress.resumed_from)
            if is_main
            else None
        )
        tracker = Tracker.open(self._tracker_settings(), is_main=is_main)
        self.tracker_record = tracker.record
        return _Attempt(
            metrics=metrics,
            reporter=reporter,
            tracker=tracker,
            first_step=self.progress.step,
            prior_wall_time_s=self.progress.wall_time_s,
        )

    def _step(self, micro_batches: Iterator[dict], attempt: _Attempt) -> Step:
        """One optimizer step: this rank's micro-batches of it forward and backward, one
        collective for the sums of every rank, then the update (never a non-finite one)."""
        began = time.monotonic()
        loss_sum, tokens, fill, stats = self._accumulate(micro_batches)
        # One collective per step: the loss and token sums of every rank, whether any rank was
        # asked to stop, and whether rank 0's clock says a checkpoint is due.
        # (A method's own loss: "tokens" are pairs or answers here; its stats start with the real
        # token count.)
        total_loss, total_tokens, stops, due, real, computed, *stats = distributed.all_reduce_sum(
            [
                float(loss_sum),
                tokens,
                float(self.stop_requested),
                float(self._checkpoint_time_due(attempt)),
                *fill,
                *stats,
            ],
            self.device,
        )
        if not math.isfinite(total_loss):  # the same sum on every rank: all stop
            self._non_finite_loss(total_loss)
        self._update(total_tokens)
        loss = total_loss / max(total_tokens, 1.0)
        if self.objective is not None:
            self.progress.method_metrics = self.objective.metrics(stats, total_tokens)
            total_tokens = stats[0]
        usable = self.steps_per_epoch * self.cfg.gradient_accumulation_steps
        self.progress.add_step(
            loss, int(total_tokens), epoch_done=self.progress.batch_in_epoch >= usable
        )
        return Step(
            tokens=total_tokens,
            seconds=time.monotonic() - began,
            fill=real / computed if computed else None,
            stop=bool(stops),
            checkpoint_due=bool(due),
        )

    def _accumulate(
        self, micro_batches: Iterator[dict]
    ) -> tuple[torch.Tensor | float, int, list[int], list[float]]:
        """Forward and backward over this rank's micro-batches of one step, the gradients adding
        up: the summed loss (on the device, read once per step), the tokens it counts, the
        (real, computed) positions and, for a method's own loss, the summed stats."""
        loss_sum, tokens, fill = 0.0, 0, [0, 0]
        stats = [0.0] * len(self.objective.stat_names) if self.objective else []
        if self.objective is not None:
            self.objective.start_step(self.progress.step)
        # Up to the step's boundary, counted in the epoch: a run resumed with another world size
        # may start part-way through a step.
        for batch in micro_batches:
            loss, n_tokens = self._loss_and_tokens(batch)
            # A mixture of experts: + its routers' load-balancing loss (models/moe.py; else 0).
            loss = loss + moe.router_aux_loss(self.model, batch.get("labels"), n_tokens)
            loss.backward()
            loss_sum += loss.detach().double()
            tokens += n_tokens
            fill = [a + b for a, b in zip(fill, self.batch_fill, strict=True)]
            if self.objective is not None:
                stats = [a + b for a, b in zip(stats, self.objective.batch_stats, strict=True)]
            self.progress.batch_in_epoch += 1
            if self.progress.batch_in_epoch % self.cfg.gradient_accumulation_steps == 0:
                break
        return loss_sum, tokens, fill, stats

    def _update(self, total_tokens: float) -> None:
        """The optimizer's update, the gradients normalised by every token of the step on every
        rank, as one big batch would be (FSDP averages gradients over ranks, hence the world size
        in the numerator)."""
        scale = self.topo.world_size / max(total_tokens, 1.0)
        training.scale_grads(self.model, torch.tensor(scale, device=self.device))
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.lr_scheduler.step()

    def _checkpoint_time_due(self, attempt: _Attempt) -> bool:
        """Rank 0's clock: checkpoint_every_minutes have passed since the last checkpoint."""
        every_s = self.cfg.checkpointing.every_minutes * 60
        return (
            self.topo.is_main
            and every_s > 0
            and time.monotonic() - attempt.last_checkpoint >= every_s
        )

    def _after_step(self, step: Step, attempt: _Attempt) -> None:
        """What follows a step: its report (rank 0), an evaluation when due, a checkpoint when
        due or asked for, and the stop that was asked for."""
        progress, cfg = self.progress, self.cfg
        if self.topo.is_main:
            self._report(step, attempt)
        finished = progress.step >= self.total_steps
        # Evaluated before any checkpoint of this step, so the checkpoint records it.
        eval_every = int(cfg.get("eval", {}).get("every_steps", 0))
        if self.val_indices and (finished or (eval_every and progress.step % eval_every == 0)):
            attempt.started += self._evaluate_and_record(attempt)  # not training time
        every_steps = cfg.checkpointing.every_steps
        by_steps = every_steps > 0 and progress.step % every_steps == 0
        if step.stop or (not finished and (by_steps or step.checkpoint_due)):
            progress.wall_time_s = attempt.wall_time_s()
            self.save_checkpoint()
            attempt.last_checkpoint = time.monotonic()
        if step.stop:
            raise StoppedError(
                f"asked to stop (SIGTERM); checkpoint of step {progress.step} written, a restart "
                "resumes from it"
            )

    def _tracker_settings(self) -> dict:
        settings = dict(self.cfg.get("tracker") or {})
        settings["run_name"] = f"{self.cfg.model_name}-{self.method.name}"
        return settings

    def _non_finite_loss(self, loss: float) -> None:
        """Stop before the optimizer step: nothing non-finite is applied, saved or published."""
        done = self.progress.step
        if done == 0:  # before any update: the base model, the data or the settings
            raise BadInputError(
                f"the loss is {loss} at the first step, before any update: check the base model's "
                "weights, the data and the arguments (dtype, max_seq_len); nothing was published"
            )
        raise NonFiniteLossError(
            f"the loss became {loss} at step {done + 1} (the step before: "
            f"{self.progress.last_loss}): training diverged; lower lr (now "
            f"{self.cfg.optimizer.lr}) or raise warmup_steps; nothing was published"
        )

    def _report(self, step: Step, attempt: _Attempt) -> None:
        """Rank 0: the newest snapshot for the controller, one JSON line per logging step, and
        the step's metrics for the tracker."""
        progress = self.progress
        lr = self.optimizer.param_groups[0]["lr"]
        tokens_per_s = step.tokens / max(step.seconds, 1e-9)
        if attempt.reporter is not None:
            per_step = attempt.trained_s() / max(progress.step - attempt.first_step, 1)
            attempt.status = {
                "loss": round(progress.last_loss, 6),
                "learning_rate": lr,
                "tokens_per_second": round(tokens_per_s, 1),
                "peak_memory_gib": round(peak_memory_gib(self.device), 3),
                "step": progress.step,
                **progress.method_metrics,
            }
            attempt.reporter.update(
                100 * progress.step // self.total_steps,
                int(per_step * (self.total_steps - progress.step)),
                {**attempt.status, **self._status_metrics()},
            )
        if progress.step % self.cfg.log_every_n_steps == 0 or progress.step == self.total_steps:
            record = {
                "event": "step",
                "step": progress.step,
                "total_steps": self.total_steps,
                # 1-based: the epoch this step belongs to
                "epoch": progress.epoch + 1 if progress.batch_in_epoch else progress.epoch,
                "loss": round(progress.last_loss, 6),
                "lr": lr,
                "tokens": int(step.tokens),
                "tokens_per_second": round(tokens_per_s, 1),
                "peak_memory_gib": round(peak_memory_gib(self.device), 3),
                "elapsed_s": round(attempt.wall_time_s(), 3),
                **progress.method_metrics,
            }
            if step.fill is not None:
                record["fill"] = round(step.fill, 4)
            self._write_line(attempt, record)
        attempt.tracker.log(
            {
                "loss": progress.last_loss,
                "lr": lr,
                "tokens_per_second": tokens_per_s,
                **progress.method_metrics,
            },
            progress.step,
        )

    def _write_line(self, attempt: _Attempt, record: dict) -> None:
        """Rank 0: one record in metrics.jsonl, and on stdout."""
        line = json.dumps(record)
        metrics_file.append_line(attempt.metrics, self.output_dir / METRICS_FILE, line + "\n")
        print(line, flush=True)
        # The same figures as name=value pairs, for a Katib Experiment's StdOut collector.
        print(f"metrics: {methods.stdout_metrics(record)}", flush=True)

    # ---------------------------------------------------------------- evaluate
    def evaluate(self) -> float:
        """The validation loss (mean per counted token, over every rank's share of the rows).

        Each rank takes every world_size-th held-out row; ranks with fewer batches run a last
        forward on a batch whose loss is discarded, so every rank joins every FSDP collective.
        No random numbers are drawn (eval mode: no dropout), so training stays bit-identical.
        """
        topo, cfg = self.topo, self.cfg
        mine = self.val_indices[topo.rank :: topo.world_size]
        per_rank = math.ceil(len(self.val_indices) / topo.world_size)
        n_batches = math.ceil(per_rank / cfg.batch_size)
        total_loss, total_tokens = 0.0, 0
        self.model.eval()
        try:
            with torch.no_grad():
                for b in range(n_batches):
                    rows = mine[b * cfg.batch_size : (b + 1) * cfg.batch_size]
                    counted = bool(rows)
                    rows = rows or self.val_indices[:1]
                    batch = self.collate([self.val_dataset[i] for i in rows])
                    loss, n_tokens = self._loss_and_tokens(batch)
                    if counted:
                        total_loss += loss.item()
                        total_tokens += n_tokens
        finally:
            self.model.train()
        total_loss, total_tokens = distributed.all_reduce_sum(
            [total_loss, float(total_tokens)], self.device
        )
        return total_loss / max(total_tokens, 1.0)

    def _evaluate_and_record(self, attempt: _Attempt) -> float:
        """Evaluate, and record it: the progress, the best weights (keep_best), and on rank 0 the
        metrics line, the tracker and the controller's status. Returns the seconds it took."""
        began = time.monotonic()
        val_loss = self.evaluate()
        if self.progress.add_evaluation(val_loss) and self.cfg.get("eval", {}).get("keep_best"):
            self._save_best()
        seconds = time.monotonic() - began
        self.progress.eval_time_s += seconds
        if self.topo.is_main:
            self._report_evaluation(val_loss, seconds, attempt)
        return seconds

    def _report_evaluation(self, val_loss: float, seconds: float, attempt: _Attempt) -> None:
        progress = self.progress
        best = progress.best_val_loss
        self._write_line(
            attempt,
            {
                "event": "eval",
                "step": progress.step,
                "total_steps": self.total_steps,
                "val_loss": round(val_loss, 6),
                "val_perplexity": round(_perplexity(val_loss), 4),
                "best_val_loss": round(best, 6) if best is not None else None,
                "best_step": progress.best_step,
                "val_rows": len(self.val_indices),
                "eval_s": round(seconds, 3),
            },
        )
        attempt.tracker.log(
            {"val_loss": val_loss, "val_perplexity": _perplexity(val_loss)}, progress.step
        )
        if attempt.reporter is not None:
            attempt.reporter.update(
                100 * progress.step // self.total_steps,
                0 if progress.step >= self.total_steps else None,
                {**attempt.status, **self._status_metrics()},
            )

    def _status_metrics(self) -> dict:
        """Validation metrics for the controller's status (empty before the first evaluation)."""
        val_loss = self.progress.val_loss
        if val_loss is None:
            return {}
        return {
            "val_loss": round(val_loss, 6),
            "val_perplexity": round(_perplexity(val_loss), 4),
        }

    def _save_best(self) -> None:
        """Keep the weights of the best step so far (collective), replacing the previous best."""
        state = artifacts.gather_state(
            self.model, trainable_only=self.is_lora, sharded=self.topo.distributed
        )
        if self.topo.is_main:
            artifacts.write_best(
                self.output_dir,
                state,
                step=self.progress.step,
                val_loss=self.progress.best_val_loss,
                digest=self.digest,
            )
        distributed.barrier()

    # ---------------------------------------------------------------- checkpoint
    def save_checkpoint(self) -> Path:
        """A resumable checkpoint of the progress as it stands (a collective: every rank)."""
        manifest = {
            **self.progress.to_manifest(self.examples_per_batch),
            # What a resume reads beside the progress: compile=auto's choice, whether the RNG
            # states fit (world size), and which run wrote it.
            "compiled": self.compiled,
            "step_plan": self.step.record(),
            "world_size": self.topo.world_size,
            "method": self.method.name,
            "digest": self.digest,
            "identity": run_identity(self.cfg),
        }
        path = checkpoint.save(
            Path(self.cfg.checkpointing.dir),
            model=self.model,
            optimizer=self.optimizer,
            lr_scheduler=self.lr_scheduler,
            manifest=manifest,
            topo=self.topo,
            keep=self.cfg.checkpointing.keep,
        )
        if self.topo.is_main:
            print(
                json.dumps({"event": "checkpoint", "step": self.progress.step, "path": str(path)}),
                flush=True,
            )
        return path

    # ---------------------------------------------------------------- save
    def save(self, extra: dict | None = None) -> Path:
        """Publish the weights, then ``result.json`` (rank 0 writes; see
        trainers/outputs/artifacts.py)."""
        # A collective: every rank calls it.
        state = artifacts.gather_state(
            self.model, trainable_only=self.is_lora, sharded=self.topo.distributed
        )
        artifact = artifacts.weights_dir(self.output_dir, self.method)
        step, best_step = self.progress.step, self.progress.best_step
        published_step = step
        keep_best = bool(self.cfg.get("eval", {}).get("keep_best"))
        if self.topo.is_main and keep_best and best_step not in (None, step):
            best = artifacts.read_best(self.output_dir, step=best_step, digest=self.digest)
            if best is None:  # cannot happen unless the output was tampered with
                raise RuntimeError(
                    f"keep_best: the weights of step {best_step} are missing from "
                    f"{self.output_dir / artifacts.BEST_DIR}"
                )
            state, published_step = best, best_step
        if self.topo.is_main:
            artifacts.publish_weights(state, self.cfg, self.method, self.output_dir)
            outcome = self._outcome(keep_best=keep_best, published_step=published_step)
            tracked = {"tracker": self.tracker_record} if self.tracker_record else {}
            artifacts.write_result(
                self.output_dir,
                self.cfg,
                self.method,
                outcome,
                artifact,
                {**tracked, **(extra or {})},
            )
        distributed.barrier()  # no rank exits before the result is complete
        return artifact

    def _outcome(self, *, keep_best: bool, published_step: int) -> artifacts.Outcome:
        """What the run did, for result.json: its progress and where it ran."""
        progress = self.progress
        val_loss = progress.val_loss
        return artifacts.Outcome(
            steps=progress.step,
            first_loss=progress.first_loss,
            final_loss=progress.last_loss,
            tokens_seen=progress.tokens_seen,
            wall_time_s=progress.wall_time_s,
            world_size=self.topo.world_size,
            device=self.device.type,
            peak_memory_gib=peak_memory_gib(self.device),
            resumed_from_step=progress.resumed_from,
            restarts=progress.restarts,
            val_loss=val_loss,
            val_perplexity=None if val_loss is None else _perplexity(val_loss),
            best_val_loss=progress.best_val_loss,
            best_step=progress.best_step,
            val_rows=len(self.val_indices),
            keep_best=keep_best,
            published_step=published_step,
            eval_time_s=progress.eval_time_s,
            evaluations=progress.eval_count,
            method_metrics=progress.method_metrics,
            step_plan={**self.step.record(), "compiled": self.compiled},
        )


def _perplexity(loss: float) -> float:
    """exp(loss), capped where it would overflow (a JSON-safe number)."""
    return math.exp(min(loss, 700.0))


def peak_memory_gib(device: torch.device) -> float:
    """Peak accelerator memory on GPU; peak resident set size of this process on CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # Linux reports KiB


def install_stop_handler(recipe: FineTuneRecipe) -> None:
    """SIGTERM, SIGINT and SIGHUP ask the loop to checkpoint and stop after the current step.

    A signal sent to the whole process group arrives twice (directly and forwarded by torchrun):
    that burst is one request. A second request is not waited on: the process dies as it would
    without the handler.
    """
    requests = lifetime.StopRequests()

    def handle(signum, _frame):
        if not requests.add(signum):
            return
        if recipe.stop_requested:
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)
            return
        recipe.stop_requested = True
        say(f"trainer: got {lifetime.signal_name(signum)}; stopping after this step")

    for sig in lifetime.STOP_SIGNALS:
        signal.signal(sig, handle)


def say(line: str) -> None:
    """A line on stderr that cannot fail: the reader of the pipe may be gone (a killed CLI), and
    a write error must not break the checkpoint the signal asked for."""
    try:
        print(line, file=sys.stderr, flush=True)
    except (OSError, ValueError):
        pass


def run(cfg: DictConfig, extra: dict | None = None) -> dict:
    """Set up, train and save; return the result record (``extra`` is added to it)."""
    recipe = FineTuneRecipe(cfg)
    install_stop_handler(recipe)
    try:
        recipe.setup()
        recipe.train()
        recipe.save(extra)
    except (TunepackError, KeyboardInterrupt, SystemExit):
        raise
    except BaseException as err:  # torch's CheckpointException is a BaseException
        if not isinstance(err, torch.OutOfMemoryError) and durable.is_disk_full(err):
            # A write no narrower guard covers: name what the error names, or the output.
            where = getattr(err, "filename", None) or recipe.output_dir
            raise durable.disk_full_error(where) from None
        if not isinstance(err, torch.OutOfMemoryError):
            raise
        step = f" with the step {recipe.step.describe()}" if recipe.step else ""
        raise DoesNotFitError(
            f"out of memory on {recipe.device}{step}: lower batch_size or max_seq_len (raise "
            "grad_accum to keep the effective batch), or set activation_checkpointing=true and "
            f"loss_chunk={planner.LOSS_EFFICIENT_ROWS} (less memory, slower steps); {err}",
            gpu=str(recipe.device),
        ) from None
    result = {}
    if recipe.topo.is_main:
        result = json.loads((recipe.output_dir / RESULT_FILE).read_text())
    distributed.shutdown()
    return result
