"""Each dataset schema the initializer writes trains with the tiny model (a few CPU steps)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest

from tests.helpers import setup_recipe
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


@pytest.mark.parametrize(("schema", "to_row"), [("chat", _chat), ("text", _text)])
def test_schema_trains_a_few_steps(schema, to_row, initialized_workspace, tmp_path):
    source = tmp_path / "rows.jsonl"
    source.write_text("".join(json.dumps(to_row(r)) + "\n" for r in tiny_dataset_rows(32)))
    workspace = tmp_path / "ws"
    shutil.copytree(initialized_workspace / "model", workspace / "model")
    env = {**os.environ, "TUNEPACK_WORKSPACE": str(workspace), "STORAGE_URI": str(source)}
    done = subprocess.run(
        [sys.executable, "-m", "tunepack.initializers.dataset"],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
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
