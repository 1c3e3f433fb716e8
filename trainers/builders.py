"""Adapters around torchtune's LoRA builders, for families whose builders need help.

The catalog names the torchtune builder; ``trainers/config.py`` routes a LoRA model through
``lora_model`` only when the entry needs it:

- Gemma and the tied Qwen 2 sizes have LoRA builders without ``apply_lora_to_output`` (their
  output projection is the embedding matrix, which LoRA cannot adapt). The recipe still reads the
  setting, so the config keeps it and this adapter checks it is off instead of passing it on.
- torchtune's ``lora_llama2`` takes no ``rope_base`` and always builds RoPE with base 10000.
  That is Llama 2's, but Code Llama uses 1e6: its ``lora_code_llama2_*`` builders would train a
  model whose positions differ from the checkpoint's. The adapter rebuilds RoPE with the base
  the catalog gives.
"""

from __future__ import annotations

import inspect

from torch import nn
from torchtune.config._utils import _get_component_from_path
from torchtune.modules import RotaryPositionalEmbeddings

from tunepack.errors import BadInputError


def lora_model(
    builder: str,
    *,
    apply_lora_to_output: bool = False,
    rope_base: float | None = None,
    **kwargs,
) -> nn.Module:
    """Build ``builder`` (a catalog component path) with ``kwargs``, as described above."""
    build = _get_component_from_path(builder)
    if "apply_lora_to_output" in inspect.signature(build).parameters:
        kwargs["apply_lora_to_output"] = apply_lora_to_output
    elif apply_lora_to_output:
        raise BadInputError(
            f"{builder} cannot apply LoRA to the output projection: it is tied to the "
            "embeddings; train without output LoRA"
        )
    model = build(**kwargs)
    if rope_base is not None:
        _rebuild_rope(model, rope_base)
    return model


def _rebuild_rope(model: nn.Module, base: float) -> None:
    for index, layer in enumerate(model.layers):
        rope = layer.attn.pos_embeddings
        if type(rope) is not RotaryPositionalEmbeddings:
            # Only plain RoPE is known to be rebuildable from (dim, max_seq_len, base).
            raise TypeError(f"layer {index} has {type(rope).__name__}, not plain RoPE")
        layer.attn.pos_embeddings = RotaryPositionalEmbeddings(
            dim=rope.dim, max_seq_len=rope.max_seq_len, base=base
        ).to(rope.cache.device)
