"""Reinforcement learning from verifiable rewards (method=grpo): learning, exact resume, FSDP2,
the console and the errors a user meets.

The toy task: the tiny prompt set (`tunepack tiny-dataset --prompts`, sums of two numbers). A
random tiny model answers with noise whose every token is about equally likely (its logits span
less than 2 nats: LoRA cannot make them peaked), so the task starts, as GRPO does in practice,
from a model that answers at all: the tiny model fine-tuned (method=full) on the same prompts
with their answers. The reward then asks for more than that model learned: an even number
(``rewards=format reward_pattern='^[0-9]*[02468]$'``), a verifiable property it meets in about
four answers of ten at first.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests.helpers import (
    TINY,
    adapter_of,
    assert_same_tensors,
    initialize_workspace,
    launch_trainer,
    result_of,
    run_program,
    setup_recipe,
    step_records,
    straight_and_resumed,
    trainer_env,
    two_processes_env,
)
from tunepack.core.errors import EXIT_BAD_INPUT
from tunepack.tiny.dataset import tiny_prompt_rows, write_tiny_prompt_dataset

EVEN = ["rewards=format", "reward_pattern=^[0-9]*[02468]$"]


@pytest.fixture(scope="module")
def answering_model(tmp_path_factory, tiny_model_dir) -> Path:
    """tiny-llama3 fine-tuned on 256 other sums with their answers (method=full, 128 steps): a
    tiny-llama3 checkpoint that answers with numbers."""
    root = tmp_path_factory.mktemp("sft")
    rows = root / "sums.jsonl"
    rows.write_text(
        "".join(
            json.dumps({"instruction": r["prompt"], "input": "", "output": r["answer"]}) + "\n"
            for r in tiny_prompt_rows(256, seed=1)
        )
    )
    workspace = initialize_workspace(root / "ws", rows, tiny_model_dir)
    recipe = setup_recipe(
        TINY,
        ["method=full", "epochs=4", "batch_size=8", "lr=3e-3", "checkpoint_every_minutes=0"],
        model_dir=workspace / "model",
        dataset_dir=workspace / "dataset",
        output=root / "out",
    )
    recipe.train()
    recipe.save()
    model = shutil.copytree(tiny_model_dir, root / "answering")
    (model / "model.safetensors").unlink()
    shutil.copy(
        root / "out" / "model" / "model-00001-of-00001.safetensors", model / "model.safetensors"
    )
    return model


@pytest.fixture(scope="module")
def prompt_workspace(tmp_path_factory, answering_model) -> Path:
    """Both initializers over the 256 tiny prompts and the answering model (read-only: copy)."""
    data = write_tiny_prompt_dataset(tmp_path_factory.mktemp("prompts") / "p.jsonl", rows=256)
    return initialize_workspace(tmp_path_factory.mktemp("grpo-ws"), data, answering_model)


def _mean(values) -> float:
    values = list(values)
    return sum(values) / len(values)


# ------------------------------------------------------------------ learning, end to end


def test_cli_run_raises_the_reward_and_the_adapter_loads_in_peft(answering_model, tmp_path):
    """`tunepack tiny-dataset --prompts` then `tunepack train --local ... method=grpo`: the mean
    reward of the last steps is well above the first steps', the console shows it, and the
    published adapter, loaded by peft over the base, answers with even numbers more often."""
    import peft
    import transformers

    data = tmp_path / "prompts.jsonl"
    made = subprocess.run(
        [sys.executable, "-m", "tunepack.cli", "tiny-dataset", "--prompts", str(data)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert made.returncode == 0 and "tiny prompt dataset (for method=grpo)" in made.stdout
    workspace = tmp_path / "ws"
    done = subprocess.run(
        [sys.executable, "-m", "tunepack.cli", "train", "--local"]
        + ["--runtime", "tunepack-tiny-llama3", "--workspace", str(workspace)]
        + ["--dataset", f"file://{data}", "--model", f"file://{answering_model}"]
        + ["method=grpo", "max_steps=24", "batch_size=8", "num_generations=8"]
        + ["max_new_tokens=4", "lr=3e-3", "warmup_steps=0", *EVEN],
        capture_output=True,
        text=True,
        timeout=900,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert done.returncode == 0, done.stdout + done.stderr
    steps = step_records(workspace / "output")
    rewards = [s["reward_mean"] for s in steps]
    assert len(steps) == 24
    first, last = _mean(rewards[:4]), _mean(rewards[-8:])
    # Measured: 0.41 over the first 4 steps, 0.73 over the last 8 (64 answers a step).
    assert 0.15 < first < 0.6, rewards
    assert last > 1.5 * first and last > first + 0.15, rewards
    assert all(s["reward_format"] == s["reward_mean"] for s in steps)  # one reward, weight 1
    assert steps[0]["kl"] == 0 and steps[-1]["kl"] > 0  # the adapters start as the reference
    assert all(0 < s["completion_length"] <= 4 and 0 <= s["clip_fraction"] <= 1 for s in steps)
    shown = [line for line in done.stdout.splitlines() if "step 24/24" in line]
    assert len(shown) == 1 and shown[0].endswith(
        f"reward {steps[-1]['reward_mean']:.3f}  kl {steps[-1]['kl']:.4f}"
    ), done.stdout
    assert f"  rewards     {steps[-1]['reward_mean']:.3f} mean" in done.stdout
    result = json.loads((workspace / "output" / "result.json").read_text())
    assert result["method"] == "grpo"
    assert result["grpo"]["rewards"] == "format" and result["grpo"]["beta"] == 0.04
    assert result["grpo"]["reward_mean"] == steps[-1]["reward_mean"]

    # The adapter in transformers: its answers to held-out prompts, sampled as in training
    # (temperature 1, 4 tokens), are even more often than the base model's.
    tokenizer = transformers.AutoTokenizer.from_pretrained(answering_model)
    base = transformers.AutoModelForCausalLM.from_pretrained(answering_model, dtype=torch.float32)
    prompts = []
    for row in tiny_prompt_rows(32, seed=7):
        text = tokenizer.apply_chat_template(
            [{"role": "user", "content": row["prompt"]}], add_generation_prompt=True, tokenize=False
        )
        prompts.append(tokenizer(text, add_special_tokens=False)["input_ids"])

    def even_share(model) -> float:
        torch.manual_seed(0)
        hits = total = 0
        for ids in prompts:
            ids = torch.tensor([ids] * 8)
            with torch.no_grad():
                out = model.generate(ids, max_new_tokens=4, do_sample=True, top_k=0)
            for answer in out[:, ids.size(1) :]:
                text = tokenizer.decode(answer, skip_special_tokens=True)
                hits += re.search(r"^[0-9]*[02468]$", text) is not None
                total += 1
        return hits / total

    before = even_share(base)
    tuned = peft.PeftModel.from_pretrained(base, workspace / "output" / "adapter").eval()
    after = even_share(tuned)
    assert after > before + 0.15, (before, after)


# ------------------------------------------------------------------ exact resume, FSDP2

# 10 steps of 4 prompts x 4 answers in 2 micro-batches; LoRA dropout makes the result depend on
# the restored random state too, the sampling on the step it resumes at.
RESUME = [
    "method=grpo",
    "max_steps=10",
    "batch_size=2",
    "grad_accum=2",
    "num_generations=4",
    "max_new_tokens=4",
    "lora_dropout=0.1",
    "lr=3e-3",
    "warmup_steps=2",
    "checkpoint_every_minutes=0",
    *EVEN,
]


def test_kill_9_then_restart_ends_bit_identical(prompt_workspace, tmp_path):
    reference, interrupted, _ = straight_and_resumed(
        prompt_workspace, tmp_path, RESUME, at_step=5, every=3
    )
    result, expected = result_of(interrupted), result_of(reference)
    assert result["steps"] == 10
    assert result["grpo"] == expected["grpo"]  # the last step's metrics, to the last digit
    assert_same_tensors(adapter_of(reference), adapter_of(interrupted))
    # metrics.jsonl lists each step once; every step's rewards are the uninterrupted run's.
    resumed = step_records(interrupted / "output")
    straight = step_records(reference / "output")
    assert [s["step"] for s in resumed] == list(range(1, 11))
    keys = ("reward_mean", "reward_std", "kl", "completion_length", "loss")
    assert [[s[k] for k in keys] for s in resumed] == [[s[k] for k in keys] for s in straight]
    assert len({s["reward_mean"] for s in straight}) > 1  # the rewards do move


def test_two_processes_with_fsdp_follow_one_process(prompt_workspace, tmp_path):
    """Two ranks of 4 prompts see the same 8 prompts per step as one process of 8; each answer's
    sampling is seeded by its prompt, not its rank, and the fresh adapters are the same
    (trainers/models/adapter_init.py): every step samples the same answers, and the losses and KL
    agree to rounding (sharded sums add in another order)."""
    common = [
        "method=grpo",
        "max_steps=4",
        "num_generations=4",
        "max_new_tokens=4",
        "lr=1e-3",
        "warmup_steps=0",
        "checkpoint_every_minutes=0",
        *EVEN,
    ]
    one = shutil.copytree(prompt_workspace, tmp_path / "one")
    done = launch_trainer(trainer_env(one), *common, "batch_size=8")
    assert done.returncode == 0, done.stderr
    two = shutil.copytree(prompt_workspace, tmp_path / "two")
    env = two_processes_env(two)
    done = launch_trainer(env, *common, "batch_size=4")
    assert done.returncode == 0, done.stdout + done.stderr
    assert result_of(two)["world_size"] == 2 and result_of(two)["method"] == "grpo"

    single, sharded = step_records(one / "output"), step_records(two / "output")
    assert len(single) == len(sharded) == 4
    for a, b in zip(single, sharded, strict=True):
        for key in ("reward_mean", "reward_std", "completion_length", "tokens"):
            assert a[key] == b[key], (key, a, b)
        assert b["loss"] == pytest.approx(a["loss"], abs=1e-5)
        assert b["kl"] == pytest.approx(a["kl"], abs=1e-5)
    assert single[-1]["kl"] > 0


# ------------------------------------------------------------------ every weight: grpo_full


def test_grpo_full_raises_the_reward_against_a_frozen_copy(prompt_workspace, tmp_path):
    """method=grpo_full trains every weight, with a frozen copy of the base as its KL reference:
    the reward rises (measured: 0.43 over the first 4 steps, 0.80 over the last 8) and the
    result is a whole model."""
    workspace = shutil.copytree(prompt_workspace, tmp_path / "ws")
    args = ["method=grpo_full", "max_steps=24", "batch_size=8", "num_generations=8"]
    args += ["max_new_tokens=4", "lr=3e-4", "warmup_steps=0", "checkpoint_every_minutes=0"]
    done = launch_trainer(trainer_env(workspace), *args, *EVEN)
    assert done.returncode == 0, done.stderr
    steps = step_records(workspace / "output")
    rewards = [s["reward_mean"] for s in steps]
    first, last = _mean(rewards[:4]), _mean(rewards[-8:])
    assert last > 1.5 * first and last > first + 0.2, rewards
    assert steps[0]["kl"] == 0 and steps[-1]["kl"] > 0  # the copy is the model's start
    result = result_of(workspace)
    assert result["method"] == "grpo_full" and result["grpo"]["beta"] == 0.04
    assert (workspace / "output" / "model" / "config.json").is_file()
    assert not (workspace / "output" / "adapter").exists()


def test_grpo_full_resumes_bit_identically_and_follows_on_two_processes(prompt_workspace, tmp_path):
    """The frozen reference is rebuilt from the base on resume (it is not in the checkpoint) and
    sharded like the model on two processes."""
    args = [
        "method=grpo_full",
        "max_steps=6",
        "batch_size=4",
        "num_generations=4",
        "max_new_tokens=4",
        "lr=3e-4",
        "warmup_steps=0",
        "checkpoint_every_minutes=0",
        *EVEN,
    ]
    reference, interrupted, _ = straight_and_resumed(
        prompt_workspace, tmp_path, args, at_step=3, every=2
    )
    straight, resumed = step_records(reference / "output"), step_records(interrupted / "output")
    keys = ("reward_mean", "kl", "loss", "tokens")
    assert [[s[k] for k in keys] for s in resumed] == [[s[k] for k in keys] for s in straight]
    assert result_of(interrupted)["grpo"] == result_of(reference)["grpo"]
    weights = Path("output", "model", "model-00001-of-00001.safetensors")
    assert_same_tensors(load_file(reference / weights), load_file(interrupted / weights))

    two = shutil.copytree(prompt_workspace, tmp_path / "two")
    env = two_processes_env(two)
    done = launch_trainer(env, *[a.replace("batch_size=4", "batch_size=2") for a in args])
    assert done.returncode == 0, done.stdout + done.stderr
    sharded = step_records(two / "output")
    assert result_of(two)["world_size"] == 2
    for a, b in zip(straight, sharded, strict=True):
        assert (a["reward_mean"], a["tokens"]) == (b["reward_mean"], b["tokens"])
        assert b["loss"] == pytest.approx(a["loss"], abs=1e-5)
        assert b["kl"] == pytest.approx(a["kl"], abs=1e-5)


# ------------------------------------------------------------------ what a user gets wrong


def test_a_reward_that_needs_answers_names_the_rows_without_one(answering_model, tmp_path):
    rows = [{"prompt": "What is 1 plus 1?", "answer": "2"}, {"prompt": "Say hi."}]
    data = tmp_path / "p.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    workspace = initialize_workspace(tmp_path / "ws", data, answering_model)
    done = run_program(
        "tunepack.trainers.launch",
        {"TUNEPACK_WORKSPACE": str(workspace), "TUNEPACK_MODEL": "tiny-llama3"},
        "method=grpo",
        "rewards=numeric",
        "batch_size=2",
    )
    assert done.returncode == EXIT_BAD_INPUT
    assert done.stderr.endswith(
        "error: rewards=numeric compares answers with each row's 'answer', and 1 of 2 rows have "
        "none (rows 2): add answers, or use rewards that need none (format, length)\n"
    ), done.stderr
    assert not (workspace / "output" / "result.json").exists()


def test_grpo_has_no_validation_loss_and_needs_prompts(prompt_workspace, tmp_path):
    workspace = shutil.copytree(prompt_workspace, tmp_path / "ws")
    env = {"TUNEPACK_WORKSPACE": str(workspace), "TUNEPACK_MODEL": "tiny-llama3"}
    done = run_program("tunepack.trainers.launch", env, "method=grpo", "val_fraction=0.1")
    assert done.returncode == EXIT_BAD_INPUT
    assert done.stderr.endswith(
        "error: val_fraction=0.1: method=grpo has no validation loss to compute (its progress is "
        "the reward in each step's metrics); leave it out\n"
    ), done.stderr
    done = run_program("tunepack.trainers.launch", env, "method=lora")
    assert done.returncode == EXIT_BAD_INPUT
    assert done.stderr.endswith(
        "error: the dataset is a prompt dataset (prompts to answer), which method=lora cannot "
        "learn from: use method=grpo or method=grpo_full\n"
    ), done.stderr


def test_the_prompt_set_fine_tunes_the_model_first_with_a_column_map(tiny_model_dir, tmp_path):
    """docs/trainer.md's first step: the prompts and their answers as instruction rows
    (`--column-map prompt:instruction,answer:output`), a supervised run; a bad map is refused
    before anything starts."""
    data = write_tiny_prompt_dataset(tmp_path / "prompts.jsonl", rows=16)
    cli = [sys.executable, "-m", "tunepack.cli", "train", "--local"]
    common = ["--runtime", "tunepack-tiny-llama3", "--dataset", f"file://{data}"]
    common += ["--model", f"file://{tiny_model_dir}"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    bad = subprocess.run(
        [*cli, *common, "--workspace", str(tmp_path / "bad"), "--column-map", "prompt"],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )
    assert bad.returncode == EXIT_BAD_INPUT
    assert bad.stderr == (
        "tunepack: error: --column-map 'prompt' is not valid: write source:target pairs "
        "separated by commas (question:instruction,answer:output) or a JSON object of strings\n"
    )
    assert not (tmp_path / "bad").exists()
    workspace = tmp_path / "sft"
    done = subprocess.run(
        [*cli, *common, "--workspace", str(workspace)]
        + ["--column-map", "prompt:instruction,answer:output", "method=full", "max_steps=2"],
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    manifest = json.loads((workspace / "dataset" / "tunepack-manifest.json").read_text())
    assert (manifest["schema"], manifest["rows"]) == ("instruction", 16)
    first = json.loads((workspace / "dataset" / "train.jsonl").read_text().splitlines()[0])
    assert first == {"instruction": tiny_prompt_rows(1)[0]["prompt"], "input": "", "output": "25"}
