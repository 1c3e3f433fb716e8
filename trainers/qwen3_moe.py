"""Qwen3-MoE on torchtune 0.6.1's components and tunepack's mixture-of-experts feed-forward.

Qwen3-MoE is the dense Qwen 3 (``trainers/qwen3.py``: q/k RMSNorm per head before RoPE, explicit
``head_dim``, no q/k/v biases) whose MLP is, in its sparse layers, a router over
``num_experts`` SwiGLU experts of width ``moe_intermediate_size``, ``num_experts_per_tok`` of
them per token (``trainers/moe.py``). Which layers are sparse follows transformers'
``Qwen3MoeDecoderLayer``: layer ``i`` is sparse unless ``i`` is in ``mlp_only_layers`` or
``(i + 1) % decoder_sparse_step != 0``; the others have a dense MLP of ``intermediate_size``.
The builders take the dense ones as ``dense_layers``.

LoRA adapts the attention projections, and the dense MLPs of ``dense_layers`` with
``apply_lora_to_mlp``; the experts and the router are frozen. LoRA on the experts is not
implemented: a checkpoint whose every layer is sparse (the published ones) refuses
``lora_mlp=true``, which the catalog's defaults leave off.

Checkpoints: the Hub's files hold each expert's projections under
``mlp.experts.{e}.{gate,up,down}_proj.weight`` and the router as ``mlp.gate.weight``, and that is
what transformers 5's ``save_pretrained`` writes too; transformers 5 holds the experts fused in
memory (``mlp.experts.gate_up_proj``: experts x 2 * width x hidden, gate rows first, and
``mlp.experts.down_proj``) and a state dict saved without its conversion has those keys. The
checkpointer reads either layout and writes back the one it read (torchtune's checkpointer
writes every key into the file it came from).
"""

from __future__ import annotations

import contextlib
import re
from functools import partial

import torch
from torch import nn
from torchtune.models.qwen2 import _convert_weights as qwen2_convert
from torchtune.models.qwen2._positional_embeddings import Qwen2RotaryPositionalEmbeddings
from torchtune.modules import (
    FeedForward,
    RMSNorm,
    TiedLinear,
    TransformerDecoder,
    TransformerSelfAttentionLayer,
)
from torchtune.modules.peft import DoRALinear, LoRALinear
from torchtune.training import FullModelHFCheckpointer

from tunepack.core.errors import BadInputError
from tunepack.runtimes.catalog import QWEN3_MOE_SIZES
from tunepack.trainers.moe import MoEFeedForward
from tunepack.trainers.qwen3 import Qwen3Attention, _linear, qwen3_hf_to_tune, qwen3_tune_to_hf


def _decoder(
    *,
    vocab_size: int,
    num_layers: int,
    num_heads: int,
    num_kv_heads: int,
    embed_dim: int,
    intermediate_dim: int,
    max_seq_len: int,
    head_dim: int,
    num_experts: int,
    experts_per_token: int,
    moe_intermediate_dim: int,
    dense_layers=(),
    norm_topk_prob: bool = True,
    router_aux_loss_coef: float = 0.0,
    rope_base: float = 1_000_000.0,
    norm_eps: float = 1e-6,
    tie_word_embeddings: bool = False,
    attn_dropout: float = 0.0,
    lora_attn_modules: tuple[str, ...] = (),
    apply_lora_to_mlp: bool = False,
    apply_lora_to_output: bool = False,
    quantize_base: bool = False,
    use_dora: bool = False,
    **lora_args,
) -> TransformerDecoder:
    dense = {int(i) for i in dense_layers}
    if apply_lora_to_mlp and not dense:
        raise BadInputError(
            "lora_mlp=true: every layer of this Qwen3-MoE model is a mixture of experts, and "
            "tunepack applies LoRA to attention only there (not to the experts); set "
            "lora_mlp=false"
        )
    if quantize_base:
        raise BadInputError(
            "quantize_base: Qwen3-MoE's experts are stacked weights that tunepack does not "
            "quantize to NF4; use method=lora"
        )
    rope = Qwen2RotaryPositionalEmbeddings(dim=head_dim, max_seq_len=max_seq_len, base=rope_base)
    lin = partial(_linear, quantize_base=False, use_dora=use_dora, **lora_args)
    q_out, kv_out = num_heads * head_dim, num_kv_heads * head_dim
    layers = nn.ModuleList()
    for index in range(num_layers):
        attn = Qwen3Attention(
            embed_dim=embed_dim,
            num_heads=num_heads,
            num_kv_heads=num_kv_heads,
            head_dim=head_dim,
            q_proj=lin(embed_dim, q_out, lora="q_proj" in lora_attn_modules),
            k_proj=lin(embed_dim, kv_out, lora="k_proj" in lora_attn_modules),
            v_proj=lin(embed_dim, kv_out, lora="v_proj" in lora_attn_modules),
            output_proj=lin(q_out, embed_dim, lora="output_proj" in lora_attn_modules),
            pos_embeddings=rope,
            q_norm=RMSNorm(dim=head_dim, eps=norm_eps),
            k_norm=RMSNorm(dim=head_dim, eps=norm_eps),
            max_seq_len=max_seq_len,
            attn_dropout=attn_dropout,
        )
        if index in dense:
            mlp = FeedForward(
                gate_proj=lin(embed_dim, intermediate_dim, lora=apply_lora_to_mlp),
                down_proj=lin(intermediate_dim, embed_dim, lora=apply_lora_to_mlp),
                up_proj=lin(embed_dim, intermediate_dim, lora=apply_lora_to_mlp),
                activation=nn.SiLU(),
            )
        else:
            mlp = MoEFeedForward(
                dim=embed_dim,
                hidden_dim=moe_intermediate_dim,
                num_experts=num_experts,
                experts_per_token=experts_per_token,
                norm_topk_prob=norm_topk_prob,
                aux_loss_coef=router_aux_loss_coef,
            )
        layers.append(
            TransformerSelfAttentionLayer(
                attn=attn,
                mlp=mlp,
                sa_norm=RMSNorm(dim=embed_dim, eps=norm_eps),
                mlp_norm=RMSNorm(dim=embed_dim, eps=norm_eps),
            )
        )
    tok_embeddings = nn.Embedding(vocab_size, embed_dim)
    if tie_word_embeddings:
        if apply_lora_to_output:
            raise ValueError("LoRA cannot adapt an output projection tied to the embeddings")
        output = TiedLinear(tok_embeddings)
    elif apply_lora_to_output:
        cls = DoRALinear if use_dora else LoRALinear
        output = cls(embed_dim, vocab_size, **lora_args)
    else:
        output = nn.Linear(embed_dim, vocab_size, bias=False)
    model = TransformerDecoder(
        tok_embeddings=tok_embeddings,
        layers=layers,
        max_seq_len=max_seq_len,
        num_heads=num_heads,
        head_dim=head_dim,
        norm=RMSNorm(embed_dim, eps=norm_eps),
        output=output,
    )
    return model


def qwen3_moe(
    *,
    vocab_size: int,
    num_layers: int,
    num_heads: int,
    num_kv_heads: int,
    embed_dim: int,
    intermediate_dim: int,
    max_seq_len: int,
    head_dim: int,
    num_experts: int,
    experts_per_token: int,
    moe_intermediate_dim: int,
    dense_layers=(),
    norm_topk_prob: bool = True,
    router_aux_loss_coef: float = 0.0,
    rope_base: float = 1_000_000.0,
    norm_eps: float = 1e-6,
    tie_word_embeddings: bool = False,
    attn_dropout: float = 0.0,
) -> TransformerDecoder:
    """A Qwen3-MoE decoder of the given shape (every parameter trainable)."""
    return _decoder(**dict(locals()))


def lora_qwen3_moe(
    lora_attn_modules,
    apply_lora_to_mlp: bool = False,
    apply_lora_to_output: bool = False,
    *,
    vocab_size: int,
    num_layers: int,
    num_heads: int,
    num_kv_heads: int,
    embed_dim: int,
    intermediate_dim: int,
    max_seq_len: int,
    head_dim: int,
    num_experts: int,
    experts_per_token: int,
    moe_intermediate_dim: int,
    dense_layers=(),
    norm_topk_prob: bool = True,
    router_aux_loss_coef: float = 0.0,
    rope_base: float = 1_000_000.0,
    norm_eps: float = 1e-6,
    tie_word_embeddings: bool = False,
    attn_dropout: float = 0.0,
    lora_rank: int,
    lora_alpha: float,
    lora_dropout: float = 0.0,
    use_dora: bool = False,
    quantize_base: bool = False,
) -> TransformerDecoder:
    """Qwen3-MoE with LoRA (DoRA with ``use_dora``) on attention (and the dense MLPs)."""
    args = dict(locals())
    args["lora_attn_modules"] = tuple(lora_attn_modules)
    args["rank"], args["alpha"], args["dropout"] = (
        args.pop("lora_rank"),
        args.pop("lora_alpha"),
        args.pop("lora_dropout"),
    )
    return _decoder(**args)


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


def qwen3_moe_30b_a3b(rope_base: float = 1_000_000.0) -> TransformerDecoder:
    return qwen3_moe(**_size_kwargs_of("30b_a3b"), rope_base=rope_base)


def lora_qwen3_moe_30b_a3b(
    lora_attn_modules,
    apply_lora_to_mlp: bool = False,
    apply_lora_to_output: bool = False,
    *,
    rope_base: float = 1_000_000.0,
    lora_rank: int,
    lora_alpha: float,
    lora_dropout: float = 0.0,
    use_dora: bool = False,
    quantize_base: bool = False,
) -> TransformerDecoder:
    return lora_qwen3_moe(
        lora_attn_modules, apply_lora_to_mlp, apply_lora_to_output,
        **_size_kwargs_of("30b_a3b"), rope_base=rope_base, lora_rank=lora_rank,
        lora_alpha=lora_alpha, lora_dropout=lora_dropout, use_dora=use_dora,
        quantize_base=quantize_base,
    )  # fmt: skip


def qwen3_moe_235b_a22b(rope_base: float = 1_000_000.0) -> TransformerDecoder:
    return qwen3_moe(**_size_kwargs_of("235b_a22b"), rope_base=rope_base)


def lora_qwen3_moe_235b_a22b(
    lora_attn_modules,
    apply_lora_to_mlp: bool = False,
    apply_lora_to_output: bool = False,
    *,
    rope_base: float = 1_000_000.0,
    lora_rank: int,
    lora_alpha: float,
    lora_dropout: float = 0.0,
    use_dora: bool = False,
    quantize_base: bool = False,
) -> TransformerDecoder:
    return lora_qwen3_moe(
        lora_attn_modules, apply_lora_to_mlp, apply_lora_to_output,
        **_size_kwargs_of("235b_a22b"), rope_base=rope_base, lora_rank=lora_rank,
        lora_alpha=lora_alpha, lora_dropout=lora_dropout, use_dora=use_dora,
        quantize_base=quantize_base,
    )  # fmt: skip


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


class Qwen3MoeHFCheckpointer(FullModelHFCheckpointer):
    """torchtune's HF checkpointer (``model_type=QWEN2``) converting Qwen3-MoE's experts, router
    and q/k norms; it writes the experts in the layout it read (see the module doc)."""

    _fused_experts = False

    @contextlib.contextmanager
    def _conversion(self):
        # torchtune's checkpointer imports the Qwen 2 conversion from its module when it runs,
        # so for one load or save that module's functions are these.
        def to_tune(state_dict, **kwargs):
            self._fused_experts = has_fused_experts(state_dict)
            return qwen3_moe_hf_to_tune(state_dict, **kwargs)

        def to_hf(state_dict, **kwargs):
            return qwen3_moe_tune_to_hf(state_dict, fused_experts=self._fused_experts, **kwargs)

        saved = qwen2_convert.qwen2_hf_to_tune, qwen2_convert.qwen2_tune_to_hf
        qwen2_convert.qwen2_hf_to_tune, qwen2_convert.qwen2_tune_to_hf = to_tune, to_hf
        try:
            yield
        finally:
            qwen2_convert.qwen2_hf_to_tune, qwen2_convert.qwen2_tune_to_hf = saved

    def load_checkpoint(self, *args, **kwargs):
        with self._conversion():
            return super().load_checkpoint(*args, **kwargs)

    def save_checkpoint(self, *args, **kwargs):
        with self._conversion():
            return super().save_checkpoint(*args, **kwargs)
