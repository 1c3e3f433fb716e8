"""Every catalog family end to end, on a tiny random instance of its Hugging Face format.

For each family (``catalog.TINY``): the generated model loads in transformers and, converted by
torchtune's ``FullModelHFCheckpointer`` into the model the trainer builds, gives the same logits
(checkpoint conversion, and tunepack's corrections of torchtune's builders where they differ from
HF: Gemma 2, RoPE bases); the family's torchtune tokenizer loads the generated tokenizer files
(tokenizer wiring); and a few LoRA steps run through tunepack's trainer, whose freshly built LoRA
model (adapters start at zero) must also give those logits (builders).
"""

from __future__ import annotations

import json
import math

import pytest
import torch
from omegaconf import OmegaConf
from torchtune import config as tt_config
from torchtune.config._utils import _get_component_from_path
from torchtune.training import MODEL_KEY, FullModelHFCheckpointer

from tests.helpers import setup_recipe
from tunepack import tiny
from tunepack.runtimes import catalog, methods
from tunepack.trainers.config import model_component

ENTRIES = list(catalog.TINY.values())
STEPS = 12
TEXT = "What is the capital of Iceland? Reverse the letters of this word: zebra."


pytestmark = pytest.mark.usefixtures("no_tiktoken_cache")


@pytest.fixture(scope="module", params=ENTRIES, ids=lambda entry: entry.name)
def family(request, tmp_path_factory):
    """(entry, model dir, HF logits on fixed tokens): one tiny instance per family."""
    from transformers import AutoModelForCausalLM

    entry = request.param
    model_dir = tiny.write_tiny_model(tmp_path_factory.mktemp("families") / entry.name, entry)
    hf_model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    assert type(hf_model).__name__ == entry.family.hf_architecture
    assert hf_model.num_parameters() == entry.parameter_count
    # Long enough that a wrong RoPE layout or scaling shows clearly in the logits.
    tokens = torch.randint(
        0, entry.shape.vocab_size, (2, 80), generator=torch.Generator().manual_seed(1)
    )
    with torch.no_grad():
        hf_logits = hf_model(tokens).logits
    # Random weights give logits well away from zero, so a small difference means a match.
    assert hf_logits.abs().max() > 1e-2
    return entry, model_dir, tokens, hf_logits


def _max_diff(model: torch.nn.Module, tokens: torch.Tensor, expected: torch.Tensor) -> float:
    with torch.no_grad():
        logits = model.eval()(tokens)
    assert logits.shape == expected.shape
    return float((logits - expected).abs().max())


def test_model_dir_has_the_files_the_catalog_requires(family):
    entry, model_dir, *_ = family
    for name in (*entry.required_files(), *tiny.model_files(entry)):
        assert (model_dir / name).is_file(), name
    hf_config = json.loads((model_dir / "config.json").read_text())
    assert hf_config["model_type"] == entry.family.hf_model_type


def test_torchtune_conversion_gives_transformers_logits(family, tmp_path):
    entry, model_dir, tokens, hf_logits = family
    # The family's checkpointer (tunepack's own where torchtune's misses keys, as Qwen 3's).
    checkpointer_cls = _get_component_from_path(entry.family.checkpointer)
    assert issubclass(checkpointer_cls, FullModelHFCheckpointer)
    checkpointer = checkpointer_cls(
        checkpoint_dir=str(model_dir),
        checkpoint_files=list(entry.weight_files(model_dir)),
        model_type=entry.checkpoint_model_type,
        output_dir=str(tmp_path),
    )
    state = checkpointer.load_checkpoint()[MODEL_KEY]
    model = tt_config.instantiate(OmegaConf.create(model_component(entry, methods.get("full"))))
    model.load_state_dict(state, strict=True)
    assert _max_diff(model, tokens, hf_logits) < 1e-4


def test_torchtune_tokenizer_loads_the_generated_files(family):
    entry, model_dir, *_ = family
    files = {kw: str(model_dir / rel) for kw, rel in entry.tokenizer.files.items()}
    tokenizer = tt_config.instantiate(
        OmegaConf.create({"_component_": entry.tokenizer.component, **files})
    )
    ids = tokenizer.encode(TEXT, add_bos=False, add_eos=False)
    assert 0 < len(ids) < len(TEXT) and all(0 <= i < entry.shape.vocab_size for i in ids)
    decoded = tokenizer.decode(ids)
    if isinstance(decoded, list):
        # torchtune 0.6.1's Phi-4 decode returns the byte-level token strings, not the text.
        byte_decoder = tokenizer.tokenizer_model.byte_decoder
        decoded = bytes(byte_decoder[c] for c in "".join(decoded)).decode("utf-8")
    assert decoded.strip() == TEXT
    assert tokenizer.eos_id < entry.shape.vocab_size
    assert tokenizer.pad_id is not None and tokenizer.pad_id < entry.shape.vocab_size


def _recipe(family, workspace, output, argv: list[str]):
    """The trainer's recipe for this family's tiny model, set up (built and loaded)."""
    entry, model_dir, *_ = family
    return setup_recipe(
        entry,
        [*argv, "warmup_steps=0", "batch_size=4"],
        model_dir=model_dir,
        dataset_dir=workspace / "dataset",
        output=output,
    )


def test_lora_steps_through_the_trainer(family, initialized_workspace, tmp_path):
    entry, model_dir, tokens, hf_logits = family
    recipe = _recipe(family, initialized_workspace, tmp_path / "output", [f"max_steps={STEPS}"])
    # LoRA's B matrices start at zero: before training the trainer's model is the base model.
    assert _max_diff(recipe.model, tokens, hf_logits) < 1e-4
    recipe.train()
    recipe.save()

    metrics = (tmp_path / "output" / "metrics.jsonl").read_text().splitlines()
    losses = [json.loads(line)["loss"] for line in metrics]
    assert len(losses) == STEPS and all(math.isfinite(loss) for loss in losses)
    assert sum(losses[-3:]) < sum(losses[:3]), losses
    adapter = tmp_path / "output" / "adapter"
    assert (adapter / "adapter_model.safetensors").stat().st_size > 0
    adapter_config = json.loads((adapter / "adapter_config.json").read_text())
    assert adapter_config["r"] == entry.defaults["lora_rank"]
    assert adapter_config["base_model_name_or_path"] == entry.hub_id

    # The exported adapter, applied by peft to the HF model, must reproduce the trained model.
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    with torch.no_grad():
        peft_logits = PeftModel.from_pretrained(base, adapter).eval()(tokens).logits
    assert (peft_logits - hf_logits).abs().max() > 1e-3  # the adapter changes the model
    assert _max_diff(recipe.model, tokens, peft_logits) < 1e-4


def test_full_fine_tune_saves_an_hf_model_that_reproduces_the_trained_one(
    family, initialized_workspace, tmp_path
):
    """The way back: trained weights (norms included) converted to the family's HF format.

    With activation checkpointing on, which must wrap every layer, Gemma 2's included.
    """
    from transformers import AutoModelForCausalLM

    _, _, tokens, hf_logits = family
    given = ["method=full", "max_steps=4", "lr=1e-3", "activation_checkpointing=true"]
    recipe = _recipe(family, initialized_workspace, tmp_path / "output", given)
    assert {type(layer).__name__ for layer in recipe.model.layers} == {"CheckpointWrapper"}
    recipe.train()
    recipe.save()

    saved = AutoModelForCausalLM.from_pretrained(tmp_path / "output" / "model", dtype=torch.float32)
    with torch.no_grad():
        saved_logits = saved.eval()(tokens).logits
    assert (saved_logits - hf_logits).abs().max() > 1e-3  # training changed the model
    assert _max_diff(recipe.model, tokens, saved_logits) < 1e-4
