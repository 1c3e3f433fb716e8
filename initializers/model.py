"""The model initializer: ``python -m tunepack.initializers.model``.

Checks that ``STORAGE_URI`` holds every file the catalog entry named by ``TUNEPACK_MODEL`` needs
(config, checkpoint, tokenizer) before copying anything, then delivers the tree to
``<workspace>/model`` with a manifest recording each file's size and sha256.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
from pathlib import Path

from tunepack import workspace
from tunepack.errors import BadInputError
from tunepack.initializers import atomic, uri
from tunepack.initializers._entry import log, run
from tunepack.runtimes import catalog

PROGRAM = "model-initializer"
_CHUNK = 1 << 20
# Hugging Face config.json key -> catalog Shape field, to catch a model given to the wrong runtime.
_CONFIG_SHAPE_KEYS = {
    "vocab_size": "vocab_size",
    "hidden_size": "embed_dim",
    "num_hidden_layers": "num_layers",
    "num_attention_heads": "num_heads",
    "num_key_value_heads": "num_kv_heads",
    "intermediate_size": "intermediate_dim",
    "head_dim": "head_dim",
    "tie_word_embeddings": "tied_embeddings",
}


def main() -> int:
    return run(PROGRAM, initialize)


def initialize() -> None:
    entry = _catalog_entry()
    source_uri = uri.from_env()
    source = uri.resolve(source_uri)
    if not source.is_dir():
        raise BadInputError(
            f"model at {source_uri.display!r} is not a directory; point "
            f"{workspace.STORAGE_URI_ENV} at the directory holding "
            f"{', '.join(entry.required_files())}"
        )
    _check_required_files(entry, source_uri, source)
    _check_shards(entry, source_uri, source)
    _check_config(entry, source_uri, source / "config.json")
    files = _source_files(source)
    log(PROGRAM, f"{source_uri.display} has every file {entry.name} needs ({len(files)} files)")

    dest = workspace.model_dir()
    for stale in atomic.remove_stale_partials(dest):
        log(PROGRAM, f"removed {stale.name} left by an interrupted run")
    expect = {
        "kind": "model",
        "source": source_uri.canonical,
        "source_fingerprint": atomic.source_fingerprint(files),
        "model": entry.name,
    }
    reason = atomic.why_incomplete(dest, expect)
    if reason is None:
        log(PROGRAM, f"{dest} already complete ({entry.name} from {source_uri.display})")
        return
    log(PROGRAM, f"building {dest}: {reason}")

    with atomic.staged(dest) as partial:
        records, linked = {}, 0
        for rel, src in files.items():
            size, sha256, how = _place(src, partial / rel)
            records[rel] = {"size": size, "sha256": sha256}
            linked += how == "linked"
            log(PROGRAM, f"{how} {rel} ({size} bytes)")
        atomic.write_manifest(partial, {**expect, "files": records, "created": atomic.now_iso()})
    total = sum(r["size"] for r in records.values())
    log(
        PROGRAM,
        f"delivered {len(records)} files ({total} bytes; {linked} hard-linked, "
        f"{len(records) - linked} copied) from {source_uri.display} to {dest}",
    )


def _catalog_entry() -> catalog.ModelEntry:
    name = os.environ.get(workspace.MODEL_ENV, "").strip()
    if not name:
        known = ", ".join(catalog.CATALOG)
        raise BadInputError(
            f"{workspace.MODEL_ENV} is not set; it names the catalog model the runtime was made "
            f"for, one of: {known}"
        )
    return catalog.get(name)


def _purpose(entry: catalog.ModelEntry, rel: str) -> str:
    if rel in entry.tokenizer.files.values():
        return f"the {entry.name} tokenizer"
    return f"the {entry.name} checkpoint loader"  # config.json and the weights


def _check_required_files(
    entry: catalog.ModelEntry, source_uri: uri.StorageUri, source: Path
) -> None:
    missing = [rel for rel in entry.required_files() if not (source / rel).is_file()]
    if not missing:
        return
    parts = "; and ".join(f"{rel}, which {_purpose(entry, rel)} needs" for rel in missing)
    raise BadInputError(
        f"model at {source_uri.display!r} is missing {parts}. Point "
        f"{workspace.STORAGE_URI_ENV} at a complete copy of {entry.hub_id}"
    )


def _check_shards(entry: catalog.ModelEntry, source_uri: uri.StorageUri, source: Path) -> None:
    """A sharded checkpoint's index names its shards; every one must be there too."""
    missing = [rel for rel in entry.weight_files(source) if not (source / rel).is_file()]
    if missing:
        raise BadInputError(
            f"model at {source_uri.display!r} is missing {len(missing)} checkpoint shard(s) "
            f"named by {catalog.SAFETENSORS_INDEX}: {', '.join(missing)}. Point "
            f"{workspace.STORAGE_URI_ENV} at a complete copy of {entry.hub_id}"
        )


def _check_config(entry: catalog.ModelEntry, source_uri: uri.StorageUri, path: Path) -> None:
    try:
        config = json.loads(path.read_bytes())
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        detail = error.msg if isinstance(error, json.JSONDecodeError) else "not UTF-8"
        raise BadInputError(
            f"model at {source_uri.display!r} has a config.json that is not valid JSON "
            f"({detail}); replace it with the model's original config.json"
        ) from None
    if not isinstance(config, dict):
        raise BadInputError(
            f"model at {source_uri.display!r} has a config.json that is not a JSON object; "
            f"replace it with the model's original config.json"
        )
    mismatches = [
        f"{key}={config[key]!r} (expected {getattr(entry.shape, field)})"
        for key, field in _CONFIG_SHAPE_KEYS.items()
        if key in config and config[key] != getattr(entry.shape, field)
    ]
    if "model_type" in config and config["model_type"] != entry.family.hf_model_type:
        mismatches.insert(
            0, f"model_type={config['model_type']!r} (expected {entry.family.hf_model_type!r})"
        )
    if mismatches:
        raise BadInputError(
            f"model at {source_uri.display!r} is not {entry.name}: its config.json has "
            f"{', '.join(mismatches)}; use the runtime made for this model or point "
            f"{workspace.STORAGE_URI_ENV} at {entry.hub_id}"
        )


def _source_files(root: Path) -> dict[str, Path]:
    """Regular files under ``root`` by relative path, symlinks followed (hub cache snapshots
    are symlink trees). Hidden entries (``.cache``, ``.git``) and a manifest left by an earlier
    tunepack workspace are not part of the model."""
    files: dict[str, Path] = {}

    def walk(directory: Path, prefix: str, ancestors: frozenset[Path]) -> None:
        real = directory.resolve()
        if real in ancestors:  # a symlink loop
            return
        for child in sorted(directory.iterdir()):
            if child.name.startswith("."):
                continue
            rel = prefix + child.name
            if child.is_dir():
                walk(child, rel + "/", ancestors | {real})
            elif child.is_file():
                files[rel] = child.resolve()
            else:
                log(PROGRAM, f"skipping {rel} (not a regular file)")

    walk(root, "", frozenset())
    files.pop(workspace.MANIFEST_FILE, None)
    return files


def _place(src: Path, dst: Path) -> tuple[int, str, str]:
    """Deliver one file by hard link where possible, else by copy; return (size, sha256, how).

    A hard link costs no space or time and leaves the source untouched; it fails across
    filesystems or without permission, and then the copy computes the hash as it goes.
    """
    dst.parent.mkdir(parents=True, exist_ok=True)
    try:
        os.link(src, dst)
    except OSError:
        size, sha256 = _copy_hashed(src, dst)
        return size, sha256, "copied"
    return dst.stat().st_size, atomic.sha256_file(dst), "linked"


def _copy_hashed(src: Path, dst: Path) -> tuple[int, str]:
    digest = hashlib.sha256()
    size = 0
    with open(src, "rb") as fin, open(dst, "xb") as fout:
        while chunk := fin.read(_CHUNK):
            digest.update(chunk)
            fout.write(chunk)
            size += len(chunk)
        fout.flush()
        os.fsync(fout.fileno())
    return size, digest.hexdigest()


if __name__ == "__main__":
    sys.exit(main())
