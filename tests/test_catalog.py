"""The catalog agrees with torchtune: every entry's builders build a model of the stated shape."""

from __future__ import annotations

import importlib
import inspect
import json

import pytest
import torch
from omegaconf import OmegaConf
from torchtune import config

from tunepack.errors import BadInputError
from tunepack.runtimes import catalog

PUBLISHED = list(catalog.CATALOG.values())
TINY = list(catalog.TINY.values())
EVERY = {entry.name: entry for entry in (*PUBLISHED, *TINY)}.values()


def _instantiate(component: str, **kwargs) -> torch.nn.Module:
    # The meta device allocates nothing, so even 405B builds in a fraction of a second.
    with torch.device("meta"):
        return config.instantiate(OmegaConf.create({"_component_": component, **kwargs}))


@pytest.mark.parametrize("entry", EVERY, ids=lambda e: e.name)
def test_parameter_count_is_torchtunes(entry):
    model = _instantiate(entry.builders["full"], **entry.builder_kwargs())
    assert sum(p.numel() for p in model.parameters()) == entry.parameter_count
    assert model.max_seq_len == entry.shape.max_seq_len
    assert model.tok_embeddings.num_embeddings == entry.shape.vocab_size
    assert model.head_dim == entry.shape.head_dim
    attn = model.layers[0].attn
    assert (attn.num_heads, attn.num_kv_heads) == (entry.shape.num_heads, entry.shape.num_kv_heads)
    assert (attn.q_proj.bias is not None) == entry.shape.qkv_bias


@pytest.mark.parametrize("entry", EVERY, ids=lambda e: e.name)
def test_lora_builder_takes_the_shape_and_lora_settings(entry):
    lora = {"lora_attn_modules": ["q_proj", "v_proj"], "apply_lora_to_mlp": True}
    module, function = entry.builders["lora"].rsplit(".", 1)
    signature = inspect.signature(getattr(importlib.import_module(module), function))
    assert ("apply_lora_to_output" in signature.parameters) == entry.lora_output
    if entry.lora_output:
        lora["apply_lora_to_output"] = False
    model = _instantiate(
        entry.builders["lora"], **entry.builder_kwargs("lora"), **lora, lora_rank=4, lora_alpha=8
    )
    adapters = [name for name, _ in model.named_parameters() if "lora_" in name]
    # q, v and the three MLP projections, A and B each, in every layer.
    assert len(adapters) == entry.shape.num_layers * 5 * 2


def test_every_family_has_published_sizes_and_a_tiny_variant():
    families = {entry.family.name for entry in PUBLISHED}
    assert families == set(catalog.FAMILIES) == set(catalog.TINY)
    for name, tiny in catalog.TINY.items():
        assert tiny.family.name == name and tiny.shape_kwargs
        assert tiny.builders == tiny.family.component_builders
    # Only the quickstart's tiny model is a published runtime.
    assert [e.name for e in PUBLISHED if e.name.startswith("tiny-")] == ["tiny-llama3"]


@pytest.mark.parametrize("entry", PUBLISHED, ids=lambda e: e.name)
def test_published_entries_are_consistent(entry):
    assert entry.runtime_name == f"tunepack-{entry.name}"
    assert entry.hub_id.count("/") == 1
    assert entry.defaults["max_seq_len"] <= entry.shape.max_seq_len
    for builder in entry.builders.values():
        assert builder.startswith(f"torchtune.models.{entry.family.name}.")
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
    "content", ["not json", "{}", '{"weight_map": {}}', '{"weight_map": {"a": "../x"}}']
)
def test_bad_index_is_named_with_a_hint(tmp_path, content):
    (tmp_path / catalog.SAFETENSORS_INDEX).write_text(content)
    with pytest.raises(BadInputError, match=r"model\.safetensors\.index\.json.*Llama-2-7b-chat"):
        catalog.get("llama2-7b").weight_files(tmp_path)


def test_a_family_with_a_known_defect_is_refused_before_anything_runs(tmp_path):
    """Gemma 2's torchtune conversion differs from HF (see test_families.py): never train it."""
    from tests.helpers import run_program
    from tunepack.errors import EXIT_BAD_INPUT, BadInputError
    from tunepack.runtimes.generate import build_runtime
    from tunepack.trainjob import build_trainjob

    gemma2 = catalog.get("tunepack-gemma2-9b")
    message = "tunepack-gemma2-9b cannot be fine-tuned correctly yet: torchtune 0.6.1 converts"
    with pytest.raises(BadInputError, match=message):
        build_trainjob("g", "tunepack-gemma2-9b", "file:///d.jsonl", "file:///m", [])
    env = {"TUNEPACK_WORKSPACE": str(tmp_path), "TUNEPACK_MODEL": gemma2.name}
    done = run_program("tunepack.trainers.launch", env)
    assert done.returncode == EXIT_BAD_INPUT and message in done.stderr
    annotations = build_runtime(gemma2)["metadata"]["annotations"]
    assert "soft-caps" in annotations["tunepack.dev/known-defect"]
    # Families without a known defect are not refused.
    catalog.get("tunepack-gemma-7b").check_trainable()
