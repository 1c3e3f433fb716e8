"""Qwen 3 specifics beyond tests/integration/test_families.py: the q/k norms matter, in HF's
order, and the checkpoint conversion is exact both ways.
"""

from __future__ import annotations

import pytest
import torch
from omegaconf import OmegaConf
from safetensors.torch import load_file
from torchtune import config as tt_config
from torchtune.training import MODEL_KEY

from tunepack import tiny
from tunepack.runtimes import catalog, methods
from tunepack.trainers.config import model_component
from tunepack.trainers.models.qwen3 import Qwen3HFCheckpointer, qwen3_hf_to_tune, qwen3_tune_to_hf

ENTRY = catalog.TINY["qwen3"]


@pytest.fixture(scope="module")
def qwen3_dir(tmp_path_factory):
    return tiny.write_tiny_model(tmp_path_factory.mktemp("qwen3") / ENTRY.name, ENTRY)


def _hf_logits(model_dir, tokens):
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    assert type(hf).__name__ == "Qwen3ForCausalLM"
    with torch.no_grad():
        return hf(tokens).logits


def _loaded(model_dir, tmp_path):
    checkpointer = Qwen3HFCheckpointer(
        checkpoint_dir=str(model_dir),
        checkpoint_files=["model.safetensors"],
        model_type=ENTRY.checkpoint_model_type,
        output_dir=str(tmp_path),
    )
    state = checkpointer.load_checkpoint()[MODEL_KEY]
    model = tt_config.instantiate(
        OmegaConf.create(model_component(ENTRY, methods.get("full")))
    ).eval()
    model.load_state_dict(state, strict=True)
    return model, state


def test_q_k_norms_are_loaded_and_applied_before_rope(qwen3_dir, tmp_path):
    tokens = torch.randint(
        0, ENTRY.shape.vocab_size, (2, 64), generator=torch.Generator().manual_seed(3)
    )
    expected = _hf_logits(qwen3_dir, tokens)
    model, state = _loaded(qwen3_dir, tmp_path)
    norms = [k for k in state if ".attn.q_norm." in k or ".attn.k_norm." in k]
    assert len(norms) == 2 * ENTRY.shape.num_layers
    with torch.no_grad():
        assert (model(tokens) - expected).abs().max() < 1e-4
        # torchtune's own order (norm after RoPE) is another model with these weights ...
        attn = model.layers[0].attn
        q = torch.randn(1, 5, ENTRY.shape.num_heads, ENTRY.shape.head_dim)
        after = attn.q_norm(attn.pos_embeddings(q))
        before = attn.pos_embeddings(attn.q_norm(q))
        assert (after - before).abs().max() > 1e-2
        # ... and so is the model without its norms: the test above would catch either.
        for layer in model.layers:
            layer.attn.q_norm.scale.fill_(1.0)
            layer.attn.k_norm.scale.fill_(1.0)
        assert (model(tokens) - expected).abs().max() > 1e-2


def test_conversion_round_trip_is_exact(qwen3_dir):
    hf_state = load_file(qwen3_dir / "model.safetensors")
    s = ENTRY.shape
    shape = {"num_heads": s.num_heads, "num_kv_heads": s.num_kv_heads, "dim": s.embed_dim}
    tune = qwen3_hf_to_tune(hf_state, **shape, tie_word_embeddings=True)
    assert "layers.1.attn.k_norm.scale" in tune and "layers.1.attn.q_proj.bias" not in tune
    back = qwen3_tune_to_hf(tune, **shape, tie_word_embeddings=True)
    assert back.keys() == hf_state.keys()
    assert all(torch.equal(back[k], hf_state[k]) for k in hf_state)


def test_checkpointer_saves_hf_qwen3_that_transformers_loads(qwen3_dir, tmp_path):
    model, state = _loaded(qwen3_dir, tmp_path / "load")
    with torch.no_grad():
        for layer in model.layers:
            layer.attn.k_norm.scale.mul_(1.5)  # a change only the norms' conversion carries
    out = tmp_path / "out"
    checkpointer = Qwen3HFCheckpointer(
        checkpoint_dir=str(qwen3_dir),
        checkpoint_files=["model.safetensors"],
        model_type=ENTRY.checkpoint_model_type,
        output_dir=str(out),
    )
    checkpointer.load_checkpoint()
    checkpointer.save_checkpoint({MODEL_KEY: model.state_dict()}, epoch=0)
    saved = next(out.rglob("*.safetensors"))
    keys = load_file(saved).keys()
    assert "model.layers.0.self_attn.k_norm.weight" in keys
    # The saved epoch directory holds the weights beside the copied config.json.
    tokens = torch.randint(
        0, ENTRY.shape.vocab_size, (1, 32), generator=torch.Generator().manual_seed(4)
    )
    with torch.no_grad():
        assert (_hf_logits(saved.parent, tokens) - model(tokens)).abs().max() < 1e-4
