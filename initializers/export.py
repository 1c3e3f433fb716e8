"""The exporter: ``python -m tunepack.initializers.export``, the step after the trainer.

Sends a finished run's result to ``EXPORT_URI`` (``s3://``, ``hf://``, a directory), verified and
all-or-nothing for the reader (the manifest last); a re-run finishes without sending anything
twice. ``EXPORT_URI`` unset: nothing to do, exit 0. docs/export.md."""

from __future__ import annotations

import json
import os
import sys
from datetime import UTC, datetime
from pathlib import Path

from tunepack.core import durable, workspace
from tunepack.core.errors import BadInputError, BadModelError, NotFoundError
from tunepack.initializers import atomic, sinks
from tunepack.initializers._entry import log, run
from tunepack.initializers.sinks import MANIFEST_KIND, LocalFile
from tunepack.initializers.transport.uri import redact

PROGRAM = "exporter"
EXPORT_URI_ENV = "EXPORT_URI"
# The run's records that travel with the artifact (when present).
RECORDS = (workspace.RESULT_FILE, workspace.CONFIG_FILE, workspace.METRICS_FILE)


def _log(message: str) -> None:
    log(PROGRAM, message)


def main() -> int:
    return run(PROGRAM, export)


def export() -> None:
    raw = os.environ.get(EXPORT_URI_ENV, "").strip()
    if not raw:
        _log(f"{EXPORT_URI_ENV} is not set: nothing to export")
        return
    sink = sinks.open_sink(raw, _log)  # the URI is checked before anything is read
    files, result = collect(workspace.output_dir())
    manifest = build_manifest(files, result, sink.display)
    if sink.publish(files, manifest):
        record = {"uri": sink.display, "files": len(files), "exported_at": _now()}
        durable.write_json(workspace.export_record_file(workspace.workspace_root()), record)


def _now() -> str:
    return datetime.now(UTC).isoformat(timespec="microseconds")


def collect(output: Path) -> tuple[list[LocalFile], dict]:
    """The files of a finished run under ``output`` (sorted), and its ``result.json``."""
    result_path = output / workspace.RESULT_FILE
    try:
        result = json.loads(result_path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise NotFoundError(
            f"there is no finished result to export: {result_path} does not exist (the trainer "
            "writes it when training completes); run the training first",
            what="result",
            name=str(result_path),
        ) from None
    except (OSError, ValueError) as error:
        raise BadModelError(f"cannot read {result_path}: {error}") from None
    if not isinstance(result, dict) or not result.get("artifact"):
        raise BadModelError(f"{result_path} names no artifact; it was not written by tunepack")
    dirs = [Path(result["artifact"]).name]
    if result.get("merged_model"):
        dirs.append(Path(result["merged_model"]).name)
    paths: dict[str, Path] = {}
    for name in dirs:
        directory = output / name
        if not directory.is_dir():
            raise NotFoundError(
                f"{result_path} names {name}/, but {directory} is not there; the result is "
                "incomplete: run the training again",
                what="directory",
                name=str(directory),
            )
        for path in sorted(directory.rglob("*")):
            rel = path.relative_to(output)
            if path.is_file() and not any(part.startswith(".") for part in rel.parts):
                paths[rel.as_posix()] = path
    for name in RECORDS:
        if (output / name).is_file():
            paths[name] = output / name
    files = [
        LocalFile(rel, path, path.stat().st_size, atomic.sha256_file(path))
        for rel, path in sorted(paths.items())
    ]
    return files, result


def build_manifest(files: list[LocalFile], result: dict, destination: str) -> dict:
    """The export manifest: what a reader needs to fetch and verify the result."""
    return {
        "kind": MANIFEST_KIND,
        "destination": destination,
        "model": result.get("model"),
        "base_model": result.get("base_model"),
        "method": result.get("method"),
        "artifact": Path(result["artifact"]).name,
        "merged_model": Path(result["merged_model"]).name if result.get("merged_model") else None,
        "final_loss": result.get("final_loss"),
        "config_digest": result.get("config_digest"),
        "files": {f.rel: {"size": f.size, "sha256": f.sha256} for f in files},
    }


def export_uri_problem(raw: str) -> str | None:
    """Why ``raw`` cannot be an export destination (checked by the SDK and CLI before a run),
    or None."""
    try:
        sinks.parse(raw)
    except BadInputError as error:
        return str(error)
    return None


def display(raw: str) -> str:
    return redact(raw)


if __name__ == "__main__":
    sys.exit(main())
