"""The objectives: one entry per ``Loss`` of a method's own, the one place the trainer picks its
loss by method (docs/architecture.md, "A new objective").

Each entry names the class that computes the loss (an ``Objective``, ``base.py``) and writes the
config node its settings travel in, ``cfg[<the loss's value>]``: part of the run's identity, and
where ``result.json`` reports them beside the metrics. This module imports neither torch nor the
objectives' modules (the config is built without them); ``Declared.load`` imports the class, the
recipe's side only. Nothing here is chosen by user input beyond the validated method's ``Loss``.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass

from tunepack.runtimes import reward_names
from tunepack.runtimes.methods import Loss


@dataclass(frozen=True)
class Declared:
    module: str  # its module in trainers/objectives/
    name: str  # the Objective class there
    settings: Callable[..., dict]  # its config node, from the resolved arguments (TrainArgs)

    def load(self) -> type:
        """The objective's class, its module imported (torch, torchtune)."""
        return getattr(importlib.import_module(f"{__package__}.{self.module}"), self.name)


def _dpo(args) -> dict:
    return {"beta": args.beta, "loss": args.dpo_loss}


def _orpo(args) -> dict:
    return {"beta": args.beta}


def _kto(args) -> dict:
    return {
        "beta": args.beta,
        "desirable_weight": args.desirable_weight,
        "undesirable_weight": args.undesirable_weight,
    }


def _grpo(args) -> dict:
    return {
        "num_generations": args.num_generations,
        "max_new_tokens": args.max_new_tokens,
        "temperature": args.temperature,
        "top_p": args.top_p,
        "beta": args.beta,
        "epsilon": args.epsilon,
        "rewards": reward_names.spelled(args.rewards),
        "reward_pattern": args.reward_pattern,
    }


# Loss.CROSS_ENTROPY has none: the recipe's own next-token loss (fused, vocab_loss.py).
OBJECTIVES: dict[Loss, Declared] = {
    Loss.DPO: Declared("dpo", "DPO", _dpo),
    Loss.ORPO: Declared("orpo", "ORPO", _orpo),
    Loss.KTO: Declared("kto", "KTO", _kto),
    Loss.GRPO: Declared("grpo", "GRPO", _grpo),
}
