"""Llama 3.2 Vision (trainers/models/mllama.py): logits equal to transformers'
MllamaForConditionalGeneration on a random checkpoint of no catalog size (irregular
cross-attention layers, Llama 3 RoPE scaling that acts on the test's length, 2-tile images with a
mix of aspect ratios, a padded tile and a padded image, non-trivial intermediate layers), with
images and text only, each difference from torchtune's own build shown to matter; the conversion
exact both ways and in both key layouts; a saved checkpoint that transformers loads; the LoRA
builder; HF inputs turned into torchtune's; what the build cannot reproduce refused in one line.
"""

from __future__ import annotations

import json
import sys

import pytest
import torch
import torchvision  # noqa: F401  Llama 3.2 Vision needs it (tunepack[vision], a dev extra)
from safetensors.torch import load_file  # noqa: E402
from torchtune.modules import TransformerCrossAttentionLayer  # noqa: E402
from torchtune.modules.peft import LoRALinear, get_adapter_params  # noqa: E402
from torchtune.training import MODEL_KEY  # noqa: E402

from tunepack.core.errors import BadModelError, UnsupportedError  # noqa: E402
from tunepack.trainers.models import mllama as mllama_module  # noqa: E402
from tunepack.trainers.models.mllama import (  # noqa: E402
    MODEL_TYPE,
    MllamaHFCheckpointer,
    lora_mllama,
    mllama,
    mllama_builder_kwargs,
    mllama_hf_to_tune,
    mllama_inputs_to_tune,
    mllama_tune_to_hf,
)

IMAGE = 500  # <|image|>: vocab_size, the first of the 8 extra embedding rows
# 7 layers, cross-attention at 2 and 4 (torchtune's fusion layers 2 and 3: not evenly spaced);
# width 80 (4 heads of 20, 2 key/value heads); Llama 3 scaling over an original context of 32
# (the test sequences are 40 long).
TEXT = {
    "vocab_size": 500, "hidden_size": 80, "intermediate_size": 144, "num_hidden_layers": 7,
    "num_attention_heads": 4, "num_key_value_heads": 2, "cross_attention_layers": [2, 4],
    "max_position_embeddings": 256, "rms_norm_eps": 1e-5,
    "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 3,
    "rope_parameters": {"rope_type": "llama3", "rope_theta": 5000.0, "factor": 4.0,
                        "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                        "original_max_position_embeddings": 32},
}  # fmt: skip
# 28-pixel tiles of 7-pixel patches: 16 patches + the class token = 17 tokens, padded to 24;
# 2 tiles at most; 3 local layers (outputs of 0 and 2 concatenated), 2 global ones; an MLP
# width that is not 4x.
VISION = {
    "hidden_size": 32, "attention_heads": 4, "intermediate_size": 48, "num_hidden_layers": 3,
    "num_global_layers": 2, "intermediate_layers_indices": [0, 2], "image_size": 28,
    "patch_size": 7, "max_num_tiles": 2, "supported_aspect_ratios": [[1, 1], [1, 2], [2, 1]],
    "vision_output_dim": 96,
}  # fmt: skip
LENGTH = 40
# Sample 0: two images, (1 down, 2 across) and (1, 1) (its second tile padding); sample 1: one
# image (2, 1) and a padded image.
ASPECT_RATIOS = [[(1, 2), (1, 1)], [(2, 1)]]


def _config(model) -> dict:
    return json.loads(model.config.to_json_string())


@pytest.fixture(scope="module")
def hf_model():
    from transformers import MllamaConfig, MllamaForConditionalGeneration

    config = MllamaConfig(text_config=TEXT, vision_config=VISION, image_token_index=IMAGE)
    torch.manual_seed(0)
    model = MllamaForConditionalGeneration(config).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "gate" in name:  # tanh gates away from 0 (transformers initialises most to 0)
                sign = torch.where(torch.rand_like(param) < 0.5, -1.0, 1.0)
                param.copy_(sign * (0.5 + torch.rand_like(param)))
            elif "norm" in name:
                param.copy_(1 + 0.3 * torch.randn_like(param))
            elif "embedding" in name:
                param.normal_(0, 0.5)
            elif param.dim() == 1:  # biases
                param.normal_(0, 0.1)
            else:  # weights of a width-independent scale (transformers' init: std 0.02)
                param.normal_(0, param.shape[-1] ** -0.5)
    return model


@pytest.fixture(scope="module")
def hf_inputs():
    from transformers.models.mllama.image_processing_mllama import (
        build_aspect_ratio_mask,
        convert_aspect_ratios_to_ids,
    )
    from transformers.models.mllama.processing_mllama import (
        convert_sparse_cross_attention_mask_to_dense,
        get_cross_attention_token_mask,
    )

    generator = torch.Generator().manual_seed(1)
    input_ids = torch.randint(4, IMAGE, (2, LENGTH), generator=generator)
    input_ids[0, 5] = input_ids[0, 20] = input_ids[1, 8] = IMAGE
    pixel_values = torch.randn(2, 2, 2, 3, 28, 28, generator=generator)
    pixel_values[0, 1, 1] = 0  # the processor's padding: a padded tile, a padded image
    pixel_values[1, 1] = 0
    # As MllamaProcessor builds them: text before an image's token sees no image.
    spans = [get_cross_attention_token_mask(row.tolist(), IMAGE) for row in input_ids]
    tiles = [[h * w for h, w in sample] for sample in ASPECT_RATIOS]
    dense = convert_sparse_cross_attention_mask_to_dense(spans, tiles, 2, LENGTH)
    return {
        "input_ids": input_ids,
        "pixel_values": pixel_values,
        "aspect_ratio_ids": convert_aspect_ratios_to_ids(ASPECT_RATIOS, 2),
        "aspect_ratio_mask": build_aspect_ratio_mask(ASPECT_RATIOS, 2),
        "cross_attention_mask": torch.tensor(dense),
    }


@pytest.fixture(scope="module")
def expected(hf_model, hf_inputs):
    with torch.no_grad():
        return hf_model(**hf_inputs).logits, hf_model(input_ids=hf_inputs["input_ids"]).logits


def _built(hf_model, *, as_transformers_524: bool = True):
    """The model built from ``hf_model``'s config and weights; by default with transformers
    5.24's intermediate features (each listed layer's output) to compare with it as it is, else
    as ``mllama()`` builds it."""
    config = _config(hf_model)
    model = mllama(**mllama_builder_kwargs(config)).eval()
    model.load_state_dict(mllama_hf_to_tune(hf_model.state_dict(), config), strict=True)
    if as_transformers_524:
        model.encoder.clip.layer_outputs = True
    return model


def _logits(model, inputs):
    with torch.no_grad():
        return model(
            inputs["tokens"],
            encoder_input=inputs["encoder_input"],
            encoder_mask=inputs["encoder_mask"],
        )


def test_logits_equal_transformers_with_images_and_text_only(hf_model, hf_inputs, expected):
    with_images, text_only = expected
    model = _built(hf_model)
    inputs = mllama_inputs_to_tune(_config(hf_model), **hf_inputs)
    assert with_images.abs().max() > 0.5
    assert (with_images - text_only).abs().max() > 0.1  # the images contribute
    diff = float((_logits(model, inputs) - with_images).abs().max())
    assert diff < 1e-4, diff
    with torch.no_grad():
        text_diff = float((model(hf_inputs["input_ids"]) - text_only).abs().max())
    assert text_diff < 1e-4, text_diff


def test_by_default_each_listed_layers_input_is_kept_as_the_reference_does(
    hf_model, hf_inputs, monkeypatch
):
    """The default build keeps layer i's input for intermediate index i (Meta's reference,
    vLLM): equal to transformers with the vision encoder that collects each layer's input, as
    huggingface/transformers#39785 wrote it."""
    from transformers.modeling_outputs import BaseModelOutput
    from transformers.models.mllama import modeling_mllama

    def collect_inputs(self, hidden_states, attention_mask=None):
        states = ()
        for layer in self.layers:
            states += (hidden_states,)
            hidden_states = layer(hidden_states=hidden_states, attention_mask=attention_mask)
        states += (hidden_states,)
        return BaseModelOutput(last_hidden_state=hidden_states, hidden_states=states)

    monkeypatch.setattr(modeling_mllama.MllamaVisionEncoder, "forward", collect_inputs)
    with torch.no_grad():
        reference = hf_model(**hf_inputs).logits
    model = _built(hf_model, as_transformers_524=False)
    inputs = mllama_inputs_to_tune(_config(hf_model), **hf_inputs)
    diff = float((_logits(model, inputs) - reference).abs().max())
    assert diff < 1e-4, diff


def test_each_difference_from_torchtunes_build_matters(hf_model, hf_inputs, expected, monkeypatch):
    """Each of these, done as torchtune 0.6.1 does it (or wired wrong), moves the logits clearly
    away from transformers', so the parity above covers it."""
    with_images, _ = expected
    model = _built(hf_model)
    inputs = mllama_inputs_to_tune(_config(hf_model), **hf_inputs)

    def diff() -> float:
        return float((_logits(model, inputs) - with_images).abs().max())

    assert diff() < 1e-4
    fusion = [
        layer.fusion_layer for layer in model.decoder.layers if hasattr(layer, "fusion_layer")
    ]
    assert len(fusion) == 2
    for gate in ("ca_scale", "mlp_scale"):  # the cross-attention gates
        saved = getattr(fusion[0], gate).scale.detach().clone()
        with torch.no_grad():
            getattr(fusion[0], gate).scale.zero_()
        assert diff() > 1e-2, gate
        with torch.no_grad():
            getattr(fusion[0], gate).scale.copy_(saved)
    clip = model.encoder.clip
    tables = {
        "pre_tile": clip.pre_tile_pos_embed.embedding.weight,
        "post_tile": clip.post_tile_pos_embed.embedding.weight,
        "token": clip.token_pos_embedding.tile_embedding.weight,
    }
    for name, target in tables.items():
        saved = target.detach().clone()
        with torch.no_grad():  # the tile embeddings of aspect ratios (1, 2) and (2, 1) swapped
            target[[2, 3]] = saved[[3, 2]]
        assert diff() > 1e-2, name
        with torch.no_grad():
            target.copy_(saved)
    assert diff() < 1e-4

    clip.layer_outputs = False  # torchtune/Meta: intermediate index i is layer i's input
    assert diff() > 1e-2
    clip.layer_outputs = True
    monkeypatch.setattr(mllama_module, "TILE_PAD", 1)  # torchtune: no padding of the tiles
    assert diff() > 1e-2
    monkeypatch.setattr(mllama_module, "TILE_PAD", 8)
    assert diff() < 1e-4
    for layer in fusion:  # torchtune: text before the first image gets no attention output
        layer.__class__ = TransformerCrossAttentionLayer
    assert diff() > 1e-2


def test_conversion_round_trip_is_exact_in_both_layouts(hf_model, tmp_path):
    config = _config(hf_model)
    state = hf_model.state_dict()
    tune = mllama_hf_to_tune(state, config)
    assert "decoder.layers.3.fusion_layer.attn.k_norm.scale" in tune
    assert "decoder.tok_embeddings.fusion_embedding.weight" in tune
    assert "encoder.clip.token_pos_embedding.tile_embedding.weight" in tune
    back = mllama_tune_to_hf(tune, config, layout="transformers")
    assert back.keys() == state.keys()
    assert all(torch.equal(back[k], state[k]) for k in state)
    hf_model.save_pretrained(tmp_path)  # the Hub's layout
    saved = load_file(tmp_path / "model.safetensors")
    assert "language_model.model.layers.2.cross_attn_attn_gate" in saved
    hub = mllama_tune_to_hf(mllama_hf_to_tune(saved, config), config)
    assert hub.keys() == saved.keys()
    assert all(torch.equal(hub[k], saved[k]) for k in saved)
    with pytest.raises(Exception, match="vision_model.transformer.layers.0.q_norm.weight"):
        mllama_hf_to_tune(
            {"vision_model.transformer.layers.0.q_norm.weight": torch.ones(1)}, config
        )


def test_checkpointer_saves_what_transformers_loads(hf_model, hf_inputs, expected, tmp_path):
    from transformers import MllamaForConditionalGeneration

    source = tmp_path / "source"
    hf_model.save_pretrained(source)
    checkpointer = MllamaHFCheckpointer(
        checkpoint_dir=str(source),
        checkpoint_files=["model.safetensors"],
        model_type=MODEL_TYPE,
        output_dir=str(tmp_path / "out"),
    )
    config = _config(hf_model)
    model = mllama(**mllama_builder_kwargs(config)).eval()
    model.load_state_dict(checkpointer.load_checkpoint()[MODEL_KEY], strict=True)
    model.encoder.clip.layer_outputs = True  # compared with transformers 5.24 as it is
    inputs = mllama_inputs_to_tune(config, **hf_inputs)
    assert float((_logits(model, inputs) - expected[0]).abs().max()) < 1e-4

    with torch.no_grad():  # a change in every part: text, fusion, tower, projector
        model.decoder.layers[3].fusion_layer.attn.q_norm.scale.mul_(1.5)
        model.decoder.layers[0].attn.q_proj.weight.add_(0.05)
        model.encoder.clip.pre_tile_pos_embed.gate.add_(0.3)
        model.encoder.projection.output.bias.add_(0.1)
    checkpointer.save_checkpoint({MODEL_KEY: model.state_dict()}, epoch=0)
    saved = tmp_path / "out" / "epoch_0"
    index = json.loads((saved / "model.safetensors.index.json").read_text())
    assert "language_model.lm_head.weight" in index["weight_map"]
    loaded = MllamaForConditionalGeneration.from_pretrained(saved, dtype=torch.float32).eval()
    with torch.no_grad():
        trained = _logits(model, inputs)
        assert (trained - expected[0]).abs().max() > 1e-2
        assert (loaded(**hf_inputs).logits - trained).abs().max() < 1e-4


def test_lora_builder_adapts_the_text_model_and_the_projector(hf_model, hf_inputs, expected):
    config = _config(hf_model)
    model = lora_mllama(
        ["q_proj", "v_proj", "output_proj"],
        apply_lora_to_mlp=True,
        apply_lora_to_output=True,
        apply_lora_to_projection=True,
        lora_rank=4,
        lora_alpha=8,
        **mllama_builder_kwargs(config),
    ).eval()
    missing, unexpected = model.load_state_dict(mllama_hf_to_tune(hf_model.state_dict(), config),
                                                strict=False)  # fmt: skip
    assert not unexpected and all("lora_" in k for k in missing)
    adapters = get_adapter_params(model)
    assert any(k.startswith("decoder.layers.2.fusion_layer.attn.q_proj.") for k in adapters)
    assert any(k.startswith("decoder.layers.0.mlp.w1.") for k in adapters)
    assert isinstance(model.encoder.projection.output, LoRALinear)
    assert not any(k.startswith("encoder.clip.") for k in adapters)
    model.encoder.clip.layer_outputs = True  # compared with transformers 5.24 as it is
    inputs = mllama_inputs_to_tune(config, **hf_inputs)
    # LoRA's B starts at zero: the adapted model computes the base model.
    assert float((_logits(model, inputs) - expected[0]).abs().max()) < 1e-4


def test_hf_inputs_become_torchtunes(hf_model, hf_inputs):
    config = _config(hf_model)
    inputs = mllama_inputs_to_tune(config, **hf_inputs)
    assert inputs["encoder_input"]["aspect_ratio"].tolist() == [[[1, 2], [1, 1]], [[2, 1], [0, 0]]]
    mask = inputs["encoder_mask"]
    assert mask.shape == (2, LENGTH, 2 * 2 * 17) and mask.dtype == torch.bool
    assert not mask[0, :5].any() and mask[0, 5, : 2 * 17].all() and not mask[0, 5, 2 * 17 :].any()
    assert mask[0, 5:20, : 2 * 17].all() and not mask[0, 20:, : 2 * 17].any()
    assert mask[0, 20:, 2 * 17 : 3 * 17].all() and not mask[0, :, 3 * 17 :].any()  # a padded tile
    assert mask[1, 8:, : 2 * 17].all() and not mask[1, :, 2 * 17 :].any()
    encoder = _built(hf_model).encoder  # and back: transformers' ids and tile mask
    ids, tiles = encoder.ids_and_tile_mask(inputs["encoder_input"]["aspect_ratio"], 2)
    assert ids.tolist() == hf_inputs["aspect_ratio_ids"].flatten().tolist()
    assert torch.equal(tiles, hf_inputs["aspect_ratio_mask"].flatten(0, 1).bool())
    assert mllama_inputs_to_tune(config, input_ids=hf_inputs["input_ids"])["encoder_input"] is None
    wrong = hf_inputs["aspect_ratio_mask"].clone()
    wrong[0, 0, 1] = 0
    with pytest.raises(ValueError, match="aspect_ratio_mask"):
        mllama_inputs_to_tune(config, **(hf_inputs | {"aspect_ratio_mask": wrong}))


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"model_type": "llama"}, "model_type='llama'"),
        ({"text_config": {"rope_parameters": {"rope_type": "yarn", "factor": 2.0}}},
         "text_config.rope_scaling.rope_type='yarn'"),
        ({"text_config": {"cross_attention_layers": [2, 3]}},
         "text_config.cross_attention_layers=[2, 3]"),
        ({"text_config": {"cross_attention_layers": [6]}},
         "text_config.cross_attention_layers=[6]"),
        ({"text_config": {"hidden_act": "gelu"}}, "text_config.hidden_act='gelu'"),
        ({"text_config": {"tie_word_embeddings": True}}, "text_config.tie_word_embeddings=True"),
        ({"vision_config": {"hidden_act": "quick_gelu"}}, "vision_config.hidden_act='quick_gelu'"),
        ({"vision_config": {"vision_output_dim": 64}}, "vision_config.vision_output_dim=64"),
        ({"vision_config": {"supported_aspect_ratios": [[1, 3]]}},
         "vision_config.supported_aspect_ratios=[[1, 3]]"),
        ({"vision_config": {"intermediate_layers_indices": [3]}},
         "vision_config.intermediate_layers_indices=[3]"),
        ({"vision_config": {"image_size": [28, 56]}}, "vision_config.image_size=[28, 56]"),
        ({"image_token_index": 600}, "image_token_index=600"),
    ],
)  # fmt: skip
def test_what_the_build_cannot_reproduce_is_refused_in_one_line(hf_model, change, message):
    config = _config(hf_model)
    for part in ("text_config", "vision_config"):
        config[part] = config[part] | change.pop(part, {})
    config |= change
    with pytest.raises(BadModelError) as raised:
        mllama_builder_kwargs(config, "model at 'x'")
    text = str(raised.value)
    assert message in text and "\n" not in text, text
    assert text.startswith("model at 'x': config.json has ")


def test_the_hubs_config_layout_reads_the_same(hf_model):
    """meta-llama/Llama-3.2-11B-Vision's config.json: rope_theta and rope_scaling, not
    rope_parameters."""
    config = _config(hf_model)
    text = {k: v for k, v in config["text_config"].items() if k != "rope_parameters"}
    text |= {"rope_theta": 5000.0, "rope_scaling": {"rope_type": "llama3", "factor": 4.0,
             "low_freq_factor": 1.0, "high_freq_factor": 4.0,
             "original_max_position_embeddings": 32}}  # fmt: skip
    assert mllama_builder_kwargs(config | {"text_config": text}) == mllama_builder_kwargs(config)


def test_without_torchvision_only_the_conversion_is_refused(hf_model, monkeypatch):
    """The module imports torchtune's vision packages (which import torchvision) only inside
    the conversion: its top-level imports name none of them, and without torchvision the
    conversion is refused in one line naming the extra."""
    import ast
    import inspect

    tree = ast.parse(inspect.getsource(mllama_module))
    top = [n.module if isinstance(n, ast.ImportFrom) else n.names[0].name
           for n in tree.body if isinstance(n, ast.Import | ast.ImportFrom)]  # fmt: skip
    assert "torchtune.modules.model_fusion" in top
    assert not [m for m in top if "vision" in m or "clip" in m], top
    monkeypatch.setitem(sys.modules, "torchvision", None)
    with pytest.raises(UnsupportedError) as raised:
        mllama_hf_to_tune(hf_model.state_dict(), _config(hf_model))
    assert str(raised.value) == (
        "Llama 3.2 Vision needs torchvision, which torchtune's vision modules import: install "
        "tunepack[vision] (pip install 'tunepack[vision]')"
    )
