"""Kahneman-Tversky Optimization (``method=kto``) over LoRA adapters, on unpaired examples
(docs/trainer.md, "ORPO and KTO").

    desirable:    w_d * (1 - sigmoid(beta * (r - z)))
    undesirable:  w_u * (1 - sigmoid(beta * (z - r)))

``r`` is an answer's log-probability ratio to the reference (the adapters switched off); the
reference point ``z``, from mismatched pairs of the batch, is summed over every process's rows so
that it does not depend on how many share the batch.
"""

from __future__ import annotations

import json

import torch
from torch import nn
from torch.utils.data import Dataset
from torchtune.data import CROSS_ENTROPY_IGNORE_IDX, Message
from torchtune.modules.peft import disable_adapter

from tunepack.trainers.objectives.base import (
    LabelledAnswers,
    real_tokens,
    reward_metrics,
    tokens_and_labels,
)
from tunepack.trainers.objectives.dpo import answer_logps
from tunepack.trainers.process import distributed

STAT_NAMES = (
    "tokens",
    "desirable",
    "reward_desirable",
    "reward_undesirable",
    "kl",
    "correct",
)


class UnpairedDataset(Dataset):
    """The rows the dataset initializer wrote (``{"messages": [...], "label": bool}``), each as
    its prompt's tokens and its answer's tokens in the run's chat format."""

    def __init__(self, tokenizer, data_files: list[str]) -> None:
        self.items = []
        for name in data_files:
            with open(name, encoding="utf-8") as lines:
                for line in lines:
                    if not line.strip():
                        continue
                    row = json.loads(line)
                    messages = [Message(m["role"], m["content"], masked=m["role"] != "assistant")
                                for m in row["messages"]]  # fmt: skip
                    tokens, mask = tokenizer.tokenize_messages(messages)
                    start = mask.index(False) if False in mask else len(tokens)
                    self.items.append(
                        {
                            "tokens": tokens,
                            "prompt": tokens[:start],
                            "answer": tokens[start:],
                            "label": bool(row["label"]),
                        }
                    )

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, index: int) -> dict:
        return self.items[index]


def unpaired_dataset(tokenizer, *, data_files: list[str], packed: bool = False, **_source):
    """The config's dataset builder for the unpaired schema (``_source``: the keys every
    schema's node carries, which plain JSON lines do not need)."""
    if packed:  # the argument parser refuses packed=true for kto
        raise ValueError("unpaired datasets are not packed")
    return UnpairedDataset(tokenizer, data_files)


def _padded(sequences: list[tuple[list[int], list[int]]], pad_id: int):
    """(prompt, answer) pairs as tokens and labels (the answer's tokens only), right-padded."""
    length = max(len(p) + len(a) for p, a in sequences)
    tokens = torch.full((len(sequences), length), pad_id, dtype=torch.long)
    labels = torch.full((len(sequences), length), CROSS_ENTROPY_IGNORE_IDX, dtype=torch.long)
    for i, (prompt, answer) in enumerate(sequences):
        row = prompt + answer
        tokens[i, : len(row)] = torch.tensor(row)
        labels[i, len(prompt) : len(row)] = torch.tensor(answer)
    return tokens, labels


def collate(batch: list[dict], *, padding_idx: int) -> dict[str, torch.Tensor]:
    """The rows, then the mismatched pairs (row i's prompt, row i+1's answer), padded together:
    ``tokens``, ``labels``, and each row's ``label``."""
    n = len(batch)
    matched = [(item["prompt"], item["answer"]) for item in batch]
    mismatched = [(batch[i]["prompt"], batch[(i + 1) % n]["answer"]) for i in range(n)]
    tokens, labels = _padded(matched + mismatched, padding_idx)
    return {
        "tokens": tokens,
        "labels": labels,
        "label": torch.tensor([item["label"] for item in batch]),
    }


def losses(
    rewards: torch.Tensor,
    desirable: torch.Tensor,
    kl: torch.Tensor,
    *,
    beta: float,
    desirable_weight: float,
    undesirable_weight: float,
) -> torch.Tensor:
    """Per answer: KTO's loss from its implicit reward, its label and the reference point."""
    good = desirable_weight * (1 - torch.sigmoid(beta * (rewards - kl)))
    bad = undesirable_weight * (1 - torch.sigmoid(beta * (kl - rewards)))
    return torch.where(desirable, good, bad)


class KTO(LabelledAnswers):
    STAT_NAMES = STAT_NAMES
    ROWS = staticmethod(collate)

    def __init__(self, beta: float, desirable_weight: float, undesirable_weight: float) -> None:
        super().__init__()
        self.beta = beta
        self.desirable_weight = desirable_weight
        self.undesirable_weight = undesirable_weight

    @classmethod
    def from_config(cls, cfg, tokenizer, *, distributed: bool) -> KTO:
        node = cfg.kto
        return cls(node.beta, node.desirable_weight, node.undesirable_weight)

    def forward(
        self, model: nn.Module, batch: dict[str, torch.Tensor], device: torch.device
    ) -> tuple[torch.Tensor, int]:
        """The summed loss over the batch's answers and their number."""
        tokens, labels, n = tokens_and_labels(batch, device)
        desirable = batch["label"].to(device)
        with torch.no_grad():
            with disable_adapter(model):
                reference, _ = answer_logps(model(tokens), labels)
            shifted, _ = answer_logps(model(tokens[n:]), labels[n:])
        # The reference point: every process's mismatched pairs (a collective: every rank's
        # forward reaches it), so it is the same whatever the world size.
        kl_sum, kl_count = distributed.all_reduce_sum(
            [float((shifted - reference[n:]).sum()), float(n)], device
        )
        kl = torch.tensor(max(kl_sum / kl_count, 0.0), device=device)
        policy, _ = answer_logps(model(tokens[:n]), labels[:n])
        rewards = policy - reference[:n]
        per_answer = losses(
            rewards,
            desirable,
            kl,
            beta=self.beta,
            desirable_weight=self.desirable_weight,
            undesirable_weight=self.undesirable_weight,
        )
        r = rewards.detach()
        right = torch.where(desirable, r > kl, r < kl)
        self.batch_stats = [
            real_tokens(labels[:n]),
            float(desirable.sum()),
            float(r[desirable].sum()),
            float(r[~desirable].sum()),
            float(kl) * n,
            float(right.sum()),
        ]
        return per_answer.sum(), n

    def metrics(self, stats: list[float], answers: float) -> dict[str, float]:
        _, desirable, good, bad, kl, right = stats
        n = max(answers, 1.0)
        undesirable = answers - desirable
        chosen = good / desirable if desirable else 0.0
        rejected = bad / undesirable if undesirable else 0.0
        # The rewards are means over each label's answers already: over 1.
        return {**reward_metrics(chosen, rejected, right / n, 1.0), "kl": round(kl / n, 6)}
