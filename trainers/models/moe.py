"""A mixture-of-experts feed-forward and its load-balancing loss (torchtune 0.6.1 has neither).

``MoEFeedForward`` stands where a torchtune layer's ``mlp`` (``FeedForward``) stands: a router
(one linear map, hidden -> experts) scores every token, softmax in fp32 turns the scores into
probabilities, each token goes to its ``experts_per_token`` most probable experts, weighted by
their probabilities (renormalised to sum to one over the chosen experts when
``norm_topk_prob``), and each expert is a SwiGLU MLP. This is Hugging Face's Qwen3-MoE sparse
block (``Qwen3MoeSparseMoeBlock``, transformers 5.24), which ``tests/unit/test_qwen3_moe.py``
compares with it.

The experts' weights are stacked, one 3-D tensor per projection (``experts x out x in``), as
transformers 5 holds them: a model has one parameter per projection and layer instead of three
per expert (18,432 modules for Qwen3-30B-A3B), and FSDP2, which shards a parameter along its
first dimension, shards them along the experts. The recipe makes each decoder layer one FSDP2
unit: with the experts a multiple of the ranks (128 is, of 2 to 128 ranks) each rank stores whole
experts, and the layer's forward gathers every expert before the expert loop runs, so no expert
is ever computed from part of its weights; the gradients are reduce-scattered back along the
same expert boundaries (tests/integration/test_trainer_processes.py, two processes).

The auxiliary load-balancing loss is the Switch Transformer's as transformers defines it
(``load_balancing_loss_func``): over every sparse layer's router logits, the fraction of the
top-k assignments each expert received times the mean probability the router gave it, summed
over experts and multiplied by their number. ``router_aux_loss`` reads the router logits the
layers kept during the forward pass (only while training with a coefficient above zero) and
returns ``coef x loss`` weighted like the cross-entropy it is added to.

LoRA on the experts (``LoRAExperts``, with ``lora_mlp=true``) gives each expert its own rank-r
pair on the fused gate/up projection (one pair whose output spans both, as transformers' fused
``gate_up_proj`` holds them) and one on the down projection: exactly what PEFT's
``target_parameters`` puts on transformers' ``Qwen3MoeExperts``, so the exported adapter loads
there (``trainers/outputs/peft_export.py``). As in PEFT, whose wrapper adds the update to the
weights, the experts' adapters take no dropout and no DoRA; the router stays frozen.
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn


class Experts(nn.Module):
    """``num_experts`` SwiGLU MLPs, their weights stacked along the first dimension."""

    def __init__(self, *, dim: int, hidden_dim: int, num_experts: int) -> None:
        super().__init__()
        self.num_experts = num_experts
        self.gate_proj = nn.Parameter(torch.empty(num_experts, hidden_dim, dim))
        self.up_proj = nn.Parameter(torch.empty(num_experts, hidden_dim, dim))
        self.down_proj = nn.Parameter(torch.empty(num_experts, dim, hidden_dim))
        for weight in (self.gate_proj, self.up_proj, self.down_proj):
            nn.init.normal_(weight, std=0.02)

    def forward(self, x: torch.Tensor, chosen: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """``x``: (tokens, dim); ``chosen``/``weights``: (tokens, k) experts and their weights."""
        out = torch.zeros_like(x)
        k = chosen.size(1)
        flat = chosen.reshape(-1)
        # The (token, slot) assignments grouped by expert: one gather and matmul per expert hit.
        order = torch.argsort(flat, stable=True)
        counts = torch.bincount(flat, minlength=self.num_experts).tolist()
        rows, slot_weights = order // k, weights.reshape(-1)[order]
        start = 0
        for expert, count in enumerate(counts):
            if not count:
                continue
            idx = rows[start : start + count]
            h = self.mlp(expert, x[idx]) * slot_weights[start : start + count, None]
            out.index_add_(0, idx, h.to(out.dtype))
            start += count
        return out

    def mlp(self, expert: int, h: torch.Tensor) -> torch.Tensor:
        """Expert ``expert``'s SwiGLU MLP of ``h``: (tokens, dim)."""
        h = F.silu(h @ self.gate_proj[expert].T) * (h @ self.up_proj[expert].T)
        return h @ self.down_proj[expert].T


class LoRAExperts(Experts):
    """``Experts`` with a LoRA pair per expert on the fused gate/up and on the down projection
    (see the module doc). ``*_lora_a`` (experts x rank x in) reads the input, ``*_lora_b``
    (experts x out x rank) starts at zero, so the experts start as their base."""

    ADAPTERS = ("gate_up_lora_a", "gate_up_lora_b", "down_lora_a", "down_lora_b")

    def __init__(
        self, *, dim: int, hidden_dim: int, num_experts: int, rank: int, alpha: float
    ) -> None:
        super().__init__(dim=dim, hidden_dim=hidden_dim, num_experts=num_experts)
        self.hidden_dim, self.rank, self.scaling = hidden_dim, rank, alpha / rank
        self.gate_up_lora_a = nn.Parameter(torch.empty(num_experts, rank, dim))
        self.gate_up_lora_b = nn.Parameter(torch.empty(num_experts, 2 * hidden_dim, rank))
        self.down_lora_a = nn.Parameter(torch.empty(num_experts, rank, hidden_dim))
        self.down_lora_b = nn.Parameter(torch.empty(num_experts, dim, rank))
        self.initialize_parameters()

    def adapter_params(self) -> list[str]:  # torchtune's AdapterModule protocol
        return list(self.ADAPTERS)

    @torch.no_grad()
    def initialize_parameters(self) -> None:
        """LoRALinear's initialisation per expert: A uniform in +-1/sqrt(in), B zero."""
        for a in (self.gate_up_lora_a, self.down_lora_a):
            bound = 1 / math.sqrt(a.shape[-1])
            a.uniform_(-bound, bound)
        nn.init.zeros_(self.gate_up_lora_b)
        nn.init.zeros_(self.down_lora_b)

    def mlp(self, expert: int, h: torch.Tensor) -> torch.Tensor:
        width, scale = self.hidden_dim, self.scaling
        gate_up = (h @ self.gate_up_lora_a[expert].T) @ self.gate_up_lora_b[expert].T * scale
        gate = h @ self.gate_proj[expert].T + gate_up[:, :width]
        up = h @ self.up_proj[expert].T + gate_up[:, width:]
        h = F.silu(gate) * up
        down = (h @ self.down_lora_a[expert].T) @ self.down_lora_b[expert].T * scale
        return h @ self.down_proj[expert].T + down


# An expert adapter's key in a state dict: (module prefix, gate_up|down, a|b).
EXPERT_ADAPTER_KEY = re.compile(r"^(.*\.experts)\.(gate_up|down)_lora_(a|b)$")


@torch.no_grad()
def merge_expert_adapters(state: dict[str, torch.Tensor], scaling: float) -> None:
    """Fold every expert adapter in ``state`` (tunepack keys) into the expert weights beside it
    and drop the adapter keys: ``W_e += scaling x B_e @ A_e``, the gate/up rows split as the
    fused adapter holds them."""
    prefixes = {m.group(1) for key in state if (m := EXPERT_ADAPTER_KEY.match(key))}
    for prefix in prefixes:
        a, b = state.pop(f"{prefix}.gate_up_lora_a"), state.pop(f"{prefix}.gate_up_lora_b")
        gate, up = (scaling * torch.bmm(b.float(), a.float())).chunk(2, dim=1)
        for name, delta in (("gate_proj", gate), ("up_proj", up)):
            weight = state[f"{prefix}.{name}"]
            state[f"{prefix}.{name}"] = (weight.float() + delta).to(weight.dtype)
        a, b = state.pop(f"{prefix}.down_lora_a"), state.pop(f"{prefix}.down_lora_b")
        weight = state[f"{prefix}.down_proj"]
        delta = scaling * torch.bmm(b.float(), a.float())
        state[f"{prefix}.down_proj"] = (weight.float() + delta).to(weight.dtype)


class MoEFeedForward(nn.Module):
    """Router + top-k + experts, in place of a layer's MLP (see the module doc)."""

    def __init__(
        self,
        *,
        dim: int,
        hidden_dim: int,
        num_experts: int,
        experts_per_token: int,
        norm_topk_prob: bool,
        aux_loss_coef: float = 0.0,
        lora_rank: int = 0,
        lora_alpha: float = 0.0,
    ) -> None:
        super().__init__()
        if not 1 <= experts_per_token <= num_experts:
            raise ValueError(
                f"experts_per_token={experts_per_token} must be between 1 and num_experts "
                f"({num_experts})"
            )
        self.router = nn.Linear(dim, num_experts, bias=False)
        sizes = {"dim": dim, "hidden_dim": hidden_dim, "num_experts": num_experts}
        self.experts = (
            LoRAExperts(**sizes, rank=lora_rank, alpha=lora_alpha)
            if lora_rank
            else Experts(**sizes)
        )
        self.num_experts = num_experts
        self.experts_per_token = experts_per_token
        self.norm_topk_prob = norm_topk_prob
        self.aux_loss_coef = aux_loss_coef
        # The last training forward's router logits, for router_aux_loss (None otherwise).
        self.router_logits: torch.Tensor | None = None

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(router logits, chosen experts, their weights) of ``x``: (tokens, dim)."""
        logits = self.router(x)
        probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
        weights, chosen = torch.topk(probs, self.experts_per_token, dim=-1)
        if self.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return logits, chosen, weights.to(logits.dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        flat = x.reshape(-1, shape[-1])
        logits, chosen, weights = self.route(flat)
        if self.aux_loss_coef > 0 and self.training and torch.is_grad_enabled():
            self.router_logits = logits
        return self.experts(flat, chosen, weights).reshape(shape)


def load_balancing_loss(
    router_logits: Sequence[torch.Tensor],
    num_experts: int,
    top_k: int,
    mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """The Switch Transformer loss over the layers' router logits (each (tokens, experts)), as
    transformers' ``load_balancing_loss_func``: ``mask`` (tokens,) leaves padding out."""
    device = router_logits[0].device
    assigned = torch.zeros(num_experts, dtype=torch.float32, device=device)
    probability = torch.zeros(num_experts, dtype=torch.float32, device=device)
    rows = torch.zeros((), dtype=torch.float32, device=device)
    weight = None if mask is None else mask.reshape(-1).to(device, torch.float32)
    for logits in router_logits:
        probs = torch.softmax(logits, dim=-1).float()
        chosen = torch.topk(probs, top_k, dim=-1).indices
        hits = F.one_hot(chosen, num_experts).float().sum(dim=1)  # (tokens, experts)
        if weight is not None:
            hits, probs = hits * weight[:, None], probs * weight[:, None]
        assigned = assigned + hits.sum(dim=0)
        probability = probability + probs.sum(dim=0)
        rows = rows + (logits.size(0) if weight is None else weight.sum())
    return num_experts * torch.sum((assigned / rows) * (probability / rows))


def moe_layers(model: nn.Module) -> list[MoEFeedForward]:
    return [m for m in model.modules() if isinstance(m, MoEFeedForward)]


def router_aux_loss(
    model: nn.Module, labels: torch.Tensor | None, n_tokens: int
) -> torch.Tensor | float:
    """``coef x load_balancing_loss x n_tokens`` over the router logits the last forward kept
    (0 for a model without them), and forgets them.

    The recipe's loss is a sum over ``n_tokens`` counted tokens, divided by the step's count, so
    the auxiliary loss is weighted by the same count: one micro-batch's step loss is the mean
    cross-entropy plus ``coef x loss``, as transformers' Qwen3MoeForCausalLM computes it. Padding
    (``labels``, as collated: each row's positions after its last labelled one) is left out as
    transformers leaves out positions its attention mask hides.
    """
    layers = [m for m in moe_layers(model) if m.router_logits is not None]
    logits = [m.router_logits for m in layers]
    for m in layers:
        m.router_logits = None
    if not layers or labels is None:  # no mixture of experts, or no labels to mask with
        return 0.0
    first = layers[0]
    labelled = labels != -100
    from_end = labelled.flip(1).int().argmax(dim=1, keepdim=True)
    length = torch.where(labelled.any(dim=1, keepdim=True), labels.size(1) - from_end, 0)
    mask = torch.arange(labels.size(1))[None, :] < length
    loss = load_balancing_loss(logits, first.num_experts, first.experts_per_token, mask)
    return first.aux_loss_coef * loss * n_tokens
