"""Gemma 3 specifics beyond tests/integration/test_families.py: logits equal to transformers' on
a checkpoint of no catalog size whose local/global layers, RoPE bases, linear scaling, window and
query scale all differ from the defaults (each one shown to matter); the conversion exact both
ways; the text weights of an image-text checkpoint read and saved as a text-only model that
transformers loads; what the builders cannot reproduce refused in one line.
"""

from __future__ import annotations

import json

import pytest
import torch
from omegaconf import OmegaConf
from safetensors.torch import load_file
from torchtune import config as tt_config
from torchtune.training import MODEL_KEY

from tunepack.core.errors import BadModelError
from tunepack.runtimes import catalog, custom, methods
from tunepack.trainers.config import model_component
from tunepack.trainers.models.gemma3 import (
    MODEL_TYPE,
    Gemma3HFCheckpointer,
    Gemma3RoPE,
    gemma3_hf_to_tune,
    gemma3_tune_to_hf,
)

ENTRY = catalog.CUSTOM["gemma3-custom"]
LAYER_TYPES = ["sliding_attention", "full_attention", "sliding_attention", "sliding_attention",
               "full_attention", "sliding_attention", "full_attention"]  # fmt: skip
# No catalog size: 7 layers, 4 heads of 24 over a width of 80, a window of 16 tokens (the test
# sequences are 70 long), query scale 30 ** -0.5 (not head_dim's), local RoPE base 5000, global
# 50000 with linear scaling by 4.
TEXT = {
    "vocab_size": 500, "hidden_size": 80, "intermediate_size": 176, "num_hidden_layers": 7,
    "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 24,
    "max_position_embeddings": 1024, "rms_norm_eps": 1e-5, "sliding_window": 16,
    "query_pre_attn_scalar": 30, "layer_types": LAYER_TYPES,
    "rope_parameters": {
        "full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 50_000.0},
        "sliding_attention": {"rope_type": "default", "rope_theta": 5000.0},
    },
}  # fmt: skip
TOKENS = torch.randint(0, 500, (2, 70), generator=torch.Generator().manual_seed(1))


def _randomize_norms(model: torch.nn.Module) -> None:
    torch.manual_seed(0)
    with torch.no_grad():  # (1 + w) norms away from neutral, different across rotary pairs
        for name, param in model.named_parameters():
            if "norm" in name:
                param.add_(torch.randn_like(param) * 0.3)


@pytest.fixture(scope="module")
def hf_model():
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    torch.manual_seed(0)
    model = Gemma3ForCausalLM(Gemma3TextConfig(**TEXT)).eval()
    _randomize_norms(model)
    return model


def _built(config: dict) -> torch.nn.Module:
    """The model the trainer builds for a checkpoint with this config.json (custom runtime)."""
    entry = custom.with_config(ENTRY, config, "here")
    return tt_config.instantiate(
        OmegaConf.create(model_component(entry, methods.get("full")))
    ).eval()


def _diff(model, expected) -> float:
    with torch.no_grad():
        return float((model(TOKENS) - expected).abs().max())


def test_logits_equal_transformers_and_each_gemma3_feature_matters(hf_model):
    config = json.loads(hf_model.config.to_json_string())
    model = _built(config)
    model.load_state_dict(gemma3_hf_to_tune(hf_model.state_dict()), strict=True)
    with torch.no_grad():
        expected = hf_model(TOKENS).logits
    assert expected.abs().max() > 0.1
    assert _diff(model, expected) < 1e-4
    globals_ = [i for i, kind in enumerate(LAYER_TYPES) if kind == "full_attention"]
    local_rope = model.layers[0].attn.pos_embeddings
    global_rope = model.layers[globals_[0]].attn.pos_embeddings
    assert local_rope.base == 5000.0 and global_rope.base == 50_000.0
    assert global_rope.scaling == 4.0

    # Each of these changes the logits clearly, so the parity above covers it.
    for layer in model.layers:
        if layer.attn.sliding_window is not None:
            layer.attn.sliding_window = 1024
    assert _diff(model, expected) > 1e-2  # the window
    for layer in model.layers:
        if layer.attn.sliding_window is not None:
            layer.attn.sliding_window = 16
    assert _diff(model, expected) < 1e-4
    unscaled = Gemma3RoPE(24, 1024, 50_000.0)
    for i in globals_:
        model.layers[i].attn.pos_embeddings = unscaled
    assert _diff(model, expected) > 1e-2  # the linear scaling of the global layers
    for layer in model.layers:
        layer.attn.pos_embeddings = global_rope
    assert _diff(model, expected) > 1e-2  # the local layers' own base
    for i, layer in enumerate(model.layers):
        layer.attn.pos_embeddings = global_rope if i in globals_ else local_rope
    model.layers[1].attn.scaling = 24**-0.5
    assert _diff(model, expected) > 1e-2  # query_pre_attn_scalar


def test_the_hubs_older_config_layout_reads_the_same():
    """google/gemma-3-*-it's config.json: rope_theta, rope_local_base_freq, rope_scaling and
    sliding_window_pattern instead of rope_parameters and layer_types."""
    legacy = {k: v for k, v in TEXT.items() if k not in ("rope_parameters", "layer_types")}
    legacy |= {"model_type": "gemma3_text", "rope_theta": 50_000.0, "rope_local_base_freq": 5000.0,
               "rope_scaling": {"rope_type": "linear", "factor": 4.0},
               "sliding_window_pattern": 3}  # fmt: skip
    built = custom.read_config("gemma3", legacy, "here")
    assert built.options["global_layers"] == [2, 5]
    assert (built.options["rope_base"], built.options["rope_local_base"]) == (50_000.0, 5000.0)
    assert built.options["rope_scaling_factor"] == 4.0
    assert built.shape.sliding_window == 16 and built.shape.qk_norm


def test_conversion_round_trip_is_exact(hf_model):
    hf_state = {k: v for k, v in hf_model.state_dict().items() if k != "lm_head.weight"}
    tune = gemma3_hf_to_tune(hf_state)
    assert "layers.6.attn.k_norm.scale" in tune and "layers.0.mlp_scale.scale" in tune
    back = gemma3_tune_to_hf(tune)
    assert back.keys() == hf_state.keys()
    assert all(torch.equal(back[k], hf_state[k]) for k in hf_state)
    with pytest.raises(ValueError, match="model.layers.0.self_attn.q_proj.bias"):
        gemma3_hf_to_tune({"model.layers.0.self_attn.q_proj.bias": torch.zeros(1)})


@pytest.fixture(scope="module")
def image_text_checkpoint(tmp_path_factory):
    """A Gemma3ForConditionalGeneration (4B/12B/27B's class) saved by transformers."""
    from transformers import Gemma3Config, Gemma3ForConditionalGeneration

    vision = {"model_type": "siglip_vision_model", "hidden_size": 32, "intermediate_size": 64,
              "num_hidden_layers": 1, "num_attention_heads": 2, "image_size": 28,
              "patch_size": 14}  # fmt: skip
    tokens = {"image_token_index": 499, "boi_token_index": 497, "eoi_token_index": 498}
    config = Gemma3Config(text_config=TEXT, vision_config=vision, mm_tokens_per_image=4, **tokens)
    torch.manual_seed(2)
    model = Gemma3ForConditionalGeneration(config).eval()
    _randomize_norms(model)
    path = tmp_path_factory.mktemp("gemma3-it") / "checkpoint"
    model.save_pretrained(path)
    with torch.no_grad():
        logits = model(input_ids=TOKENS).logits  # text only: no image token in TOKENS
    return path, logits


def test_image_text_checkpoint_loads_as_its_text_model_and_saves_a_causal_lm(
    image_text_checkpoint, tmp_path
):
    from transformers import AutoModelForCausalLM

    path, expected = image_text_checkpoint
    keys = load_file(path / "model.safetensors").keys()
    assert any(k.startswith("language_model.model.layers.") for k in keys)
    assert any(k.startswith("vision_tower.") for k in keys)
    source = json.loads((path / "config.json").read_text())
    assert source["model_type"] == "gemma3"
    checkpointer = Gemma3HFCheckpointer(
        checkpoint_dir=str(path),
        checkpoint_files=["model.safetensors"],
        model_type=MODEL_TYPE,
        output_dir=str(tmp_path),
    )
    state = checkpointer.load_checkpoint()[MODEL_KEY]
    model = _built(source)
    model.load_state_dict(state, strict=True)
    assert _diff(model, expected) < 1e-4

    with torch.no_grad():
        for layer in model.layers:
            layer.attn.q_norm.scale.mul_(1.5)  # a change only the norms' conversion carries
            layer.mlp_scale.scale.add_(0.1)
    checkpointer.save_checkpoint({MODEL_KEY: model.state_dict()}, epoch=0)
    saved = tmp_path / "epoch_0"
    config = json.loads((saved / "config.json").read_text())
    assert config["architectures"] == ["Gemma3ForCausalLM"]
    assert config["model_type"] == "gemma3_text"
    index = json.loads((saved / "model.safetensors.index.json").read_text())
    assert not any("vision" in k or "language_model" in k for k in index["weight_map"])
    loaded = AutoModelForCausalLM.from_pretrained(saved, dtype=torch.float32).eval()
    assert type(loaded).__name__ == "Gemma3ForCausalLM"
    with torch.no_grad():
        trained = model(TOKENS)
        assert (trained - expected).abs().max() > 1e-3
        assert (loaded(TOKENS).logits - trained).abs().max() < 1e-4


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"final_logit_softcapping": 30.0}, "final_logit_softcapping=30.0"),
        ({"attn_logit_softcapping": 50.0}, "attn_logit_softcapping=50.0"),
        ({"use_bidirectional_attention": True}, "use_bidirectional_attention=True"),
        ({"rope_parameters": {"full_attention": {"rope_type": "yarn", "factor": 2.0}}},
         "rope_scaling.rope_type='yarn'"),
        ({"rope_parameters": {"sliding_attention": {"rope_type": "linear", "factor": 2.0}}},
         "rope_parameters.sliding_attention.rope_type='linear'"),
        ({"layer_types": ["full_attention"] * 3}, "layer_types=['full_attention'"),
        ({"hidden_activation": "gelu"}, "hidden_activation='gelu'"),
        ({"tie_word_embeddings": False}, "tie_word_embeddings=False"),
        ({"sliding_window": 0}, "sliding_window=0"),
        ({"query_pre_attn_scalar": -1}, "query_pre_attn_scalar=-1"),
        ({"model_type": "gemma2"}, "model_type='gemma2'"),
    ],
)  # fmt: skip
def test_what_the_builders_cannot_reproduce_is_refused_in_one_line(change, message):
    config = {"model_type": "gemma3_text", **TEXT} | change
    with pytest.raises(BadModelError) as raised:
        custom.read_config("gemma3", config, "model at 'x'")
    text = str(raised.value)
    assert message in text and "\n" not in text, text
    assert text.startswith("model at 'x': config.json has ")


def test_catalog_sizes_count_the_published_parameters():
    # The published totals less the SigLIP vision tower (about 0.4B on 4B/12B/27B).
    counts = {name: catalog.CATALOG[f"gemma3-{name}"].parameter_count / 1e9
              for name in ("1b", "4b", "12b", "27b")}  # fmt: skip
    assert 0.95 < counts["1b"] < 1.05
    assert 3.8 < counts["4b"] < 3.95
    assert 11.6 < counts["12b"] < 11.9
    assert 26.8 < counts["27b"] < 27.1
    assert catalog.CATALOG["gemma3-27b"].window_limit is None  # the window is built in


def test_the_model_initializer_checks_an_image_text_checkpoint_by_its_text_config(tmp_path):
    """Gemma 3 4B/12B/27B on the Hub are Gemma3ForConditionalGeneration: config.json's
    model_type is gemma3, the text model's fields sit in text_config. The catalog entry's check
    reads those (and still refuses a text model of another shape, naming the field)."""
    from tunepack.initializers.model import _check_config
    from tunepack.initializers.transport import uri
    from tunepack.runtimes import catalog

    entry = catalog.get("gemma3-4b")
    text = {
        "model_type": "gemma3_text",
        "hidden_size": entry.shape.embed_dim,
        "num_hidden_layers": entry.shape.num_layers,
        "num_attention_heads": entry.shape.num_heads,
        "num_key_value_heads": entry.shape.num_kv_heads,
        "intermediate_size": entry.shape.intermediate_dim,
        "vocab_size": entry.shape.vocab_size,
    }
    path = tmp_path / "config.json"
    source = uri.parse("hf://google/gemma-3-4b-it")
    path.write_text(json.dumps({"model_type": "gemma3", "text_config": text}))
    _check_config(entry, source, path)  # accepted
    path.write_text(json.dumps({"model_type": "gemma3", "text_config": {**text, "hidden_size": 8}}))
    with pytest.raises(BadModelError) as err:
        _check_config(entry, source, path)
    assert "its config.json has hidden_size=8 (expected " in str(err.value)
