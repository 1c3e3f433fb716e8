"""Evaluation during training: a held-out validation split, val_loss records and keep_best."""

from __future__ import annotations

import json
import math

import pytest
import torch
from safetensors.torch import load_file

from tests.helpers import run_program, setup_recipe
from tunepack.errors import EXIT_BAD_INPUT, BadInputError
from tunepack.runtimes import catalog
from tunepack.trainers.args import parse_trainer_args

TINY = catalog.get("tiny-llama3")


def _records(output, event):
    lines = (output / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if r.get("event") == event]


def _recipe(workspace, output, argv):
    return setup_recipe(
        TINY,
        argv,
        model_dir=workspace / "model",
        dataset_dir=workspace / "dataset",
        output=output,
    )


@pytest.fixture(scope="module")
def evaluated(initialized_workspace, tmp_path_factory):
    output = tmp_path_factory.mktemp("eval-output")
    argv = ["val_fraction=0.1", "eval_every_steps=5", "max_steps=20", "lr=3e-3", "batch_size=8"]
    recipe = _recipe(initialized_workspace, output, [*argv, "warmup_steps=2"])
    recipe.train()
    recipe.save()
    return recipe, output


def test_validation_rows_are_held_out_and_fixed(evaluated, initialized_workspace, tmp_path):
    recipe, _ = evaluated
    # 256 rows, 10% held out: 26 for validation, 230 for training.
    assert len(recipe.val_indices) == 26
    assert len(recipe.dataloader.dataset) == 230
    train_rows = set(recipe.dataloader.dataset.indices)
    assert train_rows.isdisjoint(recipe.val_indices)
    # Another seed shuffles training differently but holds out the very same rows.
    other = _recipe(
        initialized_workspace, tmp_path, ["val_fraction=0.1", "seed=7", "max_steps=1"]
    )
    assert other.val_indices == recipe.val_indices


def test_eval_records_and_loss_falls(evaluated):
    _, output = evaluated
    evals = _records(output, "eval")
    assert [r["step"] for r in evals] == [5, 10, 15, 20]
    for r in evals:
        assert math.isclose(r["val_perplexity"], math.exp(r["val_loss"]), rel_tol=1e-3)
        assert r["val_rows"] == 26 and r["eval_s"] >= 0
    # The held-out loss falls as the adapter learns the task (uniform guess: ln 384 = 5.95).
    assert evals[-1]["val_loss"] < evals[0]["val_loss"] - 0.3, evals
    steps = _records(output, "step")
    assert [r["step"] for r in steps] == list(range(1, 21))


def test_result_has_validation_and_eval_time(evaluated):
    recipe, output = evaluated
    result = json.loads((output / "result.json").read_text())
    evals = _records(output, "eval")
    assert result["val_loss"] == pytest.approx(evals[-1]["val_loss"], abs=1e-6)
    assert result["best_val_loss"] == pytest.approx(min(r["val_loss"] for r in evals), abs=1e-6)
    assert result["best_step"] == min(evals, key=lambda r: r["val_loss"])["step"]
    assert result["evaluations"] == 4 and result["eval_time_s"] > 0
    assert result["published_step"] == 20 and result["keep_best"] is False
    # Evaluation time is not training time.
    assert result["eval_time_s"] == pytest.approx(sum(r["eval_s"] for r in evals), abs=0.01)


def test_keep_best_publishes_the_best_step(initialized_workspace, tmp_path):
    """A learning rate high enough to overshoot: the last step is not the best, and the
    published adapter is the best step's, not the last one's."""
    recipe = _recipe(
        initialized_workspace,
        tmp_path,
        [
            "val_fraction=0.1",
            "eval_every_steps=2",
            "max_steps=12",
            "lr=0.05",
            "warmup_steps=0",
            "batch_size=8",
            "keep_best=true",
        ],
    )
    recipe.train()
    recipe.save()
    result = json.loads((tmp_path / "result.json").read_text())
    evals = _records(tmp_path, "eval")
    best = min(evals, key=lambda r: r["val_loss"])
    assert result["keep_best"] is True
    assert result["published_step"] == result["best_step"] == best["step"]
    published = load_file(tmp_path / "adapter" / "adapter_model.safetensors")
    kept = load_file(tmp_path / ".best" / "weights.safetensors")
    assert json.loads((tmp_path / ".best" / "best.json").read_text())["step"] == best["step"]
    if best["step"] != 12:
        # The live model is the last step's; the published adapter must differ from it.
        recipe.save()  # idempotent: publishes the best again
        live = {k: v for k, v in recipe.model.state_dict().items() if "lora" in k}
        live_b = next(v for k, v in live.items() if k.endswith("lora_b.weight"))
        kept_b = next(v for k, v in kept.items() if k.endswith("lora_b.weight"))
        assert not torch.equal(live_b, kept_b)
    assert published  # loads


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["val_fraction=0.7"], "val_fraction='0.7' is not valid: expected a number >= 0.0"),
        (["eval_every_steps=-1"], "eval_every_steps='-1' is not valid: expected an integer >= 0"),
        (["tracker=comet"], "tracker='comet' is not valid: expected one of none, tensorboard"),
        (["tracker=mlflow", "tracker_uri=ftp://x"], "tracker_uri='ftp://x' is not valid"),
        (["tracker_uri=http://x"], "tracker_uri is only used by tracker=mlflow"),
    ],
)
def test_bad_arguments(argv, message):
    with pytest.raises(BadInputError, match=None) as caught:
        parse_trainer_args(argv, TINY)
    assert message in str(caught.value)


def test_keep_best_without_validation_exits_65(initialized_workspace, tmp_path):
    workspace = tmp_path / "ws"
    workspace.mkdir()
    for part in ("model", "dataset"):
        (workspace / part).symlink_to(initialized_workspace / part)
    done = run_program(
        "tunepack.trainers.launch",
        {"TUNEPACK_WORKSPACE": str(workspace), "TUNEPACK_MODEL": "tiny-llama3"},
        "keep_best=true",
        "max_steps=1",
    )
    assert done.returncode == EXIT_BAD_INPUT, done.stderr
    assert "keep_best=true needs a validation split" in done.stderr
    assert "Traceback" not in done.stderr
    assert not (workspace / "output" / "result.json").exists()
