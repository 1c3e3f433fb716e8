"""Dataset formats and schemas, and the corpus of bad inputs with their exact messages."""

from __future__ import annotations

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from tests.helpers import run_dataset_initializer
from tunepack.core.errors import EXIT_BAD_INPUT
from tunepack.core.workspace import MANIFEST_FILE

CHAT = {
    "messages": [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "2+2?"},
        {"role": "assistant", "content": "4"},
    ]
}
SHAREGPT = {"conversations": [{"from": "human", "value": "2+2?"}, {"from": "gpt", "value": "4"}]}
CHAT_HINT = (
    "each row must hold 'messages': an array of objects with 'role' (system, user or assistant) "
    "and string 'content', with at least one assistant turn"
)


def run_dataset(tmp_path, storage_uri, **env):
    return run_dataset_initializer(tmp_path / "ws", storage_uri, cwd=tmp_path, **env)


def output(tmp_path) -> tuple[list[dict], dict]:
    out = tmp_path / "ws" / "dataset"
    rows = [json.loads(x) for x in (out / "train.jsonl").read_text().splitlines()]
    return rows, json.loads((out / MANIFEST_FILE).read_text())


def jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path.name


# --- schemas and formats -------------------------------------------------------------------------


def test_chat_rows_are_kept_as_messages(tmp_path):
    result = run_dataset(tmp_path, jsonl(tmp_path / "c.jsonl", [CHAT, CHAT]))
    assert result.returncode == 0, result.stderr
    rows, manifest = output(tmp_path)
    assert rows == [CHAT, CHAT]
    assert (manifest["schema"], manifest["source_schema"], manifest["rows"]) == ("chat", "chat", 2)


def test_sharegpt_is_normalized_to_chat(tmp_path):
    result = run_dataset(tmp_path, jsonl(tmp_path / "s.jsonl", [SHAREGPT]))
    assert result.returncode == 0, result.stderr
    rows, manifest = output(tmp_path)
    assert rows == [
        {"messages": [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4"}]}
    ]
    assert (manifest["schema"], manifest["source_schema"]) == ("chat", "sharegpt")


def test_text_rows(tmp_path):
    result = run_dataset(tmp_path, jsonl(tmp_path / "t.jsonl", [{"text": "abc", "meta": 1}]))
    assert result.returncode == 0, result.stderr
    assert output(tmp_path)[0] == [{"text": "abc"}]
    assert output(tmp_path)[1]["schema"] == "text"


def test_csv_with_column_map(tmp_path):
    (tmp_path / "qa.csv").write_text('question,answer\n"Add 1, 2",3\nSay hi,hi\n')
    result = run_dataset(tmp_path, "qa.csv", COLUMN_MAP="question:instruction,answer:output")
    assert result.returncode == 0, result.stderr
    rows, manifest = output(tmp_path)
    assert rows == [
        {"instruction": "Add 1, 2", "input": "", "output": "3"},
        {"instruction": "Say hi", "input": "", "output": "hi"},
    ]
    assert (manifest["source_format"], manifest["column_map"]) == (
        "csv",
        {"question": "instruction", "answer": "output"},
    )


def test_csv_chat_column_holds_json(tmp_path):
    cell = json.dumps(CHAT["messages"]).replace('"', '""')
    (tmp_path / "c.csv").write_text(f'messages\n"{cell}"\n')
    result = run_dataset(tmp_path, "c.csv")
    assert result.returncode == 0, result.stderr
    assert output(tmp_path)[0] == [CHAT]


def test_parquet_and_arrow_with_json_column_map(tmp_path):
    table = pa.Table.from_pylist([{"body": "first"}, {"body": "second"}])
    pq.write_table(table, tmp_path / "t.parquet")
    result = run_dataset(tmp_path, "t.parquet", COLUMN_MAP='{"body": "text"}')
    assert result.returncode == 0, result.stderr
    assert output(tmp_path)[0] == [{"text": "first"}, {"text": "second"}]

    with pa.OSFile(str(tmp_path / "t.arrow"), "wb") as sink:  # the stream format `datasets` writes
        with pa.ipc.new_stream(sink, table.schema) as writer:
            writer.write_table(table)
    result = run_dataset(tmp_path, "t.arrow", COLUMN_MAP="body:text")
    assert result.returncode == 0, result.stderr
    rows, manifest = output(tmp_path)
    assert rows == [{"text": "first"}, {"text": "second"}]
    assert manifest["source_format"] == "arrow"


def test_directory_split_by_file_names(tmp_path):
    data = tmp_path / "data"
    data.mkdir()
    jsonl(data / "train.jsonl", [{"text": "t"}])
    jsonl(data / "validation.jsonl", [{"text": "v"}])
    result = run_dataset(tmp_path, "data", DATASET_SPLIT="validation")
    assert result.returncode == 0, result.stderr
    rows, manifest = output(tmp_path)
    assert (rows, manifest["split"]) == ([{"text": "v"}], "validation")


# --- the bad-input corpus: every message exact, every exit 65 -------------------------------------


def _rows(tmp_path, rows, name="d.jsonl"):
    return jsonl(tmp_path / name, rows)


CORPUS = [
    # (id, files to write as {name: rows or text}, STORAGE_URI, env, message)
    (
        "chat-bad-role",
        {"d.jsonl": [{"messages": [{"role": "bot", "content": "x"}]}]},
        "d.jsonl",
        {},
        f"dataset 'd.jsonl' has 1 invalid row; {CHAT_HINT}:\n"
        "  d.jsonl row 1: messages[0]: role 'bot' is not one of system, user, assistant",
    ),
    (
        "chat-no-assistant",
        {"d.jsonl": [CHAT, {"messages": [{"role": "user", "content": "x"}]}]},
        "d.jsonl",
        {},
        f"dataset 'd.jsonl' has 1 invalid row; {CHAT_HINT}:\n"
        "  d.jsonl row 2: field 'messages' has no assistant turn, so there is nothing to learn",
    ),
    (
        "chat-content-type",
        {"d.jsonl": [CHAT, {"messages": [{"role": "user", "content": 5}]}]},
        "d.jsonl",
        {},
        f"dataset 'd.jsonl' has 1 invalid row; {CHAT_HINT}:\n"
        "  d.jsonl row 2: messages[0]: field 'content' must be a string, got number",
    ),
    (
        "chat-not-array",
        {"d.jsonl": [CHAT, {"messages": "hello"}]},
        "d.jsonl",
        {},
        f"dataset 'd.jsonl' has 1 invalid row; {CHAT_HINT}:\n"
        "  d.jsonl row 2: field 'messages' must be an array, got string",
    ),
    (
        "sharegpt-missing-value",
        {"d.jsonl": [{"conversations": [{"from": "human"}]}]},
        "d.jsonl",
        {},
        "dataset 'd.jsonl' has 1 invalid row; each row must hold 'conversations': an array of "
        "objects with 'from' (system, human or gpt) and string 'value', with at least one gpt "
        "turn:\n  d.jsonl row 1: conversations[0]: field 'value' must be a string, got null",
    ),
    (
        "text-empty",
        {"d.jsonl": [{"text": "ok"}, {"text": "  "}]},
        "d.jsonl",
        {},
        "dataset 'd.jsonl' has 1 invalid row; each row must hold a non-empty string field 'text':\n"
        "  d.jsonl row 2: field 'text' is empty",
    ),
    (
        "undetectable",
        {"d.jsonl": [{"q": "a", "a": "b"}]},
        "d.jsonl",
        {},
        "cannot tell the schema of dataset 'd.jsonl': its first row has 'q', 'a'. Rows need "
        "'instruction' and 'output' (instruction), 'messages' (chat), 'messages' and "
        "'images' (image_chat), 'conversations' "
        "(sharegpt), 'text', 'chosen' and 'rejected' (preference), 'prompt' and 'completion' "
        "and 'label' (unpaired), or 'prompt' (prompt); rename columns with "
        "COLUMN_MAP=from:to,... or set DATASET_SCHEMA",
    ),
    (
        "column-map-malformed",
        {"d.jsonl": [{"text": "x"}]},
        "d.jsonl",
        {"COLUMN_MAP": "a=b"},
        "COLUMN_MAP='a=b' is not valid: write source:target pairs separated by commas "
        "(question:instruction,answer:output) or a JSON object of strings",
    ),
    (
        "column-map-missing-source",
        {"d.jsonl": [{"instruction": "x", "answer": "y"}, {"instruction": "x", "reply": "y"}]},
        "d.jsonl",
        {"COLUMN_MAP": "answer:output"},
        "dataset 'd.jsonl' has 1 invalid row; each row must be a JSON object with string fields "
        "'instruction' and 'output' and an optional string 'input':\n  d.jsonl row 2: field "
        "'output' is missing (COLUMN_MAP maps column 'answer' to it)",
    ),
    (  # from `tunepack train --local` (its steps get TUNEPACK_SPELLING=cli): its flags' names
        "column-map-missing-source-cli",
        {"d.jsonl": [{"instruction": "x", "answer": "y"}, {"instruction": "x", "reply": "y"}]},
        "d.jsonl",
        {"COLUMN_MAP": "answer:output", "TUNEPACK_SPELLING": "cli"},
        "dataset 'd.jsonl' has 1 invalid row; each row must be a JSON object with string fields "
        "'instruction' and 'output' and an optional string 'input':\n  d.jsonl row 2: field "
        "'output' is missing (--column-map maps column 'answer' to it)",
    ),
    (  # issue 49, item 5: a column map naming a column the data lacks was ignored silently
        "column-map-absent-column",
        {
            "d.jsonl": [
                {"instruction": "x", "output": "y"},
                {"instruction": "x", "output": "y", "input": "z"},
            ]
        },
        "d.jsonl",
        {"COLUMN_MAP": "questoin:instruction"},
        "COLUMN_MAP names column 'questoin', which no row of dataset 'd.jsonl' has; its columns "
        "are 'instruction', 'output', 'input'",
    ),
    (  # ... or, where the first row then shows no schema, hidden behind "cannot tell the schema"
        "column-map-absent-columns-cli",
        {"d.jsonl": [{"question": "q", "answer": "a"}]},
        "d.jsonl",
        {"COLUMN_MAP": "questoin:instruction,answr:output", "TUNEPACK_SPELLING": "cli"},
        "--column-map names columns 'questoin' and 'answr', which the first row of dataset "
        "'d.jsonl' does not have; its columns are 'question', 'answer'",
    ),
    (
        "schema-unknown-cli",
        {"d.jsonl": [{"text": "x"}]},
        "d.jsonl",
        {"DATASET_SCHEMA": "dpo", "TUNEPACK_SPELLING": "cli"},
        "--dataset-schema 'dpo' is not a dataset schema; use one of instruction, chat, sharegpt, "
        "text, preference, prompt, image_chat, unpaired or auto",
    ),
    (
        "schema-unknown",
        {"d.jsonl": [{"text": "x"}]},
        "d.jsonl",
        {"DATASET_SCHEMA": "dpo"},
        "DATASET_SCHEMA='dpo' is not a dataset schema; use one of instruction, chat, sharegpt, "
        "text, preference, prompt, image_chat, unpaired or auto",
    ),
    (
        "schema-forced-mismatch",
        {"d.jsonl": [{"text": "x"}]},
        "d.jsonl",
        {"DATASET_SCHEMA": "chat"},
        f"dataset 'd.jsonl' has 1 invalid row; {CHAT_HINT}:\n"
        "  d.jsonl row 1: field 'messages' is missing",
    ),
    (
        "csv-extra-cells",
        {"d.csv": "text\nok\na,b\n"},
        "d.csv",
        {},
        "dataset 'd.csv' has 1 invalid row; each row must hold a non-empty string field 'text':\n"
        "  d.csv row 3: has 1 more cells than the header's 1",
    ),
    (
        "parquet-wrong-type",
        {"d.parquet": [{"instruction": "q", "output": 7}]},
        "d.parquet",
        {},
        "dataset 'd.parquet' has 1 invalid row; each row must be a JSON object with string fields "
        "'instruction' and 'output' and an optional string 'input':\n  d.parquet row 1: field "
        "'output' must be a string, got number",
    ),
    (
        "parquet-garbage",
        {"d.parquet": "not parquet"},
        "d.parquet",
        {},
        "d.parquet: not a readable Parquet file (Parquet magic bytes not found in footer. Either "
        "the file is corrupted or this is not a parquet file.)",
    ),
    (
        "empty-csv",
        {"d.csv": "text\n"},
        "d.csv",
        {},
        "dataset 'd.csv' has no rows; each row must be a JSON object with string fields "
        "'instruction' and 'output' and an optional string 'input'",
    ),
    (
        "split-missing",
        {"train.jsonl": [{"text": "x"}]},
        ".",
        {"DATASET_SPLIT": "test"},
        "dataset '.' has no 'test' split; it has: train. Set DATASET_SPLIT or ?split= to one of "
        "them",
    ),
    (
        "split-invalid",
        {"d.jsonl": [{"text": "x"}]},
        "d.jsonl",
        {"DATASET_SPLIT": "../x"},
        "dataset split '../x' is not a valid split name (letters, digits, '_', '-', '.')",
    ),
    (
        "hf-no-name",
        {},
        "hf://org",
        {},
        "hub URI 'hf://org' does not name a repository; write hf://org/name for a model or "
        "hf://datasets/org/name for a dataset",
    ),
    (  # issue 49, item 5: one slash made it a relative path
        "hf-one-slash",
        {},
        "hf:/org/x",
        {},
        "storage URI 'hf:/org/x' has one slash after 'hf:': did you mean hf://org/x? (a local "
        "path that begins with 'hf:' is written ./hf:/org/x)",
    ),
    (
        "hf-bad-id",
        {},
        "hf://org/na!me",
        {},
        "hub URI 'hf://org/na!me' names 'org/na!me', which is not a valid repository id (letters, "
        "digits, '-', '_' and '.', at most 96 characters per part)",
    ),
    (
        "hf-empty-revision",
        {},
        "hf://org/name@",
        {},
        "hub URI 'hf://org/name@' ends with '@' but names no revision; write "
        "hf://org/name@<branch, tag or commit> or leave out the '@'",
    ),
    (
        "hf-unknown-option",
        {},
        "hf://datasets/org/name?config=x",
        {},
        "hub URI 'hf://datasets/org/name?config=***' has unknown option 'config'; the only option "
        "is ?split=<name> for datasets",
    ),
    (
        "s3-bad-bucket",
        {},
        "s3://My_Bucket/x",
        {},
        "S3 URI 's3://My_Bucket/x' names bucket 'My_Bucket', which is not a valid bucket name "
        "(3-63 lowercase letters, digits, '.' and '-'); write s3://bucket/prefix",
    ),
    (
        "http-not-loopback",
        {},
        "http://example.com/d.jsonl",
        {},
        "URL 'http://example.com/d.jsonl' uses plain http://, which tunepack accepts only for "
        "loopback test servers (127.0.0.1, localhost, ::1); use https://",
    ),
    (
        "https-bad-sha",
        {},
        "https://example.com/d.jsonl#sha256=abc",
        {},
        "the sha256 given for 'https://example.com/d.jsonl#sha256=abc' is not 64 hexadecimal "
        "digits; copy it from `sha256sum <file>`",
    ),
    (
        "https-no-host",
        {},
        "https:///d.jsonl",
        {},
        "URL 'https:///d.jsonl' has no host; write https://host/path",
    ),
]


@pytest.mark.parametrize(
    ("files", "storage_uri", "env", "message"), [c[1:] for c in CORPUS], ids=[c[0] for c in CORPUS]
)
def test_bad_input_corpus(tmp_path, files, storage_uri, env, message):
    for name, content in files.items():
        if isinstance(content, str):
            (tmp_path / name).write_text(content)
        elif name.endswith(".parquet"):
            pq.write_table(pa.Table.from_pylist(content), tmp_path / name)
        else:
            jsonl(tmp_path / name, content)
    result = run_dataset(tmp_path, storage_uri, **env)
    assert result.returncode == EXIT_BAD_INPUT, result.stderr
    assert result.stderr == f"dataset-initializer: error: {message}\n"
    assert not (tmp_path / "ws" / "dataset").exists()


def test_a_row_larger_than_the_limit_is_refused_with_its_row_number(tmp_path):
    from tunepack.initializers.data import schemas

    small = {"instruction": "say hi", "output": "hi"}
    huge = {"instruction": "recite", "output": "lorem ipsum " * (1 << 18)}  # 3 MiB
    jsonl(tmp_path / "d.jsonl", [small, small, huge, small])
    result = run_dataset(tmp_path, "d.jsonl", TUNEPACK_MODEL="tiny-llama3")
    assert result.returncode == EXIT_BAD_INPUT, result.stderr
    assert result.stderr == (
        f"dataset-initializer: error: dataset 'd.jsonl' has 1 invalid row; "
        f"{schemas.SCHEMAS['instruction'].hint}:\n"
        "  d.jsonl row 3: the row is 3.0 MiB, more than the 1.0 MiB a row may hold (the trainer "
        "reads at most max_seq_len tokens of it); split it into shorter rows or remove it\n"
    )
    assert not (tmp_path / "ws" / "dataset").exists()


def test_the_row_limit_grows_with_the_models_context_window(tmp_path, monkeypatch):
    from tunepack.initializers.data import schemas
    from tunepack.runtimes import catalog

    longest = max(catalog.CATALOG.values(), key=lambda e: e.shape.max_seq_len)
    monkeypatch.setenv("TUNEPACK_MODEL", longest.runtime_name)
    assert schemas.max_row_bytes() == 8 * longest.shape.max_seq_len > 1 << 20
    monkeypatch.setenv("TUNEPACK_MODEL", "tiny-llama3")
    assert schemas.max_row_bytes() == 1 << 20
    monkeypatch.delenv("TUNEPACK_MODEL")
    assert schemas.max_row_bytes() == 1 << 20
