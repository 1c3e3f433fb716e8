"""How far a training run has come: the recipe's ``RunProgress``, updated by the loop, saved in
every checkpoint's manifest, read back on resume and reported in ``result.json``.

The manifest's keys are a file format: checkpoints written by earlier versions must still
resume, hence the defaults for the keys added later.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field


@dataclass
class RunProgress:
    step: int = 0  # optimizer steps done (the global step)
    epoch: int = 0
    # Micro-batches this rank consumed in the current epoch; saved as examples of every rank
    # (x batch_size x world size), so a run restarted with another world size resumes too.
    batch_in_epoch: int = 0
    tokens_seen: int = 0
    first_loss: float | None = None
    last_loss: float | None = None
    # Training time of the run, earlier attempts included, as of the last checkpoint or the end
    # of training; evaluation is left out (``eval_time_s``).
    wall_time_s: float = 0.0
    restarts: int = 0
    resumed_from: int | None = None  # the step this attempt resumed from; not saved
    # Validation (val_fraction or a validation split).
    val_loss: float | None = None
    val_step: int | None = None
    best_val_loss: float | None = None
    best_step: int | None = None
    eval_time_s: float = 0.0
    eval_count: int = 0
    # The method's own metrics of the last step (DPO's and GRPO's rewards); not saved: the next
    # step sets them again.
    method_metrics: dict[str, float] = field(default_factory=dict)

    def add_step(self, loss: float, tokens: int, *, epoch_done: bool) -> None:
        """Count one optimizer step: its loss per token and the tokens it trained on."""
        self.step += 1
        self.last_loss = loss
        if self.first_loss is None:
            self.first_loss = loss
        self.tokens_seen += tokens
        if epoch_done:
            self.epoch, self.batch_in_epoch = self.epoch + 1, 0

    def add_evaluation(self, val_loss: float) -> bool:
        """Record the validation loss of the current step; whether it is the best so far."""
        self.val_loss, self.val_step = val_loss, self.step
        self.eval_count += 1
        improved = math.isfinite(val_loss) and (
            self.best_val_loss is None or val_loss < self.best_val_loss
        )
        if improved:
            self.best_val_loss, self.best_step = val_loss, self.step
        return improved

    def to_manifest(self, examples_per_batch: int) -> dict:
        """The manifest's progress keys; ``examples_per_batch``: batch_size x world size."""
        return {
            "step": self.step,
            "epoch": self.epoch,
            "samples_in_epoch": self.batch_in_epoch * examples_per_batch,
            "tokens_seen": self.tokens_seen,
            "first_loss": self.first_loss,
            "last_loss": self.last_loss,
            "wall_time_s": round(self.wall_time_s, 3),
            "restarts": self.restarts,
            "val_loss": self.val_loss,
            "val_step": self.val_step,
            "best_val_loss": self.best_val_loss,
            "best_step": self.best_step,
            "eval_time_s": round(self.eval_time_s, 3),
            "eval_count": self.eval_count,
        }

    @classmethod
    def from_manifest(cls, manifest: dict, examples_per_batch: int) -> RunProgress:
        """The progress of a run resuming from the checkpoint ``manifest`` describes: one more
        restart, and ``examples_per_batch`` (batch_size x world size) of this attempt."""
        return cls(
            step=manifest["step"],
            epoch=manifest["epoch"],
            batch_in_epoch=manifest["samples_in_epoch"] // examples_per_batch,
            tokens_seen=manifest["tokens_seen"],
            first_loss=manifest["first_loss"],
            last_loss=manifest["last_loss"],
            wall_time_s=manifest["wall_time_s"],
            restarts=manifest.get("restarts", 0) + 1,
            resumed_from=manifest["step"],
            val_loss=manifest.get("val_loss"),
            val_step=manifest.get("val_step"),
            best_val_loss=manifest.get("best_val_loss"),
            best_step=manifest.get("best_step"),
            eval_time_s=manifest.get("eval_time_s", 0.0),
            eval_count=manifest.get("eval_count", 0),
        )
