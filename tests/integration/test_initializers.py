"""The initializer programs, run as subprocesses the way the local backend and a Pod run them."""

from __future__ import annotations

import hashlib
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tunepack.core.errors import EXIT_BAD_INPUT, EXIT_TRANSIENT, BadModelError
from tunepack.core.workspace import MANIFEST_FILE
from tunepack.initializers.transport import uri
from tunepack.runtimes import catalog

ROWS = [
    {"instruction": "Add 2 and 3.", "output": "5"},
    {"instruction": "Translate to French.", "input": "cat", "output": "chat", "extra": 1},
    {"instruction": "Say hi.", "input": None, "output": "hi"},
]
NORMALIZED = [
    {"instruction": "Add 2 and 3.", "input": "", "output": "5"},
    {"instruction": "Translate to French.", "input": "cat", "output": "chat"},
    {"instruction": "Say hi.", "input": "", "output": "hi"},
]
SCHEMA_HINT = (
    "each row must be a JSON object with string fields 'instruction' and 'output' and an "
    "optional string 'input'"
)
TINY = catalog.get("tiny-llama3")


# --- helpers -------------------------------------------------------------------------------------


def run_program(
    program: str,
    tmp_path: Path,
    storage_uri: str | None,
    model: str | None = "tiny-llama3",
    code: str | None = None,
) -> subprocess.CompletedProcess[str]:
    """Run an initializer as the local backend does: a process with the runtime's environment."""
    env = {k: v for k, v in os.environ.items() if k not in {"STORAGE_URI", "TUNEPACK_MODEL"}}
    env["TUNEPACK_WORKSPACE"] = str(tmp_path / "ws")
    if storage_uri is not None:
        env["STORAGE_URI"] = storage_uri
    if model is not None:
        env["TUNEPACK_MODEL"] = model
    command = ["-c", code] if code else ["-m", f"tunepack.initializers.{program}"]
    return subprocess.run(
        [sys.executable, *command],
        env=env,
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=60,
    )


def write_jsonl(path: Path, rows: list[object]) -> Path:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows), encoding="utf-8")
    return path


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def leftovers(tmp_path: Path) -> list[str]:
    return sorted(p.name for p in (tmp_path / "ws").glob("*.partial-*"))


def assert_bad_input(result: subprocess.CompletedProcess[str], program: str, message: str):
    assert result.returncode == EXIT_BAD_INPUT, result.stderr
    assert result.stderr == f"{program}-initializer: error: {message}\n"


def tiny_safetensors(values: int = 4) -> bytes:
    """A complete safetensors file holding one F32 tensor of ``values`` values."""
    header = json.dumps({"w": {"dtype": "F32", "shape": [values], "data_offsets": [0, 4 * values]}})
    return len(header).to_bytes(8, "little") + header.encode() + b"\0" * (4 * values)


def fake_model(root: Path, entry: catalog.ModelEntry = TINY, **config_overrides) -> Path:
    """A model directory with every file the catalog entry requires (dummy bytes, a complete
    safetensors file, a real config)."""
    s = entry.shape
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": s.vocab_size,
        "hidden_size": s.embed_dim,
        "num_hidden_layers": s.num_layers,
        "num_attention_heads": s.num_heads,
        "num_key_value_heads": s.num_kv_heads,
        "intermediate_size": s.intermediate_dim,
        **config_overrides,
    }
    root.mkdir(parents=True)
    for rel in entry.required_files():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(
            tiny_safetensors() if rel.endswith(".safetensors") else b"dummy " + rel.encode() * 100
        )
    (root / "config.json").write_text(json.dumps(config), encoding="utf-8")
    (root / "generation_config.json").write_text("{}", encoding="utf-8")
    (root / ".cache").mkdir()  # hub download metadata: not part of the model
    (root / ".cache" / "lock").write_text("x")
    return root


def tree(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in root.rglob("*") if p.is_file()}


# --- dataset: happy paths ------------------------------------------------------------------------


def test_dataset_from_jsonl_writes_normalized_rows_and_manifest(tmp_path):
    source = write_jsonl(tmp_path / "instructions.jsonl", ROWS)

    result = run_program("dataset", tmp_path, "instructions.jsonl")

    assert result.returncode == 0, result.stderr
    out = tmp_path / "ws" / "dataset"
    assert sorted(p.name for p in out.iterdir()) == ["train.jsonl", MANIFEST_FILE]
    assert read_jsonl(out / "train.jsonl") == NORMALIZED
    manifest = json.loads((out / MANIFEST_FILE).read_text())
    created = manifest.pop("created")
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ", created)
    assert isinstance(manifest.pop("source_fingerprint"), str)
    train_sha256 = sha256(out / "train.jsonl")
    assert manifest == {
        "kind": "dataset",
        "source": source.as_uri(),
        "split": "train",
        "requested_schema": "auto",
        "column_map": {},
        "schema": "instruction",
        "format": "jsonl",
        "source_format": "jsonl",
        "source_schema": "instruction",
        "source_files": ["instructions.jsonl"],
        "rows": 3,
        "content_sha256": train_sha256,
        "files": {
            "train.jsonl": {
                "size": (out / "train.jsonl").stat().st_size,
                "sha256": train_sha256,
            }
        },
    }
    # The rows are reported once, not once for the file and again for the dataset.
    (said,) = [line for line in result.stdout.splitlines() if " read " in line]
    assert said.startswith(
        "dataset-initializer: read 3 rows (instruction, split train) from instructions.jsonl; "
        "wrote "
    )
    assert leftovers(tmp_path) == []


def test_dataset_from_json_array(tmp_path):
    (tmp_path / "data.json").write_text(json.dumps(ROWS, indent=2), encoding="utf-8")

    result = run_program("dataset", tmp_path, (tmp_path / "data.json").as_uri())

    assert result.returncode == 0, result.stderr
    assert read_jsonl(tmp_path / "ws" / "dataset" / "train.jsonl") == NORMALIZED


def test_dataset_from_directory_concatenates_files_sorted_by_name(tmp_path):
    data = tmp_path / "data"
    data.mkdir()
    write_jsonl(data / "b.jsonl", ROWS[2:])
    (data / "a.json").write_text(json.dumps(ROWS[:2]), encoding="utf-8")
    (data / "README.md").write_text("notes")
    (data / ".gitattributes").write_text("")

    result = run_program("dataset", tmp_path, str(data))

    assert result.returncode == 0, result.stderr
    assert read_jsonl(tmp_path / "ws" / "dataset" / "train.jsonl") == NORMALIZED
    # Of several files, each one's rows are said, then the whole.
    assert "dataset-initializer: read 2 rows from a.json" in result.stdout.splitlines()
    assert "dataset-initializer: read 1 rows from b.jsonl" in result.stdout.splitlines()
    assert (
        "dataset-initializer: ignoring README.md (not .json, .jsonl, .csv, .parquet or .arrow "
        "files)" in result.stdout
    )
    manifest = json.loads((tmp_path / "ws" / "dataset" / MANIFEST_FILE).read_text())
    assert (manifest["source"], manifest["rows"]) == (data.as_uri(), 3)


def test_dataset_rerun_is_a_no_op(tmp_path):
    write_jsonl(tmp_path / "d.jsonl", ROWS)
    assert run_program("dataset", tmp_path, "d.jsonl").returncode == 0
    out = tmp_path / "ws" / "dataset"
    before = {p.name: p.stat().st_mtime_ns for p in out.iterdir()}

    # The same file, named by file URI instead of a relative path, is the same source.
    result = run_program("dataset", tmp_path, (tmp_path / "d.jsonl").as_uri())

    assert result.returncode == 0, result.stderr
    assert f"{out} already complete (3 rows from " in result.stdout
    assert {p.name: p.stat().st_mtime_ns for p in out.iterdir()} == before


def test_dataset_changed_storage_uri_replaces_content(tmp_path):
    write_jsonl(tmp_path / "one.jsonl", ROWS)
    write_jsonl(tmp_path / "two.jsonl", ROWS[:1])
    assert run_program("dataset", tmp_path, "one.jsonl").returncode == 0

    result = run_program("dataset", tmp_path, "two.jsonl")

    assert result.returncode == 0, result.stderr
    out = tmp_path / "ws" / "dataset"
    assert read_jsonl(out / "train.jsonl") == NORMALIZED[:1]
    manifest = json.loads((out / MANIFEST_FILE).read_text())
    assert (manifest["source"], manifest["rows"]) == ((tmp_path / "two.jsonl").as_uri(), 1)
    assert "source changed" in result.stdout
    assert leftovers(tmp_path) == []


def test_dataset_edited_source_or_damaged_output_is_rebuilt(tmp_path):
    source = write_jsonl(tmp_path / "d.jsonl", ROWS)
    assert run_program("dataset", tmp_path, "d.jsonl").returncode == 0
    train = tmp_path / "ws" / "dataset" / "train.jsonl"

    write_jsonl(source, ROWS[:2])  # the user edits the dataset in place
    result = run_program("dataset", tmp_path, "d.jsonl")
    assert result.returncode == 0, result.stderr
    assert "the source files changed since the last run" in result.stdout
    assert read_jsonl(train) == NORMALIZED[:2]

    good = train.read_bytes()
    train.write_bytes(good.replace(b"chat", b"chut"))  # same size, different content
    result = run_program("dataset", tmp_path, "d.jsonl")
    assert result.returncode == 0, result.stderr
    assert "train.jsonl has changed content" in result.stdout
    assert train.read_bytes() == good


def test_dataset_leftover_partial_directory_is_cleaned_up(tmp_path):
    write_jsonl(tmp_path / "d.jsonl", ROWS)
    # What a killed run leaves behind: a half-built directory and a half-replaced old one.
    (tmp_path / "ws" / "dataset.partial-1a2b3c4d").mkdir(parents=True)
    (tmp_path / "ws" / "dataset.partial-1a2b3c4d" / "train.jsonl").write_text('{"instr')
    (tmp_path / "ws" / "dataset.partial-old-5e6f").mkdir()

    result = run_program("dataset", tmp_path, "d.jsonl")

    assert result.returncode == 0, result.stderr
    assert "removed dataset.partial-1a2b3c4d left by an interrupted run" in result.stdout
    assert leftovers(tmp_path) == []
    assert read_jsonl(tmp_path / "ws" / "dataset" / "train.jsonl") == NORMALIZED


def test_dataset_failed_rebuild_keeps_previous_complete_dataset(tmp_path):
    write_jsonl(tmp_path / "good.jsonl", ROWS)
    write_jsonl(tmp_path / "bad.jsonl", [{"instruction": "x"}])
    assert run_program("dataset", tmp_path, "good.jsonl").returncode == 0
    out = tmp_path / "ws" / "dataset"
    before = tree(out)

    assert run_program("dataset", tmp_path, "bad.jsonl").returncode == EXIT_BAD_INPUT

    assert tree(out) == before
    assert leftovers(tmp_path) == []


# --- dataset: bad input --------------------------------------------------------------------------


SUPPORTED = "file://, hf://, s3://, https://, <path>"


def test_unknown_scheme(tmp_path):
    result = run_program("dataset", tmp_path, "ftp://x")
    assert_bad_input(
        result, "dataset", f"unsupported storage URI 'ftp://x': expected one of {SUPPORTED}"
    )
    assert not (tmp_path / "ws").exists()


@pytest.mark.parametrize("value", [None, "  "])
def test_missing_storage_uri(tmp_path, value):
    result = run_program("dataset", tmp_path, value)
    assert_bad_input(
        result,
        "dataset",
        "STORAGE_URI is not set; set it to where the initializer reads from: hf://org/name, "
        "s3://bucket/prefix, https://host/file, file:///absolute/path or a plain path",
    )


def test_credentials_are_redacted_from_messages(tmp_path):
    result = run_program("dataset", tmp_path, "ftp://alice:s3cret@host/d.jsonl?token=abc&split=t")
    assert_bad_input(
        result,
        "dataset",
        "unsupported storage URI 'ftp://***@host/d.jsonl?token=***&split=t': "
        f"expected one of {SUPPORTED}",
    )


def test_file_uri_with_host(tmp_path):
    result = run_program("dataset", tmp_path, "file://data/d.jsonl")
    assert_bad_input(
        result,
        "dataset",
        "file URI 'file://data/d.jsonl' has a host part ('data'); write "
        "file:///absolute/path (three slashes) or a plain path",
    )


def test_missing_file(tmp_path):
    result = run_program("dataset", tmp_path, "nope.jsonl")
    assert_bad_input(
        result,
        "dataset",
        f"storage URI 'nope.jsonl' points to {tmp_path / 'nope.jsonl'}, which does not exist "
        f"(file:// paths are read on the machine that runs the initializer)",
    )


@pytest.mark.parametrize(("name", "content"), [("d.jsonl", "\n\n"), ("d.json", "[]")])
def test_empty_dataset(tmp_path, name, content):
    (tmp_path / name).write_text(content)
    result = run_program("dataset", tmp_path, name)
    assert_bad_input(result, "dataset", f"dataset '{name}' has no rows; {SCHEMA_HINT}")
    assert not (tmp_path / "ws" / "dataset").exists()
    assert leftovers(tmp_path) == []


def test_directory_without_data_files(tmp_path):
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "train.tsv").write_text("a\tb\n")
    result = run_program("dataset", tmp_path, "data")
    assert_bad_input(
        result,
        "dataset",
        "dataset directory 'data' has no .json, .jsonl, .csv, .parquet or .arrow files; put the "
        "training rows there",
    )


def test_unsupported_file_type(tmp_path):
    (tmp_path / "train.tsv").write_text("a\tb\n")
    result = run_program("dataset", tmp_path, "train.tsv")
    assert_bad_input(
        result,
        "dataset",
        "dataset 'train.tsv' is not a .json, .jsonl, .csv, .parquet or .arrow file; give a "
        "data file or a directory of them",
    )


@pytest.mark.parametrize(
    ("line", "problem"),
    [
        ('{"instruction": "q"}', "field 'output' is missing"),
        ('{"instruction": 5, "output": "a"}', "field 'instruction' must be a string, got number"),
        (
            '{"instruction": "q", "output": "a", "input": []}',
            "field 'input' must be a string, got array",
        ),
        ('["q", "a"]', "expected a JSON object, got array"),
        (
            '{"instruction": "q", "output": "a"',
            "not valid JSON (Expecting ',' delimiter at column 35)",
        ),
    ],
)
def test_bad_row(tmp_path, line, problem):
    good = json.dumps(ROWS[0])
    (tmp_path / "instructions.jsonl").write_text(f"{good}\n{good}\n\n{line}\n{good}\n")
    result = run_program("dataset", tmp_path, "instructions.jsonl")
    assert_bad_input(
        result,
        "dataset",
        f"dataset 'instructions.jsonl' has 1 invalid row; {SCHEMA_HINT}:\n"
        f"  instructions.jsonl row 4: {problem}",
    )
    assert not (tmp_path / "ws" / "dataset").exists()
    assert leftovers(tmp_path) == []


def test_bad_rows_report_the_first_five_by_file(tmp_path):
    data = tmp_path / "data"
    data.mkdir()
    (data / "a.json").write_text(json.dumps([ROWS[0], {"output": "x"}, "text"]))
    write_jsonl(data / "b.jsonl", [{"instruction": "q", "output": None}] * 6)

    result = run_program("dataset", tmp_path, "data")

    assert_bad_input(
        result,
        "dataset",
        f"dataset 'data' has 8 invalid rows (first 5 shown); {SCHEMA_HINT}:\n"
        "  a.json row 2: field 'instruction' is missing\n"
        "  a.json row 3: expected a JSON object, got string\n"
        "  b.jsonl row 1: field 'output' must be a string, got null\n"
        "  b.jsonl row 2: field 'output' must be a string, got null\n"
        "  b.jsonl row 3: field 'output' must be a string, got null",
    )


def test_json_file_that_is_not_an_array(tmp_path):
    (tmp_path / "d.json").write_text('{\n  "data": [1, 2]\n}\n')
    result = run_program("dataset", tmp_path, "d.json")
    assert_bad_input(
        result,
        "dataset",
        "d.json: holds a JSON object, not an array of rows; write the rows as a JSON array or "
        "as JSON Lines (.jsonl)",
    )


def test_json_lines_saved_as_json_are_accepted(tmp_path):
    write_jsonl(tmp_path / "d.json", ROWS)
    result = run_program("dataset", tmp_path, "d.json")
    assert result.returncode == 0, result.stderr
    assert read_jsonl(tmp_path / "ws" / "dataset" / "train.jsonl") == NORMALIZED


def test_foreign_content_in_destination_is_not_deleted(tmp_path):
    write_jsonl(tmp_path / "d.jsonl", ROWS)
    mine = tmp_path / "ws" / "dataset" / "mine.txt"
    mine.parent.mkdir(parents=True)
    mine.write_text("precious")

    result = run_program("dataset", tmp_path, "d.jsonl")

    assert_bad_input(
        result,
        "dataset",
        f"{mine.parent} holds files that tunepack did not write (no {MANIFEST_FILE}); move "
        f"them away or point TUNEPACK_WORKSPACE at another directory",
    )
    assert mine.read_text() == "precious"
    assert leftovers(tmp_path) == []


# --- model ---------------------------------------------------------------------------------------


def test_model_is_delivered_with_manifest_and_source_untouched(tmp_path):
    source = fake_model(tmp_path / "src")
    # A manifest from an earlier workspace in the source must neither be copied nor overwritten.
    (source / MANIFEST_FILE).write_text('{"kind": "model"}')
    before = tree(source)

    result = run_program("model", tmp_path, source.as_uri())

    assert result.returncode == 0, result.stderr
    out = tmp_path / "ws" / "model"
    delivered = sorted([*TINY.required_files(), "generation_config.json"])
    manifest = json.loads((out / MANIFEST_FILE).read_text())
    assert sorted(manifest.pop("files")) == delivered
    assert sorted(str(p.relative_to(out)) for p in out.rglob("*") if p.is_file()) == sorted(
        [*delivered, MANIFEST_FILE]
    )
    assert set(manifest) == {"kind", "source", "source_fingerprint", "model", "created"}
    assert (manifest["kind"], manifest["source"], manifest["model"]) == (
        "model",
        source.as_uri(),
        "tiny-llama3",
    )
    files = json.loads((out / MANIFEST_FILE).read_text())["files"]
    for rel in delivered:
        assert files[rel] == {"size": (out / rel).stat().st_size, "sha256": sha256(out / rel)}
        assert (out / rel).read_bytes() == (source / rel).read_bytes()
    # Same filesystem: hard links, so a multi-GiB model costs no copy.
    assert (out / "model.safetensors").stat().st_ino == (source / "model.safetensors").stat().st_ino
    assert tree(source) == before
    # One line for the files, not one per file.
    said = [line for line in result.stdout.splitlines() if "model.safetensors" in line]
    assert said == []
    assert (
        f"model-initializer: delivered 5 files ({sum(f['size'] for f in files.values())} bytes; "
        f"5 hard-linked, 0 copied) from {source.as_uri()} to {out}"
    ) in result.stdout.splitlines()


def test_model_rerun_is_a_no_op(tmp_path):
    source = fake_model(tmp_path / "src")
    assert run_program("model", tmp_path, str(source)).returncode == 0
    out = tmp_path / "ws" / "model"
    before = {str(p): p.stat().st_mtime_ns for p in out.rglob("*")}

    result = run_program("model", tmp_path, str(source))

    assert result.returncode == 0, result.stderr
    assert f"{out} already complete (tiny-llama3 from {source})" in result.stdout
    assert {str(p): p.stat().st_mtime_ns for p in out.rglob("*")} == before


def test_model_from_symlinked_snapshot(tmp_path):
    # Hugging Face cache snapshots are trees of symlinks into a blobs directory.
    blobs = fake_model(tmp_path / "blobs")
    snapshot = tmp_path / "snapshot"
    for rel in TINY.required_files():
        (snapshot / rel).parent.mkdir(parents=True, exist_ok=True)
        (snapshot / rel).symlink_to(blobs / rel)

    result = run_program("model", tmp_path, str(snapshot))

    assert result.returncode == 0, result.stderr
    out = tmp_path / "ws" / "model"
    for rel in TINY.required_files():
        assert not (out / rel).is_symlink()
        assert (out / rel).read_bytes() == (blobs / rel).read_bytes()


def test_model_missing_tokenizer_file_is_reported_before_copying(tmp_path):
    source = fake_model(tmp_path / "x")
    (source / "original" / "tokenizer.model").unlink()

    result = run_program("model", tmp_path, source.as_uri())

    assert_bad_input(
        result,
        "model",
        f"model at '{source.as_uri()}' is missing original/tokenizer.model, which the "
        f"tiny-llama3 tokenizer needs. Point STORAGE_URI at a complete copy of "
        f"tunepack/tiny-llama3",
    )
    assert not (tmp_path / "ws").exists()


def test_model_missing_several_files(tmp_path):
    """Each purpose is said once, with the files it needs (issue 49, item 4: the loader's clause
    was repeated for each of its files); a container program names its own variable."""
    source = fake_model(tmp_path / "x")
    (source / "config.json").unlink()
    (source / "model.safetensors").unlink()
    (source / "tokenizer.json").unlink()
    result = run_program("model", tmp_path, str(source))
    assert_bad_input(
        result,
        "model",
        f"model at '{source}' is missing config.json and model.safetensors, which the "
        f"tiny-llama3 checkpoint loader needs; and tokenizer.json, which the tiny-llama3 "
        f"tokenizer needs. Point STORAGE_URI at a complete copy of tunepack/tiny-llama3",
    )


def test_model_config_must_parse_and_match_the_catalog(tmp_path):
    source = fake_model(tmp_path / "x", hidden_size=64)
    result = run_program("model", tmp_path, str(source))
    assert_bad_input(
        result,
        "model",
        f"model at '{source}' is not tiny-llama3: its config.json has hidden_size=64 "
        f"(expected {TINY.shape.embed_dim}); use the runtime made for this model or point "
        f"STORAGE_URI at tunepack/tiny-llama3",
    )

    # Values beyond the shape that the trainer builds the model with: here the RoPE base.
    source = fake_model(tmp_path / "y", rope_theta=10_000)
    result = run_program("model", tmp_path, str(source))
    assert_bad_input(
        result,
        "model",
        f"model at '{source}' is not tiny-llama3: its config.json has rope_theta=10000 "
        f"(expected 500000.0); use the runtime made for this model or point "
        f"STORAGE_URI at tunepack/tiny-llama3",
    )

    (source / "config.json").write_text('{"vocab_size": ')
    result = run_program("model", tmp_path, str(source))
    assert_bad_input(
        result,
        "model",
        f"model at '{source}' has a config.json that is not valid JSON (Expecting value); "
        f"replace it with the model's original config.json",
    )


@pytest.mark.parametrize("model", [None, "llama-9000"])
def test_model_unknown_or_unset_tunepack_model(tmp_path, model):
    source = fake_model(tmp_path / "x")
    result = run_program("model", tmp_path, str(source), model=model)
    known = ", ".join(catalog.CATALOG)
    runtimes = ", ".join(e.runtime_name for e in catalog.CATALOG.values())
    message = (
        f"TUNEPACK_MODEL is not set; it names the catalog model the runtime was made for, "
        f"one of: {known}"
        if model is None
        else f"unknown runtime or model 'llama-9000'; tunepack runtimes are: {runtimes}"
    )
    assert_bad_input(result, "model", message)


def test_model_source_must_be_a_directory(tmp_path):
    (tmp_path / "model.safetensors").write_bytes(b"x")
    result = run_program("model", tmp_path, "model.safetensors")
    assert_bad_input(
        result,
        "model",
        "model at 'model.safetensors' is not a directory; point STORAGE_URI at the directory "
        "holding " + ", ".join(TINY.required_files()),
    )


# Runs the model initializer with hard links unavailable (as across filesystems) and a hook in
# the copy of the second file, to fail or interrupt the program in the middle of its work.
_MID_COPY = """
import os, signal, sys
from tunepack.initializers import model

def no_link(src, dst, **kwargs):
    raise OSError(18, "Invalid cross-device link")

copy, calls = model._copy_hashed, []
def hooked_copy(src, dst):
    calls.append(src)
    if len(calls) == 2:
        {action}
    return copy(src, dst)

os.link, model._copy_hashed = no_link, hooked_copy
sys.exit(model.main())
"""


def test_model_falls_back_to_copying(tmp_path):
    source = fake_model(tmp_path / "src")
    code = _MID_COPY.format(action="pass")
    result = run_program("model", tmp_path, str(source), code=code)
    assert result.returncode == 0, result.stderr
    out = tmp_path / "ws" / "model"
    assert "0 hard-linked, 5 copied" in result.stdout
    files = json.loads((out / MANIFEST_FILE).read_text())["files"]
    assert files["model.safetensors"]["sha256"] == sha256(source / "model.safetensors")
    assert (out / "model.safetensors").stat().st_ino != (source / "model.safetensors").stat().st_ino


def test_model_disk_full_mid_copy_is_one_line_and_leaves_no_destination(tmp_path):
    source = fake_model(tmp_path / "src")
    code = _MID_COPY.format(action='raise OSError(28, "No space left on device")')

    result = run_program("model", tmp_path, str(source), code=code)

    assert result.returncode == EXIT_TRANSIENT  # the environment's failure, one line
    assert result.stderr.startswith(
        "model-initializer: error: no space left on the device (or quota) writing "
        f"{tmp_path / 'ws' / 'model'} ("
    )
    assert "Traceback" not in result.stderr
    assert sorted(p.name for p in (tmp_path / "ws").iterdir()) == []
    # The next run starts clean and completes.
    assert run_program("model", tmp_path, str(source)).returncode == 0


def test_model_sigterm_mid_copy_exits_retriable_and_publishes_nothing(tmp_path):
    source = fake_model(tmp_path / "src")
    code = _MID_COPY.format(action="os.kill(os.getpid(), signal.SIGTERM)")

    result = run_program("model", tmp_path, str(source), code=code)

    assert result.returncode == EXIT_TRANSIENT, result.stderr
    assert result.stderr == (
        "model-initializer: error: stopped by SIGTERM (preemption or shutdown); nothing was "
        "published, the step can be retried\n"
    )
    assert sorted(p.name for p in (tmp_path / "ws").iterdir()) == []


# --- URI parsing and redaction (in process) ------------------------------------------------------


def test_parse_forms(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert uri.parse("file:///data/d.jsonl") == uri.StorageUri(
        raw="file:///data/d.jsonl", scheme="file", location="/data/d.jsonl"
    )
    assert uri.parse("data/../d.jsonl").location == str(tmp_path / "d.jsonl")
    assert uri.parse("FILE://localhost/a%20b").location == "/a b"
    assert uri.parse("file:/abs/x").location == "/abs/x"
    assert uri.parse("d.jsonl").canonical == uri.parse((tmp_path / "d.jsonl").as_uri()).canonical


@pytest.mark.parametrize(
    ("raw", "shown"),
    [
        ("https://user:pw@host/x", "https://***@host/x"),
        (
            "https://tok@host/x?X-Amz-Signature=s&revision=v1",
            "https://***@host/x?X-Amz-Signature=***&revision=v1",
        ),
        ("s3://bucket/key", "s3://bucket/key"),
        ("/plain/path", "/plain/path"),
        ("https://u:pw@[::1/x?token=t", "https://[::1/x?***"),
    ],
)
def test_redact(raw, shown):
    assert uri.redact(raw) == shown


def test_missing_shard_named_by_the_index_is_reported(tmp_path):
    from tunepack.initializers import model as model_initializer

    entry = catalog.get("gemma-2b")  # a sharded checkpoint resolved through its index
    index = {"weight_map": {"a": "model-00001-of-00002.safetensors"}}
    index["weight_map"]["b"] = "model-00002-of-00002.safetensors"
    (tmp_path / catalog.SAFETENSORS_INDEX).write_text(json.dumps(index))
    (tmp_path / "model-00001-of-00002.safetensors").write_bytes(b"x")
    source_uri = uri.parse(f"file://{tmp_path}")
    with pytest.raises(BadModelError) as err:
        model_initializer._check_shards(entry, source_uri, tmp_path)
    assert str(err.value) == (
        f"model at 'file://{tmp_path}' is missing 1 checkpoint shard(s) named by "
        "model.safetensors.index.json: model-00002-of-00002.safetensors. Point STORAGE_URI at a "
        "complete copy of google/gemma-2b-it"
    )
    (tmp_path / "model-00002-of-00002.safetensors").write_bytes(b"x")
    model_initializer._check_shards(entry, source_uri, tmp_path)


def test_a_single_file_has_only_its_own_split(tmp_path):
    """YAML TrainJobs reach the initializer without the SDK's pre-check: a single file asked for
    another split is refused (not read whole as that split); one named after the split is read."""
    data = write_jsonl(tmp_path / "rows.jsonl", ROWS)
    result = run_program("dataset", tmp_path, f"file://{data}?split=test")
    assert_bad_input(
        result,
        "dataset",
        f"dataset 'file://{data}?split=test' is a single file, which has no 'test' split: a file "
        "is the train split unless its name says otherwise. Give the file of that split, or a "
        "directory with one file per split (train.jsonl, test.jsonl), and no split to train on "
        "the whole file",
    )
    assert not (tmp_path / "ws" / "dataset").exists()
    named = write_jsonl(tmp_path / "test.jsonl", ROWS)
    result = run_program("dataset", tmp_path, f"file://{named}?split=test")
    assert result.returncode == 0, result.stderr
    assert len(read_jsonl(tmp_path / "ws" / "dataset" / "train.jsonl")) == len(ROWS)
