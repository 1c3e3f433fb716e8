"""Each dataset schema the initializer writes trains with the tiny model (a few CPU steps)."""

from __future__ import annotations

import json
import shutil

import pytest

from tests.helpers import run_dataset_initializer, setup_recipe
from tunepack.runtimes import catalog
from tunepack.tiny import tiny_dataset_rows

TINY = catalog.get("tiny-llama3")


def _chat(row: dict) -> dict:
    return {
        "conversations": [
            {"from": "human", "value": row["instruction"]},
            {"from": "gpt", "value": row["output"]},
        ]
    }


def _text(row: dict) -> dict:
    return {"text": f"{row['instruction']} {row['output']}"}


def _initialize_dataset(rows: list[dict], initialized_workspace, tmp_path):
    """A workspace with the tiny model and ``rows`` through the real dataset initializer."""
    source = tmp_path / "rows.jsonl"
    source.write_text("".join(json.dumps(r) + "\n" for r in rows))
    workspace = tmp_path / "ws"
    shutil.copytree(initialized_workspace / "model", workspace / "model")
    done = run_dataset_initializer(workspace, str(source))
    assert done.returncode == 0, done.stderr
    return workspace


@pytest.mark.parametrize(("schema", "to_row"), [("chat", _chat), ("text", _text)])
def test_schema_trains_a_few_steps(schema, to_row, initialized_workspace, tmp_path):
    rows = [to_row(r) for r in tiny_dataset_rows(32)]
    workspace = _initialize_dataset(rows, initialized_workspace, tmp_path)
    manifest = json.loads((workspace / "dataset" / "tunepack-manifest.json").read_text())
    assert manifest["schema"] == schema

    output = tmp_path / "out"
    recipe = setup_recipe(
        TINY,
        ["max_steps=2", "warmup_steps=0", "batch_size=4"],
        model_dir=workspace / "model",
        dataset_dir=workspace / "dataset",
        output=output,
    )
    assert len(recipe.dataloader.dataset) == 32
    recipe.train()
    losses = [json.loads(x)["loss"] for x in (output / "metrics.jsonl").read_text().splitlines()]
    assert len(losses) == 2 and all(loss > 0 for loss in losses)


@pytest.mark.parametrize("schema", ["instruction", "text"])
def test_rows_longer_than_max_seq_len_are_counted_in_one_line(
    schema, initialized_workspace, tmp_path, caplog
):
    rows = [{"instruction": f"say {i}", "output": f"ok {i}"} for i in range(13)]
    rows += [{"instruction": "recite", "output": "lorem ipsum dolor " * n} for n in (20, 40, 60)]
    if schema == "text":
        rows = [_text(r) for r in rows]
    workspace = _initialize_dataset(rows, initialized_workspace, tmp_path)

    caplog.set_level("WARNING", logger="tunepack.trainer")
    recipe = setup_recipe(
        TINY,
        ["max_steps=1", "max_seq_len=256", "batch_size=4"],
        model_dir=workspace / "model",
        dataset_dir=workspace / "dataset",
        output=tmp_path / "out",
    )
    with recipe.tokenizer.untruncated():
        full = [max(len(v) for v in recipe.dataloader.dataset[i].values()) for i in range(16)]
    kept = 255 if schema == "text" else 256  # torchtune keeps max_seq_len - 1 of a text row
    cut = sorted(n for n in full if n > kept)
    assert len(cut) == 3 and max(full[:13]) <= kept, full
    lines = [r.getMessage() for r in caplog.records if "max_seq_len" in r.getMessage()]
    assert lines == [
        f"3 of 16 rows are longer than max_seq_len=256 tokens and were cut to it (longest "
        f"{cut[-1]:,} tokens, {sum(cut) - 3 * kept:,} tokens not trained on); raise "
        "max_seq_len or split those rows to train on all of them"
    ]
    # What is trained on is cut to the limit; the sampler's lengths are the cut lengths.
    assert max(len(recipe.dataloader.dataset[i]["tokens"]) for i in range(16)) == kept
    assert sorted(recipe.sampler.lengths) == sorted(min(n, kept) for n in full)
