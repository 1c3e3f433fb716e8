"""Evaluation during training: a held-out validation split, val_loss records and keep_best."""

from __future__ import annotations

import json
import math
import shutil

import pytest
import torch
from safetensors.torch import load_file

from tests.helpers import (
    adapter_of,
    assert_same_tensors,
    copy_workspace,
    launch_trainer,
    records,
    result_of,
    run_program,
    setup_recipe,
    straight_and_resumed,
    two_processes_env,
)
from tests.integration.test_sources import dataset_hub, hub, manifest_of, model_files, run_init  # noqa: F401
from tunepack.core.errors import (
    EXIT_BAD_INPUT,
    BadValueError,
    ConflictError,
    UnsupportedError,
)
from tunepack.runtimes import catalog
from tunepack.runtimes.args import parse_trainer_args

TINY = catalog.get("tiny-llama3")


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
    other = _recipe(initialized_workspace, tmp_path, ["val_fraction=0.1", "seed=7", "max_steps=1"])
    assert other.val_indices == recipe.val_indices


def test_eval_records_and_loss_falls(evaluated):
    _, output = evaluated
    evals = records(output, "eval")
    assert [r["step"] for r in evals] == [5, 10, 15, 20]
    for r in evals:
        assert math.isclose(r["val_perplexity"], math.exp(r["val_loss"]), rel_tol=1e-3)
        assert r["val_rows"] == 26 and r["eval_s"] >= 0
    # The held-out loss falls as the adapter learns the task (uniform guess: ln 384 = 5.95).
    assert evals[-1]["val_loss"] < evals[0]["val_loss"] - 0.3, evals
    steps = records(output, "step")
    assert [r["step"] for r in steps] == list(range(1, 21))


def test_result_has_validation_and_eval_time(evaluated):
    recipe, output = evaluated
    result = json.loads((output / "result.json").read_text())
    evals = records(output, "eval")
    assert result["val_loss"] == pytest.approx(evals[-1]["val_loss"], abs=1e-6)
    assert result["best_val_loss"] == pytest.approx(min(r["val_loss"] for r in evals), abs=1e-6)
    assert result["best_step"] == min(evals, key=lambda r: r["val_loss"])["step"]
    assert result["evaluations"] == 4 and result["eval_time_s"] > 0
    assert result["published_step"] == 20 and result["keep_best"] is False
    # Evaluation time is not training time.
    assert result["eval_time_s"] == pytest.approx(sum(r["eval_s"] for r in evals), abs=0.01)


def test_keep_best_publishes_the_best_step(initialized_workspace, tmp_path):
    """lr=0.1 overshoots at step 2 (Adam's first steps move every adapter weight by about lr;
    measured: validation loss 5.973 after step 1, 5.998 after step 2): step 1 has the best
    validation loss, and the published adapter is bit for bit the one a run that stopped after
    step 1 publishes."""
    common = ["val_fraction=0.1", "eval_every_steps=1", "lr=0.1", "warmup_steps=0"]
    common.append("batch_size=4")
    best_run = _recipe(
        initialized_workspace, tmp_path / "best", [*common, "max_steps=2", "keep_best=true"]
    )
    best_run.train()
    best_run.save()
    result = json.loads((tmp_path / "best" / "result.json").read_text())
    evals = records(tmp_path / "best", "eval")
    assert [r["step"] for r in evals] == [1, 2]
    assert evals[1]["val_loss"] > evals[0]["val_loss"], evals
    assert result["keep_best"] is True
    assert result["steps"] == 2 and result["published_step"] == result["best_step"] == 1
    assert result["val_loss"] == pytest.approx(evals[1]["val_loss"], abs=1e-6)
    assert result["best_val_loss"] == pytest.approx(evals[0]["val_loss"], abs=1e-6)

    one_step = _recipe(initialized_workspace, tmp_path / "one", [*common, "max_steps=1"])
    one_step.train()
    one_step.save()
    published = load_file(tmp_path / "best" / "adapter" / "adapter_model.safetensors")
    reference = load_file(tmp_path / "one" / "adapter" / "adapter_model.safetensors")
    assert published.keys() == reference.keys()
    for key in published:
        assert torch.equal(published[key], reference[key]), key
    # ... and not the last step's adapter, which the live model still holds.
    last = {k: v for k, v in best_run.model.state_dict().items() if "lora_b" in k}
    first = {k: v for k, v in one_step.model.state_dict().items() if "lora_b" in k}
    assert any(not torch.equal(last[k], first[k]) for k in last)


@pytest.mark.parametrize(
    ("argv", "kind", "message"),
    [
        (
            ["val_fraction=0.7"],
            BadValueError,
            "val_fraction='0.7' is not valid: expected a number >= 0.0 and < 0.5",
        ),
        (
            ["eval_every_steps=-1"],
            BadValueError,
            "eval_every_steps='-1' is not valid: expected an integer >= 0",
        ),
        (
            ["tracker=comet"],
            BadValueError,
            "tracker='comet' is not valid: expected one of none, tensorboard, mlflow, wandb",
        ),
        (
            ["tracker=mlflow", "tracker_uri=ftp://x"],
            BadValueError,
            "tracker_uri='ftp://x' is not valid: expected a URI starting with http://, https://, "
            "file://",
        ),
        (
            ["tracker_uri=http://x"],
            ConflictError,
            "tracker_uri is only used by tracker=mlflow, but tracker='none'",
        ),
        (
            ["tracker=mlflow", "tracker_uri=https://me:s3cret@mlflow.example"],
            UnsupportedError,
            "tracker_uri must not carry credentials in the URI: give them through the environment "
            "(MLFLOW_TRACKING_USERNAME / MLFLOW_TRACKING_PASSWORD or MLFLOW_TRACKING_TOKEN)",
        ),
        (
            ["keep_best=maybe"],
            BadValueError,
            "keep_best='maybe' is not valid: expected true or false",
        ),
    ],
)
def test_bad_arguments(argv, kind, message):
    with pytest.raises(kind) as caught:
        parse_trainer_args(argv, TINY)
    assert type(caught.value) is kind
    assert str(caught.value) == message
    assert "s3cret" not in str(caught.value)  # a credential is never echoed


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


# ------------------------------------------------------------------ every method, in-process

METHOD_CASES = [("full", None), ("dora", None), ("qlora", "nf4")]


@pytest.mark.parametrize(("method", "model"), METHOD_CASES, ids=[m for m, _ in METHOD_CASES])
def test_eval_under_every_method(initialized_workspace, tmp_path, method, model):
    from tests.helpers import NF4_TINY
    from tunepack.tiny import write_tiny_model

    entry, model_dir = TINY, initialized_workspace / "model"
    if model == "nf4":  # the tiny model's shapes are too small for NF4 blocks
        entry, model_dir = NF4_TINY, write_tiny_model(tmp_path / "nf4", NF4_TINY)
    argv = [f"method={method}", "val_fraction=0.1", "eval_every_steps=2", "max_steps=4"]
    argv += ["warmup_steps=0", "batch_size=8", "lr=1e-2" if method != "full" else "lr=1e-3"]
    recipe = setup_recipe(
        entry,
        argv,
        model_dir=model_dir,
        dataset_dir=initialized_workspace / "dataset",
        output=tmp_path / "out",
    )
    recipe.train()
    recipe.save()
    evals = records(tmp_path / "out", "eval")
    assert [r["step"] for r in evals] == [2, 4]
    assert evals[-1]["val_loss"] < evals[0]["val_loss"] + 0.5  # finite and sane
    assert all(math.isfinite(r["val_loss"]) for r in evals)
    result = json.loads((tmp_path / "out" / "result.json").read_text())
    assert result["method"] == method
    assert result["val_loss"] == pytest.approx(evals[-1]["val_loss"], abs=1e-6)


# ------------------------------------------------------------------ processes: torchrun, kill -9


def test_two_processes_evaluate_the_same_loss_as_one(initialized_workspace, tmp_path):
    """Under torchrun each rank evaluates its share (26 rows over 2 ranks of batch 8: one rank
    runs a discarded batch); the summed loss is the one-process loss of the same weights."""
    args = ["method=full", "val_fraction=0.1", "eval_every_steps=2", "max_steps=2"]
    args += ["warmup_steps=0", "lr=1e-3", "batch_size=8", "keep_best=true", "tracker=tensorboard"]
    two = copy_workspace(initialized_workspace, tmp_path, "two")
    done = launch_trainer(two_processes_env(two), *args)
    assert done.returncode == 0, done.stdout + done.stderr
    result = json.loads((two / "output" / "result.json").read_text())
    assert result["world_size"] == 2 and result["val_rows"] == 26
    assert result["published_step"] == result["best_step"] == 2
    # Only rank 0 tracks: one event file.
    assert len(list((two / "output" / "tracker").glob("events.out.tfevents.*"))) == 1
    evals = records(two / "output", "eval")
    assert [r["step"] for r in evals] == [2]
    # The published model, evaluated on the same rows in one process, gives the same loss.
    published = tmp_path / "published"
    shutil.copytree(two / "output" / "model", published)
    (published / "model-00001-of-00001.safetensors").rename(published / "model.safetensors")
    (published / "model.safetensors.index.json").unlink()
    (published / "tunepack-manifest.json").unlink()
    recipe = setup_recipe(
        TINY,
        ["method=full", "val_fraction=0.1", "batch_size=8", "max_steps=1"],
        model_dir=published,
        dataset_dir=two / "dataset",
        output=tmp_path / "check",
    )
    assert recipe.evaluate() == pytest.approx(evals[0]["val_loss"], abs=1e-4)


def test_kill_9_with_eval_resumes_bit_identical(initialized_workspace, tmp_path):
    from tests.integration.test_trainer_processes import RESUME_ARGS

    eval_args = [*RESUME_ARGS, "val_fraction=0.1", "eval_every_steps=2", "keep_best=true"]
    args = [*eval_args, "checkpoint_every_minutes=0"]
    reference, interrupted, newest = straight_and_resumed(
        initialized_workspace, tmp_path, args, at_step=5, every=3
    )
    result, expected_result = result_of(interrupted), result_of(reference)
    assert newest in (3, 6)
    for key in ("steps", "tokens_seen", "val_loss", "best_val_loss", "best_step", "published_step"):
        assert result[key] == expected_result[key], key
    # Each evaluation recorded once, with the reference's values.
    got = [(r["step"], r["val_loss"]) for r in records(interrupted / "output", "eval")]
    want = [(r["step"], r["val_loss"]) for r in records(reference / "output", "eval")]
    assert got == want and [s for s, _ in got] == [2, 4, 6, 8]
    assert_same_tensors(adapter_of(reference), adapter_of(interrupted))


# ------------------------------------------------------------------ the dataset's own split


@pytest.fixture
def split_workspace(tmp_path, tiny_dataset_file, initialized_workspace):
    """A source directory with train/validation files, through the real dataset initializer."""
    rows = tiny_dataset_file.read_text().splitlines(keepends=True)
    source = tmp_path / "source"
    source.mkdir()
    (source / "train.jsonl").write_text("".join(rows[:200]))
    (source / "validation.jsonl").write_text("".join(rows[200:]))
    workspace = tmp_path / "ws"
    workspace.mkdir()
    (workspace / "model").symlink_to(initialized_workspace / "model")
    env = {"TUNEPACK_WORKSPACE": str(workspace), "TUNEPACK_MODEL": "tiny-llama3"}
    done = run_program("tunepack.initializers.dataset", {**env, "STORAGE_URI": f"file://{source}"})
    assert done.returncode == 0, done.stderr
    return workspace, env


def test_dataset_validation_split_is_written_and_evaluated(split_workspace):
    workspace, env = split_workspace
    manifest = json.loads((workspace / "dataset" / "tunepack-manifest.json").read_text())
    assert manifest["rows"] == 200
    assert manifest["validation"]["rows"] == 56
    assert manifest["validation"]["split"] == "validation"
    assert set(manifest["files"]) == {"train.jsonl", "validation.jsonl"}

    done = run_program(
        "tunepack.trainers.launch",
        env,
        "eval_every_steps=2",
        "max_steps=4",
        "batch_size=8",
        "warmup_steps=0",
        "lr=3e-3",
    )
    assert done.returncode == 0, done.stderr
    result = json.loads((workspace / "output" / "result.json").read_text())
    # Trained on the 200 training rows only, evaluated on the 56 validation rows.
    assert result["val_rows"] == 56 and result["evaluations"] == 2
    evals = records(workspace / "output", "eval")
    assert [r["step"] for r in evals] == [2, 4]
    assert evals[1]["val_loss"] < evals[0]["val_loss"]
    assert "200 examples" in done.stderr
    # Each record again as Katib's StdOut collector reads it (name=value), exactly; and last,
    # result.json's own figures, so that a Katib trial's latest values are its result's.
    katib = [line for line in done.stdout.splitlines() if line.startswith("metrics: ")]
    assert f"eval_loss={evals[1]['val_loss']!r}" in katib[-2]
    assert (
        done.stdout.splitlines()[-1]
        == katib[-1]
        == (f"metrics: loss={result['final_loss']!r} eval_loss={result['val_loss']!r}")
    )


def test_val_fraction_with_the_datasets_own_split_exits_65(split_workspace):
    workspace, env = split_workspace
    done = run_program("tunepack.trainers.launch", env, "val_fraction=0.1", "max_steps=1")
    assert done.returncode == EXIT_BAD_INPUT, done.stderr
    assert "the dataset has its own validation split (56 rows)" in done.stderr
    assert "Traceback" not in done.stderr
    assert not (workspace / "output" / "result.json").exists()


def test_hub_dataset_test_split_becomes_the_validation_file(tmp_path, dataset_hub):  # noqa: F811
    """hf:// (the loopback fake Hub): a repo with train and test parquet files and no
    validation split; the test split is downloaded too and written as validation.jsonl."""
    result = run_init(
        "dataset", tmp_path, "hf://datasets/org/chats", {"HF_ENDPOINT": dataset_hub.url}
    )
    assert result.returncode == 0, result.stderr
    manifest = manifest_of(tmp_path, "dataset")
    assert manifest["rows"] == 3
    assert manifest["validation"] == {
        "file": "validation.jsonl",
        "split": "test",
        "rows": 1,
        "source_files": ["data/test-00000-of-00001.parquet"],
    }
    lines = (tmp_path / "ws" / "dataset" / "validation.jsonl").read_text().splitlines()
    assert [json.loads(x)["messages"][1]["content"] for x in lines] == ["hello 3"]
    train = (tmp_path / "ws" / "dataset" / "train.jsonl").read_text()
    assert "hello 3" not in train
