"""What the decoders of tunepack's own families (trainers/models/, one module each) share.

- ``builders``: a family's full and LoRA builders (``qwen3``, ``lora_qwen3``), both taking the
  fields of the family's one shape record (``Qwen3Shape``) as keywords;
- ``sized``: a published size's full and LoRA builders (``qwen3_8b``, ``lora_qwen3_8b``), which
  only pass the catalog's shape of that size to the family's shape-taking builders;
- ``lora_decoder_args``: a family's LoRA builder's arguments as its ``_decoder`` takes them;
- the parts of the decoders that are the same in every family: a projection (``linear``: plain,
  NF4, LoRA or DoRA), attention's four projections, the gated MLP, HF's order of q/k norms and
  RoPE in attention (``project_qkv``), and the NF4 state-dict hook of QLoRA models.
"""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Callable
from functools import partial

from torch import nn
from torchtune.modules import FeedForward, TransformerDecoder
from torchtune.modules.common_utils import reparametrize_as_dtype_state_dict_post_hook
from torchtune.modules.low_precision import FrozenNF4Linear
from torchtune.modules.peft import DoRALinear, LoRALinear

# --- a family's full and LoRA builders, from its shape -----------------------------------------

# The LoRA settings every family's LoRA builder takes after its shape, as torchtune's take them.
_LORA_KEYWORDS = (
    ("lora_rank", inspect.Parameter.empty),
    ("lora_alpha", inspect.Parameter.empty),
    ("lora_dropout", 0.0),
    ("use_dora", False),
    ("quantize_base", False),
)


def shape_keywords(shape: object) -> dict:
    """A shape record's fields as the keywords a family's ``_decoder`` takes (values as given)."""
    return {f.name: getattr(shape, f.name) for f in dataclasses.fields(shape)}


def shape_parameters(shape: type) -> list[inspect.Parameter]:
    """A shape record's fields as a builder's keyword-only parameters (defaults as declared)."""
    return [
        inspect.Parameter(
            f.name,
            inspect.Parameter.KEYWORD_ONLY,
            default=inspect.Parameter.empty if f.default is dataclasses.MISSING else f.default,
            annotation=f.type,
        )
        for f in dataclasses.fields(shape)
    ]


def builders(
    shape: type, decoder: Callable[..., nn.Module], name: str, *, lora_output: bool
) -> tuple[Callable[..., nn.Module], Callable[..., nn.Module]]:
    """A family's full builder ``name`` and LoRA builder ``lora_<name>``, both taking ``shape``'s
    fields (a frozen dataclass: the family's shape, declared once) as keywords, as torchtune's
    component builders take theirs; the config names them with those keywords.

    ``name(**shape)`` is ``decoder(**shape)``, every parameter trainable;
    ``lora_<name>(lora_attn_modules, apply_lora_to_mlp=False[, apply_lora_to_output=False], *,
    **shape, lora_rank, lora_alpha, lora_dropout=0.0, use_dora=False, quantize_base=False)`` is
    ``decoder`` with LoRA (DoRA with ``use_dora``, QLoRA with ``quantize_base``) adapters: the
    settings as ``lora_decoder_args`` passes them. ``apply_lora_to_output`` only with
    ``lora_output`` (an output projection of the model's own, not the embeddings)."""
    positional, keyword = inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY
    shape_keyword_parameters = shape_parameters(shape)
    lora_parameters = [
        inspect.Parameter("lora_attn_modules", positional),
        inspect.Parameter("apply_lora_to_mlp", positional, default=False),
        *([inspect.Parameter("apply_lora_to_output", positional, default=False)] * lora_output),
        *shape_keyword_parameters,
        *(inspect.Parameter(n, keyword, default=default) for n, default in _LORA_KEYWORDS),
    ]
    full_signature = inspect.Signature(shape_keyword_parameters)
    lora_signature = inspect.Signature(lora_parameters)
    names = {f.name for f in dataclasses.fields(shape)}

    def full(**kwargs) -> nn.Module:
        full_signature.bind(**kwargs)
        return decoder(**shape_keywords(shape(**kwargs)))

    def lora(*args, **kwargs) -> nn.Module:
        bound = lora_signature.bind(*args, **kwargs)
        bound.apply_defaults()
        given = dict(bound.arguments)
        dims = shape(**{k: given.pop(k) for k in list(given) if k in names})
        return decoder(**shape_keywords(dims), **lora_decoder_args(given))

    module = decoder.__module__
    for function, function_name, signature, doc in (
        (full, name, full_signature, f"A {shape.__name__} decoder (every parameter trainable)."),
        (lora, f"lora_{name}", lora_signature, f"``{name}`` with LoRA (DoRA, QLoRA) adapters."),
    ):
        function.__name__ = function.__qualname__ = function_name
        function.__module__ = module
        function.__signature__ = signature
        function.__doc__ = doc
    return full, lora


# --- builders of the published sizes ----------------------------------------------------------


def _lora_parameters(lora_output: bool) -> inspect.Signature:
    """The signature of a size's LoRA builder: ``apply_lora_to_output`` only where the output
    projection is the model's own (not tied to the embeddings)."""
    positional, keyword = inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY
    empty = inspect.Parameter.empty
    specs = [
        ("lora_attn_modules", positional, empty),
        ("apply_lora_to_mlp", positional, False),
        *([("apply_lora_to_output", positional, False)] if lora_output else []),
        ("rope_base", keyword, 1_000_000.0),
        ("lora_rank", keyword, empty),
        ("lora_alpha", keyword, empty),
        ("lora_dropout", keyword, 0.0),
        ("use_dora", keyword, False),
        ("quantize_base", keyword, False),
    ]
    return inspect.Signature(
        [inspect.Parameter(name, kind, default=default) for name, kind, default in specs],
        return_annotation=TransformerDecoder,
    )


def sized(
    full_builder: Callable[..., TransformerDecoder],
    lora_builder: Callable[..., TransformerDecoder],
    size: str,
    size_kwargs: Callable[[str], dict],
    *,
    lora_output: bool,
) -> tuple[Callable[..., TransformerDecoder], Callable[..., TransformerDecoder]]:
    """The full and the LoRA builder of ``size``, as torchtune names its own per size
    (``{full_builder}_{size}``, ``lora_{full_builder}_{size}``): ``full_builder`` and
    ``lora_builder`` given ``size_kwargs(size)`` (read when a model is built). The LoRA builder
    takes ``apply_lora_to_output`` only with ``lora_output`` (an output projection of its own)."""

    def full(rope_base: float = 1_000_000.0) -> TransformerDecoder:
        return full_builder(**size_kwargs(size), rope_base=rope_base)

    signature = _lora_parameters(lora_output)

    def lora(*args, **kwargs) -> TransformerDecoder:
        bound = signature.bind(*args, **kwargs)
        bound.apply_defaults()
        arguments = dict(bound.arguments)
        modules = arguments.pop("lora_attn_modules")
        return lora_builder(modules, **arguments, **size_kwargs(size))

    lora.__signature__ = signature
    for function, builder in ((full, full_builder), (lora, lora_builder)):
        function.__name__ = function.__qualname__ = f"{builder.__name__}_{size}"
        function.__module__ = builder.__module__
        function.__doc__ = f"``{builder.__name__}`` of the catalog's size {size}."
    return full, lora


def lora_decoder_args(args: dict) -> dict:
    """A LoRA builder's arguments (its ``locals()``) as a family's ``_decoder`` takes them:
    the attention modules as a tuple, ``lora_rank/alpha/dropout`` as LoRALinear's names."""
    args = dict(args)
    args["lora_attn_modules"] = tuple(args["lora_attn_modules"])
    args["rank"], args["alpha"], args["dropout"] = (
        args.pop("lora_rank"),
        args.pop("lora_alpha"),
        args.pop("lora_dropout"),
    )
    return args


# --- decoder parts ----------------------------------------------------------------------------


def linear(in_dim, out_dim, *, lora: bool, quantize_base: bool, use_dora: bool, **lora_args):
    """A projection without bias: LoRA (DoRA with ``use_dora``) where ``lora``, over an NF4
    base with ``quantize_base``."""
    if lora:
        cls = DoRALinear if use_dora else LoRALinear
        return cls(in_dim, out_dim, quantize_base=quantize_base, **lora_args)
    if quantize_base:
        return FrozenNF4Linear(in_dim, out_dim, bias=False)
    return nn.Linear(in_dim, out_dim, bias=False)


def attention_projections(
    lin: Callable[..., nn.Module],
    *,
    embed_dim: int,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    lora_attn_modules,
) -> dict[str, nn.Module]:
    """Attention's q, k, v and output projections (``lin``: ``linear`` with its LoRA settings),
    by torchtune's argument names; LoRA on those named in ``lora_attn_modules``."""
    q_out, kv_out = num_heads * head_dim, num_kv_heads * head_dim
    return {
        "q_proj": lin(embed_dim, q_out, lora="q_proj" in lora_attn_modules),
        "k_proj": lin(embed_dim, kv_out, lora="k_proj" in lora_attn_modules),
        "v_proj": lin(embed_dim, kv_out, lora="v_proj" in lora_attn_modules),
        "output_proj": lin(q_out, embed_dim, lora="output_proj" in lora_attn_modules),
    }


def gated_mlp(
    lin: Callable[..., nn.Module],
    embed_dim: int,
    intermediate_dim: int,
    *,
    lora: bool,
    activation: nn.Module,
) -> FeedForward:
    """The gated MLP, ``down(activation(gate(x)) * up(x))``, LoRA on all three with ``lora``."""
    return FeedForward(
        gate_proj=lin(embed_dim, intermediate_dim, lora=lora),
        down_proj=lin(intermediate_dim, embed_dim, lora=lora),
        up_proj=lin(embed_dim, intermediate_dim, lora=lora),
        activation=activation,
    )


def project_qkv(attn, x, y, input_pos):
    """q, k, v (batch, heads, positions, head_dim) of torchtune's ``MultiHeadAttention``
    ``attn`` with its q/k norms applied *before* RoPE (HF's order; torchtune's is after), k and
    v through the KV cache and repeated to ``num_heads``."""
    if y is None:
        y = x
    b, s_x, _ = x.shape
    s_y = y.shape[1]
    q = attn.q_proj(x).view(b, s_x, attn.num_heads, attn.head_dim)
    k = attn.k_proj(y).view(b, s_y, attn.num_kv_heads, attn.head_dim)
    v = attn.v_proj(y).view(b, s_y, attn.num_kv_heads, attn.head_dim)
    q, k = attn.q_norm(q), attn.k_norm(k)
    q = attn.pos_embeddings(q, input_pos=input_pos).transpose(1, 2)
    k = attn.pos_embeddings(k, input_pos=input_pos).transpose(1, 2)
    v = v.transpose(1, 2)
    if attn.kv_cache is not None and attn.cache_enabled:
        k, v = attn.kv_cache.update(k, v)
    if attn.num_heads != attn.num_kv_heads:
        repeat = attn.num_heads // attn.num_kv_heads
        k = k.repeat_interleave(repeat, dim=1)
        v = v.repeat_interleave(repeat, dim=1)
    return q, k, v


def save_nf4_in_model_dtype(model: TransformerDecoder, tok_embeddings: nn.Module) -> None:
    """As torchtune's QLoRA builders: NF4 weights are saved in the model's dtype."""
    model._register_state_dict_hook(
        partial(
            reparametrize_as_dtype_state_dict_post_hook,
            dtype=tok_embeddings.weight.dtype,
            offload_to_cpu=True,
        )
    )
