"""The rest of the preference family: ORPO (reference-free, on preference pairs) and KTO (on
unpaired answers labelled desirable or undesirable): they learn the way they should, resume
bit-identically after kill -9, follow one process on two, and tell a user what is wrong."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest

from tests.helpers import (
    adapter_of,
    assert_same_tensors,
    initialize_workspace,
    launch_trainer,
    result_of,
    step_records,
    straight_and_resumed,
    trainer_env,
    two_processes_env,
)
from tunepack.core.errors import EXIT_BAD_INPUT
from tunepack.tiny.dataset import write_tiny_preference_dataset, write_tiny_unpaired_dataset


@pytest.fixture(scope="module")
def pair_workspace(tmp_path_factory, tiny_model_dir):
    """Both initializers over 8 tiny preference pairs (read-only: copy before writing)."""
    data = write_tiny_preference_dataset(tmp_path_factory.mktemp("pairs") / "p.jsonl", rows=8)
    return initialize_workspace(tmp_path_factory.mktemp("orpo-ws"), data, tiny_model_dir)


@pytest.fixture(scope="module")
def unpaired_workspace(tmp_path_factory, tiny_model_dir):
    """Both initializers over 16 tiny unpaired answers, half of them desirable."""
    data = write_tiny_unpaired_dataset(tmp_path_factory.mktemp("unpaired") / "u.jsonl", rows=16)
    return initialize_workspace(tmp_path_factory.mktemp("kto-ws"), data, tiny_model_dir)


WORKSPACES = {"orpo": "pair_workspace", "kto": "unpaired_workspace"}


def _run(workspace, *args):
    done = launch_trainer(trainer_env(workspace), *args)
    assert done.returncode == 0, done.stderr
    return step_records(workspace / "output")


def test_orpo_raises_the_chosen_answers_odds(pair_workspace, tmp_path):
    """Every step sees all 8 pairs: the log odds ratio grows step after step, the margin turns
    positive, the chosen answers' likelihood rises (ORPO's supervised term) and the loss falls."""
    workspace = shutil.copytree(pair_workspace, tmp_path / "ws")
    steps = _run(workspace, "method=orpo", "batch_size=8", "epochs=12", "lr=3e-3", "warmup_steps=0")
    ratio = [s["log_odds_ratio"] for s in steps]
    margin = [s["reward_margin"] for s in steps]
    assert len(steps) == 12
    assert ratio[-1] > ratio[6] > ratio[0], ratio
    # Measured: the log odds ratio -0.003 -> 0.046; the chosen answer's mean log-probability
    # wins 5 of the 8 pairs at the end, 4 at the start (the rewards are per-token means, close).
    assert margin[-1] > 0 > margin[0] and steps[-1]["reward_accuracy"] > 0.5, margin
    assert steps[-1]["nll"] < steps[0]["nll"]
    assert steps[-1]["loss"] < steps[0]["loss"]
    result = result_of(workspace)
    assert result["method"] == "orpo" and result["orpo"]["beta"] == 0.1
    assert result["orpo"]["log_odds_ratio"] == ratio[-1]


def test_kto_separates_desirable_from_undesirable_answers(unpaired_workspace, tmp_path):
    workspace = shutil.copytree(unpaired_workspace, tmp_path / "ws")
    steps = _run(workspace, "method=kto", "batch_size=16", "epochs=12", "lr=3e-3", "warmup_steps=0")
    margin = [s["reward_margin"] for s in steps]
    assert len(steps) == 12
    assert margin[0] == 0  # the adapters start as the reference: every reward is 0
    assert margin[-1] > margin[6] > 0, margin
    assert steps[-1]["reward_chosen"] > 0 > steps[-1]["reward_rejected"]
    assert steps[-1]["reward_accuracy"] >= 0.75
    assert steps[-1]["loss"] < steps[0]["loss"]
    assert all(s["kl"] >= 0 for s in steps)
    result = result_of(workspace)
    assert (
        result["kto"]["undesirable_weight"] == 1.0 and result["kto"]["reward_margin"] == margin[-1]
    )


# 12 epochs of 2 steps of 2 micro-batches: 24 steps; LoRA dropout makes the result depend on
# the restored random state too.
RESUME = [
    "epochs=12",
    "grad_accum=2",
    "lora_dropout=0.1",
    "lr=3e-3",
    "warmup_steps=2",
    "checkpoint_every_minutes=0",
]


@pytest.mark.parametrize(("method", "batch"), [("orpo", 2), ("kto", 4)])
def test_kill_9_then_restart_ends_bit_identical(method, batch, request, tmp_path):
    source = request.getfixturevalue(WORKSPACES[method])
    args = [f"method={method}", f"batch_size={batch}", *RESUME]
    steps = 24  # 12 epochs of 8 pairs / (2 x 2), of 16 answers / (4 x 2)
    reference, interrupted, _ = straight_and_resumed(source, tmp_path, args, at_step=5, every=3)
    result, expected = result_of(interrupted), result_of(reference)
    assert result["steps"] == steps
    assert result[method] == expected[method]  # the last step's metrics, to the last digit
    assert_same_tensors(adapter_of(reference), adapter_of(interrupted))
    resumed = step_records(interrupted / "output")
    assert [s["step"] for s in resumed] == list(range(1, steps + 1))
    assert [s["reward_margin"] for s in resumed] == [
        s["reward_margin"] for s in step_records(reference / "output")
    ]


@pytest.mark.parametrize("method", ["orpo", "kto"])
def test_two_processes_with_fsdp_follow_one_process(method, request, tmp_path):
    """Two ranks of half the batch see the batch of one process; KTO's reference point is
    summed over both ranks' mismatched pairs, so it is the one process's (up to rounding)."""
    source = request.getfixturevalue(WORKSPACES[method])
    total = 8 if method == "orpo" else 16
    common = [f"method={method}", "epochs=4", "lr=1e-3", "warmup_steps=0"]
    one = shutil.copytree(source, tmp_path / "one")
    single = _run(one, *common, f"batch_size={total}")
    two = shutil.copytree(source, tmp_path / "two")
    env = two_processes_env(two)
    done = launch_trainer(env, *common, f"batch_size={total // 2}")
    assert done.returncode == 0, done.stdout + done.stderr
    assert result_of(two)["world_size"] == 2
    sharded = step_records(two / "output")
    assert len(single) == len(sharded) == 4
    for a, b in zip(single, sharded, strict=True):
        assert a["tokens"] == b["tokens"]
        assert b["loss"] == pytest.approx(a["loss"], abs=5e-3)
        assert b["reward_margin"] == pytest.approx(a["reward_margin"], abs=1e-2)
        if method == "kto":
            assert b["kl"] == pytest.approx(a["kl"], abs=1e-3)


def test_kto_needs_unpaired_answers_and_says_so(pair_workspace, tmp_path):
    workspace = shutil.copytree(pair_workspace, tmp_path / "ws")
    done = launch_trainer(trainer_env(workspace), "method=kto", "batch_size=4")
    assert done.returncode == EXIT_BAD_INPUT
    assert done.stderr.endswith(
        "error: method=kto needs an unpaired dataset (rows with 'prompt', 'completion' and a "
        "boolean 'label' (whether the answer is desirable)), but the dataset's schema is "
        "'preference'\n"
    ), done.stderr


def test_tiny_unpaired_dataset_from_the_cli(tmp_path):
    data = tmp_path / "u.jsonl"
    made = subprocess.run(
        [sys.executable, "-m", "tunepack.cli", "tiny-dataset", "--unpaired"]
        + ["--rows", "6", str(data)],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ},
    )
    assert made.returncode == 0, made.stderr
    assert made.stdout == f"tiny unpaired dataset (for method=kto) ready at {data}\n"
    rows = [json.loads(line) for line in data.read_text().splitlines()]
    assert [r["label"] for r in rows] == [True, False] * 3
