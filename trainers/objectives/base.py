"""What the recipe asks of a method's own loss (``Objective``), and what DPO, ORPO and KTO share.

A method whose ``Loss`` is not next-token cross-entropy trains an objective: a class in this room,
named under its loss in ``trainers/objectives/table.py`` (docs/architecture.md, "A new
objective").
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import Protocol, runtime_checkable

import torch
from torch import nn
from torchtune.data import CROSS_ENTROPY_IGNORE_IDX


@runtime_checkable
class Objective(Protocol):
    """A method's loss in the recipe's terms; one instance trains the whole run."""

    # The names of the sums ``batch_stats`` holds, in order; the first is the real tokens trained
    # on (what the step reports as its tokens).
    stat_names: tuple[str, ...]
    # What the last ``forward`` adds to the step's sums: one float per name of ``stat_names``,
    # summed over the step's micro-batches and all-reduced over ranks with the loss.
    batch_stats: list[float]
    # What the last ``forward`` filled of the positions it trained on (real, all), for an
    # objective that trains on tokens of its own making (GRPO's generated answers); None: what it
    # trains on is the batch, whose labels the recipe counts.
    fill: tuple[int, int] | None
    # The frozen copy of the base model the recipe builds where ``needs_reference`` asks for one.
    reference: nn.Module | None

    @classmethod
    def from_config(cls, cfg, tokenizer, *, distributed: bool) -> Objective:
        """The objective of the run's config (its settings: ``cfg[<the loss's value>]``, the node
        ``table.OBJECTIVES`` writes); ``distributed``: the run has several processes."""
        ...

    def collate(self, dataset, padding_idx: int) -> Callable[[list[dict]], dict]:
        """How the rows of ``dataset`` make a batch (training and held-out batches); refuses a
        dataset it cannot train on (``BadDatasetError``)."""
        ...

    def needs_reference(self, *, adapters: bool) -> bool:
        """Whether the run builds a frozen copy of the base model as ``reference`` (``adapters``:
        the method trains adapters, whose model gives the base by switching them off)."""
        ...

    def start_step(self, step: int) -> None:
        """Called before the micro-batches of optimizer step ``step`` (0-based, counted over the
        run, so the same after a resume)."""
        ...

    def forward(
        self, model: nn.Module, batch: dict, device: torch.device
    ) -> tuple[torch.Tensor, int]:
        """One micro-batch: its summed loss (with a gradient; the recipe runs ``backward``) and
        what it counts (pairs, answers), by which the step's gradients are divided; leaves the
        micro-batch's sums in ``batch_stats``."""
        ...

    def metrics(self, stats: list[float], count: float) -> dict[str, float]:
        """A step's metrics from its summed stats (every rank's) and summed count: the names the
        method's record declares (``Method.metrics``)."""
        ...


class LabelledAnswers:
    """What DPO, ORPO and KTO share: batches of answers with labelled tokens, padded by the
    module's ``collate``; nothing that depends on the step; the real tokens as the first stat.
    A subclass names its ``STAT_NAMES`` and its ``ROWS``."""

    STAT_NAMES: tuple[str, ...] = ("tokens",)
    # Its module's collate function, ``(rows, *, padding_idx) -> batch`` (a staticmethod).
    ROWS: Callable[..., dict]

    def __init__(self) -> None:
        self.stat_names = self.STAT_NAMES
        self.batch_stats: list[float] = [0.0] * len(self.STAT_NAMES)
        self.fill = None  # the batch's own answers are what trains
        self.reference = None

    def needs_reference(self, *, adapters: bool) -> bool:
        """Their reference log-probabilities come with the data or from the model itself."""
        return False

    def collate(self, dataset, padding_idx: int) -> Callable[[list[dict]], dict]:
        return partial(self.ROWS, padding_idx=padding_idx)

    def start_step(self, step: int) -> None:
        """Nothing depends on the step here (GRPO's sampling does)."""


def tokens_and_labels(
    batch: dict[str, torch.Tensor], device: torch.device
) -> tuple[torch.Tensor, torch.Tensor, int]:
    """The batch's ``tokens`` and ``labels`` on the device, and half its rows (its pairs: the
    first half's rows against the second's)."""
    tokens = batch["tokens"].to(device)
    labels = batch["labels"].to(device)
    return tokens, labels, tokens.size(0) // 2


def real_tokens(labels: torch.Tensor) -> float:
    """The labelled tokens of ``labels``: the first stat of every objective here."""
    return float((labels != CROSS_ENTROPY_IGNORE_IDX).sum())


def pair_stats(rewards: torch.Tensor, pairs: int) -> list[float]:
    """The chosen answers' (the first ``pairs`` rows) and the rejected ones' summed implicit
    rewards, and the pairs whose chosen answer has the higher one."""
    chosen, rejected = rewards[:pairs], rewards[pairs:]
    return [chosen.sum().item(), rejected.sum().item(), (chosen > rejected).sum().item()]


def reward_metrics(chosen: float, rejected: float, correct: float, n: float) -> dict[str, float]:
    """``methods.PREFERENCE_METRICS`` from the chosen and rejected answers' summed rewards and
    the right-ordered count, over ``n``."""
    return {
        "reward_chosen": round(chosen / n, 6),
        "reward_rejected": round(rejected / n, 6),
        "reward_margin": round((chosen - rejected) / n, 6),
        "reward_accuracy": round(correct / n, 6),
    }
