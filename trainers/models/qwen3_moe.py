"""Qwen3-MoE on torchtune 0.6.1's components and tunepack's mixture-of-experts feed-forward.

Qwen3-MoE is the dense Qwen 3 (``trainers/models/qwen3.py``: q/k RMSNorm per head before RoPE,
explicit ``head_dim``, no q/k/v biases) whose MLP is, in its sparse layers, a router over
``num_experts`` SwiGLU experts of width ``moe_intermediate_size``, ``num_experts_per_tok`` of them
per token (``trainers/models/moe.py``). Which layers are sparse follows transformers'
``Qwen3MoeDecoderLayer``: layer ``i`` is sparse unless ``i`` is in ``mlp_only_layers`` or
``(i + 1) % decoder_sparse_step != 0``; the others have a dense MLP of ``intermediate_size``. The
builders take the dense ones as ``dense_layers``.

LoRA adapts the attention projections; with ``apply_lora_to_mlp`` (``lora_mlp=true``) also the
dense MLPs of ``dense_layers`` and every expert (``moe.LoRAExperts``: a pair per expert, as PEFT's
``target_parameters`` holds them); the router stays frozen. The catalog leaves ``lora_mlp`` off
for the published sizes: their experts' adapters would be most of the trainable parameters
(Qwen3-30B-A3B at rank 8: 315M for the experts, 7M for attention).

Checkpoints: the Hub's files hold each expert's projections under
``mlp.experts.{e}.{gate,up,down}_proj.weight`` and the router as ``mlp.gate.weight``, and that is
what transformers 5's ``save_pretrained`` writes too; transformers 5 holds the experts fused in
memory (``mlp.experts.gate_up_proj``: experts x 2 * width x hidden, gate rows first, and
``mlp.experts.down_proj``) and a state dict saved without its conversion has those keys. The
checkpointer reads either layout and writes back the one it read (torchtune's checkpointer
writes every key into the file it came from).
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import partial

import torch
from torchtune.modules import TransformerDecoder

from tunepack.core.errors import ConflictError, UnsupportedError
from tunepack.runtimes.catalog import QWEN3_MOE_SIZES, expert_lora_obstacle
from tunepack.trainers.models.decoder_parts import builders, sized
from tunepack.trainers.models.moe import MoEFeedForward
from tunepack.trainers.models.qwen3 import (
    Qwen3HFCheckpointer,
    Qwen3Shape,
    qwen2_conversion,
    qwen3_hf_to_tune,
    qwen3_tune_to_hf,
)
from tunepack.trainers.models.qwen3 import _decoder as _qwen3_decoder


def _decoder(
    *,
    embed_dim: int,
    num_experts: int,
    experts_per_token: int,
    moe_intermediate_dim: int,
    dense_layers=(),
    norm_topk_prob: bool = True,
    router_aux_loss_coef: float = 0.0,
    apply_lora_to_mlp: bool = False,
    quantize_base: bool = False,
    **kwargs,
) -> TransformerDecoder:
    """Qwen 3's decoder (trainers/models/qwen3.py) whose MLPs but ``dense_layers``' are experts."""
    dense_layers = {int(i) for i in dense_layers}
    if apply_lora_to_mlp and (
        obstacle := expert_lora_obstacle(kwargs.get("dropout", 0.0), kwargs.get("use_dora", False))
    ):
        raise ConflictError(obstacle)
    if quantize_base:
        raise UnsupportedError(
            "quantize_base: Qwen3-MoE's experts are stacked weights that tunepack does not "
            "quantize to NF4; use method=lora"
        )
    sparse_mlp = partial(
        MoEFeedForward,
        dim=embed_dim,
        hidden_dim=moe_intermediate_dim,
        num_experts=num_experts,
        experts_per_token=experts_per_token,
        norm_topk_prob=norm_topk_prob,
        aux_loss_coef=router_aux_loss_coef,
        **(
            {"lora_rank": kwargs["rank"], "lora_alpha": kwargs["alpha"]}
            if apply_lora_to_mlp
            else {}
        ),
    )
    return _qwen3_decoder(
        embed_dim=embed_dim,
        apply_lora_to_mlp=apply_lora_to_mlp,
        sparse_mlp=sparse_mlp,
        dense_layers=dense_layers,
        **kwargs,
    )


@dataclass(frozen=True, kw_only=True)
class Qwen3MoeShape(Qwen3Shape):
    """A Qwen3-MoE decoder's shape: Qwen 3's (``head_dim`` given) and its experts'; what
    ``qwen3_moe`` and ``lora_qwen3_moe`` take as keywords."""

    head_dim: int = field()  # required here (a field() without default: not Qwen 3's None)
    num_experts: int
    experts_per_token: int
    moe_intermediate_dim: int
    dense_layers: Sequence[int] = ()
    norm_topk_prob: bool = True
    router_aux_loss_coef: float = 0.0


# A Qwen3-MoE decoder of the given shape (every parameter trainable), and with LoRA (DoRA with
# ``use_dora``) on attention, and with ``apply_lora_to_mlp`` on the dense MLPs and (LoRA only)
# the experts.
qwen3_moe, lora_qwen3_moe = builders(Qwen3MoeShape, _decoder, "qwen3_moe", lora_output=True)


# --- published sizes --------------------------------------------------------------------------


def _size_kwargs_of(name: str) -> dict:
    from tunepack.runtimes import catalog

    shape = catalog.qwen3_moe_shape(name)
    return {
        "vocab_size": shape.vocab_size,
        "num_layers": shape.num_layers,
        "num_heads": shape.num_heads,
        "num_kv_heads": shape.num_kv_heads,
        "embed_dim": shape.embed_dim,
        "intermediate_dim": shape.intermediate_dim,
        "max_seq_len": shape.max_seq_len,
        "head_dim": shape.head_dim,
        "num_experts": shape.num_experts,
        "experts_per_token": shape.experts_per_token,
        "moe_intermediate_dim": shape.moe_intermediate_dim,
        "dense_layers": shape.dense_layers,
        "norm_topk_prob": True,
        "router_aux_loss_coef": QWEN3_MOE_SIZES[name][-1],
        "tie_word_embeddings": False,
    }


qwen3_moe_30b_a3b, lora_qwen3_moe_30b_a3b = sized(
    qwen3_moe, lora_qwen3_moe, "30b_a3b", _size_kwargs_of, lora_output=True
)
qwen3_moe_235b_a22b, lora_qwen3_moe_235b_a22b = sized(
    qwen3_moe, lora_qwen3_moe, "235b_a22b", _size_kwargs_of, lora_output=True
)


# --- checkpoint conversion ----------------------------------------------------------------------

_HF_EXPERT = re.compile(
    r"^model\.layers\.(\d+)\.mlp\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$"
)
_HF_FUSED = re.compile(r"^model\.layers\.(\d+)\.mlp\.experts\.(gate_up_proj|down_proj)$")
_HF_ROUTER = re.compile(r"^model\.layers\.(\d+)\.mlp\.gate\.weight$")
_TUNE_EXPERTS = re.compile(r"^layers\.(\d+)\.mlp\.experts\.(gate_proj|up_proj|down_proj)$")
_TUNE_ROUTER = re.compile(r"^layers\.(\d+)\.mlp\.router\.weight$")


def has_fused_experts(state_dict: dict[str, torch.Tensor]) -> bool:
    """Whether ``state_dict`` (HF keys) holds transformers 5's in-memory fused expert layout."""
    return any(_HF_FUSED.match(key) for key in state_dict)


def qwen3_moe_hf_to_tune(state_dict: dict[str, torch.Tensor], **kwargs) -> dict[str, torch.Tensor]:
    """HF Qwen3-MoE keys (either expert layout) -> tunepack's: Qwen 3's mapping for attention,
    norms, embeddings and dense MLPs; per layer, the experts stacked and the router."""
    experts: dict[tuple[int, str], dict[int, torch.Tensor]] = {}
    converted: dict[str, torch.Tensor] = {}
    rest = {}
    for key, value in state_dict.items():
        if match := _HF_EXPERT.match(key):
            layer, expert, proj = match.groups()
            experts.setdefault((int(layer), proj), {})[int(expert)] = value
        elif match := _HF_FUSED.match(key):
            layer, proj = match.groups()
            if proj == "gate_up_proj":
                gate, up = value.chunk(2, dim=1)
                converted[f"layers.{layer}.mlp.experts.gate_proj"] = gate.contiguous()
                converted[f"layers.{layer}.mlp.experts.up_proj"] = up.contiguous()
            else:
                converted[f"layers.{layer}.mlp.experts.down_proj"] = value
        elif match := _HF_ROUTER.match(key):
            converted[f"layers.{match.group(1)}.mlp.router.weight"] = value
        else:
            rest[key] = value
    for (layer, proj), by_expert in experts.items():
        if sorted(by_expert) != list(range(len(by_expert))):
            raise ValueError(f"layer {layer}'s {proj} experts are not numbered 0..n-1")
        stacked = torch.stack([by_expert[e] for e in range(len(by_expert))])
        converted[f"layers.{layer}.mlp.experts.{proj}"] = stacked
    return qwen3_hf_to_tune(rest, **kwargs) | converted


def qwen3_moe_tune_to_hf(
    state_dict: dict[str, torch.Tensor], *, fused_experts: bool = False, **kwargs
) -> dict[str, torch.Tensor]:
    """tunepack keys -> HF Qwen3-MoE's, the inverse of ``qwen3_moe_hf_to_tune``: per expert (the
    Hub's and ``save_pretrained``'s layout) or, with ``fused_experts``, transformers' fused one."""
    converted: dict[str, torch.Tensor] = {}
    rest = {}
    stacked: dict[int, dict[str, torch.Tensor]] = {}
    for key, value in state_dict.items():
        if match := _TUNE_EXPERTS.match(key):
            layer, proj = match.groups()
            stacked.setdefault(int(layer), {})[proj] = value
        elif match := _TUNE_ROUTER.match(key):
            converted[f"model.layers.{match.group(1)}.mlp.gate.weight"] = value
        else:
            rest[key] = value
    for layer, projs in stacked.items():
        prefix = f"model.layers.{layer}.mlp.experts"
        if fused_experts:
            converted[f"{prefix}.gate_up_proj"] = torch.cat(
                [projs["gate_proj"], projs["up_proj"]], dim=1
            )
            converted[f"{prefix}.down_proj"] = projs["down_proj"]
            continue
        for proj, weight in projs.items():
            for expert in range(weight.size(0)):
                converted[f"{prefix}.{expert}.{proj}.weight"] = weight[expert].contiguous()
    return qwen3_tune_to_hf(rest, **kwargs) | converted


class Qwen3MoeHFCheckpointer(Qwen3HFCheckpointer):
    """torchtune's HF checkpointer (``model_type=QWEN2``) converting Qwen3-MoE's experts, router
    and q/k norms; it writes the experts in the layout it read (see the module doc)."""

    _fused_experts = False

    def _conversion(self):
        def to_tune(state_dict, **kwargs):
            self._fused_experts = has_fused_experts(state_dict)
            return qwen3_moe_hf_to_tune(state_dict, **kwargs)

        def to_hf(state_dict, **kwargs):
            return qwen3_moe_tune_to_hf(state_dict, fused_experts=self._fused_experts, **kwargs)

        return qwen2_conversion(to_tune, to_hf)
