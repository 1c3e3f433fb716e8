"""Preference tuning (method=dpo): the preference schema, the DPO loss, training, resume, FSDP2."""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests import REPO
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
from tests.integration.test_dataset_schemas import jsonl, output, run_dataset
from tunepack.core.errors import EXIT_BAD_INPUT, BadValueError, ConflictError
from tunepack.runtimes import catalog, methods
from tunepack.runtimes.args import builder_for, parse_trainer_args
from tunepack.tiny.dataset import write_tiny_preference_dataset
from tunepack.trainers.objectives.dpo import DPO, answer_logps

PAIR = {"prompt": "2+2?", "chosen": "4", "rejected": "5"}
CHAT_PAIR = {
    "chosen": [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4"}],
    "rejected": [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "5"}],
}
NORMALIZED = CHAT_PAIR
PREFERENCE_HINT = (
    "each row must hold string fields 'prompt', 'chosen' and 'rejected', or 'chosen' and "
    "'rejected' as arrays of objects with 'role' (system, user or assistant) and string "
    "'content' that share every turn but their last, an assistant turn"
)


# ------------------------------------------------------------------ the preference schema


def test_prompt_chosen_rejected_rows_become_two_conversations(tmp_path):
    result = run_dataset(tmp_path, jsonl(tmp_path / "p.jsonl", [{**PAIR, "score": 3}]))
    assert result.returncode == 0, result.stderr
    rows, manifest = output(tmp_path)
    assert rows == [NORMALIZED]
    assert (manifest["schema"], manifest["source_schema"], manifest["rows"]) == (
        "preference",
        "preference",
        1,
    )


def test_chat_form_with_a_separate_prompt_and_a_system_turn(tmp_path):
    system = {"role": "system", "content": "Be brief."}
    row = {
        "prompt": [system, {"role": "user", "content": "2+2?"}],
        "chosen": [{"role": "assistant", "content": "4"}],
        "rejected": [{"role": "assistant", "content": "5"}],
    }
    result = run_dataset(tmp_path, jsonl(tmp_path / "p.jsonl", [CHAT_PAIR, row]))
    assert result.returncode == 0, result.stderr
    rows, _ = output(tmp_path)
    assert rows[0] == NORMALIZED
    assert rows[1] == {
        "chosen": [system, *NORMALIZED["chosen"]],
        "rejected": [system, *NORMALIZED["rejected"]],
    }


def test_a_prompt_the_conversations_already_hold_is_not_repeated(tmp_path):
    """UltraFeedback binarized style: full conversations next to a 'prompt' that repeats them."""
    system = {"role": "system", "content": "Be brief."}
    h4 = {"prompt": "2+2?", **CHAT_PAIR, "score_chosen": 8.0, "score_rejected": 2.0}
    with_system = {
        "prompt": "2+2?",
        "chosen": [system, *CHAT_PAIR["chosen"]],
        "rejected": [system, *CHAT_PAIR["rejected"]],
    }
    as_turns = {"prompt": CHAT_PAIR["chosen"][:1], **CHAT_PAIR}
    result = run_dataset(tmp_path, jsonl(tmp_path / "p.jsonl", [h4, with_system, as_turns]))
    assert result.returncode == 0, result.stderr
    rows, _ = output(tmp_path)
    assert rows == [
        NORMALIZED,
        {
            "chosen": [system, *NORMALIZED["chosen"]],
            "rejected": [system, *NORMALIZED["rejected"]],
        },
        NORMALIZED,
    ]


def test_csv_preference_rows_with_a_column_map(tmp_path):
    (tmp_path / "p.csv").write_text("question,good,bad\n2+2?,4,5\n")
    result = run_dataset(tmp_path, "p.csv", COLUMN_MAP="question:prompt,good:chosen,bad:rejected")
    assert result.returncode == 0, result.stderr
    assert output(tmp_path)[0] == [NORMALIZED]


def _turn(role, content):
    return {"role": role, "content": content}


PREFERENCE_CORPUS = [
    # (id, rows, message for row 2)
    ("missing-rejected", [PAIR, {"prompt": "x", "chosen": "y"}], "field 'rejected' is missing"),
    ("missing-prompt", [PAIR, {"chosen": "y", "rejected": "z"}], "field 'prompt' is missing"),
    (
        "prompt-not-string",
        [PAIR, {"prompt": 3, "chosen": "y", "rejected": "z"}],
        "field 'prompt' must be a string, got number",
    ),
    (
        "mixed-kinds",
        [PAIR, {"prompt": "x", "chosen": "y", "rejected": [_turn("assistant", "z")]}],
        "'chosen' and 'rejected' must both be strings or both arrays, got string and array",
    ),
    (
        "same-answer",
        [PAIR, {"prompt": "x", "chosen": "y", "rejected": "y"}],
        "'chosen' and 'rejected' are the same answer, so there is no preference",
    ),
    (
        "chat-ends-with-user",
        [PAIR, {"chosen": [_turn("user", "x")], "rejected": [_turn("assistant", "z")]}],
        "field 'chosen' must end with an assistant turn",
    ),
    (
        "chat-different-prompts",
        [
            PAIR,
            {
                "chosen": [_turn("user", "x"), _turn("assistant", "y")],
                "rejected": [_turn("user", "other"), _turn("assistant", "z")],
            },
        ],
        "'chosen' and 'rejected' must be the same conversation up to their last (assistant) turn",
    ),
    (
        "chat-bad-role",
        [PAIR, {"chosen": [_turn("bot", "y")], "rejected": [_turn("assistant", "z")]}],
        "chosen[0]: role 'bot' is not one of system, user, assistant",
    ),
    (
        "chat-no-user",
        [PAIR, {"chosen": [_turn("assistant", "y")], "rejected": [_turn("assistant", "z")]}],
        "the conversation has no user turn (or 'prompt') before the answers",
    ),
    (
        "prompt-not-in-conversations",
        [PAIR, {"prompt": "3+3?", **CHAT_PAIR}],
        "'chosen' and 'rejected' hold user turns of their own and 'prompt' is not among them: "
        "leave out 'prompt', or give only the answers in them",
    ),
    (
        "chat-empty",
        [PAIR, {"prompt": "x", "chosen": [], "rejected": [_turn("assistant", "z")]}],
        "field 'chosen' is empty",
    ),
]


@pytest.mark.parametrize(
    ("rows", "problem"),
    [c[1:] for c in PREFERENCE_CORPUS],
    ids=[c[0] for c in PREFERENCE_CORPUS],
)
def test_bad_preference_rows_are_named_by_row_and_field(tmp_path, rows, problem):
    result = run_dataset(tmp_path, jsonl(tmp_path / "d.jsonl", rows))
    assert result.returncode == EXIT_BAD_INPUT, result.stderr
    assert result.stderr == (
        f"dataset-initializer: error: dataset 'd.jsonl' has 1 invalid row; {PREFERENCE_HINT}:\n"
        f"  d.jsonl row 2: {problem}\n"
    )
    assert not (tmp_path / "ws" / "dataset").exists()


def test_forced_preference_schema_on_instruction_rows(tmp_path):
    rows = [{"instruction": "x", "output": "y"}]
    result = run_dataset(tmp_path, jsonl(tmp_path / "d.jsonl", rows), DATASET_SCHEMA="preference")
    assert result.returncode == EXIT_BAD_INPUT
    assert result.stderr.endswith("  d.jsonl row 1: field 'chosen' is missing\n")


def test_tiny_preference_rows_prefer_the_right_answer():
    from tunepack.tiny.dataset import tiny_dataset_rows, tiny_preference_rows

    pairs = tiny_preference_rows(20)
    assert len(pairs) == 20 and all(p["chosen"] != p["rejected"] for p in pairs)
    rows = tiny_dataset_rows(20)
    assert [p["chosen"] for p in pairs] == [r["output"] for r in rows]
    assert json.dumps(pairs) == json.dumps(tiny_preference_rows(20))  # deterministic


# ------------------------------------------------------------------ the DPO loss


@pytest.mark.parametrize(
    ("loss", "beta", "expected"),
    [
        ("sigmoid", 0.5, -math.log(1 / (1 + math.exp(-1.0)))),  # -log sigmoid(0.5 * 2)
        ("hinge", 0.5, 0.0),  # max(0, 1 - 0.5 * 2)
        ("hinge", 0.25, 0.5),  # max(0, 1 - 0.25 * 2)
        ("ipo", 0.5, 1.0),  # (2 - 1 / (2 * 0.5)) ** 2
    ],
)
def test_loss_variants_on_known_log_probabilities(loss, beta, expected):
    """h = (policy margin) - (reference margin) = (-1 - -3) - (-2 - -2) = 2; the
    log-probabilities are given (reference pass first, then the policy's)."""
    dpo = DPO(beta=beta, loss=loss)
    outputs = iter([torch.tensor([-2.0, -2.0]), torch.tensor([-1.0, -3.0])])
    dpo._logps = lambda model, tokens, labels: next(outputs)
    batch = {"tokens": torch.zeros(2, 3, dtype=torch.long), "labels": torch.zeros(2, 3)}
    total, pairs = dpo.forward(torch.nn.Identity(), batch, torch.device("cpu"))
    assert pairs == 1 and total.item() == pytest.approx(expected, abs=1e-6)
    _, chosen, rejected, correct = dpo.batch_stats
    assert (chosen, rejected, correct) == (beta, -beta, 1)


def test_answer_log_probabilities_count_only_labelled_tokens():
    logits = torch.randn(2, 4, 5, generator=torch.Generator().manual_seed(0))
    labels = torch.tensor([[-100, -100, 3, 1], [-100, 2, -100, -100]])
    summed, counted = answer_logps(logits, labels)
    logp = logits.log_softmax(-1)
    assert counted.tolist() == [2, 1]
    assert torch.allclose(summed[0], logp[0, 1, 3] + logp[0, 2, 1])
    assert torch.allclose(summed[1], logp[1, 0, 2])


# ------------------------------------------------------------------ arguments


def test_dpo_arguments_and_their_errors():
    llama = catalog.get("llama3.1-8b")
    args = parse_trainer_args(["method=dpo", "beta=0.3", "dpo_loss=ipo"], llama)
    assert (args.method, args.beta, args.dpo_loss, args.lr) == ("dpo", 0.3, "ipo", 5e-5)
    assert builder_for(llama, methods.get("dpo")) == llama.builders["lora"]
    assert "dpo" in TINY.methods and "dpo" in llama.methods
    defaults = parse_trainer_args(["method=dpo"], llama)
    assert (defaults.beta, defaults.dpo_loss) == (0.1, "sigmoid")
    # The tiny model's catalog lr (3e-3) is an SFT rate: DPO keeps its own unless one is given.
    assert parse_trainer_args(["method=dpo"], TINY).lr == 5e-5
    assert parse_trainer_args(["method=dpo", "lr=1e-3"], TINY).lr == 1e-3
    assert parse_trainer_args(["method=lora"], TINY).lr == TINY.defaults["lr"] == 3e-3
    for argv, kind, message in (
        (
            ["beta=0.3"],
            ConflictError,
            "beta=0.3: only method=dpo, orpo, kto, grpo or grpo_full uses beta, but method=lora",
        ),
        (["method=dpo", "beta=0"], BadValueError, "beta='0' is not valid: expected a number > 0.0"),
        (
            ["method=dpo", "dpo_loss=kto"],
            BadValueError,
            "dpo_loss='kto' is not valid: expected one of sigmoid, ipo, hinge",
        ),
        (
            ["method=dpo", "packed=true"],
            ConflictError,
            "packed=true is not available with method=dpo: each preference pair is its own "
            "sequence; set packed=false",
        ),
    ):
        with pytest.raises(kind) as err:
            parse_trainer_args(argv, TINY)
        assert type(err.value) is kind
        assert str(err.value) == message


# ------------------------------------------------------------------ training


@pytest.fixture(scope="module")
def preference_workspace(tmp_path_factory, tiny_model_dir) -> Path:
    """Both initializers run over 8 tiny preference pairs (read-only: copy before writing)."""
    data = write_tiny_preference_dataset(tmp_path_factory.mktemp("pref") / "pairs.jsonl", rows=8)
    return initialize_workspace(tmp_path_factory.mktemp("pref-ws"), data, tiny_model_dir)


# Every step sees all 8 pairs (one batch): the margin should grow step after step.
TRAIN = ["method=dpo", "batch_size=8", "epochs=12", "lr=3e-3", "warmup_steps=0"]


def test_dpo_grows_the_margin_and_the_adapter_loads_in_peft(preference_workspace, tmp_path):
    import peft
    import transformers

    recipe = setup_recipe(
        TINY,
        [*TRAIN, "checkpoint_every_minutes=0"],
        model_dir=preference_workspace / "model",
        dataset_dir=preference_workspace / "dataset",
        output=tmp_path,
    )
    recipe.train()
    recipe.save()
    steps = step_records(tmp_path)
    margins = [s["reward_margin"] for s in steps]
    accuracy = [s["reward_accuracy"] for s in steps]
    assert len(steps) == 12 and steps[0]["loss"] == pytest.approx(0.693147, abs=1e-5)
    assert margins[0] == 0  # the first batch meets the untrained adapters: policy == reference
    assert margins[-1] > margins[6] > margins[2] > 0, margins
    assert accuracy[0] == 0 and accuracy[-1] >= 0.75, accuracy  # at first the rewards tie
    assert steps[-1]["loss"] < steps[1]["loss"] < steps[0]["loss"]
    assert all(s["tokens"] > 8 * 2 for s in steps)  # real tokens, not pairs
    assert all(0 < s["fill"] <= 1 for s in steps)  # chosen and rejected padded together

    # The published adapter, loaded by peft over the base in transformers, prefers the chosen
    # answers: its implicit reward margin on the pairs is what the trainer reached.
    base = transformers.AutoModelForCausalLM.from_pretrained(
        preference_workspace / "model", torch_dtype=torch.float32
    )
    batch = recipe.collate([recipe.dataloader.dataset[i] for i in range(8)])
    with torch.no_grad():
        ref, _ = answer_logps(base(batch["tokens"]).logits, batch["labels"])
        tuned = peft.PeftModel.from_pretrained(base, tmp_path / "adapter").eval()
        pol, _ = answer_logps(tuned(batch["tokens"]).logits, batch["labels"])
    rewards = 0.1 * (pol - ref)
    margin = (rewards[:8] - rewards[8:]).mean().item()
    assert margin > margins[-1] > 0  # one more update than the last step's (pre-update) margin
    assert (rewards[:8] > rewards[8:]).float().mean().item() >= 0.75
    result = json.loads((tmp_path / "result.json").read_text())
    assert result["method"] == "dpo" and result["dpo"]["beta"] == 0.1
    assert result["dpo"]["reward_margin"] == margins[-1]


def test_method_and_dataset_must_match(preference_workspace, initialized_workspace, tmp_path):
    with pytest.raises(ConflictError) as err:
        setup_recipe(
            TINY,
            ["method=dpo"],
            model_dir=initialized_workspace / "model",
            dataset_dir=initialized_workspace / "dataset",
            output=tmp_path / "a",
        )
    assert str(err.value) == (
        "method=dpo needs a preference dataset (rows with 'prompt', 'chosen' and 'rejected'), "
        "but the dataset's schema is 'instruction'"
    )
    env = {"TUNEPACK_WORKSPACE": str(shutil.copytree(preference_workspace, tmp_path / "ws"))}
    done = run_program("tunepack.trainers.launch", {**env, "TUNEPACK_MODEL": "tiny-llama3"})
    assert done.returncode == EXIT_BAD_INPUT
    assert done.stderr.endswith(
        "error: the dataset is a preference dataset (chosen/rejected pairs), which method=lora "
        "cannot learn from: use method=dpo or method=orpo\n"
    ), done.stderr


# ------------------------------------------------------------------ exact resume, FSDP2

# 12 epochs of 2 steps of 2 micro-batches of 2 pairs (8 pairs): 24 steps; LoRA dropout makes
# the result depend on the restored random state too.
RESUME = [
    "method=dpo",
    "epochs=12",
    "batch_size=2",
    "grad_accum=2",
    "lora_dropout=0.1",
    "lr=3e-3",
    "warmup_steps=2",
    "checkpoint_every_minutes=0",
]


def test_kill_9_then_restart_ends_bit_identical(preference_workspace, tmp_path):
    # The trainer may have run up to a page of output past step 5, never to the end.
    reference, interrupted, _ = straight_and_resumed(
        preference_workspace, tmp_path, RESUME, at_step=5, every=3
    )
    result, expected = result_of(interrupted), result_of(reference)
    assert result["steps"] == 24
    assert result["dpo"] == expected["dpo"]  # the last step's rewards, to the last digit
    assert_same_tensors(adapter_of(reference), adapter_of(interrupted))
    # metrics.jsonl lists each step once, the resumed run's steps after the checkpoint's.
    assert [s["step"] for s in step_records(interrupted / "output")] == list(range(1, 25))
    assert [s["reward_margin"] for s in step_records(interrupted / "output")] == [
        s["reward_margin"] for s in step_records(reference / "output")
    ]


def test_two_processes_with_fsdp_match_one_process(preference_workspace, tmp_path):
    """Two ranks of 4 pairs see the same 8 pairs per step as one process of 8 (the sampler deals
    one global order out), so FSDP2's DPO follows the one-process run, reference passes and all:
    closely, not exactly, as for supervised LoRA (sharded sums round differently and Adam's
    first steps, about lr * sign(gradient), magnify that: at 3e-3 on the tiny pairs, which the
    model learns fast, the two drift 0.009 apart in loss by step 6; at 1e-3 they stay within
    0.002 while the run still learns visibly)."""
    common = ["method=dpo", "epochs=6", "lr=1e-3", "warmup_steps=0", "checkpoint_every_minutes=0"]
    one = shutil.copytree(preference_workspace, tmp_path / "one")
    done = launch_trainer(trainer_env(one), *common, "batch_size=8")
    assert done.returncode == 0, done.stderr
    two = shutil.copytree(preference_workspace, tmp_path / "two")
    env = two_processes_env(two)
    done = launch_trainer(env, *common, "batch_size=4")
    assert done.returncode == 0, done.stdout + done.stderr
    assert result_of(two)["world_size"] == 2 and result_of(two)["method"] == "dpo"

    single, sharded = step_records(one / "output"), step_records(two / "output")
    assert len(single) == len(sharded) == 6
    for a, b in zip(single, sharded, strict=True):
        assert a["tokens"] == b["tokens"]
        assert b["loss"] == pytest.approx(a["loss"], abs=5e-3)
        assert b["reward_margin"] == pytest.approx(a["reward_margin"], abs=1e-2)
    assert sharded[0]["loss"] == pytest.approx(0.693147, abs=1e-6)  # policy == reference
    assert sharded[-1]["reward_margin"] > sharded[2]["reward_margin"] > sharded[1]["reward_margin"]
    assert sharded[-1]["loss"] < sharded[1]["loss"] < sharded[0]["loss"]
    assert sharded[-1]["reward_accuracy"] >= 0.75


# ------------------------------------------------------------------ planner


def test_planner_counts_two_sequences_per_example():
    from tunepack.runtimes.planner import plan

    lora = plan("llama3.1-8b", "lora", 1024, 2, lora_rank=8)
    dpo = plan("llama3.1-8b", "dpo", 1024, 2, lora_rank=8)
    assert (dpo.weights, dpo.gradients, dpo.optimizer) == (
        lora.weights,
        lora.gradients,
        lora.optimizer,
    )
    # Same tokens per sequence, twice the sequences: chosen and rejected. DPO needs the whole
    # logits, where LoRA's cross-entropy is fused with the output projection.
    whole = plan("llama3.1-8b", "lora", 1024, 2, lora_rank=8, fused_loss=False)
    assert (dpo.activations, dpo.logits) == (2 * lora.activations, 2 * whole.logits)
    assert dpo.peak_bytes > lora.peak_bytes
    assert any("reference forward pass" in note for note in dpo.notes)
    assert not any("reference" in note for note in lora.notes)
    # Batch 4 fits for LoRA but not for DPO on one H100 without activation checkpointing.
    assert plan("llama3.1-8b", "lora", 2048, 4, activation_checkpointing=False).fits
    assert not plan("llama3.1-8b", "dpo", 2048, 4, activation_checkpointing=False).fits


def test_readme_method_table_is_generated_from_the_vocabulary():
    from tunepack.runtimes.args_docs import methods_table
    from tunepack.runtimes.methods import NAMES

    readme = (REPO / "README.md").read_text(encoding="utf-8")
    block = readme.split("<!-- methods:begin -->\n")[1].split("<!-- methods:end -->")[0]
    assert block == methods_table(), (
        "README.md is stale: python -m tunepack.runtimes.args_docs methods"
    )
    assert all(f"| `{method}` |" in block for method in NAMES)


def test_validation_split_reports_the_dpo_loss_of_held_out_pairs(preference_workspace, tmp_path):
    recipe = setup_recipe(
        TINY,
        ["method=dpo", "batch_size=2", "max_steps=2", "val_fraction=0.25", "lr=3e-3"],
        model_dir=preference_workspace / "model",
        dataset_dir=preference_workspace / "dataset",
        output=tmp_path,
    )
    assert len(recipe.val_indices) == 2 and len(recipe.dataloader.dataset) == 6
    before = recipe.evaluate()
    assert before == pytest.approx(0.693147, abs=1e-6)  # adapters untrained: policy == reference
    recipe.train()
    recipe.save()
    result = json.loads((tmp_path / "result.json").read_text())
    assert result["val_loss"] == pytest.approx(recipe.evaluate(), abs=1e-6)
    assert result["val_loss"] != pytest.approx(before, abs=1e-6)


def test_quickstart_size_cli_run_learns_and_shows_the_rewards(tiny_model_dir, tmp_path):
    """docs/trainer.md's run: `tunepack tiny-dataset --preference` (256 pairs) then `tunepack
    train --local ... method=dpo epochs=3` end to end, at DPO's own lr (not the tiny model's SFT
    rate): it ends preferring the chosen answers, and the console says so."""
    data = tmp_path / "pairs.jsonl"
    made = subprocess.run(
        [sys.executable, "-m", "tunepack.cli", "tiny-dataset", "--preference", str(data)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert made.returncode == 0 and "tiny preference dataset" in made.stdout, made.stderr
    workspace = tmp_path / "ws"
    done = subprocess.run(
        [sys.executable, "-m", "tunepack.cli", "train", "--local"]
        + ["--runtime", "tunepack-tiny-llama3", "--workspace", str(workspace)]
        + ["--dataset", f"file://{data}", "--model", f"file://{tiny_model_dir}"]
        + ["method=dpo", "epochs=3"],
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert done.returncode == 0, done.stdout + done.stderr
    steps = step_records(workspace / "output")
    last = steps[-1]
    shown = [line for line in done.stdout.splitlines() if f"step {len(steps)}/" in line]
    margin, accuracy = f"{last['reward_margin']:.4f}", f"{last['reward_accuracy']:.2f}"
    assert len(shown) == 1 and shown[0].endswith(f"margin {margin}  accuracy {accuracy}")
    assert f"  rewards     margin {margin}, accuracy {accuracy} (last step)\n" in done.stdout
    assert "method      dpo" in done.stdout
    assert max(s["lr"] for s in steps) == pytest.approx(5e-5)  # the method's, not 3e-3
    # It learns: over the last epoch the chosen answers mostly win (chance is 0.5).
    last_epoch = [s for s in steps if s["epoch"] == 3]
    assert sum(s["reward_accuracy"] for s in last_epoch) / len(last_epoch) > 0.7
    assert sum(s["reward_margin"] for s in last_epoch) > 0
    manifest = json.loads((workspace / "dataset" / "tunepack-manifest.json").read_text())
    assert (manifest["schema"], manifest["rows"]) == ("preference", 256)


@pytest.mark.parametrize(("loss", "at_start"), [("ipo", (1 / (2 * 0.1)) ** 2), ("hinge", 1.0)])
def test_other_losses_train_too(preference_workspace, tmp_path, loss, at_start):
    recipe = setup_recipe(
        TINY,
        ["method=dpo", f"dpo_loss={loss}", "batch_size=8", "epochs=4", "lr=3e-3", "warmup_steps=0"],
        model_dir=preference_workspace / "model",
        dataset_dir=preference_workspace / "dataset",
        output=tmp_path,
    )
    recipe.train()
    steps = step_records(tmp_path)
    assert steps[0]["loss"] == pytest.approx(at_start, rel=1e-6)  # h = 0 before any update
    assert steps[-1]["loss"] < steps[1]["loss"] < steps[0]["loss"]
    assert steps[-1]["reward_margin"] > steps[1]["reward_margin"] > 0
