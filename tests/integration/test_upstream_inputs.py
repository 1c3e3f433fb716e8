"""Inputs written for the Kubeflow SDK, run: the notebook's parquet slice trains on exactly those
rows. How each upstream input becomes a TrainJob: tests/unit/test_upstream_inputs.py."""

from __future__ import annotations

import json

import pyarrow as pa
import pyarrow.parquet as pq
from kubeflow.trainer import (
    DataFormat,
)

from tests.helpers import run_dataset_initializer
from tests.unit.test_upstream_inputs import _build, _env, _trainer
from tunepack.core.workspace import MANIFEST_FILE


def test_the_notebooks_parquet_slice_trains_on_those_rows(tmp_path):
    shards = tmp_path / "alpaca" / "data"
    shards.mkdir(parents=True)
    rows = [{"instruction": f"q{i}", "input": "", "output": f"a{i}"} for i in range(1500)]
    pq.write_table(pa.Table.from_pylist(rows[:800]), shards / "train-00000-of-00002.parquet")
    pq.write_table(pa.Table.from_pylist(rows[800:]), shards / "train-00001-of-00002.parquet")

    job = _build(
        _trainer(source=DataFormat.PARQUET, split="train[:1000]"),
        dataset=f"file://{tmp_path / 'alpaca'}",
    )
    assert _env(job, "dataset")["DATASET_SPLIT"] == "train[:1000]"
    assert "DATASET_SPLIT" not in _env(job, "model")  # the slice is the dataset's alone

    # The dataset initializer, with what the TrainJob gives it, keeps the first 1000 rows.
    block = job["spec"]["initializer"]["dataset"]
    done = run_dataset_initializer(
        tmp_path / "ws", block["storageUri"], timeout=120, **_env(job, "dataset")
    )
    assert done.returncode == 0, done.stderr
    manifest = json.loads((tmp_path / "ws" / "dataset" / MANIFEST_FILE).read_text())
    assert (manifest["rows"], manifest["source_format"]) == (1000, "parquet")
    assert "read 1000 rows (instruction, split train[:1000])" in done.stdout


def test_a_torchtune_column_map_reads_the_columns_it_names(tmp_path):
    """``TorchTuneInstructDataset(column_map={'input': 'question', 'output': 'answer'})``: the
    dataset initializer, with the TrainJob's env, reads 'question' as the prompt and 'answer'
    as the answer, as torchtune's instruct_dataset would."""
    data = tmp_path / "qa.jsonl"
    rows = [{"question": f"q{i}", "answer": f"a{i}", "id": i} for i in range(20)]
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    job = _build(
        _trainer(column_map={"input": "question", "output": "answer"}), dataset=f"file://{data}"
    )
    block = job["spec"]["initializer"]["dataset"]
    done = run_dataset_initializer(
        tmp_path / "ws", block["storageUri"], timeout=120, **_env(job, "dataset")
    )
    assert done.returncode == 0, done.stderr
    manifest = json.loads((tmp_path / "ws" / "dataset" / MANIFEST_FILE).read_text())
    assert manifest["column_map"] == {"question": "instruction", "answer": "output"}
    assert (manifest["rows"], manifest["schema"]) == (20, "instruction")
    written = (tmp_path / "ws" / "dataset" / "train.jsonl").read_text().splitlines()
    assert json.loads(written[3]) == {"instruction": "q3", "input": "", "output": "a3"}
    assert "read 20 rows (instruction, split train)" in done.stdout
