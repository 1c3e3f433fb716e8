"""Split slices as ``datasets`` writes them (``train[:1000]``, ``train[10%:20%]``), read by the
dataset initializer from Parquet and JSON Lines: the rows kept, the manifest, the refusals."""

from __future__ import annotations

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from tests.helpers import run_dataset_initializer
from tunepack.core.errors import EXIT_BAD_INPUT, BadValueError
from tunepack.core.workspace import MANIFEST_FILE
from tunepack.initializers.data import splits

ROWS = [{"instruction": f"q{i}", "input": "", "output": f"a{i}"} for i in range(20)]


def run_dataset(tmp_path, storage_uri, **env):
    return run_dataset_initializer(tmp_path / "ws", storage_uri, **env)


def written(tmp_path) -> tuple[list[str], dict]:
    out = tmp_path / "ws" / "dataset"
    rows = [json.loads(x) for x in (out / "train.jsonl").read_text().splitlines()]
    return [r["instruction"] for r in rows], json.loads((out / MANIFEST_FILE).read_text())


def parquet_dir(tmp_path, rows=ROWS):
    """A hub-style directory: the train split in two Parquet shards, and a test split."""
    data = tmp_path / "src" / "data"
    data.mkdir(parents=True)
    half = len(rows) // 2
    pq.write_table(pa.Table.from_pylist(rows[:half]), data / "train-00000-of-00002.parquet")
    pq.write_table(pa.Table.from_pylist(rows[half:]), data / "train-00001-of-00002.parquet")
    pq.write_table(pa.Table.from_pylist(rows[:3]), data / "test-00000-of-00001.parquet")
    return tmp_path / "src"


@pytest.mark.parametrize(
    ("spec", "kept"),
    [
        ("train[:5]", range(0, 5)),
        ("train[8:12]", range(8, 12)),  # across the two shards
        ("train[-3:]", range(17, 20)),
        ("train[10%:20%]", range(2, 4)),
        ("train[:50%]", range(0, 10)),
        ("train[-25%:]", range(15, 20)),
        ("train[15:1000]", range(15, 20)),  # a bound past the end stops there
    ],
)
def test_a_sliced_split_of_parquet_shards_keeps_those_rows(tmp_path, spec, kept):
    done = run_dataset(tmp_path, f"file://{parquet_dir(tmp_path)}", DATASET_SPLIT=spec)
    assert done.returncode == 0, done.stderr
    instructions, manifest = written(tmp_path)
    assert instructions == [f"q{i}" for i in kept]
    assert manifest["split"] == "train" and manifest["slice"] == spec
    assert manifest["rows"] == len(kept)
    assert manifest["source_format"] == "parquet"
    # The validation rows are the test split, whole: the slice is of the train split.
    assert manifest["validation"]["rows"] == 3


def test_the_slice_is_in_the_uri_too_and_the_log_says_how_many_of_how_many(tmp_path):
    data = tmp_path / "rows.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    done = run_dataset(tmp_path, f"file://{data}?split=train[:10%25]")  # %25: a '%'
    assert done.returncode == 0, done.stderr
    assert written(tmp_path)[0] == ["q0", "q1"]
    assert "read 2 of 20 rows (instruction, split train[:10%])" in done.stdout


def test_rows_outside_the_slice_are_not_checked(tmp_path):
    data = tmp_path / "rows.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in ROWS[:4]) + "not json\n")
    assert run_dataset(tmp_path, f"file://{data}", DATASET_SPLIT="train[:4]").returncode == 0
    refused = run_dataset(tmp_path / "again", f"file://{data}", DATASET_SPLIT="train[:5]")
    assert refused.returncode == EXIT_BAD_INPUT
    assert "rows.jsonl row 5: not valid JSON" in refused.stderr


def test_another_slice_rebuilds_the_workspace(tmp_path):
    source = f"file://{parquet_dir(tmp_path)}"
    assert run_dataset(tmp_path, source, DATASET_SPLIT="train[:5]").returncode == 0
    again = run_dataset(tmp_path, source, DATASET_SPLIT="train[5:7]")
    assert again.returncode == 0, again.stderr
    assert "slice changed (was 'train[:5]')" in again.stdout
    assert written(tmp_path)[0] == ["q5", "q6"]


def test_a_slice_with_no_rows_is_refused_with_the_splits_size(tmp_path):
    done = run_dataset(tmp_path, f"file://{parquet_dir(tmp_path)}", DATASET_SPLIT="train[30:]")
    assert done.returncode == EXIT_BAD_INPUT
    assert (
        done.stderr.strip()
        .splitlines()[-1]
        .endswith("split 'train[30:]' selects no rows; the train split has 20")
    )


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        (
            "train[:ten]",
            "dataset split 'train[:ten]': bound 'ten' is not a whole number of rows or a "
            "percentage; e.g. train[:1000], train[10%:20%] or train[-100:]",
        ),
        (
            "train[10]",
            "dataset split 'train[10]' is not a split name or a slice of one; write "
            "<name>[<from>:<to>], e.g. train[:1000], train[10%:20%] or train[-100:] (one slice; "
            "no '+' or rounding suffix)",
        ),
        ("train[:150%]", "dataset split 'train[:150%]': 150% is not a percentage from -100%"),
        ("train[10:50%]", "dataset split 'train[10:50%]' mixes a row count and a percentage"),
        ("train+test", "dataset split 'train+test' is not a valid split name"),
        ("train[:10]+test", "dataset split 'train[:10]+test' is not a split name or a slice"),
    ],
)
def test_malformed_slices_are_refused_in_one_line(tmp_path, spec, message):
    with pytest.raises(BadValueError) as err:
        splits.parse(spec)
    assert str(err.value).startswith(message)
    # The initializer says the same, exit 65, before reading anything.
    done = run_dataset(tmp_path, f"file://{parquet_dir(tmp_path)}", DATASET_SPLIT=spec)
    assert done.returncode == EXIT_BAD_INPUT
    assert message in done.stderr
