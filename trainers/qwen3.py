"""Qwen 3 (dense) on torchtune 0.6.1's components, which has no Qwen 3 of its own.

Qwen 3 is the Qwen 2 decoder (SwiGLU MLP, RMSNorm, half-split RoPE with base 1e6, grouped-query
attention) without q/k/v biases, with an explicit ``head_dim`` (128 at every size, so the query
width differs from the model width on the small sizes) and with an RMSNorm over each head's
query and key (``q_norm``/``k_norm``, one scale of ``head_dim`` values shared by the heads).

Hugging Face's Qwen 3 normalises q and k *before* RoPE. torchtune 0.6.1's ``MultiHeadAttention``
takes ``q_norm``/``k_norm`` but applies them *after* RoPE, which is another model as soon as the
norm's scale differs between the two halves of a rotary pair; ``Qwen3Attention`` keeps torchtune's
module names (so state-dict keys are ``layers.N.attn.q_norm.scale``) and applies them in HF's
order.

Checkpoints: torchtune's Qwen 2 conversion maps every Qwen 3 key except the norms (HF keeps q/k
rows in the order torchtune's Qwen 2 RoPE uses, so no permutation). ``Qwen3HFCheckpointer`` is
torchtune's HF checkpointer with the Qwen 2 conversion extended by those two keys, both ways.

Builders take no user input: the catalog (runtimes/catalog.py) maps model names to these
functions, and the trainer builds them through ``tunepack.trainers.builders.build``.
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
    MultiHeadAttention,
    RMSNorm,
    TiedLinear,
    TransformerDecoder,
    TransformerSelfAttentionLayer,
)
from torchtune.modules.common_utils import reparametrize_as_dtype_state_dict_post_hook
from torchtune.modules.low_precision import FrozenNF4Linear
from torchtune.modules.peft import DoRALinear, LoRALinear
from torchtune.training import FullModelHFCheckpointer

from tunepack.runtimes.catalog import QWEN3_CONTEXT, QWEN3_HEAD_DIM, QWEN3_SIZES, QWEN3_VOCAB


class Qwen3Attention(MultiHeadAttention):
    """torchtune's attention with q/k RMSNorm per head applied before RoPE, as HF's Qwen 3."""

    def forward(self, x, y=None, *, mask=None, input_pos=None):
        if y is None:
            y = x
        b, s_x, _ = x.shape
        s_y = y.shape[1]
        q = self.q_proj(x).view(b, s_x, self.num_heads, self.head_dim)
        k = self.k_proj(y).view(b, s_y, self.num_kv_heads, self.head_dim)
        v = self.v_proj(y).view(b, s_y, self.num_kv_heads, self.head_dim)
        q, k = self.q_norm(q), self.k_norm(k)
        q = self.pos_embeddings(q, input_pos=input_pos).transpose(1, 2)
        k = self.pos_embeddings(k, input_pos=input_pos).transpose(1, 2)
        v = v.transpose(1, 2)
        if self.kv_cache is not None and self.cache_enabled:
            k, v = self.kv_cache.update(k, v)
        if self.num_heads != self.num_kv_heads:
            repeat = self.num_heads // self.num_kv_heads
            k = k.repeat_interleave(repeat, dim=1)
            v = v.repeat_interleave(repeat, dim=1)
        output = self._attention_call(
            q,
            k,
            v,
            mask=mask,
            dropout_p=self.attn_dropout if self.training else 0.0,
            is_causal=self.kv_cache is None and mask is None and self.is_causal,
        )
        return self.output_proj(output.transpose(1, 2).contiguous().view(b, s_x, -1))


def _linear(in_dim, out_dim, *, lora: bool, quantize_base: bool, use_dora: bool, **lora_args):
    if lora:
        cls = DoRALinear if use_dora else LoRALinear
        return cls(in_dim, out_dim, quantize_base=quantize_base, **lora_args)
    if quantize_base:
        return FrozenNF4Linear(in_dim, out_dim, bias=False)
    return nn.Linear(in_dim, out_dim, bias=False)


def _decoder(
    *,
    vocab_size: int,
    num_layers: int,
    num_heads: int,
    num_kv_heads: int,
    embed_dim: int,
    intermediate_dim: int,
    max_seq_len: int,
    head_dim: int | None,
    rope_base: float,
    norm_eps: float,
    tie_word_embeddings: bool,
    attn_dropout: float = 0.0,
    lora_attn_modules: tuple[str, ...] = (),
    apply_lora_to_mlp: bool = False,
    apply_lora_to_output: bool = False,
    quantize_base: bool = False,
    use_dora: bool = False,
    **lora_args,
) -> TransformerDecoder:
    head_dim = head_dim or embed_dim // num_heads
    rope = Qwen2RotaryPositionalEmbeddings(dim=head_dim, max_seq_len=max_seq_len, base=rope_base)
    lin = partial(_linear, quantize_base=quantize_base, use_dora=use_dora, **lora_args)
    q_out, kv_out = num_heads * head_dim, num_kv_heads * head_dim
    layers = nn.ModuleList()
    for _ in range(num_layers):
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
        mlp = FeedForward(
            gate_proj=lin(embed_dim, intermediate_dim, lora=apply_lora_to_mlp),
            down_proj=lin(intermediate_dim, embed_dim, lora=apply_lora_to_mlp),
            up_proj=lin(embed_dim, intermediate_dim, lora=apply_lora_to_mlp),
            activation=nn.SiLU(),
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
    if quantize_base:
        # As torchtune's QLoRA builders: NF4 weights are saved in the model's dtype.
        model._register_state_dict_hook(
            partial(
                reparametrize_as_dtype_state_dict_post_hook,
                dtype=tok_embeddings.weight.dtype,
                offload_to_cpu=True,
            )
        )
    return model


def qwen3(
    *,
    vocab_size: int,
    num_layers: int,
    num_heads: int,
    num_kv_heads: int,
    embed_dim: int,
    intermediate_dim: int,
    max_seq_len: int,
    head_dim: int | None = None,
    rope_base: float = 1_000_000.0,
    norm_eps: float = 1e-6,
    tie_word_embeddings: bool = False,
    attn_dropout: float = 0.0,
) -> TransformerDecoder:
    """A Qwen 3 dense decoder of the given shape (every parameter trainable)."""
    return _decoder(**{k: v for k, v in locals().items()})


def lora_qwen3(
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
    head_dim: int | None = None,
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
    """Qwen 3 with LoRA (DoRA with ``use_dora``, QLoRA with ``quantize_base``) adapters."""
    args = dict(locals())
    args["lora_attn_modules"] = tuple(lora_attn_modules)
    args["rank"], args["alpha"], args["dropout"] = (
        args.pop("lora_rank"),
        args.pop("lora_alpha"),
        args.pop("lora_dropout"),
    )
    return _decoder(**args)


# --- published sizes --------------------------------------------------------------------------
# The published sizes' dimensions live in the catalog (source named there).


def _size_kwargs(size: str) -> dict:
    layers, heads, kv, dim, ffn, tied = QWEN3_SIZES[size]
    return {
        "vocab_size": QWEN3_VOCAB,
        "num_layers": layers,
        "num_heads": heads,
        "num_kv_heads": kv,
        "embed_dim": dim,
        "intermediate_dim": ffn,
        "max_seq_len": QWEN3_CONTEXT,
        "head_dim": QWEN3_HEAD_DIM,
        "tie_word_embeddings": tied,
    }


def _full(size: str, rope_base: float) -> TransformerDecoder:
    return qwen3(**_size_kwargs(size), rope_base=rope_base)


def _lora(size: str, lora_attn_modules, apply_lora_to_mlp: bool, **kwargs) -> TransformerDecoder:
    return lora_qwen3(lora_attn_modules, apply_lora_to_mlp, **_size_kwargs(size), **kwargs)


# One full and one LoRA builder per size, as torchtune names its own (qwen2_5_7b_instruct, ...).
# The tied sizes' LoRA builders take no apply_lora_to_output: their output is the embedding.


def qwen3_0_6b(rope_base: float = 1_000_000.0) -> TransformerDecoder:
    return _full("0_6b", rope_base)


def lora_qwen3_0_6b(
    lora_attn_modules,
    apply_lora_to_mlp: bool = False,
    *,
    rope_base: float = 1_000_000.0,
    lora_rank: int,
    lora_alpha: float,
    lora_dropout: float = 0.0,
    use_dora: bool = False,
    quantize_base: bool = False,
) -> TransformerDecoder:
    return _lora(
        "0_6b",
        lora_attn_modules,
        apply_lora_to_mlp,
        rope_base=rope_base,
        lora_rank=lora_rank,
        lora_alpha=lora_alpha,
        lora_dropout=lora_dropout,
        use_dora=use_dora,
        quantize_base=quantize_base,
    )


def qwen3_1_7b(rope_base: float = 1_000_000.0) -> TransformerDecoder:
    return _full("1_7b", rope_base)


def lora_qwen3_1_7b(
    lora_attn_modules,
    apply_lora_to_mlp: bool = False,
    *,
    rope_base: float = 1_000_000.0,
    lora_rank: int,
    lora_alpha: float,
    lora_dropout: float = 0.0,
    use_dora: bool = False,
    quantize_base: bool = False,
) -> TransformerDecoder:
    return _lora(
        "1_7b",
        lora_attn_modules,
        apply_lora_to_mlp,
        rope_base=rope_base,
        lora_rank=lora_rank,
        lora_alpha=lora_alpha,
        lora_dropout=lora_dropout,
        use_dora=use_dora,
        quantize_base=quantize_base,
    )


def qwen3_4b(rope_base: float = 1_000_000.0) -> TransformerDecoder:
    return _full("4b", rope_base)


def lora_qwen3_4b(
    lora_attn_modules,
    apply_lora_to_mlp: bool = False,
    *,
    rope_base: float = 1_000_000.0,
    lora_rank: int,
    lora_alpha: float,
    lora_dropout: float = 0.0,
    use_dora: bool = False,
    quantize_base: bool = False,
) -> TransformerDecoder:
    return _lora(
        "4b",
        lora_attn_modules,
        apply_lora_to_mlp,
        rope_base=rope_base,
        lora_rank=lora_rank,
        lora_alpha=lora_alpha,
        lora_dropout=lora_dropout,
        use_dora=use_dora,
        quantize_base=quantize_base,
    )


def qwen3_8b(rope_base: float = 1_000_000.0) -> TransformerDecoder:
    return _full("8b", rope_base)


def lora_qwen3_8b(
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
    return _lora(
        "8b",
        lora_attn_modules,
        apply_lora_to_mlp,
        apply_lora_to_output=apply_lora_to_output,
        rope_base=rope_base,
        lora_rank=lora_rank,
        lora_alpha=lora_alpha,
        lora_dropout=lora_dropout,
        use_dora=use_dora,
        quantize_base=quantize_base,
    )


def qwen3_14b(rope_base: float = 1_000_000.0) -> TransformerDecoder:
    return _full("14b", rope_base)


def lora_qwen3_14b(
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
    return _lora(
        "14b",
        lora_attn_modules,
        apply_lora_to_mlp,
        apply_lora_to_output=apply_lora_to_output,
        rope_base=rope_base,
        lora_rank=lora_rank,
        lora_alpha=lora_alpha,
        lora_dropout=lora_dropout,
        use_dora=use_dora,
        quantize_base=quantize_base,
    )


def qwen3_32b(rope_base: float = 1_000_000.0) -> TransformerDecoder:
    return _full("32b", rope_base)


def lora_qwen3_32b(
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
    return _lora(
        "32b",
        lora_attn_modules,
        apply_lora_to_mlp,
        apply_lora_to_output=apply_lora_to_output,
        rope_base=rope_base,
        lora_rank=lora_rank,
        lora_alpha=lora_alpha,
        lora_dropout=lora_dropout,
        use_dora=use_dora,
        quantize_base=quantize_base,
    )


# --- checkpoint conversion ----------------------------------------------------------------------

_HF_NORM = re.compile(r"^model\.layers\.(\d+)\.self_attn\.(q_norm|k_norm)\.weight$")
_TUNE_NORM = re.compile(r"^layers\.(\d+)\.attn\.(q_norm|k_norm)\.scale$")
_qwen2_hf_to_tune = qwen2_convert.qwen2_hf_to_tune
_qwen2_tune_to_hf = qwen2_convert.qwen2_tune_to_hf


def qwen3_hf_to_tune(state_dict: dict[str, torch.Tensor], **kwargs) -> dict[str, torch.Tensor]:
    """HF Qwen 3 keys -> torchtune's: Qwen 2's mapping plus the per-head q/k norms."""
    norms = {k: v for k, v in state_dict.items() if _HF_NORM.match(k)}
    rest = {k: v for k, v in state_dict.items() if k not in norms}
    converted = _qwen2_hf_to_tune(rest, **kwargs)
    for key, value in norms.items():
        layer, which = _HF_NORM.match(key).groups()
        converted[f"layers.{layer}.attn.{which}.scale"] = value
    return converted


def qwen3_tune_to_hf(state_dict: dict[str, torch.Tensor], **kwargs) -> dict[str, torch.Tensor]:
    """torchtune keys -> HF Qwen 3's, the inverse of ``qwen3_hf_to_tune``."""
    norms = {k: v for k, v in state_dict.items() if _TUNE_NORM.match(k)}
    rest = {k: v for k, v in state_dict.items() if k not in norms}
    converted = _qwen2_tune_to_hf(rest, **kwargs)
    for key, value in norms.items():
        layer, which = _TUNE_NORM.match(key).groups()
        converted[f"model.layers.{layer}.self_attn.{which}.weight"] = value
    return converted


@contextlib.contextmanager
def _qwen3_conversion():
    # torchtune's checkpointer imports the Qwen 2 conversion from its module when it runs, so
    # for the duration of one load or save that module's functions are the Qwen 3 ones.
    saved = qwen2_convert.qwen2_hf_to_tune, qwen2_convert.qwen2_tune_to_hf
    qwen2_convert.qwen2_hf_to_tune, qwen2_convert.qwen2_tune_to_hf = (
        qwen3_hf_to_tune,
        qwen3_tune_to_hf,
    )
    try:
        yield
    finally:
        qwen2_convert.qwen2_hf_to_tune, qwen2_convert.qwen2_tune_to_hf = saved


class Qwen3HFCheckpointer(FullModelHFCheckpointer):
    """torchtune's HF checkpointer (``model_type=QWEN2``) that also converts the q/k norms."""

    def load_checkpoint(self, *args, **kwargs):
        with _qwen3_conversion():
            return super().load_checkpoint(*args, **kwargs)

    def save_checkpoint(self, *args, **kwargs):
        with _qwen3_conversion():
            return super().save_checkpoint(*args, **kwargs)
