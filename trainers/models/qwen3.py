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
functions, and the trainer builds them through ``tunepack.trainers.models.builders.build``.
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

import torch
from torch import nn
from torchtune.models.qwen2 import _convert_weights as qwen2_convert
from torchtune.models.qwen2._positional_embeddings import Qwen2RotaryPositionalEmbeddings
from torchtune.modules import (
    MultiHeadAttention,
    RMSNorm,
    TiedLinear,
    TransformerDecoder,
    TransformerSelfAttentionLayer,
)
from torchtune.training import FullModelHFCheckpointer

from tunepack.runtimes.catalog import QWEN3_CONTEXT, QWEN3_HEAD_DIM, QWEN3_SIZES, QWEN3_VOCAB
from tunepack.runtimes.shape import DecoderDims
from tunepack.trainers.models.decoder_parts import (
    attention_projections,
    builders,
    gated_mlp,
    linear,
    project_qkv,
    save_nf4_in_model_dtype,
    sized,
)


class Qwen3Attention(MultiHeadAttention):
    """torchtune's attention with q/k RMSNorm per head applied before RoPE, as HF's Qwen 3."""

    def forward(self, x, y=None, *, mask=None, input_pos=None):
        b, s_x, _ = x.shape
        q, k, v = project_qkv(self, x, y, input_pos)
        output = self._attention_call(
            q,
            k,
            v,
            mask=mask,
            dropout_p=self.attn_dropout if self.training else 0.0,
            is_causal=self.kv_cache is None and mask is None and self.is_causal,
        )
        return self.output_proj(output.transpose(1, 2).contiguous().view(b, s_x, -1))


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
    sparse_mlp: Callable[[], nn.Module] | None = None,
    dense_layers=(),
    **lora_args,
) -> TransformerDecoder:
    # With ``sparse_mlp`` (Qwen3-MoE, trainers/models/qwen3_moe.py), the MLP of every layer but
    # ``dense_layers`` is ``sparse_mlp()``.
    head_dim = head_dim or embed_dim // num_heads
    rope = Qwen2RotaryPositionalEmbeddings(dim=head_dim, max_seq_len=max_seq_len, base=rope_base)
    lin = partial(linear, quantize_base=quantize_base, use_dora=use_dora, **lora_args)
    layers = nn.ModuleList()
    for index in range(num_layers):
        attn = Qwen3Attention(
            embed_dim=embed_dim,
            num_heads=num_heads,
            num_kv_heads=num_kv_heads,
            head_dim=head_dim,
            **attention_projections(
                lin,
                embed_dim=embed_dim,
                num_heads=num_heads,
                num_kv_heads=num_kv_heads,
                head_dim=head_dim,
                lora_attn_modules=lora_attn_modules,
            ),
            pos_embeddings=rope,
            q_norm=RMSNorm(dim=head_dim, eps=norm_eps),
            k_norm=RMSNorm(dim=head_dim, eps=norm_eps),
            max_seq_len=max_seq_len,
            attn_dropout=attn_dropout,
        )
        if sparse_mlp is None or index in dense_layers:
            mlp = gated_mlp(
                lin, embed_dim, intermediate_dim, lora=apply_lora_to_mlp, activation=nn.SiLU()
            )
        else:
            mlp = sparse_mlp()
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
    else:
        output = linear(  # the output projection stays in the dtype, never NF4 (as torchtune's)
            embed_dim, vocab_size, lora=apply_lora_to_output, quantize_base=False,
            use_dora=use_dora, **lora_args,
        )  # fmt: skip
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
        save_nf4_in_model_dtype(model, tok_embeddings)
    return model


@dataclass(frozen=True, kw_only=True)
class Qwen3Shape(DecoderDims):
    """A Qwen 3 dense decoder's shape: what ``qwen3`` and ``lora_qwen3`` take as keywords."""

    head_dim: int | None = None
    rope_base: float = 1_000_000.0
    norm_eps: float = 1e-6
    tie_word_embeddings: bool = False
    attn_dropout: float = 0.0


# A Qwen 3 dense decoder of the given shape (every parameter trainable), and with LoRA (DoRA with
# ``use_dora``, QLoRA with ``quantize_base``) adapters.
qwen3, lora_qwen3 = builders(Qwen3Shape, _decoder, "qwen3", lora_output=True)


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


# One full and one LoRA builder per size, as torchtune names its own (qwen2_5_7b_instruct, ...).
# The tied sizes' LoRA builders take no apply_lora_to_output: their output is the embedding.


def _sized(size: str):
    return sized(qwen3, lora_qwen3, size, _size_kwargs, lora_output=not QWEN3_SIZES[size][-1])


qwen3_0_6b, lora_qwen3_0_6b = _sized("0_6b")
qwen3_1_7b, lora_qwen3_1_7b = _sized("1_7b")
qwen3_4b, lora_qwen3_4b = _sized("4b")
qwen3_8b, lora_qwen3_8b = _sized("8b")
qwen3_14b, lora_qwen3_14b = _sized("14b")
qwen3_32b, lora_qwen3_32b = _sized("32b")


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
def qwen2_conversion(to_tune, to_hf):
    """torchtune's checkpointer imports the Qwen 2 conversion from its module when it runs, so
    for the duration of one load or save that module's functions are ``to_tune`` and ``to_hf``."""
    saved = qwen2_convert.qwen2_hf_to_tune, qwen2_convert.qwen2_tune_to_hf
    qwen2_convert.qwen2_hf_to_tune, qwen2_convert.qwen2_tune_to_hf = to_tune, to_hf
    try:
        yield
    finally:
        qwen2_convert.qwen2_hf_to_tune, qwen2_convert.qwen2_tune_to_hf = saved


class Qwen3HFCheckpointer(FullModelHFCheckpointer):
    """torchtune's HF checkpointer (``model_type=QWEN2``) that also converts the q/k norms."""

    def _conversion(self):
        return qwen2_conversion(qwen3_hf_to_tune, qwen3_tune_to_hf)

    def load_checkpoint(self, *args, **kwargs):
        with self._conversion():
            return super().load_checkpoint(*args, **kwargs)

    def save_checkpoint(self, *args, **kwargs):
        with self._conversion():
            return super().save_checkpoint(*args, **kwargs)
