"""Gemma 3 (text) on torchtune 0.6.1's components, which has no Gemma 3 of its own.

The layout, as transformers' ``Gemma3ForCausalLM`` (``models/gemma3/modeling_gemma3.py``) computes
it:

- token embeddings scaled by ``sqrt(hidden_size)`` (torchtune's ``GemmaNormEmbeddings``), tied to
  the output projection; no soft-capping of attention scores or logits (Gemma 2's is gone);
- Gemma's RMSNorm, ``x * (1 + w)`` (torchtune's ``GemmaRMSNorm``), four per layer: before and
  after attention, before and after the MLP, in torchtune's ``TransformerSelfAttentionLayer``
  under its names (``sa_norm``, ``sa_scale``, ``mlp_norm``, ``mlp_scale``), whose order is HF's;
- an RMSNorm over each head's query and key (one ``head_dim``-wide scale each) *before* RoPE;
- scores scaled by ``query_pre_attn_scalar ** -0.5`` (not always ``head_dim ** -0.5``: 27B);
- local and global layers: a layer is global when ``(i + 1) % sliding_window_pattern == 0``
  (transformers' default ``layer_types``; a checkpoint's own ``layer_types`` give
  ``global_layers``), a local one attends to the last ``sliding_window`` positions (itself
  included) only;
- two RoPE tables, half-split as HF's (so HF's q/k row order needs no permutation): local layers
  use ``rope_local_base`` (10 000), global ones ``rope_base`` (1 000 000) with the positions
  divided by ``rope_scaling_factor`` (HF's "linear" scaling, 8 on 4B/12B/27B);
- a GELU (tanh) gated MLP.

Checkpoints: ``Gemma3HFCheckpointer`` reads ``Gemma3ForCausalLM`` files (1B) and the text weights
of ``Gemma3ForConditionalGeneration`` ones (4B/12B/27B: under ``language_model.model.``; the
vision tower and projector are left out), and always saves a text-only ``Gemma3ForCausalLM``
with its ``config.json``.

Builders take no user input: the catalog (runtimes/catalog.py) maps model names to these
functions, and the trainer builds them through ``tunepack.trainers.models.builders.build``.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from torchtune.models.gemma.gemma_norm_embedding import GemmaNormEmbeddings
from torchtune.models.gemma.rms_norm import GemmaRMSNorm
from torchtune.models.qwen2._positional_embeddings import Qwen2RotaryPositionalEmbeddings
from torchtune.modules import (
    MultiHeadAttention,
    TiedLinear,
    TransformerDecoder,
    TransformerSelfAttentionLayer,
)
from torchtune.training import FullModelHFCheckpointer

from tunepack.runtimes.catalog import GEMMA3_SIZES
from tunepack.runtimes.custom import text_config
from tunepack.runtimes.shape import DecoderDims
from tunepack.trainers.models import hf_shards
from tunepack.trainers.models.decoder_parts import (
    attention_projections,
    builders,
    gated_mlp,
    linear,
    project_qkv,
    save_nf4_in_model_dtype,
    sized,
)

# The checkpointer's model type: not one of torchtune's ModelType names (it has no Gemma 3), so
# nothing treats these checkpoints as another family's (the PEFT export leaves q/k rows as they
# are, trainers/outputs/peft_export.py).
MODEL_TYPE = "GEMMA3"


class Gemma3RoPE(Qwen2RotaryPositionalEmbeddings):
    """Half-split RoPE (HF's layout) with linear position scaling: positions / ``scaling``."""

    def __init__(self, dim: int, max_seq_len: int, base: float, scaling: float = 1.0) -> None:
        self.scaling = float(scaling)
        super().__init__(dim=dim, max_seq_len=max_seq_len, base=base)

    def rope_init(self) -> None:
        exponents = torch.arange(0, self.dim, 2)[: self.dim // 2].float() / self.dim
        theta = 1.0 / (self.base**exponents) / self.scaling
        self.register_buffer("theta", theta, persistent=False)
        self.build_rope_cache(self.max_seq_len)


def _in_window(window: int):
    def mask_mod(_b, _h, q_idx, kv_idx):
        return q_idx - kv_idx < window

    return mask_mod


class Gemma3Attention(MultiHeadAttention):
    """torchtune's attention with Gemma 3's q/k norms before RoPE, its score scale and, on local
    layers, a sliding window (``sliding_window`` positions, the query's own included)."""

    def __init__(self, *, sliding_window: int | None, query_pre_attn_scalar: float, **kwargs):
        super().__init__(**kwargs)
        self.sliding_window = sliding_window
        self.scaling = float(query_pre_attn_scalar) ** -0.5

    def _window_mask(self, mask, s_x: int, s_y: int, device):
        """The mask of a local layer: ``mask`` (None: causal) and the window; None where the
        window cuts nothing (no sequence longer than it)."""
        window = self.sliding_window
        if window is None or (mask is None and s_y <= window):
            return mask
        if isinstance(mask, torch.Tensor) or mask is None:
            q_pos = torch.arange(s_y - s_x, s_y, device=device)[:, None]
            kv_pos = torch.arange(s_y, device=device)[None, :]
            local = (q_pos - kv_pos < window) & (kv_pos <= q_pos)
            return local[None] if mask is None else mask & local
        # A flex-attention BlockMask (packed batches on a GPU): the same window over its rule.
        from torch.nn.attention.flex_attention import and_masks, create_block_mask

        batch, heads, q_len, kv_len = mask.shape
        return create_block_mask(
            and_masks(mask.mask_mod, _in_window(window)),
            batch,
            heads,
            q_len,
            kv_len,
            device=mask.kv_num_blocks.device,
        )

    def forward(self, x, y=None, *, mask=None, input_pos=None):
        b, s_x, _ = x.shape
        q, k, v = project_qkv(self, x, y, input_pos)
        mask = self._window_mask(mask, s_x, k.shape[2], x.device)
        dropout = self.attn_dropout if self.training else 0.0
        if mask is None or isinstance(mask, torch.Tensor):
            output = F.scaled_dot_product_attention(
                q,
                k,
                v,
                attn_mask=None if mask is None else mask[:, None],
                dropout_p=dropout,
                is_causal=mask is None and self.kv_cache is None and self.is_causal,
                scale=self.scaling,
            )
        else:  # a BlockMask: torchtune's flex attention scales by head_dim ** -0.5
            q = q * (self.scaling * math.sqrt(self.head_dim))
            output = self._attention_call(q, k, v, mask=mask, dropout_p=dropout, is_causal=False)
        return self.output_proj(output.transpose(1, 2).contiguous().view(b, s_x, -1))


def global_layer_indices(num_layers: int, sliding_window_pattern: int) -> list[int]:
    """The global layers of transformers' default ``layer_types``: every ``pattern``-th."""
    return [i for i in range(num_layers) if (i + 1) % sliding_window_pattern == 0]


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
    sliding_window_size: int,
    rope_base: float,
    rope_local_base: float,
    rope_scaling_factor: float,
    query_pre_attn_scalar: float | None,
    sliding_window_pattern: int,
    global_layers,
    norm_eps: float,
    attn_dropout: float = 0.0,
    lora_attn_modules: tuple[str, ...] = (),
    apply_lora_to_mlp: bool = False,
    quantize_base: bool = False,
    use_dora: bool = False,
    **lora_args,
) -> TransformerDecoder:
    if global_layers is None:
        global_layers = global_layer_indices(num_layers, sliding_window_pattern)
    global_layers = {int(i) for i in global_layers}
    if not global_layers <= set(range(num_layers)):
        raise ValueError(f"global_layers {sorted(global_layers)} outside 0..{num_layers - 1}")
    scalar = head_dim if query_pre_attn_scalar is None else query_pre_attn_scalar
    # One table per kind of layer, shared by the layers of that kind (as torchtune shares one).
    local_rope = Gemma3RoPE(head_dim, max_seq_len, rope_local_base)
    global_rope = Gemma3RoPE(head_dim, max_seq_len, rope_base, rope_scaling_factor)
    lin = partial(linear, quantize_base=quantize_base, use_dora=use_dora, **lora_args)
    layers = nn.ModuleList()
    for index in range(num_layers):
        is_global = index in global_layers
        attn = Gemma3Attention(
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
            pos_embeddings=global_rope if is_global else local_rope,
            q_norm=GemmaRMSNorm(head_dim, eps=norm_eps),
            k_norm=GemmaRMSNorm(head_dim, eps=norm_eps),
            max_seq_len=max_seq_len,
            attn_dropout=attn_dropout,
            sliding_window=None if is_global else sliding_window_size,
            query_pre_attn_scalar=scalar,
        )
        mlp = gated_mlp(
            lin,
            embed_dim,
            intermediate_dim,
            lora=apply_lora_to_mlp,
            activation=nn.GELU(approximate="tanh"),
        )
        layers.append(
            TransformerSelfAttentionLayer(
                attn=attn,
                mlp=mlp,
                sa_norm=GemmaRMSNorm(embed_dim, eps=norm_eps),  # input_layernorm
                sa_scale=GemmaRMSNorm(embed_dim, eps=norm_eps),  # post_attention_layernorm
                mlp_norm=GemmaRMSNorm(embed_dim, eps=norm_eps),  # pre_feedforward_layernorm
                mlp_scale=GemmaRMSNorm(embed_dim, eps=norm_eps),  # post_feedforward_layernorm
            )
        )
    tok_embeddings = GemmaNormEmbeddings(vocab_size, embed_dim)
    model = TransformerDecoder(
        tok_embeddings=tok_embeddings,
        layers=layers,
        max_seq_len=max_seq_len,
        num_heads=num_heads,
        head_dim=head_dim,
        norm=GemmaRMSNorm(embed_dim, eps=norm_eps),
        output=TiedLinear(tok_embeddings),
    )
    if quantize_base:
        save_nf4_in_model_dtype(model, tok_embeddings)
    return model


@dataclass(frozen=True, kw_only=True)
class Gemma3Shape(DecoderDims):
    """A Gemma 3 text decoder's shape: what ``gemma3`` and ``lora_gemma3`` take as keywords.

    ``query_pre_attn_scalar`` None means ``head_dim``; ``global_layers`` (the indices of the
    full-attention layers) overrides ``sliding_window_pattern``.
    """

    head_dim: int
    sliding_window_size: int
    rope_base: float = 1_000_000.0
    rope_local_base: float = 10_000.0
    rope_scaling_factor: float = 1.0
    query_pre_attn_scalar: float | None = None
    sliding_window_pattern: int = 6
    global_layers: list[int] | None = None
    norm_eps: float = 1e-6
    attn_dropout: float = 0.0


# A Gemma 3 text decoder of the given shape (every parameter trainable), and with LoRA (DoRA with
# ``use_dora``, QLoRA with ``quantize_base``) adapters. The output projection is the embedding
# matrix: LoRA cannot adapt it (no apply_lora_to_output).
gemma3, lora_gemma3 = builders(Gemma3Shape, _decoder, "gemma3", lora_output=False)


# --- published sizes --------------------------------------------------------------------------
# The published sizes' dimensions live in the catalog (source named there).


def _size_kwargs(size: str) -> dict:
    s = GEMMA3_SIZES[size]
    return {
        "vocab_size": s.vocab,
        "num_layers": s.layers,
        "num_heads": s.heads,
        "num_kv_heads": s.kv_heads,
        "embed_dim": s.hidden,
        "intermediate_dim": s.intermediate,
        "max_seq_len": s.context,
        "head_dim": s.head_dim,
        "sliding_window_size": s.sliding_window,
        "rope_scaling_factor": s.rope_scaling,
        "query_pre_attn_scalar": s.query_pre_attn_scalar,
    }


# One full and one LoRA builder per size, as torchtune names its own (gemma2_9b, lora_gemma2_9b).
# The LoRA builders take no apply_lora_to_output: the output projection is the embedding.


def _sized(size: str):
    return sized(gemma3, lora_gemma3, size, _size_kwargs, lora_output=False)


gemma3_1b, lora_gemma3_1b = _sized("1b")
gemma3_4b, lora_gemma3_4b = _sized("4b")
gemma3_12b, lora_gemma3_12b = _sized("12b")
gemma3_27b, lora_gemma3_27b = _sized("27b")


# --- checkpoint conversion ----------------------------------------------------------------------

# Where the text model's weights sit: Gemma3ForCausalLM; Gemma3ForConditionalGeneration as saved
# (the Hub's files, and transformers 5's save_pretrained); and as transformers 5 names it in memory.
TEXT_PREFIXES = ("model.", "language_model.model.", "model.language_model.")
# Gemma3ForConditionalGeneration's other parts, which a text model leaves out; and the output
# projection, tied to the embeddings.
_SKIPPED = re.compile(
    r"^(?:model\.)?(?:vision_tower|multi_modal_projector)\.|^(?:language_model\.)?lm_head\.weight$"
)
_LAYER_KEYS = {
    "input_layernorm.weight": "sa_norm.scale",
    "post_attention_layernorm.weight": "sa_scale.scale",
    "pre_feedforward_layernorm.weight": "mlp_norm.scale",
    "post_feedforward_layernorm.weight": "mlp_scale.scale",
    "self_attn.q_proj.weight": "attn.q_proj.weight",
    "self_attn.k_proj.weight": "attn.k_proj.weight",
    "self_attn.v_proj.weight": "attn.v_proj.weight",
    "self_attn.o_proj.weight": "attn.output_proj.weight",
    "self_attn.q_norm.weight": "attn.q_norm.scale",
    "self_attn.k_norm.weight": "attn.k_norm.scale",
    "mlp.gate_proj.weight": "mlp.w1.weight",
    "mlp.up_proj.weight": "mlp.w3.weight",
    "mlp.down_proj.weight": "mlp.w2.weight",
}
_TOP_KEYS = {"embed_tokens.weight": "tok_embeddings.weight", "norm.weight": "norm.scale"}
_LAYER = re.compile(r"^layers\.(\d+)\.(.+)$")


def _text_key(key: str) -> str | None:
    """``key`` without its text-model prefix (``layers.0...``), or None for a skipped weight."""
    if _SKIPPED.match(key):
        return None
    for prefix in sorted(TEXT_PREFIXES, key=len, reverse=True):
        if key.startswith(prefix):
            return key.removeprefix(prefix)
    raise ValueError(f"{key!r} is not a weight of a Gemma 3 text model")


def gemma3_hf_to_tune(state_dict: dict[str, torch.Tensor], **_kwargs) -> dict[str, torch.Tensor]:
    """HF Gemma 3 keys (``Gemma3ForCausalLM``, or ``Gemma3ForConditionalGeneration``'s text
    weights) -> torchtune's. q/k rows stay in HF's order (the RoPE here is half-split)."""
    converted = {}
    for key, value in state_dict.items():
        text = _text_key(key)
        if text is None:
            continue
        if text in _TOP_KEYS:
            converted[_TOP_KEYS[text]] = value
            continue
        match = _LAYER.match(text)
        if not match or match.group(2) not in _LAYER_KEYS:
            raise ValueError(f"{key!r} is not a weight of a Gemma 3 text model")
        converted[f"layers.{match.group(1)}.{_LAYER_KEYS[match.group(2)]}"] = value
    return converted


_TUNE_TOP = {v: k for k, v in _TOP_KEYS.items()}
_TUNE_LAYER = {v: k for k, v in _LAYER_KEYS.items()}


def gemma3_tune_to_hf(state_dict: dict[str, torch.Tensor], **_kwargs) -> dict[str, torch.Tensor]:
    """torchtune keys -> ``Gemma3ForCausalLM``'s (the output projection stays tied)."""
    converted = {}
    for key, value in state_dict.items():
        if key in _TUNE_TOP:
            converted[f"model.{_TUNE_TOP[key]}"] = value
            continue
        match = _LAYER.match(key)
        if not match or match.group(2) not in _TUNE_LAYER:
            raise ValueError(f"{key!r} is not a weight of tunepack's Gemma 3")
        converted[f"model.layers.{match.group(1)}.{_TUNE_LAYER[match.group(2)]}"] = value
    return converted


class Gemma3HFCheckpointer(FullModelHFCheckpointer):
    """torchtune's HF checkpointer with Gemma 3's conversion (``model_type=GEMMA3``).

    Loads a ``Gemma3ForCausalLM`` or a ``Gemma3ForConditionalGeneration`` checkpoint (its text
    weights); saves a text-only ``Gemma3ForCausalLM`` with that model's ``config.json``.
    """

    def __init__(self, *args, model_type: str = MODEL_TYPE, **kwargs):
        if model_type != MODEL_TYPE:
            raise ValueError(f"Gemma3HFCheckpointer takes model_type={MODEL_TYPE}: {model_type}")
        # torchtune's ModelType has no Gemma 3; its checkpointer needs one for its own branches,
        # which load_checkpoint and save_checkpoint below do not reach.
        super().__init__(*args, model_type="GEMMA2", **kwargs)
        self._source_config = self._config
        self._config = text_config(self._config)

    def load_checkpoint(self) -> dict:
        from torchtune import training

        merged, shard_of = hf_shards.load_shards(self._checkpoint_paths)
        self._weight_map = {key: f"{index:04}" for key, index in shard_of.items()}
        return {training.MODEL_KEY: gemma3_hf_to_tune(merged)}

    def save_checkpoint(self, state_dict, epoch, intermediate_checkpoint=False, adapter_only=False):
        from torchtune import training

        if adapter_only or intermediate_checkpoint:
            raise ValueError("Gemma3HFCheckpointer saves whole models only")
        hf_state = gemma3_tune_to_hf(state_dict[training.MODEL_KEY])
        # The text weights keep the shard they came from; shards numbered from 1 again where a
        # vision-only shard drops out.
        shard_of = {}
        for key, shard in (self._weight_map or {}).items():
            text = _text_key(key)
            if text is not None:
                shard_of[f"model.{text}"] = shard
        order = {s: i for i, s in enumerate(sorted(set(shard_of.values())), start=1)}
        # The saved model is a text-only Gemma3ForCausalLM: its config.json says so.
        hf_shards.save_shards(
            hf_state,
            {key: order[shard] for key, shard in shard_of.items()},
            Path(self._output_dir) / f"epoch_{epoch}",
            source_dir=Path(self._checkpoint_dir),
            config=self._config,
        )
