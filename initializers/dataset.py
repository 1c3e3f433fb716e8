"""The dataset initializer: ``python -m tunepack.initializers.dataset``.

Reads ``STORAGE_URI`` (a local file or directory, ``hf://datasets/...``, ``s3://...`` or
``https://...``), checks every row against one schema (``tunepack.initializers.data.schemas``) and
writes ``<workspace>/dataset/train.jsonl`` in the normalized form the trainer reads, with a
manifest; an image-text dataset's images are checked and stored beside it, in ``images/``
(``tunepack.initializers.data.images``). Bad rows are reported here, by file, row and field, before
any trainer Pod starts.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
from pathlib import Path

from tunepack.core import workspace
from tunepack.core.errors import BadDatasetError, BadValueError
from tunepack.initializers import atomic, trainer_args
from tunepack.initializers._entry import log, run
from tunepack.initializers.data import formats, images, schemas, splits
from tunepack.initializers.transport import download, uri
from tunepack.initializers.transport.archives import extract, is_archive
from tunepack.initializers.transport.retry import retrying

PROGRAM = "dataset-initializer"
OUTPUT_FILE = "train.jsonl"
# The source's own validation split (or its test split when it has no validation split), written
# next to the training rows when the training split is read: the trainer evaluates on it.
VALIDATION_FILE = "validation.jsonl"
VALIDATION_SPLITS = ("validation", "test")
MAX_REPORTED = 5


def main() -> int:
    return run(PROGRAM, initialize)


def _log(message: str) -> None:
    log(PROGRAM, message)


def initialize() -> None:
    if (checked := trainer_args.check_from_env()) is not None:
        _log(f"the trainer's {checked} arguments are valid")
    source_uri = uri.from_env()
    split = splits.requested(source_uri.options.get("split"))
    options = {
        "split": split.name,
        # Only when sliced, so that a workspace built before slices existed stays complete.
        **({"slice": split.spec} if split.sliced else {}),
        "requested_schema": (schemas.requested() or _Auto).name,
        "column_map": schemas.column_map(),
    }
    # The trainer's method against the schema, as soon as it is known: here when it is named,
    # else at the first row (_write_dataset), before any row is written or the model fetched.
    method = trainer_args.method_from_env()
    if (named := schemas.requested()) is not None:
        schemas.check_method(method, named.output)
    workspace.claim_workspace(workspace.workspace_root(), PROGRAM)
    dest = workspace.dataset_dir()
    for stale in atomic.remove_stale_partials(dest):
        _log(f"removed {stale.name} left by an interrupted run")

    expect: dict[str, object] = {"kind": "dataset", "source": source_uri.canonical, **options}
    files: dict[str, Path] | None = None
    val_files: dict[str, Path] = {}
    image_root: Path | None = None  # where an image-text row's relative paths are read from
    if source_uri.is_local:
        source = uri.resolve(source_uri)
        image_root = source if source.is_dir() else source.parent
        files = _local_files(source_uri, source, options["split"])
        val_files = _local_validation_files(source, options["split"])
        expect["source_fingerprint"] = atomic.source_fingerprint({**files, **val_files})
    hashed = frozenset({OUTPUT_FILE, VALIDATION_FILE})
    reason = atomic.why_incomplete(dest, expect, hashed=hashed)
    if reason is None:
        manifest = atomic.read_manifest(dest)
        if "schema" in manifest:  # rows another run's method took: maybe not this one's
            schemas.check_method(method, manifest["schema"])
        rows = manifest.get("rows", "?")
        _log(f"{dest} already complete ({rows} rows from {source_uri.display})")
        return
    _log(f"building {dest}: {reason}")

    cache = None
    facts: dict[str, object] = {}
    if files is None:
        cache = download.cache_dir(workspace.workspace_root(), "dataset", source_uri.canonical)
        files, facts, val_files, image_root = _remote_files(source_uri, options["split"], cache)

    # The normalized rows take about what the source's do (an estimate: Parquet compresses).
    image_cache = download.cache_dir(workspace.workspace_root(), "images", source_uri.canonical)
    with atomic.staged(dest, atomic.files_size({**files, **val_files})) as partial:
        store = images.ImageStore(partial, image_root, image_cache, _log)
        result = _write_dataset(source_uri, files, partial / OUTPUT_FILE, options, store)
        written = {OUTPUT_FILE: {"size": result["size"], "sha256": result["sha256"]}}
        validation = None
        if val_files:  # the same schema as the training rows; a slice is of the train split
            val_options = {**options, "requested_schema": result["schema"].name}
            val_options.pop("slice", None)
            val = _write_dataset(
                source_uri, val_files, partial / VALIDATION_FILE, val_options, store
            )
            written[VALIDATION_FILE] = {"size": val["size"], "sha256": val["sha256"]}
            validation = {
                "file": VALIDATION_FILE,
                "split": splits.split_of(next(iter(val_files))),
                "rows": val["rows"],
                "source_files": list(val_files),
            }
        manifest = {
            **expect,
            **facts,
            "format": "jsonl",
            "source_format": result["source_format"],
            "schema": result["schema"].output,
            "source_schema": result["schema"].name,
            "rows": result["rows"],
            **({"split_rows": result["split_rows"]} if "split_rows" in result else {}),
            "content_sha256": result["sha256"],
            "source_files": list(files),
            "files": written,
            **({"validation": validation} if validation else {}),
            **({"images": store.record()} if store.stored else {}),
            "created": atomic.now_iso(),
        }
        atomic.write_manifest(partial, manifest)
    if cache is not None:
        download.remove_cache(cache)
    download.remove_cache(image_cache)
    if store.stored:
        _log(f"checked and stored {store.summary()}")
    of = f" of {result['split_rows']}" if "split_rows" in result else ""
    _log(
        f"read {result['rows']}{of} rows ({result['schema'].name}, split {split.spec}) from "
        f"{source_uri.display}; wrote {dest / OUTPUT_FILE} ({result['size']} bytes, sha256 "
        f"{result['sha256'][:12]})"
    )
    if validation:
        _log(
            f"read {validation['rows']} rows of the {validation['split']} split; wrote "
            f"{dest / VALIDATION_FILE} (the trainer evaluates on it)"
        )


class _Auto:
    name = "auto"


def _local_files(source_uri: uri.StorageUri, source: Path, split: str) -> dict[str, Path]:
    """Data files by display name, in reading order (a directory's files sorted by path)."""
    if source.is_file():
        if formats.format_of(source.name) is None:
            raise BadDatasetError(
                f"dataset {source_uri.display!r} is not a {formats.SUFFIX_TEXT} file; give a "
                f"data file or a directory of them"
            )
        splits.check_single_file(source.name, split, source_uri.display)
        return {source.name: source}
    if not source.is_dir():
        raise BadDatasetError(
            f"dataset {source_uri.display!r} is neither a regular file nor a directory"
        )
    found, skipped = {}, []
    for path in sorted(source.rglob("*")):
        rel = path.relative_to(source).as_posix()
        if any(part.startswith(".") for part in path.relative_to(source).parts):
            continue
        if path.is_file():
            if formats.format_of(path.name):
                found[rel] = path
            else:
                skipped.append(rel)
    if not found:
        raise BadDatasetError(
            f"dataset directory {source_uri.display!r} has no {formats.SUFFIX_TEXT} files; put "
            f"the training rows there"
        )
    if skipped:
        _log(f"ignoring {', '.join(skipped)} (not {formats.SUFFIX_TEXT} files)")
    chosen = splits.select(list(found), split, source_uri.display)
    return {rel: found[rel] for rel in chosen}


def validation_names(paths: list[str], split: str) -> list[str]:
    """The files of the source's validation split (else its test split) when the training split
    is read; none otherwise (a source whose files name no split has none)."""
    if split != splits.DEFAULT_SPLIT:
        return []
    for candidate in VALIDATION_SPLITS:
        names = [p for p in paths if splits.split_of(p) == candidate]
        if names:
            return names
    return []


def _local_validation_files(source: Path, split: str) -> dict[str, Path]:
    if not source.is_dir():
        return {}
    found = {
        path.relative_to(source).as_posix(): path
        for path in sorted(source.rglob("*"))
        if path.is_file()
        and formats.format_of(path.name)
        and not any(part.startswith(".") for part in path.relative_to(source).parts)
    }
    return {rel: found[rel] for rel in validation_names(list(found), split)}


def _remote_files(
    source_uri: uri.StorageUri, split: str, cache: Path
) -> tuple[dict[str, Path], dict[str, object], dict[str, Path], Path | None]:
    """Download the split's data files into ``cache``; return them, manifest facts, the
    validation split's files (empty when there is none) and the directory an image-text row's
    relative paths are read from (an extracted archive's; None for other sources)."""
    source, listing = download.open_listing(source_uri, "dataset", cache, _log)
    val_chosen: list = []  # the source's validation split, when it has one
    if source_uri.scheme in ("https", "http"):
        (file,) = listing.files
        if is_archive(file.path):
            with download.removed_if_refused(cache):
                download.fetch(source, [file], cache, _log)
                root = extract(cache / file.path, cache / "extracted", source_uri.display)
                files = _local_files(source_uri, root, split)
            return files, listing.facts, _local_validation_files(root, split), root
        if formats.format_of(file.path) is None:
            raise BadDatasetError(
                f"dataset {source_uri.display!r} is not a {formats.SUFFIX_TEXT} file or a "
                f"tar/zip archive; name the file with its format's extension"
            )
        splits.check_single_file(file.path, split, source_uri.display)
        chosen = [file]
    else:
        data = [f for f in listing.files if formats.format_of(f.path)]
        if not data:
            raise BadDatasetError(
                f"dataset {source_uri.display!r} has no {formats.SUFFIX_TEXT} files; "
                f"found: {', '.join(f.path for f in listing.files[:5])}"
            )
        names = splits.select([f.path for f in data], split, source_uri.display)
        chosen = [f for f in data if f.path in set(names)]
        val_names = set(validation_names([f.path for f in data], split))
        val_chosen = [f for f in data if f.path in val_names]
    if hasattr(source, "probe"):
        retrying(
            f"checking access to {source_uri.display!r}", lambda: source.probe(chosen[0]), _log
        )
    fetched = download.fetch(source, [*chosen, *val_chosen], cache, _log)
    files = {f.path: fetched[f.path].path for f in chosen}
    return files, listing.facts, {f.path: fetched[f.path].path for f in val_chosen}, None


def _write_dataset(
    source_uri: uri.StorageUri,
    files: dict[str, Path],
    out_path: Path,
    options: dict,
    store: images.ImageStore,
) -> dict:
    """Check every row and write the normalized JSONL; return what the manifest records."""
    mapping = options["column_map"]
    schema = schemas.SCHEMAS.get(options["requested_schema"])
    max_row = schemas.max_row_bytes()
    problems: list[str] = []
    bad_rows = rows = size = 0
    split = splits.parse(options["slice"]) if "slice" in options else None
    total = _count_rows(files) if split is not None and split.needs_count else None
    start, stop = split.bounds(total) if split is not None else (0, None)
    position = 0  # the row's place in the split, every row counted, as datasets slices it
    read_whole = True  # False once past the slice's end: the rest is not read
    digest = hashlib.sha256()
    source_formats = set()
    columns: dict[str, None] = {}  # the source's columns, in the order rows show them
    with open(out_path, "xb") as out:
        for name, path in files.items():
            if stop is not None and position >= stop:
                read_whole = False
                break
            source_formats.add(formats.format_of(name))
            text_cells = formats.format_of(name) == "csv"
            file_rows = file_bad = 0
            for number, row, problem in formats.read_rows(name, path):
                if stop is not None and position >= stop:
                    read_whole = False
                    break
                position += 1
                if not start < position <= (position if stop is None else stop):
                    continue  # outside the slice: neither checked nor trained on
                if problem is None:
                    if mapping and isinstance(row, dict) and not row.keys() <= columns.keys():
                        columns.update(dict.fromkeys(row))
                    source_row, row = row, schemas.rename(row, mapping)
                    if schema is None and isinstance(row, dict):
                        schema = _detect(row, source_row, mapping, source_uri)
                        _log(f"rows look like the {schema.name} schema")
                        schemas.check_method(trainer_args.method_from_env(), schema.output)
                    if schema is None:
                        problem = f"expected a JSON object, got {formats.json_type(row)}"
                    else:
                        line, problem = _encode(schema, row, text_cells, store)
                        problem = problem or schemas.row_size_problem(len(line), max_row)
                    if problem and mapping:
                        problem = _mention_mapping(problem, mapping)
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
            if len(files) > 1 or file_bad:  # one file's rows are said once, at the end
                invalid = f" and {file_bad} invalid rows" if file_bad else ""
                _log(f"read {file_rows} rows{invalid} from {name}")
        out.flush()
        os.fsync(out.fileno())

    if columns and (absent := [src for src in mapping if src not in columns]):
        rows_of = (
            f"split {split.spec!r} of "
            if split is not None
            else "the validation rows of "
            if out_path.name == VALIDATION_FILE
            else ""
        )
        which = f"no row of {rows_of}dataset {source_uri.display!r} has"
        raise BadValueError(schemas.absent_columns_message(absent, list(columns), which))
    hint = (schema or schemas.SCHEMAS["instruction"]).hint
    if bad_rows:
        shown = f" (first {MAX_REPORTED} shown)" if bad_rows > MAX_REPORTED else ""
        plural = "s" if bad_rows > 1 else ""
        raise BadDatasetError(
            f"dataset {source_uri.display!r} has {bad_rows} invalid row{plural}{shown}; "
            f"{hint}:\n" + "\n".join(f"  {p}" for p in problems)
        )
    split_rows = total if total is not None else position if read_whole else None
    if rows == 0 and split is not None:
        has = f"; the {split.name} split has {split_rows}" if split_rows is not None else ""
        raise BadDatasetError(
            f"dataset {source_uri.display!r}: split {split.spec!r} selects no rows{has}"
        )
    if rows == 0:
        raise BadDatasetError(f"dataset {source_uri.display!r} has no rows; {hint}")
    return {
        **({"split_rows": split_rows} if split is not None and split_rows is not None else {}),
        "rows": rows,
        "size": size,
        "sha256": digest.hexdigest(),
        "schema": schema,
        "source_format": "+".join(sorted(source_formats)),
    }


def _detect(row: dict, source_row: dict, mapping: dict[str, str], source_uri) -> schemas.Schema:
    """The schema the first row (``row``, renamed from ``source_row``) shows; when it shows
    none, a column map naming columns that row lacks is the likelier mistake, and is said."""
    try:
        return schemas.detect(row, source_uri.display)
    except BadDatasetError:
        if absent := [src for src in mapping if src not in source_row]:
            which = f"the first row of dataset {source_uri.display!r} does not have"
            raise BadValueError(
                schemas.absent_columns_message(absent, list(source_row), which)
            ) from None
        raise


def _count_rows(files: dict[str, Path]) -> int:
    """How many rows the split's files hold: what a percentage or negative bound is of."""
    return sum(1 for name, path in files.items() for _ in formats.read_rows(name, path))


def _encode(
    schema: schemas.Schema, row: object, text_cells: bool, store: images.ImageStore
) -> tuple[bytes, str | None]:
    """The normalized JSONL line for a valid row, or the reason it cannot be written."""
    if not isinstance(row, dict):
        return b"", f"expected a JSON object, got {formats.json_type(row)}"
    normalized, problem = schema.normalize(row, text_cells)
    if problem is not None:
        return b"", problem
    if "images" in normalized:  # each checked and stored; the row names the stored files
        stored = []
        for index, ref in enumerate(normalized["images"]):
            path, problem = store.add(ref)
            if problem is not None:
                return b"", f"images[{index}]: {problem}"
            stored.append(path)
        normalized["images"] = stored
    try:
        return (json.dumps(normalized, ensure_ascii=False) + "\n").encode(), None
    except UnicodeEncodeError:  # a lone surrogate escape such as "\\ud800"
        return b"", "contains an invalid Unicode escape (an unpaired surrogate)"


def _mention_mapping(problem: str, mapping: dict[str, str]) -> str:
    for src, dst in mapping.items():
        if f"field {dst!r} is missing" in problem:
            return f"{problem} ({schemas.spelling().column_map} maps column {src!r} to it)"
    return problem


if __name__ == "__main__":
    sys.exit(main())
