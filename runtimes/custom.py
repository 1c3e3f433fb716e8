"""Bring your own checkpoint of a supported architecture: the ``tunepack-<arch>-custom`` runtimes.

``read_config`` is the one reader of the checkpoint's ``config.json`` (model initializer, trainer,
planner); it only fills in numbers its table allows, never selects code, and refuses what the
family's builders cannot reproduce. docs/trainer.md, "Your own checkpoint: the ``-custom``
runtimes"."""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, replace
from pathlib import Path

from tunepack.core.errors import BadModelError
from tunepack.runtimes.families import FAMILIES
from tunepack.runtimes.shape import Shape

CUSTOM_SUFFIX = "-custom"
TOKENIZER_JSON = "tokenizer.json"
# torchtune 0.6.1's Llama3ScaledRoPE has these three constants built in; only the factor is a
# builder keyword.
_LLAMA3_ROPE_FIXED = {
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}


@dataclass(frozen=True)
class Architecture:
    """What tunepack can build of one Hugging Face architecture, and how."""

    name: str  # the runtime is tunepack-<name>-custom
    family: str  # the catalog family (runtimes/families.py): builders, checkpointer, chat format
    activation: str  # the MLP activation the builders hard-code
    # The config.json field transformers reads it from, and legacy values it takes for the same.
    activation_field: str = "hidden_act"
    activation_aliases: tuple[str, ...] = ()
    # "derived": the builders compute head_dim as hidden_size // heads; "free": config.json's;
    # "optional": config.json's, hidden_size // heads where it has none (as transformers reads it).
    head_dim: str = "derived"
    # Tied input/output embeddings: "never", "always" or "either" (a builder keyword).
    tied: str = "never"
    qkv_bias: bool = False
    # How a sliding window is treated: "refuse", "limit" (the builders attend over the whole
    # sequence: max_seq_len is capped at the window, where both agree) or "model" (built in).
    window: str = "refuse"
    llama3_rope: bool = False  # Llama 3 RoPE scaling (rope_type llama3) can be built
    softcapping: bool = False  # Gemma 2's attention and final-logit tanh soft-capping
    # HF class defaults of the fields an older config.json may leave out.
    defaults: tuple[tuple[str, object], ...] = ()
    qk_norm: bool = False  # Qwen 3's RMSNorm over each head's query and key
    moe: bool = False  # Qwen3-MoE's experts (read_moe)
    gemma3: bool = False  # Gemma 3's local/global layers and their two RoPE tables (read_gemma3)

    @property
    def model_type(self) -> str:
        """config.json's ``model_type``: its family's."""
        return FAMILIES[self.family].hf_model_type


ARCHITECTURES: dict[str, Architecture] = {
    a.name: a
    for a in (
        # Llama 3.2's builders: the only Llama ones that take tie_word_embeddings; their scaled
        # RoPE with factor 1 is plain RoPE, so a checkpoint without rope_scaling builds too.
        Architecture("llama", "llama3_2", "silu", tied="either", llama3_rope=True,
                     defaults=(("rms_norm_eps", 1e-6), ("max_position_embeddings", 2048),
                               ("tie_word_embeddings", False))),
        Architecture("mistral", "mistral", "silu", window="limit",
                     defaults=(("rms_norm_eps", 1e-6), ("max_position_embeddings", 131_072),
                               ("tie_word_embeddings", False))),
        Architecture("qwen2", "qwen2_5", "silu", tied="either", qkv_bias=True,
                     defaults=(("rms_norm_eps", 1e-6), ("max_position_embeddings", 32_768),
                               ("tie_word_embeddings", False))),
        Architecture("gemma", "gemma", "gelu_pytorch_tanh", head_dim="free",
                     activation_aliases=("gelu",),  # transformers: "gelu" means the tanh one
                     tied="always",
                     defaults=(("rms_norm_eps", 1e-6), ("max_position_embeddings", 8192),
                               ("tie_word_embeddings", True), ("head_dim", 256))),
        Architecture("gemma2", "gemma2", "gelu_pytorch_tanh", head_dim="free",
                     activation_field="hidden_activation",
                     tied="always", window="model", softcapping=True,
                     defaults=(("rms_norm_eps", 1e-6), ("max_position_embeddings", 8192),
                               ("tie_word_embeddings", True), ("head_dim", 256),
                               ("hidden_activation", "gelu_pytorch_tanh"),
                               ("sliding_window", 4096), ("attn_logit_softcapping", 50.0),
                               ("final_logit_softcapping", 30.0))),
        Architecture("phi3", "phi3", "silu", window="limit",
                     defaults=(("rms_norm_eps", 1e-5), ("max_position_embeddings", 4096),
                               ("tie_word_embeddings", False))),
        # Qwen3MoeConfig's defaults (transformers 5.24) for what a config.json may leave out.
        Architecture("qwen3_moe", "qwen3_moe", "silu", head_dim="optional",
                     tied="either", qk_norm=True, moe=True,
                     defaults=(("rms_norm_eps", 1e-6), ("max_position_embeddings", 32_768),
                               ("tie_word_embeddings", False), ("decoder_sparse_step", 1),
                               ("mlp_only_layers", []), ("norm_topk_prob", False),
                               ("router_aux_loss_coef", 0.001),
                               ("num_experts_per_tok", 8), ("moe_intermediate_size", 768))),
        # Gemma3TextConfig's defaults (transformers 5.24) for what a config.json may leave out,
        # as the text_config of google/gemma-3-4b-it does (heads, vocabulary, head_dim).
        Architecture("gemma3", "gemma3", "gelu_pytorch_tanh", head_dim="free",
                     activation_field="hidden_activation", tied="always", window="model",
                     gemma3=True,
                     defaults=(("rms_norm_eps", 1e-6), ("max_position_embeddings", 131_072),
                               ("tie_word_embeddings", True), ("head_dim", 256),
                               ("hidden_activation", "gelu_pytorch_tanh"),
                               ("num_attention_heads", 8), ("num_key_value_heads", 4),
                               ("vocab_size", 262_208), ("sliding_window", 4096),
                               ("query_pre_attn_scalar", 256))),
    )
}  # fmt: skip


# The special tokens each custom runtime's default chat format writes
# (trainers/data/prompt_format.py; a test keeps the two equal): "<bos>"/"<eos>" stand for the
# tokenizer's BOS/EOS, the others are looked up by their text. The model initializer checks them,
# which cannot import the trainer.
FORMAT_TOKENS: dict[str, tuple[str, ...]] = {
    "llama3.2": ("<bos>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"),
    "mistral": ("<bos>", "<eos>"),
    "qwen2.5": ("<|im_start|>", "<|im_end|>"),
    "qwen3": ("<|im_start|>", "<|im_end|>"),
    "gemma": ("<bos>", "<start_of_turn>", "<end_of_turn>"),
    "gemma3": ("<bos>", "<start_of_turn>", "<end_of_turn>"),
    "phi3": ("<eos>", "<|system|>", "<|user|>", "<|assistant|>", "<|end|>"),
}


def runtime_model_name(arch: str) -> str:
    """``qwen3-moe-custom`` for ``qwen3_moe``: runtime names are Kubernetes names (RFC 1123: no
    underscore)."""
    return arch.replace("_", "-") + CUSTOM_SUFFIX


@dataclass(frozen=True)
class Built:
    """What config.json says, as the builders take it."""

    shape: Shape
    options: dict[str, object]  # the family's builder options (rope_base, norm_eps, ...)
    softcapping: tuple[float, float] | None = None


def _fail(where: str, field: str, value: object, expected: str) -> BadModelError:
    return BadModelError(
        f"{where}: config.json has {field}={value!r}, which tunepack cannot build: expected "
        f"{expected}"
    )


def _positive_int(where: str, config: dict, field: str) -> int:
    value = config.get(field)
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        if value is None and field not in config:
            raise BadModelError(
                f"{where}: config.json has no {field}; expected a positive integer (give the "
                "checkpoint's original config.json)"
            )
        raise _fail(where, field, value, "a positive integer")
    return value


def _positive_number(where: str, config: dict, field: str) -> float:
    value = config.get(field)
    if isinstance(value, bool) or not isinstance(value, int | float) or not value > 0:
        raise _fail(where, field, value, "a positive number")
    if not math.isfinite(value):
        raise _fail(where, field, value, "a finite positive number")
    return float(value)


def _rope(config: dict) -> tuple[dict, dict | None]:
    """(RoPE parameters, scaling) from either layout: transformers 5's ``rope_parameters``
    (rope_theta and the scaling together) or the older ``rope_theta`` + ``rope_scaling``."""
    params = config.get("rope_parameters")
    scaling = config.get("rope_scaling")
    merged: dict = {}
    if isinstance(params, dict):
        merged |= params
    if isinstance(scaling, dict):
        merged |= scaling
    if "rope_theta" in config:
        merged.setdefault("rope_theta", config["rope_theta"])
    rope_type = merged.get("rope_type", merged.get("type"))
    if rope_type == "default" or (rope_type is None and "factor" not in merged):
        return merged, None  # plain RoPE (a scaling factor without a type is refused)
    return merged, {**merged, "rope_type": rope_type}


def read_config(arch_name: str, config: object, where: str) -> Built:
    """The model ``config`` (a parsed config.json) describes, as ``arch_name``'s builders take
    it; ``BadInputError`` naming the field and value of anything they cannot reproduce.
    ``where`` names the checkpoint in messages."""
    arch = ARCHITECTURES[arch_name]
    if not isinstance(config, dict):
        raise BadModelError(f"{where}: config.json is not a JSON object")
    if arch.gemma3:
        config = text_config(config)
    config = dict(arch.defaults) | config
    model_type = config.get("model_type")
    if model_type != arch.model_type:
        raise _fail(where, "model_type", model_type, f"{arch.model_type!r} for this runtime")

    dims = {
        field: _positive_int(where, config, field)
        for field in (
            "vocab_size",
            "num_hidden_layers",
            "num_attention_heads",
            "hidden_size",
            "intermediate_size",
            "max_position_embeddings",
        )
    }
    heads, width = dims["num_attention_heads"], dims["hidden_size"]
    kv_heads = config.get("num_key_value_heads")
    kv_heads = heads if kv_heads is None else _positive_int(where, config, "num_key_value_heads")
    if heads % kv_heads:
        raise _fail(
            where, "num_key_value_heads", kv_heads, f"a divisor of num_attention_heads ({heads})"
        )
    head_dim = config.get("head_dim")
    if arch.head_dim == "derived":
        if width % heads:
            raise _fail(where, "hidden_size", width, f"a multiple of num_attention_heads ({heads})")
        if head_dim is not None and head_dim != width // heads:
            raise _fail(
                where, "head_dim", head_dim,
                f"hidden_size // num_attention_heads ({width // heads}): the {arch.name} "
                "builders derive it",
            )  # fmt: skip
        head_dim = width // heads
    elif arch.head_dim == "optional" and config.get("head_dim") is None:
        head_dim = width // heads
    else:
        head_dim = _positive_int(where, config, "head_dim")
    if head_dim % 2:
        raise _fail(where, "head_dim", head_dim, "an even number (RoPE rotates pairs)")

    activation = config.get(arch.activation_field)
    if activation != arch.activation and activation not in arch.activation_aliases:
        raise _fail(where, arch.activation_field, activation, repr(arch.activation))
    for field in ("attention_bias", "mlp_bias"):  # Qwen 2's q/k/v biases are implied
        if config.get(field) not in (None, False):
            raise _fail(where, field, config[field], "false (the builders have no such bias)")

    tied = config.get("tie_word_embeddings")
    allowed = {"never": (False,), "always": (True,), "either": (False, True)}[arch.tied]
    if tied not in allowed:
        raise _fail(where, "tie_word_embeddings", tied, " or ".join(map(str, allowed)).lower())

    if arch.gemma3:
        return read_gemma3(where, config, dims, kv_heads, head_dim)
    rope, scaling = _rope(config)
    rope_base = _positive_number(where, {"rope_theta": rope.get("rope_theta", 10_000.0)},
                                 "rope_theta")  # fmt: skip
    options: dict[str, object] = {
        "rope_base": rope_base,
        "norm_eps": _positive_number(where, config, "rms_norm_eps"),
    }
    if arch.llama3_rope:
        options["scale_factor"] = 1
    if scaling is not None:
        kind = scaling.get("rope_type")
        if not arch.llama3_rope or kind != "llama3":
            expected = "none or rope_type 'llama3'" if arch.llama3_rope else "none"
            raise _fail(where, "rope_scaling.rope_type", kind, expected)
        for key, value in _LLAMA3_ROPE_FIXED.items():
            if scaling.get(key) != value:
                raise _fail(
                    where, f"rope_scaling.{key}", scaling.get(key),
                    f"{value} (torchtune 0.6.1's Llama 3 scaled RoPE has it built in)",
                )  # fmt: skip
        options["scale_factor"] = _positive_number(where, scaling, "factor")
    partial = rope.get("partial_rotary_factor", config.get("partial_rotary_factor", 1.0))
    if partial != 1.0:
        raise _fail(where, "partial_rotary_factor", partial, "1.0 (RoPE over the whole head)")

    window = config.get("sliding_window")
    if config.get("use_sliding_window") is True:
        raise _fail(where, "use_sliding_window", True, "false")
    if arch.window == "refuse" or (arch.window == "limit" and window is None):
        window = None
    else:
        window = _positive_int(where, config, "sliding_window")
    layer_types = config.get("layer_types")
    if layer_types is not None:
        expected_types = ["full_attention"] * dims["num_hidden_layers"]
        if arch.window == "model":  # Gemma 2: sliding on even layers, as torchtune builds it
            expected_types = [
                "sliding_attention" if i % 2 == 0 else "full_attention"
                for i in range(dims["num_hidden_layers"])
            ]
        elif arch.window == "limit" and window is not None:
            expected_types = ["sliding_attention"] * dims["num_hidden_layers"]
        if layer_types != expected_types and not (
            arch.window == "limit" and set(layer_types) <= {"sliding_attention", "full_attention"}
            and window is not None
        ):  # fmt: skip
            raise _fail(where, "layer_types", layer_types, repr(expected_types))

    softcapping = None
    if arch.softcapping:
        caps = []
        for field in ("attn_logit_softcapping", "final_logit_softcapping"):
            caps.append(_positive_number(where, config, field))
        softcapping = (caps[0], caps[1])
        scalar = config.get("query_pre_attn_scalar", head_dim)
        if scalar != head_dim:
            raise _fail(where, "query_pre_attn_scalar", scalar, f"head_dim ({head_dim})")

    moe = read_moe(where, config, dims["num_hidden_layers"]) if arch.moe else {}
    if arch.moe:
        options["norm_topk_prob"] = moe.pop("norm_topk_prob")
        options["router_aux_loss_coef"] = moe.pop("router_aux_loss_coef")
    shape = Shape(
        vocab_size=dims["vocab_size"],
        num_layers=dims["num_hidden_layers"],
        num_heads=heads,
        num_kv_heads=kv_heads,
        embed_dim=width,
        intermediate_dim=dims["intermediate_size"],
        max_seq_len=dims["max_position_embeddings"],
        tied_embeddings=bool(tied),
        qkv_bias=arch.qkv_bias,
        head_dim=head_dim,
        norms_per_layer=4 if arch.softcapping else 2,
        sliding_window=window,
        qk_norm=arch.qk_norm,
        **moe,
    )
    return Built(shape=shape, options=options, softcapping=softcapping)


def text_config(config: dict) -> dict:
    """The text model's ``config.json`` of a Gemma 3 checkpoint: itself (``Gemma3ForCausalLM``),
    or a ``Gemma3ForConditionalGeneration``'s ``text_config`` (model_type ``gemma3``: 4B, 12B,
    27B), as a ``Gemma3ForCausalLM`` of those weights would say it."""
    if config.get("model_type") != "gemma3" or not isinstance(config.get("text_config"), dict):
        return config
    text = dict(config["text_config"])
    text["model_type"] = "gemma3_text"
    text["architectures"] = ["Gemma3ForCausalLM"]
    text.setdefault("tie_word_embeddings", config.get("tie_word_embeddings", True))
    for key in ("torch_dtype", "dtype", "transformers_version"):
        if key in config:
            text.setdefault(key, config[key])
    return text


_GEMMA3_LAYER_TYPES = ("sliding_attention", "full_attention")


def read_gemma3(where: str, config: dict, dims: dict, kv_heads: int, head_dim: int) -> Built:
    """Gemma 3's own fields as trainers/models/gemma3.py builds them: the two RoPE tables (either
    layout: transformers 5's ``rope_parameters`` by layer type, or ``rope_theta``,
    ``rope_local_base_freq`` and ``rope_scaling``), which layers are global (``layer_types``, or
    ``sliding_window_pattern``), the window and the query scale; soft-capping is refused."""
    for field in ("attn_logit_softcapping", "final_logit_softcapping"):
        if config.get(field) is not None:
            raise _fail(where, field, config[field], "null (Gemma 3 has no soft-capping)")
    if config.get("use_bidirectional_attention"):
        raise _fail(where, "use_bidirectional_attention", config["use_bidirectional_attention"],
                    "false (a causal language model)")  # fmt: skip
    params = config.get("rope_parameters")
    if params is None:
        params = {}
    if not isinstance(params, dict) or not set(params) <= set(_GEMMA3_LAYER_TYPES):
        expected = "RoPE parameters by layer type (sliding_attention, full_attention)"
        raise _fail(where, "rope_parameters", params, expected)
    full = dict(params.get("full_attention") or {})
    if isinstance(config.get("rope_scaling"), dict):
        full |= config["rope_scaling"]
    full.setdefault("rope_theta", config.get("rope_theta", 1_000_000.0))
    local = dict(params.get("sliding_attention") or {})
    local.setdefault("rope_theta", config.get("rope_local_base_freq", 10_000.0))
    scaling = 1.0
    kind = full.get("rope_type", full.get("type", "default"))
    if kind == "linear":
        scaling = _positive_number(where, {"rope_scaling.factor": full.get("factor")},
                                   "rope_scaling.factor")  # fmt: skip
    elif kind != "default":
        raise _fail(where, "rope_scaling.rope_type", kind, "none, 'default' or 'linear'")
    local_kind = local.get("rope_type", local.get("type", "default"))
    if local_kind != "default":
        raise _fail(where, "rope_parameters.sliding_attention.rope_type", local_kind,
                    "'default' (local layers take no RoPE scaling)")  # fmt: skip
    for rope in (full, local):
        partial = rope.get("partial_rotary_factor", 1.0)
        if partial != 1.0:
            raise _fail(where, "partial_rotary_factor", partial, "1.0 (RoPE over the whole head)")
    layers = dims["num_hidden_layers"]
    types = config.get("layer_types")
    if types is None:
        pattern = config.get("sliding_window_pattern", config.get("_sliding_window_pattern", 6))
        pattern = _positive_int(where, {"sliding_window_pattern": pattern},
                                "sliding_window_pattern")  # fmt: skip
        types = ["full_attention" if (i + 1) % pattern == 0 else "sliding_attention"
                 for i in range(layers)]  # fmt: skip
    if not isinstance(types, list) or len(types) != layers:
        types_ok = False
    else:
        types_ok = all(isinstance(t, str) and t in _GEMMA3_LAYER_TYPES for t in types)
    if not types_ok:
        raise _fail(where, "layer_types", types,
                    f"{layers} of 'sliding_attention' or 'full_attention'")  # fmt: skip
    options: dict[str, object] = {
        "rope_base": _positive_number(where, {"rope_theta": full["rope_theta"]}, "rope_theta"),
        "norm_eps": _positive_number(where, config, "rms_norm_eps"),
        "rope_local_base": _positive_number(
            where, {"rope_local_base_freq": local["rope_theta"]}, "rope_local_base_freq"
        ),
        "rope_scaling_factor": scaling,
        "query_pre_attn_scalar": _positive_number(where, config, "query_pre_attn_scalar"),
        "sliding_window_pattern": 6,  # unused: global_layers says which layers are global
        "global_layers": [i for i, kind in enumerate(types) if kind == "full_attention"],
    }
    shape = Shape(
        vocab_size=dims["vocab_size"],
        num_layers=layers,
        num_heads=dims["num_attention_heads"],
        num_kv_heads=kv_heads,
        embed_dim=dims["hidden_size"],
        intermediate_dim=dims["intermediate_size"],
        max_seq_len=dims["max_position_embeddings"],
        tied_embeddings=True,
        head_dim=head_dim,
        norms_per_layer=4,
        sliding_window=_positive_int(where, config, "sliding_window"),
        qk_norm=True,
    )
    return Built(shape=shape, options=options)


def read_moe(where: str, config: dict, num_layers: int) -> dict[str, object]:
    """Qwen3-MoE's expert fields as Shape and builder options take them: which layers are sparse
    (transformers: layer i unless it is in ``mlp_only_layers`` or ``(i + 1) %
    decoder_sparse_step``), the experts, the top-k renormalisation and the auxiliary loss."""
    # The Hub's config.json says num_experts; transformers 5 saves it as num_local_experts.
    named = [f for f in ("num_experts", "num_local_experts") if f in config]
    experts = _positive_int(where, config, named[0]) if named else 128  # the class default
    if len(named) == 2 and config["num_local_experts"] != experts:
        raise _fail(where, "num_local_experts", config["num_local_experts"],
                    f"num_experts ({experts}): both name the number of experts")  # fmt: skip
    per_token = _positive_int(where, config, "num_experts_per_tok")
    if per_token > experts:
        raise _fail(where, "num_experts_per_tok", per_token, f"at most num_experts ({experts})")
    width = _positive_int(where, config, "moe_intermediate_size")
    step = _positive_int(where, config, "decoder_sparse_step")
    only = config.get("mlp_only_layers")
    if not isinstance(only, list) or not all(
        isinstance(i, int) and not isinstance(i, bool) and 0 <= i < num_layers for i in only
    ):
        raise _fail(where, "mlp_only_layers", only, f"a list of layer indices below {num_layers}")
    dense = tuple(i for i in range(num_layers) if i in only or (i + 1) % step)
    if len(dense) == num_layers:
        raise _fail(where, "decoder_sparse_step", step,
                    "a value that leaves at least one layer a mixture of experts")  # fmt: skip
    norm = config.get("norm_topk_prob")
    if not isinstance(norm, bool):
        raise _fail(where, "norm_topk_prob", norm, "true or false")
    coef = config.get("router_aux_loss_coef")
    if isinstance(coef, bool) or not isinstance(coef, int | float) or not 0 <= coef < math.inf:
        raise _fail(where, "router_aux_loss_coef", coef, "a finite number >= 0")
    if config.get("output_router_logits") not in (None, False, True):
        raise _fail(where, "output_router_logits", config["output_router_logits"], "a boolean")
    return {
        "num_experts": experts,
        "experts_per_token": per_token,
        "moe_intermediate_dim": width,
        "dense_layers": dense,
        "norm_topk_prob": norm,
        "router_aux_loss_coef": float(coef),
    }


def load_config(path: Path, where: str) -> dict:
    try:
        config = json.loads(Path(path).read_bytes())
    except FileNotFoundError:
        raise BadModelError(f"{where} has no config.json") from None
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise BadModelError(
            f"{where} has a config.json that is not valid JSON; give the checkpoint's original "
            "config.json"
        ) from None
    if not isinstance(config, dict):
        raise BadModelError(f"{where}: config.json is not a JSON object")
    return config


def resolve(entry, model_dir: Path, where: str | None = None):
    """``entry`` (a custom catalog entry) as the checkpoint in ``model_dir`` makes it: its shape,
    RoPE, norms and soft-capping from config.json. Other entries come back unchanged."""
    if not entry.custom:
        return entry
    where = where or f"model at {str(model_dir)!r}"
    config = load_config(Path(model_dir) / "config.json", where)
    resolved = with_config(entry, config, where)
    repo = _hub_repository(Path(model_dir))
    return replace(resolved, hub_id=repo) if repo else resolved


def _hub_repository(model_dir: Path) -> str | None:
    """The Hub repository the model initializer fetched ``model_dir`` from (its manifest's
    ``hf://`` source), for the adapter's ``base_model_name_or_path``; None for other sources."""
    from tunepack.core.workspace import MANIFEST_FILE

    try:
        source = json.loads((model_dir / MANIFEST_FILE).read_text()).get("source")
    except (OSError, ValueError, AttributeError):
        return None
    if not isinstance(source, str) or not source.startswith("hf://"):
        return None
    repo = source.removeprefix("hf://").partition("?")[0].partition("@")[0].strip("/")
    return repo if re.fullmatch(r"[\w.-]+/[\w.-]+", repo) else None


def with_config(entry, config: dict, where: str):
    built = read_config(entry.custom, config, where)
    family = replace(
        entry.family,
        options=built.options,
        softcapping=built.softcapping,
        # Llama: untied checkpoints convert as Llama 3 (the output weight is its own).
        checkpoint_model_type=(
            "LLAMA3"
            if entry.family.checkpoint_model_type == "LLAMA3_2" and not built.shape.tied_embeddings
            else entry.family.checkpoint_model_type
        ),
    )
    resolved = replace(
        entry,
        family=family,
        shape=built.shape,
        defaults=dict(entry.defaults),
    )
    limits = (entry.defaults["max_seq_len"], built.shape.max_seq_len)
    resolved.defaults["max_seq_len"] = min((*limits, resolved.window_limit or limits[0]))
    return resolved


def special_token_ids(
    model_dir: Path, vocab_size: int, where: str, chat_format: str | None = None
) -> dict[str, int | None]:
    """BOS, EOS and padding ids of the checkpoint's tokenizer, read from its JSON files alone
    (tokenizer_config.json's token strings, looked up in tokenizer.json; else config.json's and
    generation_config.json's ids). ``BadInputError`` when tokenizer.json is missing or unreadable,
    or a token is outside the vocabulary."""
    model_dir = Path(model_dir)

    def read(name: str) -> dict:
        try:
            data = json.loads((model_dir / name).read_bytes())
        except FileNotFoundError:
            return {}
        except (json.JSONDecodeError, UnicodeDecodeError):
            raise BadModelError(f"{where} has a {name} that is not valid JSON") from None
        return data if isinstance(data, dict) else {}

    if not (model_dir / TOKENIZER_JSON).is_file():
        raise BadModelError(
            f"{where} has no {TOKENIZER_JSON}: a custom runtime encodes text with the "
            "checkpoint's own Hugging Face fast tokenizer (save it with "
            "tokenizer.save_pretrained)"
        )
    tokenizer = read(TOKENIZER_JSON)
    if not isinstance(tokenizer.get("model"), dict):
        raise BadModelError(f"{where} has a {TOKENIZER_JSON} without a tokenizer model")
    ids: dict[str, int] = {}
    vocab = tokenizer["model"].get("vocab")
    if isinstance(vocab, dict):
        ids |= {k: v for k, v in vocab.items() if isinstance(v, int)}
    elif isinstance(vocab, list):  # Unigram: [piece, score] pairs
        ids |= {p[0]: i for i, p in enumerate(vocab) if isinstance(p, list) and p}
    for added in tokenizer.get("added_tokens") or []:
        if isinstance(added, dict) and isinstance(added.get("id"), int):
            ids[added.get("content")] = added["id"]

    token_config, config = read("tokenizer_config.json"), read("config.json")
    generation = read("generation_config.json")
    found: dict[str, int | None] = {}
    for role in ("bos", "eos", "pad"):
        token = token_config.get(f"{role}_token")
        if isinstance(token, dict):
            token = token.get("content")
        value: object = None
        field = f"tokenizer_config.json {role}_token"
        if isinstance(token, str):
            if token not in ids:
                raise BadModelError(
                    f"{where}: {field}={token!r} is not a token of its {TOKENIZER_JSON}"
                )
            value = ids[token]
        else:
            for name, source in (("config.json", config), ("generation_config.json", generation)):
                raw = source.get(f"{role}_token_id")
                if isinstance(raw, list):
                    raw = raw[0] if raw else None
                if raw is not None:
                    value, field = raw, f"{name} {role}_token_id"
                    break
        if value is not None and (
            isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < vocab_size
        ):
            raise BadModelError(
                f"{where}: {field}={value!r} is not a token id of the model (0 to {vocab_size - 1})"
            )
        found[role] = value
    if found["eos"] is None:
        raise BadModelError(
            f"{where} names no end-of-sequence token: expected eos_token in "
            "tokenizer_config.json or eos_token_id in config.json"
        )
    for name in FORMAT_TOKENS.get(chat_format or "", ()):
        if name == "<bos>" and found["bos"] is None:
            raise BadModelError(
                f"{where} names no BOS token (tokenizer_config.json bos_token or config.json "
                f"bos_token_id), which the {chat_format} chat format starts with"
            )
        if name not in ("<bos>", "<eos>") and name not in ids:
            raise BadModelError(
                f"{where}: its {TOKENIZER_JSON} has no {name} token, which the {chat_format} "
                "chat format needs (the family's format is what a custom runtime trains in)"
            )
    return found
