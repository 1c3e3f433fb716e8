"""The store: the committed runtimes under ``runtimes/generated/``, as the programs read them at
run time (the CLI, the local backend, ``tunepack install``).

The files are written by ``python -m tunepack.runtimes.generate`` from the builder
(``runtimes/builder.py``) and ship in the wheel as package data; reading them needs neither the
builder nor the API models.
"""

from __future__ import annotations

from importlib import resources
from pathlib import Path

import yaml

from tunepack.runtimes import catalog

GENERATED = "generated"  # the package directory holding one <runtime>.yaml per catalog entry
# In a source checkout, where the command writes (resolved: under a strict editable install this
# module is a link in build/__editable__.*, and the files must land in runtimes/generated/).
GENERATED_DIR = Path(__file__).resolve().parent / GENERATED


# The committed runtimes are tunepack's own files, never a user's: libyaml's parser (the same safe
# constructors) reads them about 7x faster than PyYAML's pure-Python one, and `tunepack install`
# reads every one of them.
_COMMITTED_LOADER = getattr(yaml, "CSafeLoader", yaml.SafeLoader)


def load_runtime(name: str) -> dict:
    """The committed ClusterTrainingRuntime for a runtime or model name.

    Raises ``BadInputError`` listing the runtimes when the name is unknown.
    """
    entry = catalog.get(name)
    path = resources.files("tunepack.runtimes").joinpath(GENERATED, f"{entry.runtime_name}.yaml")
    return yaml.load(path.read_text(encoding="utf-8"), Loader=_COMMITTED_LOADER)


def list_runtimes() -> list[dict]:
    """One summary row per runtime, for the CLI and the SDK's runtime list."""
    return [
        {
            "name": entry.runtime_name,
            "model": entry.name,
            "methods": list(entry.methods),
            "params": None if entry.custom else entry.parameter_count,  # custom: config.json's
            "gpus": entry.resources.gpus,
            "description": entry.description,
        }
        for entry in sorted(catalog.CATALOG.values(), key=lambda e: e.runtime_name)
    ]
