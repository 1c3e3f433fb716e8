"""Odds Ratio Preference Optimization (``method=orpo``) over LoRA adapters: preference tuning
without a reference model (docs/trainer.md, "ORPO and KTO").

Batches are DPO's (``trainers/objectives/dpo.py``); one forward pass gives each answer's mean
log-probability per token ``l`` and its log-odds ``l - log(1 - exp(l))``:

    loss = -l_chosen - beta * log sigmoid(log_odds(chosen) - log_odds(rejected))
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tunepack.trainers.objectives.base import (
    LabelledAnswers,
    pair_stats,
    real_tokens,
    reward_metrics,
    tokens_and_labels,
)
from tunepack.trainers.objectives.dpo import answer_logps, collate

STAT_NAMES = ("tokens", "reward_chosen", "reward_rejected", "correct", "log_odds_ratio", "nll")


def log_odds(mean_logps: torch.Tensor) -> torch.Tensor:
    """``log(p / (1 - p))`` of a mean per-token probability given as its log (< 0)."""
    return mean_logps - torch.log1p(-torch.exp(mean_logps.clamp(max=-1e-6)))


def pair_losses(
    chosen: torch.Tensor, rejected: torch.Tensor, beta: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per pair, from the mean per-token log-probabilities of the answers: the loss, the log odds
    ratio and the chosen answer's negative log-likelihood."""
    ratio = log_odds(chosen) - log_odds(rejected)
    nll = -chosen
    return nll - beta * F.logsigmoid(ratio), ratio, nll


class ORPO(LabelledAnswers):
    STAT_NAMES = STAT_NAMES
    ROWS = staticmethod(collate)  # DPO's batches: the chosen rows, then the rejected ones

    def __init__(self, beta: float) -> None:
        super().__init__()
        self.beta = beta

    @classmethod
    def from_config(cls, cfg, tokenizer, *, distributed: bool) -> ORPO:
        return cls(cfg.orpo.beta)

    def forward(
        self, model: nn.Module, batch: dict[str, torch.Tensor], device: torch.device
    ) -> tuple[torch.Tensor, int]:
        """The summed loss over the batch's pairs and their number."""
        tokens, labels, pairs = tokens_and_labels(batch, device)
        summed, counted = answer_logps(model(tokens), labels)
        mean = summed / counted.clamp(min=1)
        losses, ratio, nll = pair_losses(mean[:pairs], mean[pairs:], self.beta)
        rewards = self.beta * mean.detach()
        self.batch_stats = [
            real_tokens(labels),
            *pair_stats(rewards, pairs),
            ratio.detach().sum().item(),
            nll.detach().sum().item(),
        ]
        return losses.sum(), pairs

    def metrics(self, stats: list[float], pairs: float) -> dict[str, float]:
        _, chosen, rejected, correct, ratio, nll = stats
        n = max(pairs, 1.0)
        return {
            **reward_metrics(chosen, rejected, correct, n),
            "log_odds_ratio": round(ratio / n, 6),
            "nll": round(nll / n, 6),
        }
