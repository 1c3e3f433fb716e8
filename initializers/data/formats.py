"""Reading dataset files: JSON, JSON Lines, CSV, Parquet and Arrow, row by row.

Every reader yields ``(row number, row, problem)``: the row is a dict (or whatever JSON value the
file holds, for the schema check to reject) and ``problem`` describes a row that could not even be
decoded. Row numbers are what a person finds in the file: the line for JSON Lines and CSV, the
1-based position for a JSON array, Parquet and Arrow. Files are streamed, except a JSON array.
"""

from __future__ import annotations

import csv
import json
from collections.abc import Iterator
from pathlib import Path

from tunepack.core.errors import BadDatasetError, DeniedError

Row = tuple[int, object, str | None]
FORMATS = {
    ".jsonl": "jsonl",
    ".json": "json",
    ".csv": "csv",
    ".parquet": "parquet",
    ".arrow": "arrow",
}
SUFFIX_TEXT = ".json, .jsonl, .csv, .parquet or .arrow"
_BATCH = 1024


def format_of(name: str) -> str | None:
    return FORMATS.get(Path(name).suffix.lower())


def read_rows(name: str, path: Path) -> Iterator[Row]:
    """Rows of one data file; raise BadInputError when the file as a whole is unreadable."""
    fmt = format_of(name)
    try:
        if fmt == "jsonl":
            yield from _jsonl_rows(path)
        elif fmt == "json":
            yield from _json_rows(name, path)
        elif fmt == "csv":
            yield from _csv_rows(name, path)
        elif fmt == "parquet":
            yield from _parquet_rows(name, path)
        elif fmt == "arrow":
            yield from _arrow_rows(name, path)
        else:
            raise AssertionError(f"not a data file: {name}")
    except PermissionError:
        raise DeniedError(f"cannot read dataset file {path}: permission denied") from None


def _json_rows(name: str, path: Path) -> Iterator[Row]:
    try:
        text = path.read_bytes().decode("utf-8-sig")
    except UnicodeDecodeError as error:
        raise BadDatasetError(
            f"{name}: not UTF-8 text (byte {error.start}); save it as UTF-8 JSON"
        ) from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as error:
        if text.lstrip().startswith("{"):  # JSON Lines saved with a .json name
            yield from _jsonl_rows(path)
            return
        raise BadDatasetError(
            f"{name}: not valid JSON ({error.msg} at line {error.lineno} column {error.colno}); "
            f"expected an array of rows"
        ) from None
    if not isinstance(data, list):
        raise BadDatasetError(
            f"{name}: holds a JSON {json_type(data)}, not an array of rows; write the rows as "
            f"a JSON array or as JSON Lines (.jsonl)"
        )
    for number, row in enumerate(data, 1):
        yield number, row, None


def _jsonl_rows(path: Path) -> Iterator[Row]:
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


def _csv_rows(name: str, path: Path) -> Iterator[Row]:
    # CSV cells are text: a chat column holds its messages as JSON text, which the schema decodes.
    try:
        with open(path, encoding="utf-8-sig", newline="") as f:
            reader = csv.DictReader(f)
            if not reader.fieldnames:
                return
            for row in reader:
                extra = row.pop(None, None)  # cells beyond the header
                if extra:
                    yield (
                        reader.line_num,
                        None,
                        (f"has {len(extra)} more cells than the header's {len(reader.fieldnames)}"),
                    )
                    continue
                yield reader.line_num, row, None
    except UnicodeDecodeError as error:
        raise BadDatasetError(
            f"{name}: not UTF-8 text (byte {error.start}); save it as UTF-8 CSV"
        ) from None
    except csv.Error as error:
        raise BadDatasetError(f"{name}: not valid CSV ({error})") from None


def _parquet_rows(name: str, path: Path) -> Iterator[Row]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        parquet = pq.ParquetFile(path)
        batches = parquet.iter_batches(batch_size=_BATCH)
        yield from _batch_rows(batches)
    except (pa.ArrowInvalid, pa.ArrowNotImplementedError, OSError) as error:
        raise BadDatasetError(f"{name}: not a readable Parquet file ({error})") from None


def _arrow_rows(name: str, path: Path) -> Iterator[Row]:
    import pyarrow as pa

    try:
        source = pa.memory_map(str(path))
        try:
            reader = pa.ipc.open_file(source)
            batches = (reader.get_batch(i) for i in range(reader.num_record_batches))
        except pa.ArrowInvalid:
            # Hugging Face `datasets` writes the streaming IPC format under the .arrow name.
            source.seek(0)
            batches = iter(pa.ipc.open_stream(source))
        yield from _batch_rows(batches)
    except (pa.ArrowInvalid, pa.ArrowNotImplementedError, OSError) as error:
        raise BadDatasetError(f"{name}: not a readable Arrow file ({error})") from None


def _batch_rows(batches) -> Iterator[Row]:
    number = 0
    for batch in batches:
        for row in batch.to_pylist():
            number += 1
            yield number, row, None


def json_type(value: object) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int | float):
        return "number"
    if isinstance(value, str):
        return "string"
    if isinstance(value, list | tuple):
        return "array"
    if isinstance(value, dict):
        return "object"
    return type(value).__name__
