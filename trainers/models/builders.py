"""Build a catalog model with torchtune's builders, corrected to compute what its checkpoint does.

``trainers/config.py`` names ``build`` as the model's component for every run, with the catalog's
torchtune builder as ``builder``. Most builders need nothing; ``build`` corrects the ones that,
with torchtune 0.6.1, would train a different model than the Hugging Face checkpoint holds:

- RoPE base: ``lora_llama2`` takes no ``rope_base`` and always builds base 10000, which is Llama
  2's but not Code Llama's (1e6); ``phi4_14b`` and ``lora_phi4_14b`` build 10000 where Phi-4's
  config says 250000. ``build`` passes the catalog's base to a builder that takes it and rebuilds
  RoPE (one module, shared by the layers as torchtune shares it) wherever the result differs.
- Gemma 2: torchtune's HF key map stores ``pre_feedforward_layernorm`` as a layer's
  ``mlp_scale`` and ``post_feedforward_layernorm`` as its ``mlp_norm``, the reverse of what the
  layer applies them as; its builders swap HF's attention (50) and final (30) soft-capping values;
  and its final norm soft-caps the normalised hidden state where HF soft-caps the logits.
  ``build`` keeps torchtune's module names and state-dict keys (so its checkpointer loads and
  saves HF files unchanged) and makes the forward pass HF's: see ``match_hf_gemma2``.
- Output LoRA: Gemma's and the tied Qwen 2 sizes' LoRA builders take no
  ``apply_lora_to_output`` (their output projection is the embedding matrix, which LoRA cannot
  adapt). The recipe still reads the setting, so ``build`` checks it is off instead of passing
  it on.

``tests/integration/test_families.py`` proves the result against transformers for every family, and
``tests/unit/test_catalog.py`` checks the corrections on every published size.
"""

from __future__ import annotations

import inspect
from collections.abc import Sequence

import torch
from torch import nn
from torchtune.config._utils import _get_component_from_path
from torchtune.models.phi3._position_embeddings import Phi3RotaryPositionalEmbeddings
from torchtune.models.qwen2._positional_embeddings import Qwen2RotaryPositionalEmbeddings
from torchtune.modules import (
    RotaryPositionalEmbeddings,
    TiedLinear,
    TransformerDecoder,
    TransformerSelfAttentionLayer,
)

from tunepack.core.errors import UnsupportedError

# RoPE modules that are fully described by (dim, max_seq_len, base), so can be rebuilt from them.
# Llama 3.1's scaled RoPE is not among them: its builders already take the right base.
_PLAIN_ROPE = (
    RotaryPositionalEmbeddings,
    Phi3RotaryPositionalEmbeddings,
    Qwen2RotaryPositionalEmbeddings,
)


def build(
    builder: str,
    *,
    rope_base: float,
    softcapping: Sequence[float] | None = None,
    apply_lora_to_output: bool = False,
    **kwargs,
) -> TransformerDecoder:
    """Build ``builder`` (a catalog component path) with ``kwargs``, corrected as above.

    ``rope_base`` is the checkpoint's RoPE base (config.json ``rope_theta``); ``softcapping`` is
    Gemma 2's (attention, final logit) soft-capping pair, from its config.json.
    """
    build_fn = _get_component_from_path(builder)
    takes = inspect.signature(build_fn).parameters
    if "apply_lora_to_output" in takes:
        kwargs["apply_lora_to_output"] = apply_lora_to_output
    elif apply_lora_to_output:
        raise UnsupportedError(
            f"{builder} cannot apply LoRA to the output projection: it is tied to the "
            "embeddings; train without output LoRA"
        )
    # A builder that passes its keywords on to its shape record (**shape) takes the base too.
    takes_base = "rope_base" in takes or any(p.kind is p.VAR_KEYWORD for p in takes.values())
    model = build_fn(**kwargs, **({"rope_base": rope_base} if takes_base else {}))
    if not takes_base:
        # A builder that takes the base builds it (Gemma 3's, two bases, where its local layers
        # keep their own); one that does not gets it here.
        set_rope_base(model, rope_base)
    if softcapping is not None:
        match_hf_gemma2(model, *softcapping)
    return model


def set_rope_base(model: TransformerDecoder, base: float) -> None:
    """Give every layer RoPE with ``base``, rebuilding the modules whose base differs."""
    rebuilt: dict[int, nn.Module] = {}  # id(old) -> new: layers that shared one module still do
    for index, layer in enumerate(model.layers):
        rope = layer.attn.pos_embeddings
        if float(rope.base) == float(base):
            continue
        if type(rope) not in _PLAIN_ROPE:
            name = type(rope).__name__
            raise TypeError(f"layer {index}'s {name} cannot be rebuilt with RoPE base {base}")
        if id(rope) not in rebuilt:
            rebuilt[id(rope)] = type(rope)(
                dim=rope.dim, max_seq_len=rope.max_seq_len, base=base
            ).to(rope.cache.device)
        layer.attn.pos_embeddings = rebuilt[id(rope)]


class Gemma2Layer(TransformerSelfAttentionLayer):
    """A Gemma 2 decoder layer in Hugging Face's order, under torchtune's module names.

    torchtune's checkpointer puts HF's ``pre_feedforward_layernorm`` in ``mlp_scale`` and
    ``post_feedforward_layernorm`` in ``mlp_norm``, so this layer applies ``mlp_scale`` before
    the MLP and ``mlp_norm`` after it. Attention is unchanged: ``sa_norm`` before, ``sa_scale``
    after.
    """

    def forward(self, x: torch.Tensor, *, mask=None, input_pos=None, **_kwargs) -> torch.Tensor:
        h = self.sa_norm(x)
        h = x + self.sa_scale(self.attn(h, h, mask=mask, input_pos=input_pos))
        return h + self.mlp_norm(self.mlp(self.mlp_scale(h)))


class SoftCappedTiedLinear(TiedLinear):
    """The tied output projection followed by ``cap * tanh(logits / cap)``, as HF's Gemma 2."""

    def __init__(self, tied_module: nn.Module, cap: float) -> None:
        super().__init__(tied_module)
        self.cap = cap

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(super().__call__(x) / self.cap) * self.cap


def match_hf_gemma2(model: TransformerDecoder, attention_cap: float, final_cap: float) -> None:
    """Make a model from torchtune's Gemma 2 builders compute HF's Gemma 2 (see module doc)."""
    for index, layer in enumerate(model.layers):
        layer.attn.softcapping = attention_cap
        model.layers[index] = Gemma2Layer(
            attn=layer.attn,
            mlp=layer.mlp,
            sa_norm=layer.sa_norm,
            mlp_norm=layer.mlp_norm,
            sa_scale=layer.sa_scale,
            mlp_scale=layer.mlp_scale,
        )
    # Keep the final norm's module (and its key norm.rms_norm.scale) but not its capping.
    model.norm.logit_capping = nn.Identity()
    if not isinstance(model.output, TiedLinear):
        raise TypeError(f"Gemma 2's output should be tied, not {type(model.output).__name__}")
    model.output = SoftCappedTiedLinear(model.output.tied_module, final_cap)
