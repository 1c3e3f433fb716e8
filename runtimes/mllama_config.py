"""Llama 3.2 Vision's config.json read into the builder's arguments (``trainers/models/mllama.py``),
without torch: the model initializer refuses, before any weight moves, a checkpoint the build
cannot reproduce, in one line naming the field and its value, as the trainer would.
"""

from __future__ import annotations

from tunepack.core.errors import BadModelError
from tunepack.runtimes.custom import _fail, _positive_int, _positive_number, _rope

# transformers' MllamaTextModel: vocab_size + 8 embedding rows (<|image|> and 7 reserved).
NUM_SPECIAL_TOKENS = 8


def fusion_positions(num_layers: int, cross_attention_layers) -> dict[int, int]:
    """transformers' layer index -> torchtune's: each self-attention layer in order, and each
    cross-attention layer to the self-attention layer after it (whose fusion part it is)."""
    cross = {int(i) for i in cross_attention_layers}
    positions, self_index = {}, 0
    for index in range(num_layers):
        if index in cross:
            if index + 1 >= num_layers or index + 1 in cross:
                raise ValueError(
                    f"cross-attention layer {index} is not followed by a self-attention layer"
                )
            positions[index] = self_index
        else:
            positions[index] = self_index
            self_index += 1
    return positions


# --- config.json --------------------------------------------------------------------------------


def _index_list(where: str, config: dict, field: str, limit: int) -> list[int]:
    value = config.get(field)
    if not isinstance(value, list) or not all(
        isinstance(i, int) and not isinstance(i, bool) and 0 <= i < limit for i in value
    ):
        raise _fail(where, field, value, f"a list of layer indices below {limit}")
    return list(value)


def _text_kwargs(where: str, text: dict) -> dict:
    """The text model's builder arguments from ``text_config``, its fields checked in this order
    (the first one wrong is the one reported)."""
    dims, kv_heads = _text_shape(where, text)
    heads, width = dims["num_attention_heads"], dims["hidden_size"]
    layers = dims["num_hidden_layers"]
    cross = _cross_attention_layers(where, text, layers)
    dropout = text.get("dropout", 0.0)
    if isinstance(dropout, bool) or not isinstance(dropout, int | float) or not 0 <= dropout < 1:
        raise _fail(where, "text_config.dropout", dropout, "a number in [0, 1)")
    kwargs = _text_rope(where, text)
    return kwargs | {
        "vocab_size": dims["vocab_size"],
        "num_layers": layers,
        "cross_attention_layers": sorted(cross),
        "num_heads": heads,
        "num_kv_heads": kv_heads,
        "embed_dim": width,
        "intermediate_dim": dims["intermediate_size"],
        "max_seq_len": dims["max_position_embeddings"],
        "norm_eps": _positive_number(
            where,
            {"text_config.rms_norm_eps": text.get("rms_norm_eps", 1e-5)},
            "text_config.rms_norm_eps",
        ),  # fmt: skip
        "attn_dropout": float(dropout),
    }


def _text_shape(where: str, text: dict) -> tuple[dict, int]:
    """The text model's sizes (by config field) and its key/value heads; its activation, tied
    embeddings and biases as the build has them."""
    model_type = text.get("model_type", "mllama_text_model")
    if model_type != "mllama_text_model":
        raise _fail(where, "text_config.model_type", model_type, "'mllama_text_model'")
    named = {f"text_config.{k}": v for k, v in text.items()}
    dims = {
        f: _positive_int(where, named, f"text_config.{f}")
        for f in (
            "vocab_size",
            "hidden_size",
            "num_hidden_layers",
            "num_attention_heads",
            "intermediate_size",
            "max_position_embeddings",
        )
    }
    heads, width = dims["num_attention_heads"], dims["hidden_size"]
    kv_heads = text.get("num_key_value_heads")
    if kv_heads is not None:
        kv_heads = _positive_int(where, named, "text_config.num_key_value_heads")
    kv_heads = kv_heads or heads
    if heads % kv_heads:
        raise _fail(where, "text_config.num_key_value_heads", kv_heads,
                    f"a divisor of num_attention_heads ({heads})")  # fmt: skip
    if width % heads or (width // heads) % 2:
        raise _fail(where, "text_config.hidden_size", width,
                    f"an even head width times num_attention_heads ({heads})")  # fmt: skip
    if text.get("head_dim") not in (None, width // heads):
        raise _fail(where, "text_config.head_dim", text["head_dim"],
                    f"hidden_size // num_attention_heads ({width // heads})")  # fmt: skip
    if text.get("hidden_act", "silu") != "silu":
        raise _fail(where, "text_config.hidden_act", text["hidden_act"], "'silu'")
    if text.get("tie_word_embeddings", False) is not False:
        raise _fail(where, "text_config.tie_word_embeddings", text["tie_word_embeddings"],
                    "false (output: vocab_size rows, embeddings: vocab_size + 8)")  # fmt: skip
    for field in ("attention_bias", "mlp_bias"):
        if text.get(field) not in (None, False):
            raise _fail(where, f"text_config.{field}", text[field], "false")
    return dims, kv_heads


def _cross_attention_layers(where: str, text: dict, layers: int) -> list[int]:
    cross = text.get("cross_attention_layers")
    cross = _index_list(where, {"text_config.cross_attention_layers": cross},
                        "text_config.cross_attention_layers", layers)  # fmt: skip
    try:
        fusion_positions(layers, cross)
    except ValueError as err:
        raise _fail(where, "text_config.cross_attention_layers", cross,
                    f"each followed by a self-attention layer ({err})") from None  # fmt: skip
    if len(set(cross)) != len(cross):
        raise _fail(where, "text_config.cross_attention_layers", cross, "distinct indices")
    return cross


def _text_rope(where: str, text: dict) -> dict:
    """The builder's RoPE arguments: Llama 3's scaling, or none."""
    rope, scaling = _rope(text)
    theta = rope.get("rope_theta", 500_000.0)
    kwargs = {
        "rope_base": _positive_number(where, {"rope_theta": theta}, "rope_theta"),
        "rope_scale_factor": 1.0,  # Llama 3 scaling by 1 is plain RoPE
        "rope_low_freq_factor": 1.0,
        "rope_high_freq_factor": 4.0,
        "rope_old_context_len": 8192,
    }
    if scaling is not None:
        if scaling.get("rope_type") != "llama3":
            raise _fail(where, "text_config.rope_scaling.rope_type", scaling.get("rope_type"),
                        "none, 'default' or 'llama3'")  # fmt: skip
        scaled = {f"text_config.rope_scaling.{k}": v for k, v in scaling.items()}
        for field, key in (("factor", "rope_scale_factor"),
                           ("low_freq_factor", "rope_low_freq_factor"),
                           ("high_freq_factor", "rope_high_freq_factor")):  # fmt: skip
            kwargs[key] = _positive_number(where, scaled, f"text_config.rope_scaling.{field}")
        kwargs["rope_old_context_len"] = _positive_int(
            where, scaled, "text_config.rope_scaling.original_max_position_embeddings"
        )
        if kwargs["rope_high_freq_factor"] <= kwargs["rope_low_freq_factor"]:
            raise _fail(where, "text_config.rope_scaling.high_freq_factor",
                        kwargs["rope_high_freq_factor"], "above low_freq_factor")  # fmt: skip
    partial_rotary = rope.get("partial_rotary_factor", 1.0)
    if partial_rotary != 1.0:
        raise _fail(where, "text_config.partial_rotary_factor", partial_rotary, "1.0")
    return kwargs


def _square(where: str, vision: dict, field: str) -> int:
    value = vision.get(field)
    if isinstance(value, list | tuple) and len(value) == 2 and value[0] == value[1]:
        value = value[0]
    return _positive_int(where, {f"vision_config.{field}": value}, f"vision_config.{field}")


def _vision_kwargs(where: str, vision: dict) -> dict:
    model_type = vision.get("model_type", "mllama_vision_model")
    if model_type != "mllama_vision_model":
        raise _fail(where, "vision_config.model_type", model_type, "'mllama_vision_model'")
    if vision.get("hidden_act", "gelu") != "gelu":
        raise _fail(where, "vision_config.hidden_act", vision["hidden_act"], "'gelu'")
    named = {f"vision_config.{k}": v for k, v in vision.items()}

    def number(field):
        return _positive_int(where, named, f"vision_config.{field}")

    width = number("hidden_size")
    heads = number("attention_heads")
    if width % heads:
        raise _fail(where, "vision_config.hidden_size", width,
                    f"a multiple of attention_heads ({heads})")  # fmt: skip
    layers = number("num_hidden_layers")
    tiles = number("max_num_tiles")
    ratios = vision.get("supported_aspect_ratios")
    if (
        not isinstance(ratios, list)
        or not ratios
        or not all(
            isinstance(r, list | tuple)
            and len(r) == 2
            and all(isinstance(n, int) and not isinstance(n, bool) and n > 0 for n in r)
            and r[0] * r[1] <= tiles
            for r in ratios
        )
        or len({tuple(r) for r in ratios}) != len(ratios)
    ):
        raise _fail(where, "vision_config.supported_aspect_ratios", ratios,
                    f"distinct [down, across] tile counts of at most {tiles} tiles")  # fmt: skip
    indices = _index_list(where, named, "vision_config.intermediate_layers_indices", layers)
    output_dim = number("vision_output_dim")
    if output_dim != width * (len(indices) + 1):
        raise _fail(where, "vision_config.vision_output_dim", output_dim,
                    f"hidden_size * (len(intermediate_layers_indices) + 1) = "
                    f"{width * (len(indices) + 1)}")  # fmt: skip
    image, patch = _square(where, vision, "image_size"), _square(where, vision, "patch_size")
    if patch > image:
        raise _fail(where, "vision_config.patch_size", patch, f"at most image_size ({image})")
    eps = vision.get("norm_eps", 1e-5)
    return {
        "patch_size": patch,
        "tile_size": image,
        "vision_embed_dim": width,
        "vision_num_heads": heads,
        "vision_intermediate_dim": number("intermediate_size"),
        "vision_num_layers": layers,
        "vision_num_global_layers": number("num_global_layers"),
        "intermediate_layers": indices,
        "max_num_tiles": tiles,
        "supported_aspect_ratios": [list(r) for r in ratios],
        "in_channels": number("num_channels") if "num_channels" in vision else 3,
        "vision_norm_eps": _positive_number(
            where, {"vision_config.norm_eps": eps}, "vision_config.norm_eps"
        ),  # fmt: skip
    }


def mllama_builder_kwargs(config: dict, where: str = "model") -> dict:
    """``mllama``'s arguments from a ``MllamaForConditionalGeneration`` config.json (either
    layout of its RoPE fields); ``BadInputError`` in one line naming the field and value of
    anything the build cannot reproduce."""
    if not isinstance(config, dict):
        raise BadModelError(f"{where}: config.json is not a JSON object")
    if config.get("model_type") != "mllama":
        raise _fail(where, "model_type", config.get("model_type"), "'mllama'")
    for field in ("text_config", "vision_config"):
        if not isinstance(config.get(field), dict):
            raise _fail(where, field, config.get(field), "a JSON object")
    if config.get("tie_word_embeddings") not in (None, False):
        raise _fail(where, "tie_word_embeddings", config["tie_word_embeddings"], "false")
    kwargs = _text_kwargs(where, config["text_config"])
    kwargs |= _vision_kwargs(where, config["vision_config"])
    image = config.get("image_token_index", 128_256)
    rows = kwargs["vocab_size"] + NUM_SPECIAL_TOKENS
    if isinstance(image, bool) or not isinstance(image, int) or not 0 <= image < rows:
        raise _fail(where, "image_token_index", image, f"a token id below vocab_size + 8 ({rows})")
    return kwargs
