"""Group Relative Policy Optimization (``method=grpo``, ``grpo_full``): the prompt dataset,
sampling with a KV cache, the group advantages and the clipped objective with its KL penalty
(docs/trainer.md, "Reinforcement learning from verifiable rewards").

    ratio = exp(logp_t - old_logp_t)
    loss_t = -min(ratio * A, clip(ratio, 1 - epsilon, 1 + epsilon) * A) + beta * KL_t
    KL_t = exp(ref_t - logp_t) - (ref_t - logp_t) - 1        (an unbiased estimate, >= 0)

The answers are used for one update, so ``old_logp`` is the policy's own log-probability without
its gradient: the ratio is 1 and its gradient that of ``A * logp``. Log-probabilities are those
of the sampling distribution, the logits divided by ``temperature``. With several processes
(FSDP2) every rank runs the same number of forward passes (no early stop once all of its answers
have ended), so the collectives line up.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass

import torch
from torch import nn
from torch.utils.data import Dataset
from torchtune.data import Message
from torchtune.modules.common_utils import delete_kv_caches
from torchtune.modules.peft import disable_adapter

from tunepack.core.errors import BadDatasetError, ConflictError
from tunepack.runtimes import reward_names
from tunepack.runtimes.reward_names import Weighted
from tunepack.trainers.objectives import rewards, vocab_loss
from tunepack.trainers.objectives.rewards import Sample

_STD_FLOOR = 1e-4  # added to a group's reward standard deviation (all-equal groups: A = 0)
_SEED_MIX = 0x9E3779B97F4A7C15  # spreads (seed, step, row, answer) over the generator's seeds


@dataclass(frozen=True)
class Settings:
    num_generations: int
    max_new_tokens: int
    temperature: float
    top_p: float
    beta: float
    epsilon: float
    rewards: tuple[Weighted, ...]
    pattern: str
    seed: int

    @classmethod
    def from_config(cls, node, seed: int) -> Settings:
        return cls(
            num_generations=int(node.num_generations),
            max_new_tokens=int(node.max_new_tokens),
            temperature=float(node.temperature),
            top_p=float(node.top_p),
            beta=float(node.beta),
            epsilon=float(node.epsilon),
            rewards=reward_names.parse("rewards", str(node.rewards)),
            pattern=str(node.reward_pattern),
            seed=seed,
        )


# ------------------------------------------------------------------------------------ prompts
class PromptDataset(Dataset):
    """The prompt rows the dataset initializer wrote (``{"messages": [...], "answer": ...}``),
    each as the tokens the model sees before its answer, in the run's chat format."""

    def __init__(self, tokenizer, data_files: list[str], max_new_tokens: int) -> None:
        self.rows: list[dict] = []
        for name in data_files:
            with open(name, encoding="utf-8") as lines:
                self.rows.extend(json.loads(line) for line in lines if line.strip())
        room = (tokenizer.max_seq_len or 0) - max_new_tokens
        self.items = []
        with tokenizer.untruncated():
            for index, row in enumerate(self.rows):
                messages = [Message(m["role"], m["content"]) for m in row["messages"]]
                messages.append(Message("assistant", ""))
                tokens, _ = tokenizer.tokenize_messages(messages, add_end_tokens=False)
                if tokenizer.max_seq_len and len(tokens) > room:
                    raise ConflictError(
                        f"row {index + 1} of the prompt dataset is {len(tokens)} tokens long, "
                        f"more than the {room} that max_seq_len={tokenizer.max_seq_len} leaves "
                        f"next to max_new_tokens={max_new_tokens}: raise max_seq_len, lower "
                        "max_new_tokens or shorten the prompt"
                    )
                prompt = next(
                    (m["content"] for m in reversed(row["messages"]) if m["role"] == "user"), ""
                )
                self.items.append(
                    {"tokens": tokens, "row": index, "prompt": prompt, "answer": row.get("answer")}
                )

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, index: int) -> dict:
        return self.items[index]


def prompt_dataset(
    tokenizer, *, data_files: list[str], max_new_tokens: int, packed: bool = False, **_source
) -> PromptDataset:
    """The config's dataset builder for the prompt schema (``_source``: the keys every schema's
    node carries, source/split/cache_dir, which plain JSON lines do not need)."""
    if packed:  # the argument parser refuses packed=true for grpo
        raise ValueError("prompt datasets are not packed")
    return PromptDataset(tokenizer, data_files, max_new_tokens)


def collate(batch: list[dict]) -> dict:
    """Prompts stay lists of their own lengths: generation pads them to the left."""
    return {
        "prompts": [item["tokens"] for item in batch],
        "rows": [item["row"] for item in batch],
        "texts": [item["prompt"] for item in batch],
        "answers": [item["answer"] for item in batch],
    }


def missing_answer(dataset: PromptDataset, chosen: tuple[Weighted, ...]) -> str | None:
    """The message for a reward that needs the row's answer where a row has none."""
    needing = [w.name for w in chosen if w.name in rewards.NEEDS_ANSWER]
    if not needing:
        return None
    lacking = [item["row"] + 1 for item in dataset.items if item["answer"] is None]
    if not lacking:
        return None
    rows = ", ".join(map(str, lacking[:5])) + (" ..." if len(lacking) > 5 else "")
    return (
        f"rewards={','.join(needing)} compares answers with each row's 'answer', and "
        f"{len(lacking)} of {len(dataset)} rows have none (rows {rows}): add answers, or use "
        "rewards that need none (format, length)"
    )


# ------------------------------------------------------------------------------------ sampling
def answer_seed(seed: int, step: int, row: int, answer: int) -> int:
    """The generator seed of one answer: a function of what it answers, not of the batch."""
    mixed = seed
    for part in (step, row, answer):
        mixed = (mixed * _SEED_MIX + part + 1) % (1 << 63)
    return mixed


def sample_tokens(
    logits: torch.Tensor, uniforms: torch.Tensor, temperature: float, top_p: float
) -> torch.Tensor:
    """One token per row of ``logits`` [N, V] by inverse-CDF sampling of the tempered
    distribution cut to its nucleus, with one uniform number per row (``uniforms`` [N])."""
    probs = torch.softmax(logits.float() / temperature, dim=-1)
    sorted_probs, order = probs.sort(dim=-1, descending=True)
    if top_p < 1.0:
        before = sorted_probs.cumsum(-1) - sorted_probs  # the mass of the tokens ahead of each
        sorted_probs = sorted_probs.masked_fill(before >= top_p, 0.0)
    cdf = sorted_probs.cumsum(-1)
    target = (uniforms.to(cdf.device) * cdf[:, -1]).unsqueeze(-1)
    picked = torch.searchsorted(cdf, target).clamp(max=cdf.size(-1) - 1)
    return order.gather(-1, picked).squeeze(-1)


# Positions: a left-padded row's tokens keep the positions of their columns (its prompt starts
# after the padding), one set of positions for the whole batch. Rotary embeddings make attention
# depend on the distance between two tokens only, so this computes what positions counted from
# each row's first token would, while the model takes torchtune's fast path (no per-row lookup).
@dataclass
class Generated:
    """Prompts (left-padded) and their sampled answers, as one batch of sequences."""

    tokens: torch.Tensor  # [N, P + T]: padding, prompt, answer (padding after it ends)
    prompt_len: int  # P
    answer_mask: torch.Tensor  # [N, T]: the answer's tokens, its end-of-turn token included
    real: torch.Tensor  # [N, P + T]: positions holding a prompt or answer token


def _attention(real: torch.Tensor) -> torch.Tensor:
    """Causal attention over real positions ([N, L, L]; a padding row sees itself alone, so no
    softmax is over nothing)."""
    length = real.size(1)
    causal = torch.ones(length, length, dtype=torch.bool, device=real.device).tril()
    mask = causal.unsqueeze(0) & real.unsqueeze(1)
    return mask | torch.eye(length, dtype=torch.bool, device=real.device).unsqueeze(0)


def _share_caches(model: nn.Module, group: int) -> None:
    """Each prompt's KV cache, filled once, copied for every answer of its group (consecutive
    rows): the prompt's positions are computed once per group, not once per answer."""
    for module in model.modules():
        cache = getattr(module, "kv_cache", None)
        if cache is not None and hasattr(cache, "k_cache"):
            cache.k_cache = cache.k_cache.repeat_interleave(group, dim=0)
            cache.v_cache = cache.v_cache.repeat_interleave(group, dim=0)
            cache.batch_size = cache.k_cache.size(0)


@torch.no_grad()
def generate(
    model: nn.Module,
    prompts: list[list[int]],
    group: int,
    seeds: list[int],
    settings: Settings,
    *,
    pad_id: int,
    stop_ids: set[int],
    dtype: torch.dtype,
    device: torch.device,
    every_step: bool,
) -> Generated:
    """Sample ``group`` answers to each of ``prompts``, answer ``i`` (prompt ``i // group``) with
    the generator seeded by ``seeds[i]``. The prompts go through the model once each (left-padded
    to one length); their caches are then shared by their answers. ``every_step``: run all
    ``max_new_tokens`` forward passes even once every answer has ended (sharded runs)."""
    new = settings.max_new_tokens
    prompt_len = max(len(p) for p in prompts)
    length = prompt_len + new
    unique = torch.full((len(prompts), length), pad_id, dtype=torch.long)
    real = torch.zeros((len(prompts), length), dtype=torch.bool)
    for i, prompt in enumerate(prompts):
        unique[i, prompt_len - len(prompt) : prompt_len] = torch.tensor(prompt)
        real[i, prompt_len - len(prompt) : prompt_len] = True
    uniforms = torch.stack(
        [
            torch.rand(new, generator=torch.Generator().manual_seed(s), dtype=torch.float64)
            for s in seeds
        ]
    ).float()
    real[:, prompt_len:] = True  # answer positions are real until their answer has ended
    unique, real = unique.to(device), real.to(device)
    mask = _attention(real)
    tokens = unique.repeat_interleave(group, dim=0)
    n = tokens.size(0)
    mask = mask.repeat_interleave(group, dim=0)
    ended = torch.zeros(n, dtype=torch.bool, device=device)
    answer_mask = torch.zeros((n, new), dtype=torch.bool, device=device)
    stops = torch.tensor(sorted(stop_ids), device=device)
    was_training = model.training
    model.eval()
    model.setup_caches(len(prompts), dtype, decoder_max_seq_len=length)
    try:
        logits = model(
            unique[:, :prompt_len],
            mask=mask[::group, :prompt_len],
            input_pos=torch.arange(prompt_len, device=device).unsqueeze(0),
        )[:, -1].repeat_interleave(group, dim=0)
        _share_caches(model, group)
        for t in range(new):
            picked = sample_tokens(logits, uniforms[:, t], settings.temperature, settings.top_p)
            picked = torch.where(ended, torch.full_like(picked, pad_id), picked)
            answer_mask[:, t] = ~ended
            tokens[:, prompt_len + t] = picked
            ended |= torch.isin(picked, stops)
            if t == new - 1 or (ended.all() and not every_step):
                break
            at = slice(prompt_len + t, prompt_len + t + 1)
            where = torch.tensor([[prompt_len + t]], device=device)
            logits = model(tokens[:, at], mask=mask[:, at], input_pos=where)[:, -1]
    finally:
        delete_kv_caches(model)
        model.train(was_training)
    real = real.repeat_interleave(group, dim=0)
    real[:, prompt_len:] = answer_mask
    return Generated(tokens=tokens, prompt_len=prompt_len, answer_mask=answer_mask, real=real)


# ------------------------------------------------------------------------------------ the loss
def answer_logps(model: nn.Module, generated: Generated, temperature: float) -> torch.Tensor:
    """Per answer token: its log-probability under ``model``'s tempered distribution [N, T]."""
    mask = _attention(generated.real)
    start = generated.prompt_len
    # The logits of the positions that predict answer tokens only (the last one predicts none).
    tokens = generated.tokens[:, :-1]
    with vocab_loss.logits_from(model, start - 1):
        logits = model(tokens, mask=mask[:, :-1, :-1])
    predicting = logits / temperature
    targets = generated.tokens[:, start:]
    return torch.log_softmax(predicting, dim=-1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)


@torch.no_grad()
def shared_prompt_logps(
    model: nn.Module, generated: Generated, group: int, temperature: float, dtype: torch.dtype
) -> torch.Tensor:
    """``answer_logps`` without gradient (the reference's), computing each prompt once: the
    prompts fill a KV cache, shared by their answers, whose tokens then go through the model
    together. [N, T], as ``answer_logps`` gives them."""
    start, length = generated.prompt_len, generated.tokens.size(1)
    mask = _attention(generated.real)
    device = generated.tokens.device
    model.setup_caches(generated.tokens.size(0) // group, dtype, decoder_max_seq_len=length)
    try:
        first = model(
            generated.tokens[::group, :start],
            mask=mask[::group, :start],
            input_pos=torch.arange(start, device=device).unsqueeze(0),
        )[:, -1:].repeat_interleave(group, dim=0)
        _share_caches(model, group)
        logits = first
        if length - 1 > start:  # the answer tokens but the last predict the ones after them
            rest = model(
                generated.tokens[:, start:-1],
                mask=mask[:, start:-1],
                input_pos=torch.arange(start, length - 1, device=device).unsqueeze(0),
            )
            logits = torch.cat([first, rest], dim=1)
    finally:
        delete_kv_caches(model)
    targets = generated.tokens[:, start:]
    scaled = logits.float() / temperature
    return torch.log_softmax(scaled, dim=-1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)


def group_advantages(scores: torch.Tensor) -> torch.Tensor:
    """Rewards [B, G] as advantages relative to each group (row)."""
    mean = scores.mean(dim=1, keepdim=True)
    std = scores.std(dim=1, keepdim=True) if scores.size(1) > 1 else torch.zeros_like(mean)
    return (scores - mean) / (std + _STD_FLOOR)


def policy_loss(
    logps: torch.Tensor,
    old_logps: torch.Tensor,
    ref_logps: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    beta: float,
    epsilon: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per answer: the mean over its tokens of the clipped objective plus the KL penalty.
    Also per token, for the metrics: the KL estimate and whether clipping bound it."""
    ratio = torch.exp(logps - old_logps)
    adv = advantages.unsqueeze(-1)
    unclipped = ratio * adv
    clipped = ratio.clamp(1 - epsilon, 1 + epsilon) * adv
    gap = (ref_logps - logps).masked_fill(~mask, 0.0)  # past an answer's end: nothing
    kl = torch.exp(gap) - gap - 1
    per_token = -torch.minimum(unclipped, clipped) + beta * kl
    counted = mask.float()
    per_answer = (per_token * counted).sum(-1) / counted.sum(-1).clamp(min=1)
    return per_answer, kl.detach(), (clipped < unclipped).detach() & mask


class GRPO:
    """The GRPO objective, in the recipe's terms: ``forward`` gives a micro-batch's summed loss
    and its count (answers), and leaves its sums for the metrics in ``batch_stats``."""

    def __init__(self, settings: Settings, tokenizer, *, distributed: bool) -> None:
        self.settings = settings
        self.tokenizer = tokenizer
        self.functions = rewards.resolve(settings.rewards)
        self.stat_names = (
            "tokens",
            "answers",
            "reward",
            "reward_sq",
            "kl",
            "clipped",
            "zero_std_groups",
            "groups",
            *(f"reward_{w.name}" for w in settings.rewards),
        )
        self.batch_stats = [0.0] * len(self.stat_names)
        self.fill = (0, 0)
        self.step = 0  # the optimizer step being taken (seeds the sampling); set by the recipe
        self.every_step = distributed
        # The KL reference: None for the adapters' methods (the model with its adapters off);
        # a frozen copy of the base for grpo_full (the recipe sets it).
        self.reference: nn.Module | None = None
        # The tokenizer's stop tokens and the chat format's end of an assistant's turn.
        self.stop_ids = set(getattr(tokenizer, "stop_tokens", None) or ()) | {tokenizer.eos_id}
        if hasattr(tokenizer, "turn_end_ids"):
            self.stop_ids |= tokenizer.turn_end_ids()

    def needs_reference(self, *, adapters: bool) -> bool:
        """grpo_full's KL term compares with a frozen copy of the base (none without the term)."""
        return not adapters and self.settings.beta > 0

    @classmethod
    def from_config(cls, cfg, tokenizer, *, distributed: bool) -> GRPO:
        return cls(Settings.from_config(cfg.grpo, cfg.seed), tokenizer, distributed=distributed)

    def collate(self, dataset: PromptDataset, padding_idx: int):
        """The prompts as they are (each is generated from on its own); first, every row has what
        its rewards read."""
        if problem := missing_answer(dataset, self.settings.rewards):
            raise BadDatasetError(problem)
        return collate

    def start_step(self, step: int) -> None:
        self.step = step

    def _scores(self, generated: Generated, batch: dict) -> tuple[torch.Tensor, list[list[float]]]:
        """Each answer's reward [N] and each reward function's values."""
        s, group = self.settings, self.settings.num_generations
        totals, parts = [], []
        start = generated.prompt_len
        for i in range(generated.tokens.size(0)):
            kept = generated.tokens[i, start:][generated.answer_mask[i]].tolist()
            if kept and kept[-1] in self.stop_ids:
                kept = kept[:-1]
            row = i // group
            sample = Sample(
                prompt=batch["texts"][row],
                completion=self.tokenizer.decode(kept),
                answer=None if batch["answers"][row] is None else str(batch["answers"][row]),
                tokens=int(generated.answer_mask[i].sum()),
                max_new_tokens=s.max_new_tokens,
                pattern=s.pattern,
            )
            total, values = rewards.score(self.functions, sample)
            totals.append(total)
            parts.append(values)
        return torch.tensor(totals, dtype=torch.float64), parts

    def forward(
        self, model: nn.Module, batch: dict, device: torch.device
    ) -> tuple[torch.Tensor, int]:
        s = self.settings
        group = s.num_generations
        prompts = batch["prompts"]
        seeds = [
            answer_seed(s.seed, self.step, row, k) for row in batch["rows"] for k in range(group)
        ]
        dtype = next(model.parameters()).dtype
        generated = generate(
            model,
            prompts,
            group,
            seeds,
            s,
            pad_id=self.tokenizer.pad_id,
            stop_ids=self.stop_ids,
            dtype=dtype,
            device=device,
            every_step=self.every_step,
        )
        scores, parts = self._scores(generated, batch)
        advantages = group_advantages(scores.view(-1, group)).view(-1).to(device).float()
        # The reference first (no gradient): its logits are gone before the policy's
        # activations pile up. beta=0 has no KL term and needs no reference pass.
        ref = None
        if s.beta > 0 and self.reference is not None:
            ref = shared_prompt_logps(self.reference, generated, group, s.temperature, dtype)
        elif s.beta > 0:
            with disable_adapter(model):
                ref = shared_prompt_logps(model, generated, group, s.temperature, dtype)
        logps = answer_logps(model, generated, s.temperature)
        if ref is None:
            ref = logps.detach()
        losses, kl, clipped = policy_loss(
            logps,
            logps.detach(),
            ref,
            advantages,
            generated.answer_mask,
            beta=s.beta,
            epsilon=s.epsilon,
        )
        mask = generated.answer_mask
        per_group_std = scores.view(-1, group).std(dim=1) if group > 1 else scores.new_zeros(1)
        by_reward = [sum(values[j] for values in parts) for j in range(len(self.functions))]
        self.batch_stats = [
            float(mask.sum()),
            float(len(prompts) * group),
            float(scores.sum()),
            float((scores**2).sum()),
            float(kl[mask].sum()),
            float(clipped.sum()),
            float((per_group_std < 1e-12).sum()),
            float(len(batch["prompts"])),
            *by_reward,
        ]
        self.fill = (int(generated.real.sum()), generated.real.numel())
        return losses.sum(), len(prompts) * group

    def metrics(self, stats: list[float], answers: float) -> dict[str, float]:
        """A step's metrics from its summed stats (every rank's) and answer count."""
        named = dict(zip(self.stat_names, stats, strict=True))
        n = max(answers, 1.0)
        tokens = max(named["tokens"], 1.0)
        mean = named["reward"] / n
        variance = max(named["reward_sq"] / n - mean * mean, 0.0)
        out = {
            "reward_mean": round(mean, 6),
            "reward_std": round(math.sqrt(variance), 6),
            "kl": round(named["kl"] / tokens, 6),
            "completion_length": round(named["tokens"] / n, 3),
            "clip_fraction": round(named["clipped"] / tokens, 6),
            "zero_std_fraction": round(named["zero_std_groups"] / max(named["groups"], 1.0), 6),
        }
        for w in self.settings.rewards:
            out[f"reward_{w.name}"] = round(named[f"reward_{w.name}"] / n, 6)
        return out
