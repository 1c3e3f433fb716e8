"""Direct Preference Optimization (``method=dpo``) over LoRA adapters; the losses and metrics:
docs/trainer.md, "Preference tuning".

The reference is the model with its adapters switched off (``disable_adapter``), so no second
copy of the weights is held. Each batch holds the chosen conversations then the rejected ones,
padded together: one forward pass with the adapters off (no gradient) and one with them on give
every answer's log-probability under the reference and the policy.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torchtune.data import CROSS_ENTROPY_IGNORE_IDX, padded_collate_dpo
from torchtune.modules.peft import disable_adapter

from tunepack.trainers.objectives.base import (
    LabelledAnswers,
    pair_stats,
    real_tokens,
    reward_metrics,
    tokens_and_labels,
)

LOSSES = ("sigmoid", "ipo", "hinge")
# What one micro-batch adds to the step's sums (all-reduced over ranks with the loss).
STAT_NAMES = ("tokens", "reward_chosen", "reward_rejected", "correct")


def collate(batch: list[dict], *, padding_idx: int) -> dict[str, torch.Tensor]:
    """Chosen rows first, then rejected rows, padded to one length: ``tokens``, ``labels``."""
    tokens, labels = padded_collate_dpo(
        batch, padding_idx=padding_idx, ignore_idx=CROSS_ENTROPY_IGNORE_IDX
    )
    return {"tokens": tokens, "labels": labels}


def answer_logps(logits: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per sequence: the summed log-probability of its labelled tokens, and how many there are.

    Position t predicts token t+1; unlabelled (prompt, padding) positions count for nothing.
    """
    targets = labels[:, 1:]
    per_token = -F.cross_entropy(
        logits[:, :-1].float().transpose(1, 2),
        targets,
        ignore_index=CROSS_ENTROPY_IGNORE_IDX,
        reduction="none",
    )
    counted = (targets != CROSS_ENTROPY_IGNORE_IDX).sum(-1)
    return per_token.sum(-1), counted


class DPO(LabelledAnswers):
    STAT_NAMES = STAT_NAMES
    ROWS = staticmethod(collate)

    def __init__(self, beta: float, loss: str) -> None:
        if loss not in LOSSES:  # the argument parser allows only these
            raise ValueError(f"unknown DPO loss {loss!r}")
        super().__init__()
        self.beta = beta
        self.loss = loss

    @classmethod
    def from_config(cls, cfg, tokenizer, *, distributed: bool) -> DPO:
        return cls(cfg.dpo.beta, cfg.dpo.loss)

    def _logps(self, model: nn.Module, tokens: torch.Tensor, labels: torch.Tensor):
        summed, counted = answer_logps(model(tokens), labels)
        if self.loss == "ipo":
            return summed / counted.clamp(min=1)
        return summed

    def forward(
        self, model: nn.Module, batch: dict[str, torch.Tensor], device: torch.device
    ) -> tuple[torch.Tensor, int]:
        """The summed loss over the batch's pairs and their number; leaves the micro-batch's
        token count and reward sums in ``batch_stats``."""
        tokens, labels, pairs = tokens_and_labels(batch, device)
        # The reference first: its logits are gone before the policy's activations pile up.
        with torch.no_grad(), disable_adapter(model):
            reference = self._logps(model, tokens, labels)
        policy = self._logps(model, tokens, labels)
        h = (policy[:pairs] - policy[pairs:]) - (reference[:pairs] - reference[pairs:])
        if self.loss == "sigmoid":
            losses = -F.logsigmoid(self.beta * h)
        elif self.loss == "hinge":
            losses = torch.relu(1 - self.beta * h)
        else:
            losses = (h - 1 / (2 * self.beta)) ** 2
        rewards = self.beta * (policy - reference).detach()
        self.batch_stats = [real_tokens(labels), *pair_stats(rewards, pairs)]
        return losses.sum(), pairs

    @staticmethod
    def metrics(stats: list[float], pairs: float) -> dict[str, float]:
        """A step's reward metrics from its summed stats (every rank's) and pair count."""
        _, chosen, rejected, correct = stats
        return reward_metrics(chosen, rejected, correct, max(pairs, 1.0))
