"""The catalog agrees with torchtune: each entry builds (as the trainer builds it) its model."""

from __future__ import annotations

import importlib
import inspect
import json

import pytest
import torch
from omegaconf import OmegaConf
from torchtune import config

from tunepack.core.errors import BadModelError
from tunepack.runtimes import catalog, methods
from tunepack.trainers.config import model_component
from tunepack.trainers.models.builders import Gemma2Layer, SoftCappedTiedLinear

PUBLISHED = list(catalog.CATALOG.values())
TINY = list(catalog.TINY.values())
EVERY = {entry.name: entry for entry in (*PUBLISHED, *TINY)}.values()
# The text decoders the catalog's Shape describes whole; a model that reads images is built from
# its config.json (test_vision_sizes_build_from_their_config below).
TEXT = [entry for entry in EVERY if not entry.family.reads_images]
VISION = [entry for entry in PUBLISHED if entry.family.reads_images]


def _instantiate(entry: catalog.ModelEntry, method: str, **kwargs) -> torch.nn.Module:
    """The model the trainer builds for ``method``, on the meta device.

    The meta device allocates nothing, so even 405B builds in a fraction of a second.
    """
    with torch.device("meta"):
        return config.instantiate(
            OmegaConf.create({**model_component(entry, methods.get(method)), **kwargs})
        )


@pytest.mark.parametrize("entry", TEXT, ids=lambda e: e.name)
def test_parameter_count_is_torchtunes(entry):
    model = _instantiate(entry, "full")
    assert sum(p.numel() for p in model.parameters()) == entry.parameter_count
    assert model.max_seq_len == entry.shape.max_seq_len
    assert model.tok_embeddings.num_embeddings == entry.shape.vocab_size
    assert model.head_dim == entry.shape.head_dim
    attn = model.layers[0].attn
    assert (attn.num_heads, attn.num_kv_heads) == (entry.shape.num_heads, entry.shape.num_kv_heads)
    assert (attn.q_proj.bias is not None) == entry.shape.qkv_bias


@pytest.mark.parametrize("entry", TEXT, ids=lambda e: e.name)
def test_lora_builder_takes_the_shape_and_lora_settings(entry):
    lora = {"lora_attn_modules": ["q_proj", "v_proj"], "apply_lora_to_mlp": True}
    module, function = entry.builders["lora"].rsplit(".", 1)
    signature = inspect.signature(getattr(importlib.import_module(module), function))
    assert ("apply_lora_to_output" in signature.parameters) == entry.lora_output
    if entry.lora_output:
        lora["apply_lora_to_output"] = False
    model = _instantiate(entry, "lora", **lora, lora_rank=4, lora_alpha=8)
    adapters = [name for name, _ in model.named_parameters() if "lora_" in name]
    # q and v, A and B each, in every layer; a dense MLP's three projections, A and B each; a
    # mixture of experts' fused gate/up and down adapters, A and B each, stacked over experts.
    sparse = entry.shape.sparse_layers
    expected = entry.shape.num_layers * 4 + (entry.shape.num_layers - sparse) * 6 + sparse * 4
    assert len(adapters) == expected
    if sparse == entry.shape.num_layers:  # every MLP a mixture of experts: opt-in (most params)
        assert entry.defaults["lora_mlp"] is False


def test_every_family_has_published_sizes_and_a_tiny_variant():
    families = {entry.family.name for entry in PUBLISHED}
    assert families == set(catalog.FAMILIES) == set(catalog.TINY) | set(catalog.TINY_VISION)
    for name, tiny in (catalog.TINY | catalog.TINY_VISION).items():
        assert tiny.family.name == name and tiny.shape_kwargs
        assert tiny.builders == tiny.family.component_builders
    # Only the quickstart's tiny model is a published runtime.
    assert [e.name for e in PUBLISHED if e.name.startswith("tiny-")] == ["tiny-llama3"]


@pytest.mark.parametrize("entry", PUBLISHED, ids=lambda e: e.name)
def test_published_entries_are_consistent(entry):
    assert entry.runtime_name == f"tunepack-{entry.name}"
    assert entry.hub_id.count("/") == 1 or entry.custom  # custom: the user's checkpoint
    assert entry.defaults["max_seq_len"] <= min(entry.shape.max_seq_len, entry.window_limit or 1e9)
    # torchtune's package of the family, or the module where tunepack builds a family torchtune
    # lacks (Qwen 3) beside its component builders.
    own = entry.family.component_builders["full"].rsplit(".", 1)[0] + "."
    for builder in entry.builders.values():
        assert builder.startswith((f"torchtune.models.{entry.family.name}.", own))
    if entry.name != "tiny-llama3":
        assert entry.resources.gpus >= 1
    files = entry.required_files()
    assert files[0] == "config.json" and len(set(files)) == len(files)


def test_multi_node_only_where_one_node_cannot_hold_the_model():
    nodes = {entry.name: entry.resources.nodes for entry in PUBLISHED if entry.resources.nodes > 1}
    assert nodes == {"llama3.1-405b": 2}


def test_sharded_checkpoint_is_read_from_its_index(tmp_path):
    entry = catalog.get("llama2-7b")
    assert entry.checkpoint_files == (catalog.SAFETENSORS_INDEX,)
    index = {"metadata": {}, "weight_map": {"a": "model-2.safetensors", "b": "model-1.safetensors"}}
    index["weight_map"]["c"] = "model-1.safetensors"
    (tmp_path / catalog.SAFETENSORS_INDEX).write_text(json.dumps(index))
    assert entry.weight_files(tmp_path) == ("model-1.safetensors", "model-2.safetensors")
    listed = catalog.get("llama3.1-8b")
    assert listed.weight_files(tmp_path) == listed.checkpoint_files  # the index is not read


@pytest.mark.parametrize(
    ("content", "line"),
    [
        ("not json", "cannot read the shard list of llama2-7b from {index} (Expecting value: line "
         "1 column 1 (char 0)); it must be the {hf}, with a weight_map of tensor -> file"),
        ("{}", "cannot read the shard list of llama2-7b from {index} ('weight_map'); it must be "
         "the {hf}, with a weight_map of tensor -> file"),
        ('{"weight_map": {}}',
         "{index} names no usable shard files ([]); replace it with the {hf}"),
        ('{"weight_map": {"a": "../x"}}',
         "{index} names no usable shard files (['../x']); replace it with the {hf}"),
    ],
)  # fmt: skip
def test_bad_index_is_named_with_a_hint(tmp_path, content, line):
    index = tmp_path / catalog.SAFETENSORS_INDEX
    index.write_text(content)
    with pytest.raises(BadModelError) as err:
        catalog.get("llama2-7b").weight_files(tmp_path)
    hf = "model.safetensors.index.json of meta-llama/Llama-2-7b-chat-hf"
    assert str(err.value) == line.format(index=index, hf=hf)


@pytest.mark.parametrize("entry", TEXT, ids=lambda e: e.name)
@pytest.mark.parametrize("method", ["full", "lora"])
def test_the_trainers_model_has_the_checkpoints_rope_and_soft_capping(entry, method):
    """Where torchtune's builders differ from the HF model (Code Llama's and Phi-4's RoPE base,
    Gemma 2's norms and capping), the model the trainer builds must not. The tiny models prove
    the corrections against transformers (test_families.py); this covers every published size,
    whose named builders the tiny models do not use."""
    lora = {"lora_attn_modules": ["q_proj"], "lora_rank": 4, "lora_alpha": 8}
    lora = lora if method == "lora" else {}
    model = _instantiate(entry, method, **lora)
    bases = {float(layer.attn.pos_embeddings.base) for layer in model.layers}
    expected = {entry.family.options["rope_base"]}
    if "rope_local_base" in entry.family.options:  # Gemma 3: local layers have their own base
        expected.add(entry.family.options["rope_local_base"])
    assert bases == expected
    if entry.family.softcapping:
        attention_cap, final_cap = entry.family.softcapping
        assert all(type(layer) is Gemma2Layer for layer in model.layers)
        assert {layer.attn.softcapping for layer in model.layers} == {attention_cap}
        assert isinstance(model.output, SoftCappedTiedLinear) and model.output.cap == final_cap
        assert isinstance(model.norm.logit_capping, torch.nn.Identity)
        windows = [layer.attn.sliding_window_size for layer in model.layers]
        assert windows[::2] == [entry.shape.sliding_window] * len(windows[::2])
        assert set(windows[1::2]) == {None}
    else:
        assert {type(layer).__name__ for layer in model.layers} == {"TransformerSelfAttentionLayer"}


def test_phi4_needs_the_rope_correction():
    """torchtune 0.6.1's phi4_14b builds RoPE base 10000; microsoft/phi-4 uses 250000."""
    from torchtune.models.phi4 import phi4_14b

    with torch.device("meta"):
        stock = phi4_14b()
    assert stock.layers[0].attn.pos_embeddings.base == 10_000
    assert catalog.get("phi4-14b").family.options["rope_base"] == 250_000


def test_models_doc_is_generated_from_the_catalog():
    from tunepack.runtimes import models_doc

    assert models_doc.DOC.read_text(encoding="utf-8") == models_doc.render(), (
        "docs/models.md does not match runtimes/catalog.py; run "
        "`python -m tunepack.runtimes.models_doc`"
    )
    assert all(f"`{entry.runtime_name}`" in models_doc.render() for entry in PUBLISHED)


def _vision_config(entry: catalog.ModelEntry) -> dict:
    """The published config.json's fields the build reads, from the catalog's shape and the
    vision tower every size shares (runtimes/catalog.py, _mllama_entry)."""
    s = entry.shape
    cross = list(range(3, s.num_layers, 5))
    return {
        "model_type": "mllama",
        "image_token_index": s.vocab_size,
        "text_config": {
            "model_type": "mllama_text_model", "vocab_size": s.vocab_size,
            "hidden_size": s.embed_dim, "intermediate_size": s.intermediate_dim,
            "num_hidden_layers": s.num_layers, "num_attention_heads": s.num_heads,
            "num_key_value_heads": s.num_kv_heads, "cross_attention_layers": cross,
            "max_position_embeddings": s.max_seq_len, "rms_norm_eps": 1e-5,
            "rope_theta": 500000.0,
            "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                             "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
        },
        "vision_config": {
            "hidden_size": 1280, "attention_heads": 16, "intermediate_size": 5120,
            "num_hidden_layers": 32, "num_global_layers": 8,
            "intermediate_layers_indices": [3, 7, 15, 23, 30], "image_size": 560,
            "patch_size": 14, "max_num_tiles": 4, "vision_output_dim": 7680, "norm_eps": 1e-5,
            "supported_aspect_ratios": [[1, 1], [1, 2], [1, 3], [1, 4], [2, 1], [2, 2], [3, 1],
                                        [4, 1]],
        },
    }  # fmt: skip


@pytest.mark.parametrize("entry", VISION, ids=lambda e: e.name)
def test_vision_sizes_build_from_their_config(entry, tmp_path):
    """Llama 3.2 Vision is built from the checkpoint's config.json: the published shape builds,
    with the parameter count the catalog plans with (its vision tower estimated within 1%), and
    full fine-tuning trains every weight."""
    (tmp_path / "config.json").write_text(json.dumps(_vision_config(entry)))
    node = model_component(entry, methods.get("full"), tmp_path)
    assert node["decoder_trainable"] and node["encoder_trainable"]
    with torch.device("meta"):
        model = config.instantiate(OmegaConf.create(node))
    count = sum(p.numel() for p in model.parameters())
    assert abs(count - entry.parameter_count) / count < 0.01, (count, entry.parameter_count)
    assert all(p.requires_grad for p in model.parameters())
    assert entry.methods == ("full", "lora", "qlora", "dora")
    with pytest.raises(ValueError, match="config.json"):
        model_component(entry, methods.get("full"))
