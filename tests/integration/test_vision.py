"""Llama 3.2 Vision end to end on a CPU: a tiny random ``MllamaForConditionalGeneration`` written
by transformers (``catalog.TINY_VISION``), a dataset of generated pictures (coloured squares and
circles with questions about them, ``tunepack.tiny.pictures``) through the real dataset
initializer, and the trainer.

- what the trainer feeds the model (tokens, tiles, aspect ratios, cross-attention mask) equals
  what transformers' ``MllamaProcessor`` gives for the same conversation and images, converted
  by ``mllama_inputs_to_tune``; and so do the logits;
- LoRA trains: the loss falls, result.json is written, the exported PEFT adapter loads into
  transformers' model and reproduces the trained one, and so does the merged model (merge=true);
  full fine-tuning saves a model transformers loads that reproduces the trained one;
- a vision model trains on text-only chat too (no images: its cross-attention layers are
  skipped, as transformers skips them);
- the published runtime (tunepack-llama3.2-vision-11b) runs through the launcher on the tiny
  checkpoint (any size builds from config.json), and a run killed with SIGKILL resumes from its
  checkpoint to a bit-identical adapter; two processes (FSDP2) train the same losses;
- what a user does: `tunepack tiny-model --model tiny-llama3.2-vision` and `tunepack tiny-dataset
  --images`, then `tunepack train --local` with that runtime and method=qlora runs both
  initializers and the trainer.
"""

from __future__ import annotations

import json
import math
import shutil

import pytest
import torch
import torchvision  # noqa: F401  Llama 3.2 Vision needs it (tunepack[vision], a dev extra)
from PIL import Image  # noqa: E402

from tests.helpers import (  # noqa: E402
    adapter_of,
    launch_trainer,
    losses_of,
    result_of,
    run_dataset_initializer,
    setup_recipe,
    start_and_wait_for_step,
    trainer_env,
)
from tunepack.core.errors import BadDatasetError, UnsupportedError
from tunepack.runtimes import catalog  # noqa: E402
from tunepack.tiny import write_tiny_model  # noqa: E402
from tunepack.tiny.pictures import write_tiny_image_dataset  # noqa: E402

ENTRY = catalog.TINY_VISION["mllama"]
FAST = ["warmup_steps=0", "checkpoint_every_minutes=0", "batch_size=4", "seed=0"]


@pytest.fixture(scope="module")
def workspace(tmp_path_factory):
    root = tmp_path_factory.mktemp("vision")
    data = write_tiny_image_dataset(root / "data", rows=12)
    done = run_dataset_initializer(root / "ws", str(data), cwd=root)
    assert done.returncode == 0, done.stderr
    write_tiny_model(root / "ws" / "model", ENTRY)
    return root / "ws"


def _recipe(workspace, output, argv, dataset_dir=None):
    return setup_recipe(
        ENTRY,
        [*FAST, *argv],
        model_dir=workspace / "model",
        dataset_dir=dataset_dir or workspace / "dataset",
        output=output,
    )


def _hf_inputs(recipe, workspace, indices):
    """transformers' MllamaProcessor on the same rows: the chat template of the tiny tokenizer
    (the published one's), the image processor of its preprocessor_config.json."""
    from transformers import AutoTokenizer, MllamaImageProcessor, MllamaProcessor

    from tunepack.trainers.data.vision_data import load_image

    model_dir = workspace / "model"
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    processor = MllamaProcessor(
        image_processor=MllamaImageProcessor.from_pretrained(model_dir), tokenizer=tokenizer
    )
    dataset = recipe.dataloader.dataset
    rows = [getattr(dataset, "dataset", dataset).rows[i] for i in indices]  # held out: a Subset
    texts = [tokenizer.apply_chat_template(row["messages"], tokenize=False) for *_, row in rows]
    images = [[load_image(root / name) for name in row["images"]] for root, _, row in rows]
    return processor(
        text=texts, images=images, padding=True, return_tensors="pt", add_special_tokens=False
    )


def _hf_model(path):
    from transformers import MllamaForConditionalGeneration

    return MllamaForConditionalGeneration.from_pretrained(path, dtype=torch.float32).eval()


def _tune_logits(model, batch, *, as_transformers=False):
    """The trainer's model on ``batch``; ``as_transformers``: its vision features taken as
    transformers 5.24 takes them (each listed layer's output, not its input:
    trainers/models/mllama.py, point 3), for comparisons with transformers' model."""
    model.encoder.clip.layer_outputs = as_transformers
    with torch.no_grad():
        return model.eval()(
            batch["tokens"],
            encoder_input=batch["encoder_input"],
            encoder_mask=batch["encoder_mask"],
        )


def _converted(workspace, hf) -> dict:
    from tunepack.trainers.models.mllama import mllama_inputs_to_tune

    config = json.loads((workspace / "model" / "config.json").read_text())
    return mllama_inputs_to_tune(config, **{k: hf[k] for k in hf if k != "attention_mask"})


def _real(batch) -> torch.Tensor:
    """Positions that are not padding (the loss's and every comparison's)."""
    return batch["attention_mask"].bool()


# Rows 0-3: a square, a wide, a tall and a larger square picture (2, 2x1, 1x3, 2x2 tiles).
ROWS = [0, 1, 2, 3]


def test_inputs_and_logits_equal_transformers_processor_and_model(workspace, tmp_path):
    recipe = _recipe(workspace, tmp_path / "out", ["method=full", "max_steps=1"])
    ours = recipe.collate([recipe.dataloader.dataset[i] for i in ROWS])
    hf = _hf_inputs(recipe, workspace, ROWS)
    theirs = _converted(workspace, hf)
    assert torch.equal(ours["tokens"], theirs["tokens"])
    assert torch.equal(
        ours["encoder_input"]["aspect_ratio"], theirs["encoder_input"]["aspect_ratio"]
    )
    tiles = ours["encoder_input"]["aspect_ratio"][:, 0].prod(-1).tolist()
    assert {2, 3, 4} <= set(tiles), tiles  # wide, tall and square canvases of whole tiles
    # transformers resizes 8-bit pixels (rounding each), torchtune resizes floats: within one
    # grey level (1/255 over CLIP's smallest std, 0.261), most pixels far closer.
    difference = (ours["encoder_input"]["images"] - theirs["encoder_input"]["images"]).abs()
    assert difference.max() < (1 / 255) / 0.261 and difference.mean() < 1e-3
    real = _real(hf)
    assert torch.equal(ours["encoder_mask"][real], theirs["encoder_mask"][real])

    # The base model: transformers' logits equal ours from the same inputs; the trainer's
    # pixels change them by no more than the grey level above does.
    with torch.no_grad():
        expected = _hf_model(workspace / "model")(**hf).logits
    logits = _tune_logits(recipe.model, theirs, as_transformers=True)
    assert (logits[real] - expected[real]).abs().max() < 1e-4
    ours_logits = _tune_logits(recipe.model, ours, as_transformers=True)
    assert (ours_logits[real] - expected[real]).abs().max() < 2e-3


def test_lora_trains_on_images_and_its_peft_adapter_reproduces_it(workspace, tmp_path):
    from peft import PeftModel

    output = tmp_path / "out"
    given = ["max_steps=12", "epochs=10", "merge=true", "lora_projector=true"]
    recipe = _recipe(workspace, output, given)
    recipe.train()
    recipe.save()
    losses = losses_of(output)
    assert len(losses) == 12 and all(math.isfinite(x) for x in losses)
    assert sum(losses[-3:]) < sum(losses[:3]) - 0.5, losses
    result = json.loads((output / "result.json").read_text())
    assert (result["model"], result["method"], result["steps"]) == (ENTRY.name, "lora", 12)
    assert result["final_loss"] == pytest.approx(losses[-1], abs=1e-5)
    assert result["artifact"] and result["chat_template"] == "llama3.2-vision"
    adapter = output / "adapter"
    config = json.loads((adapter / "adapter_config.json").read_text())
    assert config["base_model_name_or_path"] == ENTRY.hub_id

    hf = _hf_inputs(recipe, workspace, ROWS)
    theirs = _converted(workspace, hf)
    real = _real(hf)
    base = _hf_model(workspace / "model")
    with torch.no_grad():
        before = base(**hf).logits
        peft = PeftModel.from_pretrained(base, adapter).eval()
        after = peft(**hf).logits
    # The text model's modules and the projector were adapted: the vision tower's are untouched.
    wrapped = [n for n, _ in peft.named_modules() if n.endswith("lora_A")]
    assert "base_model.model.model.multi_modal_projector.lora_A" in wrapped
    assert all("language_model" in n or "multi_modal_projector" in n for n in wrapped)
    projector = recipe.model.encoder.projection.output.lora_b.weight
    assert projector.abs().max() > 0  # trained (B starts at zero)
    assert (after[real] - before[real]).abs().max() > 1e-3  # the adapter changes the model
    trained = _tune_logits(recipe.model, theirs, as_transformers=True)
    assert (trained[real] - after[real]).abs().max() < 1e-4
    # merge=true: the adapter folded into the base, saved in its layout, loads the same.
    with torch.no_grad():
        merged = _hf_model(result["merged_model"])(**hf).logits
    assert (trained[real] - merged[real]).abs().max() < 1e-4


def test_dora_trains_on_images_and_its_peft_adapter_reproduces_it(workspace, tmp_path):
    from peft import PeftModel

    output = tmp_path / "out"
    recipe = _recipe(workspace, output, ["method=dora", "max_steps=12", "epochs=10", "merge=true"])
    recipe.train()
    recipe.save()
    losses = losses_of(output)
    assert sum(losses[-3:]) < sum(losses[:3]) - 0.5, losses
    adapter = output / "adapter"
    assert json.loads((adapter / "adapter_config.json").read_text())["use_dora"] is True
    hf = _hf_inputs(recipe, workspace, ROWS)
    real = _real(hf)
    base = _hf_model(workspace / "model")
    with torch.no_grad():
        before = base(**hf).logits
        after = PeftModel.from_pretrained(base, adapter).eval()(**hf).logits
        merged = _hf_model(output / "merged")(**hf).logits
    trained = _tune_logits(recipe.model, _converted(workspace, hf), as_transformers=True)
    assert (after[real] - before[real]).abs().max() > 1e-3
    assert (trained[real] - after[real]).abs().max() < 1e-4
    assert (trained[real] - merged[real]).abs().max() < 1e-4


# The tiny model with text projections NF4 can quantize (each a multiple of its 16384-value
# block), as `tunepack tiny-model --model tiny-llama3.2-vision` writes it (indexed).
NF4_ENTRY = catalog.TINY_VISION_NF4


def test_qlora_trains_on_images_over_an_nf4_text_model(workspace, tmp_path):
    """The text model's projections (self- and cross-attention, MLPs) in NF4, the vision tower in
    the dtype; the adapter, applied by peft to the base as NF4 rounds it, is the trained model,
    and ``merge=true`` folds it into the unquantized base (as peft applies it there)."""
    from peft import PeftModel

    from tunepack.trainers.outputs import artifacts

    assert "qlora" not in ENTRY.methods and "qlora" in NF4_ENTRY.methods
    model_dir = write_tiny_model(tmp_path / "model", NF4_ENTRY)
    output = tmp_path / "out"
    given = [*FAST, "method=qlora", "max_steps=12", "epochs=10", "lr=3e-3", "merge=true"]
    recipe = setup_recipe(
        NF4_ENTRY, given, model_dir=model_dir, dataset_dir=workspace / "dataset", output=output
    )
    decoder = recipe.model.decoder
    nf4 = [decoder.layers[0].attn.q_proj.weight, decoder.layers[1].fusion_layer.attn.k_proj.weight]
    assert {type(w).__name__ for w in nf4} == {"NF4Tensor"}
    assert not any(type(w).__name__ == "NF4Tensor" for w in recipe.model.encoder.parameters())
    recipe.train()
    recipe.save()
    losses = losses_of(output)
    assert sum(losses[-3:]) < sum(losses[:3]) - 0.5, losses

    hf = _hf_inputs(recipe, workspace, ROWS)
    real = _real(hf)
    trained = _tune_logits(recipe.model, _converted(workspace, hf), as_transformers=True)
    # The base as the trainer held it (its state dict dequantizes NF4), in transformers' layout.
    state = artifacts.gather_state(recipe.model, trainable_only=False, sharded=False)
    rounded = tmp_path / "rounded"
    rounded.mkdir()
    artifacts.write_hf_model(
        {k: v for k, v in state.items() if "lora" not in k}, recipe.cfg, rounded
    )
    adapter = output / "adapter"
    with torch.no_grad():
        on_rounded = PeftModel.from_pretrained(_hf_model(rounded), adapter).eval()(**hf).logits
        base = _hf_model(model_dir)
        before = base(**hf).logits
        on_base = PeftModel.from_pretrained(base, adapter).eval()(**hf).logits
        merged = _hf_model(output / "merged")(**hf).logits
    assert (trained[real] - on_rounded[real]).abs().max() < 1e-4
    assert (on_base[real] - before[real]).abs().max() > 1e-3
    assert (on_base[real] - merged[real]).abs().max() < 1e-4


def test_qlora_on_two_processes_trains_what_one_does(workspace, tmp_path):
    """FSDP2 over the NF4 text model: rank 0 streams the base into both ranks' shards (the
    fusion modules' keys included); the same global batches give the same losses."""
    from tests.integration.test_trainer_processes import train_on_processes

    model_dir = write_tiny_model(tmp_path / "model", NF4_ENTRY)
    given = ["warmup_steps=0", "seed=0", "method=qlora", "max_steps=3", "epochs=10"]
    losses = {}
    for nproc in (1, 2):
        train_on_processes(
            NF4_ENTRY, [*given, f"batch_size={4 // nproc}"], model_dir=model_dir,
            dataset_dir=workspace / "dataset", output=tmp_path / f"out-{nproc}", nproc=nproc,
            tmp_path=tmp_path,
        )  # fmt: skip
        losses[nproc] = losses_of(tmp_path / f"out-{nproc}")
    assert len(losses[2]) == 3 and losses[2][-1] < losses[2][0]
    assert max(abs(a - b) for a, b in zip(losses[1], losses[2], strict=True)) < 1e-4, losses


def test_full_fine_tune_saves_a_model_transformers_loads(workspace, tmp_path):
    output = tmp_path / "out"
    given = ["method=full", "max_steps=3", "lr=1e-3", "val_fraction=0.25"]
    recipe = _recipe(workspace, output, given)
    trainable = {n.split(".")[0] for n, p in recipe.model.named_parameters() if p.requires_grad}
    assert trainable == {"decoder", "encoder"}  # every weight: the text model's too
    recipe.train()
    recipe.save()
    # Held-out rows (3 of 12) are evaluated with the same image batches.
    result = json.loads((output / "result.json").read_text())
    assert result["val_rows"] == 3 and math.isfinite(result["val_loss"])
    hf = _hf_inputs(recipe, workspace, ROWS)
    theirs = _converted(workspace, hf)
    real = _real(hf)
    with torch.no_grad():
        before = _hf_model(workspace / "model")(**hf).logits
        saved = _hf_model(output / "model")(**hf).logits
    assert (saved[real] - before[real]).abs().max() > 1e-3
    trained = _tune_logits(recipe.model, theirs, as_transformers=True)
    assert (trained[real] - saved[real]).abs().max() < 1e-4


def test_a_vision_model_trains_on_text_only_chat(workspace, tmp_path):
    """No image in the data: the cross-attention layers are skipped, as transformers skips
    them, and the chat format is the template's text-only one (a dated system turn)."""
    data = tmp_path / "data"
    data.mkdir()
    rows = [
        {"messages": [{"role": "user", "content": f"What is {n} plus one?"},
                      {"role": "assistant", "content": f"It is {n + 1}."}]}
        for n in range(8)
    ]  # fmt: skip
    (data / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    done = run_dataset_initializer(tmp_path / "ws", str(data), cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    output = tmp_path / "out"
    recipe = _recipe(workspace, output, ["max_steps=6", "epochs=10"], tmp_path / "ws" / "dataset")
    # Laid out as the published template lays out a conversation without images.
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(workspace / "model")
    expected = tokenizer.apply_chat_template(
        rows[0]["messages"], tokenize=True, return_dict=False, date_string="26 Jul 2024"
    )
    assert recipe.dataloader.dataset[0]["tokens"] == list(expected)
    recipe.train()
    losses = losses_of(output)
    assert len(losses) == 6 and sum(losses[-2:]) < sum(losses[:2]), losses


def test_the_model_initializer_refuses_a_config_the_build_cannot_reproduce(workspace, tmp_path):
    """Before any weight moves: cross-attention as the last layer has no self-attention layer to
    be the fusion part of. One line naming the field and value; nothing published."""
    from tests.helpers import run_program
    from tunepack.core.errors import EXIT_BAD_INPUT

    source = _published_workspace(workspace, tmp_path / "published") / "model"
    config = json.loads((source / "config.json").read_text())
    last = config["text_config"]["num_hidden_layers"] - 1
    config["text_config"]["cross_attention_layers"] = [last]
    (source / "config.json").write_text(json.dumps(config))
    target = tmp_path / "ws"
    env = {"TUNEPACK_WORKSPACE": str(target), "TUNEPACK_MODEL": "llama3.2-vision-11b"}
    done = run_program("tunepack.initializers.model", env | {"STORAGE_URI": f"file://{source}"})
    assert done.returncode == EXIT_BAD_INPUT, done.stderr
    lines = done.stderr.strip().splitlines()
    assert lines[-1].startswith(
        f"model-initializer: error: model at 'file://{source}': config.json has "
        f"text_config.cross_attention_layers=[{last}]"
    ), lines
    assert "Traceback" not in done.stderr
    assert not (target / "model").exists()


def test_lora_projector_is_refused_for_a_model_without_images():
    from tunepack.runtimes.args import parse_trainer_args

    assert parse_trainer_args(["lora_projector=true"], ENTRY).lora_projector is True
    with pytest.raises(UnsupportedError) as caught:
        parse_trainer_args(["lora_projector=true"], catalog.TINY["llama3"])
    assert str(caught.value) == (
        "lora_projector=true: tiny-llama3 takes no images, so it has no image projector to "
        "adapt; leave lora_projector unset"
    )


def test_methods_not_wired_for_images_are_refused_in_one_line():
    from tunepack.runtimes.args import parse_trainer_args

    assert catalog.get("llama3.2-vision-11b").methods == ("full", "lora", "qlora", "dora")
    with pytest.raises(UnsupportedError) as err:
        parse_trainer_args(["method=dpo"], ENTRY)
    assert str(err.value) == (
        "method=dpo is not available for tiny-mllama (Llama 3.2 Vision trains with full, lora, "
        "dora, qlora)"
    )


def test_a_system_message_beside_an_image_is_refused_as_the_template_refuses_it():
    from tunepack.trainers.data.prompt_format import Turn, render

    turns = [Turn("system", "Be brief."), Turn("user", "<|image|>What is it?")]
    with pytest.raises(BadDatasetError) as err:
        render("llama3.2-vision", turns)
    assert str(err.value) == (
        "the llama3.2-vision chat format refuses a system message in a conversation with images "
        "(as the published template does): drop the system message or system_prompt"
    )
    pieces = render("llama3.2-vision", turns[1:])  # no system turn at all beside an image
    assert [p.text for p in pieces if p.special] == [
        "<bos>", "<|start_header_id|>", "<|end_header_id|>", "<|image|>", "<|eot_id|>"
    ]  # fmt: skip


def _published_workspace(workspace, target):
    """The workspace with the tiny checkpoint indexed as the published sizes are (their
    checkpoints are sharded): the llama3.2-vision-11b runtime builds any size from config.json."""
    from safetensors import safe_open

    shutil.copytree(workspace, target)
    with safe_open(target / "model" / "model.safetensors", "pt") as weights:
        weight_map = dict.fromkeys(weights.keys(), "model.safetensors")
    index = {"metadata": {}, "weight_map": weight_map}
    (target / "model" / "model.safetensors.index.json").write_text(json.dumps(index))
    return target


def _launcher_env(workspace, **pet) -> dict[str, str]:
    return trainer_env(workspace, model="llama3.2-vision-11b", **pet)


LAUNCHED = ["max_steps=8", "epochs=10", "batch_size=4", "lr=3e-3", "warmup_steps=0"]


def test_the_published_runtime_trains_killed_and_restarted_bit_identical(workspace, tmp_path):
    """The launcher as a Pod runs it, with the tunepack-llama3.2-vision-11b runtime: trains
    (the loss falls, result.json and the adapter written); a run killed with SIGKILL after its
    step-3 checkpoint and started again ends with the same adapter, bit for bit; two processes
    (FSDP2) end with the same adapter."""
    reference = _published_workspace(workspace, tmp_path / "reference")
    done = launch_trainer(_launcher_env(reference), *LAUNCHED, timeout=300)
    assert done.returncode == 0, done.stderr
    result = result_of(reference)
    assert (result["model"], result["method"], result["steps"]) == (
        "llama3.2-vision-11b",
        "lora",
        8,
    )
    assert result["final_loss"] < result["first_loss"] - 0.3, result

    interrupted = _published_workspace(workspace, tmp_path / "interrupted")
    args = [*LAUNCHED, "checkpoint_every_steps=3", "checkpoint_every_minutes=0"]
    proc = start_and_wait_for_step(_launcher_env(interrupted), args, step=4)
    proc.kill()  # SIGKILL: nothing is flushed or finished
    proc.wait()
    assert not (interrupted / "output" / "result.json").exists()
    again = launch_trainer(_launcher_env(interrupted), *args, timeout=300)
    assert again.returncode == 0, again.stderr
    resumed = result_of(interrupted)
    assert resumed["resumed_from_step"] in (3, 6) and resumed["restarts"] == 1
    expected, got = adapter_of(reference), adapter_of(interrupted)
    assert expected.keys() == got.keys()
    assert all(torch.equal(expected[k], got[k]) for k in expected)

    # Two processes (FSDP2 over gloo): the model built on the meta device, the base streamed
    # from rank 0 into the shards (the fusion modules' keys by attribute), the adapter gathered
    # back; the same global batches, so the same losses up to the reductions' order (and an
    # adapter as close as Adam allows: it scales a near-zero gradient's rounding up to lr).
    sharded = _published_workspace(workspace, tmp_path / "sharded")
    sharded_args = [*LAUNCHED[:2], "batch_size=2", *LAUNCHED[3:]]
    done = launch_trainer(_launcher_env(sharded, nproc_per_node=2), *sharded_args, timeout=300)
    assert done.returncode == 0, done.stderr
    two, one = losses_of(sharded / "output"), losses_of(reference / "output")
    assert len(two) == len(one) == 8
    assert max(abs(a - b) for a, b in zip(two, one, strict=True)) < 1e-4, (two, one)
    got = adapter_of(sharded)
    assert expected.keys() == got.keys()
    for key in expected:
        assert (expected[key] - got[key]).norm() <= 0.1 * expected[key].norm(), key


def test_the_readme_s_vision_lines_train_qlora_on_a_cpu_as_it_says(tmp_path):
    """What a user does to try QLoRA on images on a CPU, README's three lines as written:
    `tunepack tiny-model --model tiny-llama3.2-vision`, `tunepack tiny-dataset --images`, then
    `tunepack train --local` with the published runtime: the raw picture dataset checked and
    stored by the dataset initializer, the tiny checkpoint fetched and checked by the model
    initializer, its text projections quantized to NF4 by the trainer; the steps and losses are
    the README's."""
    import re
    import shlex

    from tests import REPO
    from tests.helpers import run_program

    section = (REPO / "README.md").read_text().split("**QLoRA and Llama 3.2 Vision on a CPU.**")[1]
    block = section.split("```bash\n", 1)[1].split("```", 1)[0]
    commands = [shlex.split(line.split("#")[0]) for line in block.replace("\\\n", " ").splitlines()]
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    env = {"TUNEPACK_HOME": str(tmp_path / "home"), "PWD": str(cwd)}
    lines = []
    for argv in commands:
        assert argv[0] == "tunepack", argv
        argv = [a.replace("$PWD", str(cwd)) for a in argv[1:]]
        done = run_program("tunepack.cli", env, *argv, timeout=300, cwd=cwd)
        assert done.returncode == 0, done.stderr + done.stdout
        lines.append(done.stdout.splitlines()[-1] if argv[0] != "train" else done.stdout)
    assert lines[0] == (
        "tiny model ready at .tunepack/vision/tiny-llama3.2-vision (for --runtime "
        "tunepack-llama3.2-vision-11b; method=full, lora, qlora, dora)"
    )
    assert lines[1] == (
        "tiny image dataset ready at .tunepack/vision/pictures (24 pictures; for "
        "tiny-llama3.2-vision with --runtime tunepack-llama3.2-vision-11b, method=full, lora, "
        "qlora, dora)"
    )
    assert "tunepack: training finished" in lines[2]
    (run,) = (cwd / ".tunepack" / "runs").iterdir()
    result = json.loads((run / "output" / "result.json").read_text())
    assert (result["model"], result["method"]) == ("llama3.2-vision-11b", "qlora")
    assert result["final_loss"] < result["first_loss"] - 1, result
    assert (run / "output" / "adapter" / "adapter_model.safetensors").stat().st_size > 0
    said = re.search(r"That is (\d+) steps, loss (\d\.\d\d) -> (\d\.\d\d)", section)
    got = (str(result["steps"]), f"{result['first_loss']:.2f}", f"{result['final_loss']:.2f}")
    assert said.groups() == got, "README's QLoRA and Llama 3.2 Vision figures are stale"


def test_result_generate_answers_about_an_image_as_the_trained_model_does(workspace, tmp_path):
    """Result.generate(image=...) (the notebook's): transformers with the PEFT adapter, the
    image tiled by the checkpoint's image processor, run as trained (trainers/models/mllama.py,
    run_as_trained); its greedy answer is the trainer's own model's, decoded token by token."""
    from transformers import MllamaImageProcessor
    from transformers.models.mllama.processing_mllama import (
        convert_sparse_cross_attention_mask_to_dense,
        get_cross_attention_token_mask,
    )

    from tunepack.trainers.models.mllama import mllama_inputs_to_tune
    from tunepack.types import Result

    run = _published_workspace(workspace, tmp_path / "ws")  # trained as the 11B runtime does
    recipe = setup_recipe(
        catalog.get("llama3.2-vision-11b"), [*FAST, "max_steps=6", "epochs=10", "lr=3e-3"],
        model_dir=run / "model", dataset_dir=run / "dataset", output=run / "output",
    )  # fmt: skip
    recipe.train()
    recipe.save()
    info = json.loads((run / "output" / "result.json").read_text())
    result = Result(
        job="vision", path=info["artifact"], base_model=str(run / "model"), method="lora",
        chat_template=info["chat_template"], system_prompt=info.get("system_prompt"),
    )  # fmt: skip
    picture = workspace.parent / "data" / "pics" / "1.png"
    question = "What color is the circle?"
    answer = result.generate(question, max_new_tokens=5, image=picture)
    assert isinstance(answer, str)

    # The trained model (torchtune's, the trainer's), greedily over the same prompt and image.
    config = json.loads((workspace / "model" / "config.json").read_text())
    processor = MllamaImageProcessor.from_pretrained(workspace / "model")
    ids = result.prompt_ids(question, image=True)
    image_id = config["image_token_index"]
    assert ids.count(image_id) == 1
    pixels = processor(images=[[Image.open(picture).convert("RGB")]], return_tensors="pt")
    tiles = pixels.pop("num_tiles")
    new = []
    for _ in range(5):
        tokens = ids + new
        mask = convert_sparse_cross_attention_mask_to_dense(
            [get_cross_attention_token_mask(tokens, image_id)], tiles,
            processor.max_image_tiles, len(tokens),
        )  # fmt: skip
        inputs = mllama_inputs_to_tune(
            config, input_ids=torch.tensor([tokens]), cross_attention_mask=torch.tensor(mask),
            **pixels,
        )  # fmt: skip
        logits = _tune_logits(recipe.model, inputs)
        new.append(int(logits[0, -1].argmax()))
        if new[-1] in recipe.tokenizer.stop_tokens:
            break
    model, tokenizer = result.load()
    assert answer == tokenizer.decode(new, skip_special_tokens=True)

    # And the loaded model's logits over the prompt are the trained model's: the same image
    # features (run as trained), adapter and masks.
    mask = convert_sparse_cross_attention_mask_to_dense(
        [get_cross_attention_token_mask(ids, image_id)], tiles, processor.max_image_tiles, len(ids)
    )
    hf = {"input_ids": torch.tensor([ids]), "cross_attention_mask": torch.tensor(mask), **pixels}
    with torch.no_grad():
        theirs = model(**hf, attention_mask=torch.ones_like(hf["input_ids"])).logits
    ours = _tune_logits(recipe.model, mllama_inputs_to_tune(config, **hf))
    # 3e-7 measured; with transformers 5.24's own features (no run_as_trained) 1e-4.
    assert (theirs - ours).abs().max() < 1e-5


def test_result_generate_refuses_an_image_for_a_text_model(tmp_path):
    from tunepack.types import Result

    (tmp_path / "output").mkdir()
    (tmp_path / "output" / "result.json").write_text(json.dumps({"model": "tiny-llama3"}))
    result = Result(job="text", path=str(tmp_path / "output" / "adapter"),
                    base_model=str(tmp_path / "model"), method="lora")  # fmt: skip
    with pytest.raises(UnsupportedError) as refused:
        result.generate("What is it?", image="cat.png")
    assert str(refused.value) == (
        "image= needs a model that takes images; tiny-llama3 reads text only"
    )
