"""The dataset initializer: ``python -m tunepack.initializers.dataset``.

Reads ``STORAGE_URI`` (a JSON array or JSON Lines file, or a directory of them), validates every
row against the instruction schema and writes ``<workspace>/dataset/train.jsonl`` with its
manifest. Bad rows are reported here, with file and row, before any trainer Pod starts.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
from collections.abc import Iterator
from pathlib import Path

from tunepack import workspace
from tunepack.errors import BadInputError
from tunepack.initializers import atomic, uri
from tunepack.initializers._entry import log, run

PROGRAM = "dataset-initializer"
OUTPUT_FILE = "train.jsonl"
DATA_SUFFIXES = (".json", ".jsonl")
MAX_REPORTED = 5
SCHEMA_HINT = (
    "each row must be a JSON object with string fields 'instruction' and 'output' and an "
    "optional string 'input'"
)


def main() -> int:
    return run(PROGRAM, initialize)


def initialize() -> None:
    source_uri = uri.from_env()
    files = _data_files(source_uri, uri.resolve(source_uri))
    dest = workspace.dataset_dir()
    for stale in atomic.remove_stale_partials(dest):
        log(PROGRAM, f"removed {stale.name} left by an interrupted run")

    expect = {
        "kind": "dataset",
        "source": source_uri.canonical,
        "source_fingerprint": atomic.source_fingerprint(files),
    }
    reason = atomic.why_incomplete(dest, expect, hashed=frozenset({OUTPUT_FILE}))
    if reason is None:
        rows = atomic.read_manifest(dest).get("rows", "?")
        log(PROGRAM, f"{dest} already complete ({rows} rows from {source_uri.display})")
        return
    log(PROGRAM, f"building {dest}: {reason}")

    with atomic.staged(dest) as partial:
        rows, size, sha256 = _write_dataset(source_uri, files, partial / OUTPUT_FILE)
        manifest = {
            **expect,
            "format": "jsonl",
            "schema": "instruction",
            "rows": rows,
            "files": {OUTPUT_FILE: {"size": size, "sha256": sha256}},
            "created": atomic.now_iso(),
        }
        atomic.write_manifest(partial, manifest)
    log(
        PROGRAM,
        f"read {rows} rows from {source_uri.display}; wrote {dest / OUTPUT_FILE} "
        f"({size} bytes, sha256 {sha256[:12]})",
    )


def _data_files(source_uri: uri.StorageUri, source: Path) -> dict[str, Path]:
    """Data files by display name, in reading order (a directory's files sorted by name)."""
    if source.is_file():
        if source.suffix.lower() not in DATA_SUFFIXES:
            raise BadInputError(
                f"dataset {source_uri.display!r} is not a .json or .jsonl file; give a JSON "
                f"array of rows (.json), JSON Lines (.jsonl) or a directory of such files"
            )
        return {source.name: source}
    if not source.is_dir():
        raise BadInputError(
            f"dataset {source_uri.display!r} is neither a regular file nor a directory"
        )
    entries = sorted(p for p in source.iterdir() if not p.name.startswith("."))
    files = {p.name: p for p in entries if p.is_file() and p.suffix.lower() in DATA_SUFFIXES}
    if not files:
        raise BadInputError(
            f"dataset directory {source_uri.display!r} has no .json or .jsonl files; put the "
            f"training rows there as a JSON array (.json) or JSON Lines (.jsonl)"
        )
    skipped = [p.name for p in entries if p.name not in files]
    if skipped:
        log(PROGRAM, f"ignoring {', '.join(skipped)} (not .json or .jsonl files)")
    return files


def _write_dataset(
    source_uri: uri.StorageUri, files: dict[str, Path], out_path: Path
) -> tuple[int, int, str]:
    """Validate every row and write the normalized JSONL; return (rows, bytes, sha256)."""
    problems: list[str] = []
    bad_rows = rows = size = 0
    digest = hashlib.sha256()
    with open(out_path, "xb") as out:
        for name, path in files.items():
            file_rows = file_bad = 0
            for number, row, problem in _rows(name, path):
                problem = problem or _row_problem(row)
                if problem is None:
                    line, problem = _encode(row)
                if problem is not None:
                    file_bad += 1
                    if len(problems) < MAX_REPORTED:
                        problems.append(f"{name} row {number}: {problem}")
                    continue
                file_rows += 1
                if bad_rows or file_bad:
                    continue  # the output will be discarded; keep validating only
                out.write(line)
                digest.update(line)
                size += len(line)
            rows += file_rows
            bad_rows += file_bad
            invalid = f" and {file_bad} invalid rows" if file_bad else ""
            log(PROGRAM, f"read {file_rows} rows{invalid} from {name}")
        out.flush()
        os.fsync(out.fileno())

    if bad_rows:
        shown = f" (first {MAX_REPORTED} shown)" if bad_rows > MAX_REPORTED else ""
        plural = "s" if bad_rows > 1 else ""
        raise BadInputError(
            f"dataset {source_uri.display!r} has {bad_rows} invalid row{plural}{shown}; "
            f"{SCHEMA_HINT}:\n" + "\n".join(f"  {p}" for p in problems)
        )
    if rows == 0:
        raise BadInputError(f"dataset {source_uri.display!r} has no rows; {SCHEMA_HINT}")
    return rows, size, digest.hexdigest()


def _rows(name: str, path: Path) -> Iterator[tuple[int, object, str | None]]:
    """Yield (1-based row number, value, problem) for each row of a data file."""
    try:
        if path.suffix.lower() == ".jsonl":
            yield from _jsonl_rows(path)
            return
        # A JSON array is parsed whole; JSON Lines stream, so they suit very large datasets.
        text = path.read_bytes().decode("utf-8-sig")
    except PermissionError:
        raise BadInputError(f"cannot read dataset file {path}: permission denied") from None
    except UnicodeDecodeError as error:
        raise BadInputError(
            f"{name}: not UTF-8 text (byte {error.start}); save it as UTF-8 JSON"
        ) from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as error:
        if text.lstrip().startswith("{"):  # JSON Lines saved with a .json name
            yield from _jsonl_rows(path)
            return
        raise BadInputError(
            f"{name}: not valid JSON ({error.msg} at line {error.lineno} column {error.colno}); "
            f"expected an array of rows"
        ) from None
    if not isinstance(data, list):
        raise BadInputError(
            f"{name}: holds a JSON {_json_type(data)}, not an array of rows; write the rows as "
            f"a JSON array or as JSON Lines (.jsonl)"
        )
    for number, row in enumerate(data, 1):
        yield number, row, None


def _jsonl_rows(path: Path) -> Iterator[tuple[int, object, str | None]]:
    # The row number is the line number (blank lines count but yield nothing), so a reported row
    # is the line an editor shows.
    with open(path, "rb") as f:
        for number, raw in enumerate(f, 1):
            if number == 1:
                raw = raw.removeprefix(b"\xef\xbb\xbf")  # UTF-8 byte order mark
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as error:
                yield number, None, f"not UTF-8 text (byte {error.start})"
                continue
            if not line.strip():
                continue
            try:
                yield number, json.loads(line.strip()), None
            except json.JSONDecodeError as error:
                yield number, None, f"not valid JSON ({error.msg} at column {error.colno})"


def _row_problem(row: object) -> str | None:
    if not isinstance(row, dict):
        return f"expected a JSON object, got {_json_type(row)}"
    for field in ("instruction", "output"):
        if field not in row:
            return f"field {field!r} is missing"
        if not isinstance(row[field], str):
            return f"field {field!r} must be a string, got {_json_type(row[field])}"
    value = row.get("input")
    if value is not None and not isinstance(value, str):
        return f"field 'input' must be a string, got {_json_type(value)}"
    return None


def _encode(row: dict) -> tuple[bytes, str | None]:
    """The normalized JSONL line for a valid row, or the reason it cannot be written."""
    # One fixed shape for every row: extra fields dropped, a missing or null input becomes "".
    normalized = {
        "instruction": row["instruction"],
        "input": row.get("input") or "",
        "output": row["output"],
    }
    try:
        return (json.dumps(normalized, ensure_ascii=False) + "\n").encode(), None
    except UnicodeEncodeError:  # a lone surrogate escape such as "\\ud800"
        return b"", "contains an invalid Unicode escape (an unpaired surrogate)"


def _json_type(value: object) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int | float):
        return "number"
    if isinstance(value, str):
        return "string"
    if isinstance(value, list):
        return "array"
    return "object"


if __name__ == "__main__":
    sys.exit(main())
