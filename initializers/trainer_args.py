"""The initializers refuse bad trainer arguments before they download anything.

An initializer Pod cannot see ``spec.trainer.args``, so TrainJobs tunepack writes also give it
the arguments as ``TUNEPACK_TRAINER_ARGS`` (a JSON list of ``key=value``), checked here with the
vocabulary the trainer reads them with (``tunepack.runtimes.args``): exit 65 before the
download, not after it (docs/cluster.md, end of "Admission: TrainJobs that could not run are
refused")."""

from __future__ import annotations

import json
import os

from tunepack.core import workspace
from tunepack.core.errors import BadValueError
from tunepack.runtimes import args as vocabulary
from tunepack.runtimes import catalog, methods


def check_from_env() -> int | None:
    """Check ``TUNEPACK_TRAINER_ARGS`` against the vocabulary, for the model ``TUNEPACK_MODEL``
    names when it is set; raise ``BadInputError`` with the trainer's message. Returns how many
    arguments were checked (None: the variable is not set)."""
    raw = os.environ.get(workspace.TRAINER_ARGS_ENV)
    if raw is None:
        return None
    try:
        args = json.loads(raw)
    except ValueError:
        args = None
    if not isinstance(args, list) or not all(isinstance(a, str) for a in args):
        raise BadValueError(
            f"{workspace.TRAINER_ARGS_ENV} must be a JSON list of key=value strings (the "
            'TrainJob\'s spec.trainer.args), e.g. ["method=lora", "epochs=1"]'
        )
    model = os.environ.get(workspace.MODEL_ENV, "").strip()
    entry = catalog.get(model) if model else None  # an unknown model first, as it always was
    parsed = vocabulary.parse_args(args)
    if entry is not None:  # else no catalog entry to hold them against: keys and values alone
        vocabulary.resolve_args(parsed, entry)
    return len(args)


def method_from_env() -> str | None:
    """The method the trainer will run, from ``TUNEPACK_TRAINER_ARGS`` (its ``method=``, else the
    default); None where the variable is not set (a TrainJob tunepack did not write: its
    arguments are not known here). Call after ``check_from_env``."""
    raw = os.environ.get(workspace.TRAINER_ARGS_ENV)
    if raw is None:
        return None
    return vocabulary.parse_args(json.loads(raw)).values.get("method", methods.DEFAULT)
