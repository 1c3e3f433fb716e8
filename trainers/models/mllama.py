"""Llama 3.2 Vision (transformers' Mllama) on torchtune 0.6.1's components, at any size.

What transformers 5.24's ``MllamaForConditionalGeneration`` (``models/mllama/modeling_mllama.py``)
computes, and how the build here mirrors it:

- Vision tower (``MllamaVisionModel``), per image of ``max_num_tiles`` tiles: a patch convolution
  (no bias); a gated tile embedding looked up by the image's *aspect-ratio id* (its index in
  ``supported_aspect_ratios`` plus 1; 0 is a padded image) and added to every patch of a tile
  (``pre_tile``); a class token in front of each tile's patches; a gated position embedding
  (``(1 - tanh g) * per-token + tanh g * per-(aspect ratio, tile, token)``); LayerNorm; each tile's
  tokens padded with zeros to a multiple of 8; the local transformer (LayerNorm, attention, GELU
  MLP, no gates); LayerNorm; a second gated tile embedding (``post_tile``, over the padded tokens
  too); the gated global transformer; padding removed; the local transformer's
  ``intermediate_layers_indices`` outputs concatenated feature-wise (interleaved, as
  ``torch.stack(..., -1)`` lays them out) after the global output.
- Attention inside the tower is masked only between two *padding* tokens (padding patches or
  padded tiles): a real token attends to padding too (transformers' ``_prepare_aspect_ratio_
  attention_mask``, an outer product of the padding indicator).
- ``multi_modal_projector``: a linear layer (with bias) to the text width.
- Text model: Llama 3 self-attention layers (interleaved RoPE in torchtune, so q/k rows are
  permuted on conversion; Llama 3 scaled RoPE with the checkpoint's own four parameters) with
  cross-attention layers at ``cross_attention_layers``: RMSNorm, attention to the image tokens
  with RMSNorm over each head's query and key, a tanh gate, an RMSNorm + SwiGLU MLP, a tanh gate.
  Embeddings have ``vocab_size + 8`` rows (``<|image|>`` is ``vocab_size``); the output has
  ``vocab_size``.

torchtune builds the decoder as self-attention layers whose ``FusionLayer`` runs a cross-attention
layer first: transformers' cross-attention layer i becomes the fusion part of the self-attention
layer that follows it (so none may be last, and no two may be adjacent: refused on reading the
config). ``FusionEmbedding`` holds rows ``vocab_size..vocab_size+7`` apart (``fusion_embedding``),
as transformers' single table; ids are looked up the same.

Where torchtune 0.6.1's own Llama 3.2 Vision differs from transformers 5.24, and what is built
here instead (1 to 4 each shown to change the logits in tests/unit/test_mllama.py):

1. Tile and position embeddings: torchtune keeps one ``(max_tiles, max_tiles)`` grid and slices it
   per aspect ratio; transformers keeps one table row per aspect-ratio id (padded images have their
   own, id 0), and its rows for tiles beyond an image's own are added to its padded tiles. The grid
   cannot hold a checkpoint whose rows disagree, so torchtune's conversion is lossy (it reads only
   the ratios that fill every tile). Here the embeddings are transformers' tables, unchanged.
2. Padding: torchtune's ``VisionTransformer`` neither pads tiles to a multiple of 8 tokens nor
   masks, so its real tokens do not see transformers' padding tokens (nor are padded tiles kept
   from each other). ``MllamaVisionEncoder`` pads and masks as above, in both transformers.
3. Intermediate features: Meta's reference (which the published weights were trained with),
   torchtune, vLLM and transformers' own fix of its integration tests (huggingface/transformers
   #39785) take the *input* of local layer i for index i; transformers 5.24's
   ``MllamaVisionEncoder`` collects each layer's *output* instead, one layer later. Built as the
   reference (``MllamaLocalTransformer.layer_outputs = False``); the tests hold it to
   transformers with that one line as #39785 wrote it, and the other setting to 5.24 as it is.
4. Text rows that see no image (before the first ``<|image|>``): torchtune's
   ``TransformerCrossAttentionLayer`` zeroes both their attention and MLP outputs; transformers
   lets them attend to every image token (their mask row is cleared) and zeroes only the MLP
   output. ``MllamaCrossAttentionLayer`` does as transformers.
5. Norm epsilons: torchtune hard-codes 1e-5 for the text norms and 1e-6 (RMSNorm's default) for
   the cross-attention layers' norms; here every norm takes the config's ``rms_norm_eps`` /
   ``norm_eps`` (the tower's pre/post LayerNorms keep 1e-5, as transformers builds them).
6. Layout: torchtune's builders space cross-attention layers evenly and fix the MLP widths of the
   vision tower (4x); here any ``cross_attention_layers`` and ``intermediate_size`` build.

Inputs: ``DeepFusionModel`` takes ``encoder_input={"images", "aspect_ratio"}`` (torchtune's:
``aspect_ratio`` is (tiles down, tiles across) per image; (0, 0) is a padded image, transformers'
id 0) and a boolean ``encoder_mask`` (text position x image token). ``mllama_inputs_to_tune``
turns the processor's ``pixel_values``, ``aspect_ratio_ids``, ``aspect_ratio_mask`` and
``cross_attention_mask`` into those. (torchtune's collate pads missing images with (1, 1), not
(0, 0): the two differ only in what text rows that see no image attend to.)

Checkpoints: ``MllamaHFCheckpointer`` reads ``MllamaForConditionalGeneration`` safetensors in the
Hub's layout (``language_model.model.``, ``vision_model.``, ``multi_modal_projector.``,
``language_model.lm_head.``, which transformers 5 also writes) or transformers 5's in-memory one
(``model.language_model.``, ``lm_head.``), and saves in the layout it read, with its config.json.

torchtune's Llama 3.2 Vision and CLIP packages import torchvision (the optional
``tunepack[vision]`` extra): they are imported here only inside the conversion functions, so this
module and the text families never need it.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from torchtune.models.llama3_1._position_embeddings import Llama3ScaledRoPE
from torchtune.modules import (
    FeedForward,
    Fp32LayerNorm,
    MultiHeadAttention,
    RMSNorm,
    TanhGate,
    TransformerCrossAttentionLayer,
    TransformerDecoder,
    TransformerSelfAttentionLayer,
    VisionTransformer,
)
from torchtune.modules.model_fusion import (
    DeepFusionModel,
    FusionEmbedding,
    FusionLayer,
    register_fusion_module,
)
from torchtune.modules.peft import DoRALinear, LoRALinear
from torchtune.training import FullModelHFCheckpointer

from tunepack.core.errors import UnsupportedError
from tunepack.runtimes.mllama_config import (
    NUM_SPECIAL_TOKENS,
    fusion_positions,
    mllama_builder_kwargs,
)
from tunepack.runtimes.shape import DecoderDims
from tunepack.trainers.models import hf_shards
from tunepack.trainers.models.decoder_parts import (
    attention_projections,
    gated_mlp,
    linear,
    save_nf4_in_model_dtype,
    shape_keywords,
    shape_parameters,
)

MODEL_TYPE = "MLLAMA"
# Each tile's tokens are padded to a multiple of this (transformers' vision model, Meta's too).
TILE_PAD = 8


def require_vision() -> None:
    """``BadInputError`` unless torchvision (which torchtune's vision packages import) is there."""
    try:
        import torchvision  # noqa: F401
    except ImportError:
        raise UnsupportedError(
            "Llama 3.2 Vision needs torchvision, which torchtune's vision modules import: "
            "install tunepack[vision] (pip install 'tunepack[vision]')"
        ) from None


# --- vision tower -------------------------------------------------------------------------------


class MllamaTileEmbedding(nn.Module):
    """A gated embedding per (aspect-ratio id, tile), added to every token of the tile
    (transformers' ``MllamaPrecomputedAspectRatioEmbedding``, gated)."""

    def __init__(self, num_aspect_ratios: int, max_num_tiles: int, embed_dim: int) -> None:
        super().__init__()
        self.max_num_tiles, self.embed_dim = max_num_tiles, embed_dim
        self.embedding = nn.Embedding(num_aspect_ratios + 1, max_num_tiles * embed_dim)
        self.gate = nn.Parameter(torch.zeros(1))

    def forward(self, x: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        # x: (images, tiles, tokens, dim); ids: (images,)
        table = self.embedding(ids).view(-1, self.max_num_tiles, 1, self.embed_dim)
        return x + table[:, : x.shape[1]] * self.gate.tanh()


class MllamaTokenEmbedding(nn.Module):
    """Position embeddings of a tile's tokens (class token first): a shared table weighted by
    ``1 - tanh(gate)`` plus one per (aspect-ratio id, tile, token) weighted by ``tanh(gate)``
    (transformers' ``MllamaPrecomputedPositionEmbedding``)."""

    def __init__(
        self, num_aspect_ratios: int, max_num_tiles: int, num_tokens: int, embed_dim: int
    ) -> None:
        super().__init__()
        self.max_num_tiles, self.num_tokens, self.embed_dim = max_num_tiles, num_tokens, embed_dim
        self.embedding = nn.Parameter(torch.randn(num_tokens, embed_dim) * embed_dim**-0.5)
        self.tile_embedding = nn.Embedding(
            num_aspect_ratios + 1, max_num_tiles * num_tokens * embed_dim
        )
        self.gate = nn.Parameter(torch.zeros(1))

    def forward(self, x: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        gate = self.gate.tanh()
        shape = (-1, self.max_num_tiles, self.num_tokens, self.embed_dim)
        tiles = self.tile_embedding(ids).view(shape)[:, : x.shape[1]]
        return x + (1 - gate) * self.embedding + gate * tiles


def _padding_mask(tile_mask: torch.Tensor, tokens: int, padded: int) -> torch.Tensor:
    """(images, seq, seq) boolean, True where attention is allowed: everywhere except between two
    padding tokens (a padded tile's, or a tile's padding to ``padded`` tokens)."""
    real_token = torch.arange(padded, device=tile_mask.device) < tokens
    real = (tile_mask[:, :, None] & real_token).flatten(1)
    return real[:, :, None] | real[:, None, :]


class MllamaLocalTransformer(VisionTransformer):
    """torchtune's ``VisionTransformer`` modules (``conv``, ``cls_token_embedding``, ``ln_pre``,
    ``layers``, ``ln_post``, the three positional embeddings) run as transformers' Mllama runs
    its local transformer: tiles padded to a multiple of 8 tokens and masked, each listed layer's
    output kept (``intermediate_layers``), the post-tile embedding added over the padded tokens.
    """

    def __init__(self, *, intermediate_layers: list[int], **kwargs) -> None:
        super().__init__(**kwargs)
        self.intermediate_layers = list(intermediate_layers)
        # Index i is layer i's input, as in Meta's reference and vLLM (transformers 5.24 keeps
        # its output: True reproduces that, for the parity tests).
        self.layer_outputs = False

    def forward(self, images, ids, tile_mask):
        """``images`` (images, tiles, channels, h, w), ``ids`` (images,), ``tile_mask`` (images,
        tiles): the padded tokens (images, tiles * padded, dim), the listed layers' outputs, the
        attention mask and the padded token count per tile."""
        n, tiles, channels, height, width = images.shape
        x = self.conv(images.reshape(n * tiles, channels, height, width))
        x = x.flatten(2).transpose(1, 2).reshape(n, tiles, self.patches_per_tile, -1)
        x = self.pre_tile_pos_embed(x, ids)
        x = self.cls_token_embedding(x)
        x = self.ln_pre(self.token_pos_embedding(x, ids))
        tokens = x.shape[2]
        padded = -(-tokens // TILE_PAD) * TILE_PAD
        x = F.pad(x, (0, 0, 0, padded - tokens))
        mask = _padding_mask(tile_mask, tokens, padded)
        x = x.reshape(n, tiles * padded, -1)
        wanted = set(self.intermediate_layers)
        kept = {}
        for index, layer in enumerate(self.layers):
            if not self.layer_outputs and index in wanted:
                kept[index] = x
            x = layer(x, mask=mask)
            if self.layer_outputs and index in wanted:
                kept[index] = x
        if not self.layer_outputs and len(self.layers) in wanted:
            kept[len(self.layers)] = x
        x = self.ln_post(x).reshape(n, tiles, padded, -1)
        x = self.post_tile_pos_embed(x, ids).reshape(n, tiles * padded, -1)
        return x, [kept[i] for i in self.intermediate_layers], mask, padded


class MllamaGlobalTransformer(nn.Module):
    """transformers' gated global transformer and ``multi_modal_projector`` (``output``), under
    torchtune's projection-head names (``layers``, ``output``): it drops the tiles' padding and
    concatenates the local layers' outputs before projecting."""

    def __init__(self, layers: nn.ModuleList, output: nn.Module) -> None:
        super().__init__()
        self.layers = layers
        self.output = output

    def forward(self, x, hidden_states, mask, *, tiles: int, padded: int, tokens: int):
        for layer in self.layers:
            x = layer(x, mask=mask)
        n = x.shape[0]
        parts = [x.view(n, tiles, padded, -1)[:, :, :tokens]]
        if hidden_states:
            stacked = torch.stack(hidden_states, dim=-1).view(n, tiles, padded, -1)
            parts.append(stacked[:, :, :tokens])
        return self.output(torch.cat(parts, dim=-1))


class MllamaVisionEncoder(nn.Module):
    """The vision tower and projector: ``images`` (batch, images, tiles, channels, h, w) and
    ``aspect_ratio`` (batch, images, 2) to (batch, images * tiles * tokens, text width).

    ``aspect_ratio`` gives each image's tiles down and across (torchtune's input); (0, 0) marks a
    padded image (transformers' aspect-ratio id 0). An image's first tile is always treated as
    real, its tiles beyond ``h * w`` as padding (transformers' processor's ``aspect_ratio_mask``).
    """

    def __init__(
        self,
        clip: MllamaLocalTransformer,
        projection: MllamaGlobalTransformer,
        supported_aspect_ratios: list[list[int]],
        max_num_tiles: int,
    ) -> None:
        super().__init__()
        self.clip = clip
        self.projection = projection
        # The projector is the new part of a fusion model (torchtune's fusion_trainable).
        register_fusion_module(self.projection)
        self.supported_aspect_ratios = [tuple(r) for r in supported_aspect_ratios]
        self.max_num_tiles = max_num_tiles
        self.init_tables()

    def init_tables(self) -> None:
        """(Re)build the aspect-ratio id table, a buffer no checkpoint holds (a model built on
        the meta device for FSDP calls it once materialised, as RoPE's ``rope_init``)."""
        size = self.max_num_tiles + 1
        table = torch.zeros(size, size, dtype=torch.long)
        for index, (down, across) in enumerate(self.supported_aspect_ratios, start=1):
            table[down, across] = index
        self.register_buffer("aspect_ratio_ids", table, persistent=False)

    def ids_and_tile_mask(self, aspect_ratio: torch.Tensor, tiles: int):
        """Aspect-ratio ids (images,) and tile mask (images, tiles) of ``aspect_ratio``."""
        pairs = aspect_ratio.reshape(-1, 2).long()
        limit = self.aspect_ratio_ids.shape[0]
        if ((pairs < 0) | (pairs >= limit)).any():
            raise ValueError(f"aspect ratios outside 0..{limit - 1}: {pairs.tolist()}")
        ids = self.aspect_ratio_ids[pairs[:, 0], pairs[:, 1]]
        padding = (pairs == 0).all(dim=-1)
        if ((ids == 0) & ~padding).any():
            raise ValueError(f"an aspect ratio the model does not support: {pairs.tolist()}")
        count = (pairs[:, 0] * pairs[:, 1]).clamp(min=1)
        tile_mask = torch.arange(tiles, device=pairs.device) < count[:, None]
        return ids, tile_mask

    def forward(self, images: torch.Tensor, aspect_ratio: torch.Tensor | None = None):
        batch, per_sample, tiles = images.shape[:3]
        if aspect_ratio is None:
            if tiles > 1:
                raise ValueError("images of several tiles need their aspect_ratio")
            aspect_ratio = torch.ones(batch, per_sample, 2, dtype=torch.long, device=images.device)
        ids, tile_mask = self.ids_and_tile_mask(aspect_ratio, tiles)
        x, hidden, mask, padded = self.clip(images.flatten(0, 1), ids, tile_mask)
        tokens = self.clip.get_image_tokens_per_tile()
        x = self.projection(x, hidden, mask, tiles=tiles, padded=padded, tokens=tokens)
        return x.reshape(batch, per_sample * tiles * tokens, -1)


def _vision_layer(dim, heads, intermediate, eps, *, gated: bool) -> TransformerSelfAttentionLayer:
    head_dim = dim // heads
    attn = MultiHeadAttention(
        embed_dim=dim,
        num_heads=heads,
        num_kv_heads=heads,
        head_dim=head_dim,
        q_proj=nn.Linear(dim, dim, bias=False),
        k_proj=nn.Linear(dim, dim, bias=False),
        v_proj=nn.Linear(dim, dim, bias=False),
        output_proj=nn.Linear(dim, dim, bias=False),
        pos_embeddings=None,
        is_causal=False,
    )
    mlp = FeedForward(
        gate_proj=nn.Linear(dim, intermediate),  # fc1
        down_proj=nn.Linear(intermediate, dim),  # fc2
        activation=nn.GELU(),
    )
    return TransformerSelfAttentionLayer(
        attn=attn,
        mlp=mlp,
        sa_norm=Fp32LayerNorm(dim, eps=eps),
        mlp_norm=Fp32LayerNorm(dim, eps=eps),
        sa_scale=TanhGate() if gated else None,
        mlp_scale=TanhGate() if gated else None,
    )


def mllama_vision_encoder(
    *,
    patch_size: int,
    tile_size: int,
    vision_embed_dim: int,
    vision_num_heads: int,
    vision_intermediate_dim: int,
    vision_num_layers: int,
    vision_num_global_layers: int,
    intermediate_layers: list[int],
    max_num_tiles: int,
    supported_aspect_ratios: list[list[int]],
    decoder_embed_dim: int,
    in_channels: int = 3,
    vision_norm_eps: float = 1e-5,
    projection: nn.Module | None = None,
) -> MllamaVisionEncoder:
    """The vision tower and projector (``projection``: the projector's module, else a linear
    layer with bias)."""
    tokens = (tile_size // patch_size) ** 2 + 1
    ratios = len(supported_aspect_ratios)
    layer = partial(
        _vision_layer, vision_embed_dim, vision_num_heads, vision_intermediate_dim, vision_norm_eps
    )
    clip = MllamaLocalTransformer(
        patch_size=patch_size,
        tile_size=tile_size,
        num_layers=vision_num_layers,
        embed_dim=vision_embed_dim,
        layer=layer(gated=False),
        token_pos_embedding=MllamaTokenEmbedding(ratios, max_num_tiles, tokens, vision_embed_dim),
        pre_tile_pos_embed=MllamaTileEmbedding(ratios, max_num_tiles, vision_embed_dim),
        post_tile_pos_embed=MllamaTileEmbedding(ratios, max_num_tiles, vision_embed_dim),
        in_channels=in_channels,
        intermediate_layers=intermediate_layers,
    )
    width = vision_embed_dim * (len(intermediate_layers) + 1)
    head = MllamaGlobalTransformer(
        nn.ModuleList(layer(gated=True) for _ in range(vision_num_global_layers)),
        projection if projection is not None else nn.Linear(width, decoder_embed_dim),
    )
    return MllamaVisionEncoder(clip, head, supported_aspect_ratios, max_num_tiles)


# --- text decoder -------------------------------------------------------------------------------


class MllamaCrossAttentionLayer(TransformerCrossAttentionLayer):
    """torchtune's gated cross-attention layer, as transformers computes a text row that sees no
    image: its mask row is cleared (it attends to every image token) and only its MLP output is
    zeroed, not its attention output (torchtune zeroes both)."""

    def forward(self, x, *, encoder_input=None, encoder_mask=None, **_kwargs):
        empty_cache = not self.caches_are_enabled() or self.attn.kv_cache.size == 0
        if encoder_input is None and empty_cache:
            return x  # text only: transformers skips the layer
        no_image = self._skip_mask(encoder_mask)
        if no_image is not None:
            encoder_mask = encoder_mask.masked_fill(no_image, True)
        h = x + self.ca_scale(self.attn(self.ca_norm(x), encoder_input, mask=encoder_mask))
        mlp_out = self.mlp(self.mlp_norm(h))
        if no_image is not None:
            mlp_out = mlp_out.masked_fill(no_image, 0)
        return h + self.mlp_scale(mlp_out)


def _decoder(
    *,
    vocab_size: int,
    num_layers: int,
    cross_attention_layers: list[int],
    num_heads: int,
    num_kv_heads: int,
    embed_dim: int,
    intermediate_dim: int,
    max_seq_len: int,
    encoder_max_seq_len: int,
    rope_base: float,
    rope_scale_factor: float,
    rope_low_freq_factor: float,
    rope_high_freq_factor: float,
    rope_old_context_len: int,
    norm_eps: float,
    attn_dropout: float = 0.0,
    lora_attn_modules: tuple[str, ...] = (),
    apply_lora_to_mlp: bool = False,
    apply_lora_to_output: bool = False,
    quantize_base: bool = False,
    use_dora: bool = False,
    **lora_args,
) -> TransformerDecoder:
    head_dim = embed_dim // num_heads
    rope = Llama3ScaledRoPE(
        dim=head_dim,
        max_seq_len=max_seq_len,
        base=rope_base,
        scale_factor=rope_scale_factor,
        low_freq_factor=rope_low_freq_factor,
        high_freq_factor=rope_high_freq_factor,
        old_context_len=rope_old_context_len,
    )
    lin = partial(linear, quantize_base=quantize_base, use_dora=use_dora, **lora_args)
    projections = partial(
        attention_projections,
        lin,
        embed_dim=embed_dim,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        lora_attn_modules=lora_attn_modules,
    )
    mlp = partial(gated_mlp, lin, embed_dim, intermediate_dim, lora=apply_lora_to_mlp)
    cross = set(cross_attention_layers)
    positions = fusion_positions(num_layers, cross)
    layers = nn.ModuleList()
    pending = None  # the cross-attention layer waiting for its self-attention layer
    for index in range(num_layers):
        if index in cross:
            pending = MllamaCrossAttentionLayer(
                attn=MultiHeadAttention(
                    embed_dim=embed_dim,
                    num_heads=num_heads,
                    num_kv_heads=num_kv_heads,
                    head_dim=head_dim,
                    **projections(),
                    q_norm=RMSNorm(head_dim, eps=norm_eps),
                    k_norm=RMSNorm(head_dim, eps=norm_eps),
                    pos_embeddings=None,
                    max_seq_len=encoder_max_seq_len,
                    is_causal=False,
                    attn_dropout=attn_dropout,
                ),
                mlp=mlp(activation=nn.SiLU()),
                ca_norm=RMSNorm(embed_dim, eps=norm_eps),
                mlp_norm=RMSNorm(embed_dim, eps=norm_eps),
                ca_scale=TanhGate(),
                mlp_scale=TanhGate(),
            )
            continue
        layer = TransformerSelfAttentionLayer(
            attn=MultiHeadAttention(
                embed_dim=embed_dim,
                num_heads=num_heads,
                num_kv_heads=num_kv_heads,
                head_dim=head_dim,
                **projections(),
                pos_embeddings=rope,
                max_seq_len=max_seq_len,
                attn_dropout=attn_dropout,
            ),
            mlp=mlp(activation=nn.SiLU()),
            sa_norm=RMSNorm(embed_dim, eps=norm_eps),
            mlp_norm=RMSNorm(embed_dim, eps=norm_eps),
        )
        if pending is not None:
            layer = FusionLayer(layer=layer, fusion_layer=pending)
            pending = None
        assert positions[index] == len(layers)
        layers.append(layer)
    tok_embeddings = FusionEmbedding(vocab_size, NUM_SPECIAL_TOKENS, embed_dim)
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
        save_nf4_in_model_dtype(model, tok_embeddings.embedding)
    return model


_DECODER_ARGS = (
    "vocab_size",
    "num_layers",
    "cross_attention_layers",
    "num_heads",
    "num_kv_heads",
    "embed_dim",
    "intermediate_dim",
    "max_seq_len",
    "rope_base",
    "rope_scale_factor",
    "rope_low_freq_factor",
    "rope_high_freq_factor",
    "rope_old_context_len",
    "norm_eps",
    "attn_dropout",
)
_ENCODER_ARGS = (
    "patch_size",
    "tile_size",
    "vision_embed_dim",
    "vision_num_heads",
    "vision_intermediate_dim",
    "vision_num_layers",
    "vision_num_global_layers",
    "intermediate_layers",
    "max_num_tiles",
    "supported_aspect_ratios",
    "in_channels",
    "vision_norm_eps",
)


def _model(
    args: dict,
    *,
    decoder_trainable: bool,
    encoder_trainable: bool,
    fusion_trainable: bool,
    decoder_lora: dict | None = None,
    projection: nn.Module | None = None,
) -> DeepFusionModel:
    tokens = (args["tile_size"] // args["patch_size"]) ** 2 + 1
    encoder_max = args.get("encoder_max_seq_len") or args["max_num_tiles"] * tokens
    decoder = _decoder(
        **{k: args[k] for k in _DECODER_ARGS if k in args},
        encoder_max_seq_len=encoder_max,
        **(decoder_lora or {}),
    )
    encoder = mllama_vision_encoder(
        **{k: args[k] for k in _ENCODER_ARGS if k in args},
        decoder_embed_dim=args["embed_dim"],
        projection=projection,
    )
    return DeepFusionModel(
        decoder=decoder,
        encoder=encoder,
        decoder_trainable=decoder_trainable,
        encoder_trainable=encoder_trainable,
        fusion_trainable=fusion_trainable,
    )


@dataclass(frozen=True, kw_only=True)
class MllamaShape(DecoderDims):
    """Llama 3.2 Vision's shape (``mllama_builder_kwargs`` reads it from config.json): what
    ``mllama`` and ``lora_mllama`` take as keywords.

    ``num_layers`` and ``cross_attention_layers`` count as transformers does (cross-attention
    layers included); ``intermediate_layers`` are ``intermediate_layers_indices``.
    ``encoder_max_seq_len`` (the cross-attention KV cache) defaults to one image's tokens.
    """

    cross_attention_layers: list[int]
    patch_size: int
    tile_size: int
    vision_embed_dim: int
    vision_num_heads: int
    vision_intermediate_dim: int
    vision_num_layers: int
    vision_num_global_layers: int
    intermediate_layers: list[int]
    max_num_tiles: int
    supported_aspect_ratios: list[list[int]]
    rope_base: float = 500_000.0
    rope_scale_factor: float = 8.0
    rope_low_freq_factor: float = 1.0
    rope_high_freq_factor: float = 4.0
    rope_old_context_len: int = 8192
    norm_eps: float = 1e-5
    vision_norm_eps: float = 1e-5
    in_channels: int = 3
    attn_dropout: float = 0.0
    encoder_max_seq_len: int | None = None


# torchtune's DeepFusionModel's flags, as its Llama 3.2 Vision builders default them: the text
# model frozen, the tower and the fusion parts trained.
_TRAINABLE = {"decoder_trainable": False, "encoder_trainable": True, "fusion_trainable": True}


def mllama(**kwargs) -> DeepFusionModel:
    """Llama 3.2 Vision of the given shape (``MllamaShape``'s fields, as keywords) and the
    trainable flags of torchtune's ``DeepFusionModel`` (``decoder_trainable``,
    ``encoder_trainable``, ``fusion_trainable``)."""
    flags = {k: kwargs.pop(k, default) for k, default in _TRAINABLE.items()}
    return _model(shape_keywords(MllamaShape(**kwargs)), **flags)


mllama.__signature__ = inspect.Signature(
    [
        *shape_parameters(MllamaShape),
        *(
            inspect.Parameter(k, inspect.Parameter.KEYWORD_ONLY, default=v)
            for k, v in _TRAINABLE.items()
        ),
    ]
)


# The projector's adapter keys (``apply_lora_to_projection``): transformers' multi_modal_projector.
PROJECTOR_ADAPTER = "encoder.projection.output.lora_"


def lora_mllama(
    lora_attn_modules,
    apply_lora_to_mlp: bool = False,
    apply_lora_to_output: bool = False,
    *,
    apply_lora_to_projection: bool = False,
    lora_rank: int,
    lora_alpha: float,
    lora_dropout: float = 0.0,
    use_dora: bool = False,
    quantize_base: bool = False,
    **shape,
) -> DeepFusionModel:
    """Llama 3.2 Vision with LoRA (DoRA with ``use_dora``, QLoRA with ``quantize_base``) on the
    text model: ``lora_attn_modules`` of its self- and cross-attention, its MLPs with
    ``apply_lora_to_mlp``, its output with ``apply_lora_to_output``; and on the projector
    (``multi_modal_projector``) with ``apply_lora_to_projection``. ``shape``: ``MllamaShape``'s
    fields. No part is trainable but the adapters (the recipe's ``set_trainable_params``)."""
    for flag in _TRAINABLE:
        shape.pop(flag, None)
    shape = shape_keywords(MllamaShape(**shape))
    lora_args = {"rank": lora_rank, "alpha": lora_alpha, "dropout": lora_dropout}
    decoder_lora = {
        "lora_attn_modules": tuple(lora_attn_modules),
        "apply_lora_to_mlp": apply_lora_to_mlp,
        "apply_lora_to_output": apply_lora_to_output,
        "quantize_base": quantize_base,
        "use_dora": use_dora,
        **lora_args,
    }
    projection = None
    if apply_lora_to_projection:
        width = shape["vision_embed_dim"] * (len(shape["intermediate_layers"]) + 1)
        cls = DoRALinear if use_dora else LoRALinear
        projection = cls(width, shape["embed_dim"], use_bias=True, **lora_args)
    return _model(
        shape,
        decoder_trainable=False,
        encoder_trainable=False,
        fusion_trainable=False,
        decoder_lora=decoder_lora,
        projection=projection,
    )


# --- inputs -------------------------------------------------------------------------------------


def mllama_inputs_to_tune(
    config: dict,
    *,
    input_ids: torch.Tensor,
    pixel_values: torch.Tensor | None = None,
    aspect_ratio_ids: torch.Tensor | None = None,
    aspect_ratio_mask: torch.Tensor | None = None,
    cross_attention_mask: torch.Tensor | None = None,
) -> dict:
    """transformers' processor outputs as ``DeepFusionModel``'s arguments: ``tokens``,
    ``encoder_input`` ({"images", "aspect_ratio"}, None without images) and ``encoder_mask``
    (batch, text, images * tiles * tokens per tile; None without a cross-attention mask)."""
    kwargs = mllama_builder_kwargs(config)
    out: dict = {"tokens": input_ids, "encoder_input": None, "encoder_mask": None}
    if pixel_values is None:
        return out
    if aspect_ratio_ids is None:
        raise ValueError("pixel_values need their aspect_ratio_ids")
    tiles = pixel_values.shape[2]
    table = torch.tensor([[0, 0], *kwargs["supported_aspect_ratios"]], device=input_ids.device)
    if int(aspect_ratio_ids.max()) >= len(table) or int(aspect_ratio_ids.min()) < 0:
        raise ValueError(f"aspect_ratio_ids outside 0..{len(table) - 1}")
    aspect_ratio = table[aspect_ratio_ids.long()]
    if aspect_ratio_mask is not None:
        count = (aspect_ratio[..., 0] * aspect_ratio[..., 1]).clamp(min=1)
        implied = torch.arange(tiles, device=count.device) < count[..., None]
        if not torch.equal(implied, aspect_ratio_mask.bool()):
            raise ValueError("aspect_ratio_mask differs from what aspect_ratio_ids say")
    out["encoder_input"] = {"images": pixel_values, "aspect_ratio": aspect_ratio}
    if cross_attention_mask is not None:
        tokens = (kwargs["tile_size"] // kwargs["patch_size"]) ** 2 + 1
        mask = cross_attention_mask.bool().repeat_interleave(tokens, dim=3)
        out["encoder_mask"] = mask.flatten(2)
    return out


# --- checkpoint conversion ----------------------------------------------------------------------

# transformers 5's in-memory prefixes -> the Hub's (which torchtune's conversion reads and
# transformers 5's save_pretrained writes).
_LAYOUTS = (
    ("model.language_model.", "language_model.model."),
    ("model.vision_model.", "vision_model."),
    ("model.multi_modal_projector.", "multi_modal_projector."),
    ("lm_head.", "language_model.lm_head."),
)
HUB, TRANSFORMERS = "hub", "transformers"
# The positional embeddings, kept in transformers' per-aspect-ratio layout (torchtune's grid
# cannot hold them: see the module doc). Hub keys -> torchtune module keys.
_POSITIONAL = {
    "vision_model.gated_positional_embedding.embedding": "token_pos_embedding.embedding",
    "vision_model.gated_positional_embedding.gate": "token_pos_embedding.gate",
    "vision_model.gated_positional_embedding.tile_embedding.weight": (
        "token_pos_embedding.tile_embedding.weight"
    ),
    "vision_model.pre_tile_positional_embedding.embedding.weight": (
        "pre_tile_pos_embed.embedding.weight"
    ),
    "vision_model.pre_tile_positional_embedding.gate": "pre_tile_pos_embed.gate",
    "vision_model.post_tile_positional_embedding.embedding.weight": (
        "post_tile_pos_embed.embedding.weight"
    ),
    "vision_model.post_tile_positional_embedding.gate": "post_tile_pos_embed.gate",
}
_POSITIONAL = {k: f"encoder.clip.{v}" for k, v in _POSITIONAL.items()}
_POSITIONAL_TUNE = {v: k for k, v in _POSITIONAL.items()}


def layout_of(keys) -> str:
    """Which layout HF keys are in: transformers 5's in-memory one, or the Hub's."""
    return TRANSFORMERS if any(k.startswith("model.") for k in keys) else HUB


def _to_hub(key: str) -> str:
    for new, hub in _LAYOUTS:
        if key.startswith(new):
            return hub + key.removeprefix(new)
    return key


def _to_transformers(key: str) -> str:
    for new, hub in _LAYOUTS:
        if key.startswith(hub):
            return new + key.removeprefix(hub)
    return key


def _convert_args(kwargs: dict) -> dict:
    return {
        "num_heads": kwargs["num_heads"],
        "num_kv_heads": kwargs["num_kv_heads"],
        "dim": kwargs["embed_dim"],
        "vocab_size": kwargs["vocab_size"],
        "cross_attention_layers": kwargs["cross_attention_layers"],
        "encoder_dim": kwargs["vision_embed_dim"],
        "tile_size": kwargs["tile_size"],
        "num_tiles": kwargs["max_num_tiles"],
        "supported_aspect_ratios": [tuple(r) for r in kwargs["supported_aspect_ratios"]],
    }


def mllama_hf_to_tune(state_dict: dict[str, torch.Tensor], config: dict) -> dict:
    """``MllamaForConditionalGeneration`` weights (either layout) -> the ``mllama`` model's.
    torchtune's conversion for all but the positional embeddings, which keep their layout."""
    require_vision()
    from torchtune.models.llama3_2_vision._convert_weights import llama3_vision_hf_to_tune

    kwargs = mllama_builder_kwargs(config)
    hub = {_to_hub(k): v for k, v in state_dict.items()}
    positional = {_POSITIONAL[k]: hub.pop(k) for k in list(hub) if k in _POSITIONAL}
    return llama3_vision_hf_to_tune(hub, **_convert_args(kwargs)) | positional


def mllama_tune_to_hf(
    state_dict: dict[str, torch.Tensor], config: dict, layout: str = HUB
) -> dict[str, torch.Tensor]:
    """The ``mllama`` model's weights -> ``MllamaForConditionalGeneration``'s, in ``layout``
    (``"hub"``: what save_pretrained writes; ``"transformers"``: its in-memory names)."""
    require_vision()
    from torchtune.models.llama3_2_vision._convert_weights import llama3_vision_tune_to_hf

    if layout not in (HUB, TRANSFORMERS):
        raise ValueError(f"layout is {HUB!r} or {TRANSFORMERS!r}: {layout!r}")
    kwargs = mllama_builder_kwargs(config)
    state = dict(state_dict)
    positional = {_POSITIONAL_TUNE[k]: state.pop(k) for k in list(state) if k in _POSITIONAL_TUNE}
    hub = llama3_vision_tune_to_hf(state, **_convert_args(kwargs)) | positional
    if layout == HUB:
        return hub
    return {_to_transformers(k): v for k, v in hub.items()}


class MllamaHFCheckpointer(FullModelHFCheckpointer):
    """torchtune's HF checkpointer with Llama 3.2 Vision's conversion (``model_type=MLLAMA``).

    Loads ``MllamaForConditionalGeneration`` safetensors (either layout); saves the whole model
    in the layout and shards it read, with its config.json, for transformers to load."""

    def __init__(self, *args, model_type: str = MODEL_TYPE, **kwargs):
        if model_type != MODEL_TYPE:
            raise ValueError(f"MllamaHFCheckpointer takes model_type={MODEL_TYPE}: {model_type}")
        require_vision()
        # torchtune's own LLAMA3_VISION branches (a lossy conversion) are not reached: loading
        # and saving are below.
        super().__init__(*args, model_type="LLAMA3_VISION", **kwargs)
        mllama_builder_kwargs(self._config, f"model at {str(self._checkpoint_dir)!r}")
        self._layout = HUB

    def load_checkpoint(self) -> dict:
        from torchtune import training

        merged, self._weight_map = hf_shards.load_shards(self._checkpoint_paths)
        self._layout = layout_of(merged)
        return {training.MODEL_KEY: mllama_hf_to_tune(merged, self._config)}

    def save_checkpoint(self, state_dict, epoch, intermediate_checkpoint=False, adapter_only=False):
        from torchtune import training

        if adapter_only or intermediate_checkpoint:
            raise ValueError("MllamaHFCheckpointer saves whole models only")
        hf_state = mllama_tune_to_hf(state_dict[training.MODEL_KEY], self._config, self._layout)
        # Shard numbers: ints as load_checkpoint records them, or the strings ("0001") torchtune's
        # checkpointers use, which tunepack's artifacts.write_hf_model sets from the shards.
        shard_of = {key: int(index) for key, index in (self._weight_map or {}).items()}
        hf_shards.save_shards(
            hf_state,
            shard_of,
            Path(self._output_dir) / f"epoch_{epoch}",
            source_dir=Path(self._checkpoint_dir),
            config=self._config,
        )


def run_as_trained(model: nn.Module) -> int:
    """Make every transformers ``MllamaVisionEncoder`` in ``model`` keep each layer's *input*
    for the intermediate features, as the model built here computes them (point 3 above:
    transformers 5.24 keeps each layer's output): a result then runs in transformers as it was
    trained. Changes those module instances only; returns how many."""
    from transformers.modeling_outputs import BaseModelOutput

    changed = 0
    for module in model.modules():
        if type(module).__name__ != "MllamaVisionEncoder":
            continue

        def forward(hidden_states, attention_mask=None, _encoder=module, **_ignored):
            states = ()
            for layer in _encoder.layers:
                states += (hidden_states,)
                hidden_states = layer(hidden_states=hidden_states, attention_mask=attention_mask)
            states += (hidden_states,)
            return BaseModelOutput(last_hidden_state=hidden_states, hidden_states=states)

        module.forward = forward
        changed += 1
    return changed
