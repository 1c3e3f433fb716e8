"""The trainer: real torchtune LoRA training on CPU, and an adapter that serves what was trained."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from tests.helpers import run_program, setup_recipe
from tunepack.core.errors import EXIT_BAD_INPUT
from tunepack.runtimes import catalog

TINY = catalog.get("tiny-llama3")


@pytest.fixture(scope="module")
def trained(initialized_workspace, tmp_path_factory):
    """Train in-process for 2 epochs so the test can compare the live model with the export."""
    output = tmp_path_factory.mktemp("output")
    recipe = setup_recipe(
        TINY,
        ["epochs=2", "warmup_steps=2", "lr=3e-3", "batch_size=8"],
        model_dir=initialized_workspace / "model",
        dataset_dir=initialized_workspace / "dataset",
        output=output,
    )
    base_before = {k: v.clone() for k, v in recipe.model.state_dict().items() if "lora" not in k}
    recipe.train()
    recipe.save()
    return recipe, base_before, output


def test_loss_falls(trained):
    recipe, _, output = trained
    lines = (output / "metrics.jsonl").read_text().splitlines()
    losses = [json.loads(line)["loss"] for line in lines]
    assert len(losses) == recipe.total_steps == 2 * (256 // 8)
    first, last = sum(losses[:5]) / 5, sum(losses[-5:]) / 5
    # ln(384) = 5.95 nats is a uniform guess; the adapter must take a clear bite out of it.
    assert last < first - 0.5, (first, last)


def test_base_weights_stay_frozen_across_epochs(trained):
    """The stock CPU recipe merges LoRA into the live base at each epoch end; this one must not."""
    recipe, base_before, _ = trained
    after = recipe.model.state_dict()
    for key, value in base_before.items():
        assert torch.equal(after[key], value), key


def test_result_record(trained):
    recipe, _, output = trained
    result = json.loads((output / "result.json").read_text())
    assert result["method"] == "lora"
    assert result["steps"] == recipe.total_steps
    assert result["final_loss"] < result["first_loss"]
    assert result["tokens_seen"] > 0
    assert result["artifact"] == str(output / "adapter")


def test_adapter_loads_with_peft_and_reproduces_trained_model(trained, initialized_workspace):
    import peft
    import transformers

    recipe, _, output = trained
    adapter_dir = output / "adapter"
    config = json.loads((adapter_dir / "adapter_config.json").read_text())
    assert config["peft_type"] == "LORA" and config["r"] == TINY.defaults["lora_rank"]
    assert config["base_model_name_or_path"] == TINY.hub_id
    assert set(config["target_modules"]) == {
        "q_proj",
        "k_proj",
        "v_proj",
        "o_proj",
        "gate_proj",
        "up_proj",
        "down_proj",
    }

    base = transformers.AutoModelForCausalLM.from_pretrained(
        initialized_workspace / "model", torch_dtype=torch.float32
    )
    tokens = torch.randint(
        0, TINY.shape.vocab_size, (2, 24), generator=torch.Generator().manual_seed(1)
    )
    with torch.no_grad():
        base_logits = base(tokens).logits
        tuned = peft.PeftModel.from_pretrained(base, adapter_dir).eval()
        peft_logits = tuned(tokens).logits
        recipe.model.eval()
        trained_logits = recipe.model(tokens)
    assert torch.allclose(peft_logits, trained_logits, atol=1e-4), (
        (peft_logits - trained_logits).abs().max()
    )
    # And the adapter really changes the model (LoRA B starts at zero, so this proves training).
    assert (peft_logits - base_logits).abs().max() > 1e-2


def test_launcher_rejects_bad_arguments_before_loading_anything(tmp_path):
    env = {"TUNEPACK_WORKSPACE": str(tmp_path), "TUNEPACK_MODEL": "tiny-llama3"}
    done = run_program("tunepack.trainers.launch", env, "lora_rank=abc")
    assert done.returncode == EXIT_BAD_INPUT
    assert "trainer: error: lora_rank='abc' is not valid: expected an integer" in done.stderr
    assert not (tmp_path / "output").exists()


def test_launcher_requires_model_env(tmp_path):
    done = run_program("tunepack.trainers.launch", {"TUNEPACK_WORKSPACE": str(tmp_path)})
    assert done.returncode == EXIT_BAD_INPUT
    assert "TUNEPACK_MODEL is not set" in done.stderr


def test_launcher_trains_and_skips_a_finished_run(initialized_workspace, tmp_path):
    workspace = tmp_path / "ws"
    shutil.copytree(initialized_workspace, workspace)
    env = {"TUNEPACK_WORKSPACE": str(workspace), "TUNEPACK_MODEL": "tiny-llama3"}
    done = run_program("tunepack.trainers.launch", env, "max_steps=3", "warmup_steps=0")
    assert done.returncode == 0, done.stderr
    lines = [json.loads(x) for x in done.stdout.splitlines() if x.startswith("{")]
    assert [line["step"] for line in lines] == [1, 2, 3]
    assert (workspace / "output" / "adapter" / "adapter_model.safetensors").is_file()
    assert (workspace / "output" / "config.yaml").is_file()

    again = run_program("tunepack.trainers.launch", env, "max_steps=3", "warmup_steps=0")
    assert again.returncode == 0
    assert "nothing to do" in again.stdout
