"""The initializers refuse bad trainer arguments before they download anything.

The trainer's arguments are ``spec.trainer.args`` of the TrainJob, which the Trainer renders into
the trainer's (``node``) container only: an initializer Pod cannot see them (it gets its own
``storageUri``, ``env`` and ``secretRef`` from the TrainJob, and no API access). TrainJobs that
tunepack writes (the SDK, the CLI, ``tunepack render``) therefore also give each initializer the
arguments as ``TUNEPACK_TRAINER_ARGS``, a JSON list of ``key=value`` strings, and both
initializers check them first, with the trainer's own vocabulary for the runtime's model
(``tunepack.trainers.args``, standard library only): a bad argument fails the TrainJob with exit
65 before the model download, not after it. For TrainJob YAML written without it, the admission
policy (``tunepack.tools.admission``) is the check.
"""

from __future__ import annotations

import json
import os

from tunepack.core import workspace
from tunepack.core.errors import BadValueError
from tunepack.runtimes import catalog


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
    # Imported here: the trainer's vocabulary, needed only when there are arguments to check.
    from tunepack.trainers import args as vocabulary

    model = os.environ.get(workspace.MODEL_ENV, "").strip()
    if model:
        vocabulary.parse_trainer_args(args, catalog.get(model))
    else:  # no catalog entry to hold the arguments against: the keys and values alone
        by_name = {arg.name: arg for arg in vocabulary.VOCABULARY}
        for key, value in vocabulary.split_pairs(args).items():
            by_name[key].parse(key, value)
    return len(args)
