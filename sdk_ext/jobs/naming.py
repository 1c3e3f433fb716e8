"""TrainJob names: the name each entry point gives a job when none is asked for, and the limits
every name meets.

- ``random_job_name``: ``TrainingClient.train`` without ``Name(...)``, named as the Kubeflow SDK
  names a job;
- ``timestamped_job_name``: ``tunepack train`` on a cluster and ``tunepack render trainjob``
  without ``--name``: ``<model>-<YYYYmmdd-HHMMSS>``;
- ``stable_job_name``: ``tunepack train --local`` without ``--name``: ``<model>-<digest>`` of what
  the command trains, so that the same command finds (and resumes) the same job;
- ``max_name_length``, ``check_dns_label``: the limits ``build_trainjob`` checks every TrainJob's
  name against (defined in ``tunepack.jobs.trainjob`` for now, re-exported here).
"""

from __future__ import annotations

import random
import re
import string
import time
import uuid
from pathlib import Path
from typing import TYPE_CHECKING

from tunepack.jobs.trainjob import check_dns_label, max_name_length
from tunepack.runtimes.catalog import RUNTIME_PREFIX

if TYPE_CHECKING:
    from tunepack.finetune import FineTune

__all__ = [
    "check_dns_label",
    "max_name_length",
    "random_job_name",
    "stable_job_name",
    "timestamped_job_name",
]


def random_job_name() -> str:
    """A name like the SDK's: a letter and 11 hex digits."""
    return random.choice(string.ascii_lowercase) + uuid.uuid4().hex[:11]


def timestamped_job_name(runtime: str) -> str:
    """``<model>-<YYYYmmdd-HHMMSS>``: a new job each time the command runs."""
    model = runtime.removeprefix(RUNTIME_PREFIX)
    return _label_chars(f"{model}-{time.strftime('%Y%m%d-%H%M%S')}")


def stable_job_name(
    runtime: str, dataset: str, model: str, trainer: FineTune, workspace: Path | None = None
) -> str:
    """The default name of a local job: ``<model>-<digest>``, the digest of what the command
    trains (the runtime, the dataset and model as their canonical URIs, the trainer arguments in
    their canonical spelling and the placement) and where (``workspace``, the absolute
    ``--workspace`` when one is given). The same command gets the same job, hence its workspace,
    and resumes it; another dataset, model, argument value or workspace gets another job."""
    from tunepack.core.digest import json_digest
    from tunepack.core.errors import BadInputError
    from tunepack.initializers import uri as storage_uri

    def canonical(uri: str) -> str:
        try:
            parsed = storage_uri.parse(uri)
        except BadInputError:
            return uri  # refused by the TrainJob's own checks, with the flag's name
        if parsed.is_local and parsed.options:  # file:///d?split=test: the split is the data
            return f"{parsed.canonical}?{sorted(parsed.options.items())}"
        return parsed.canonical

    identity = {
        "runtime": runtime,
        "dataset": canonical(dataset),
        "model": canonical(model),
        "args": trainer.to_args(),  # vocabulary order, values parsed: lr=1e-4 is lr=0.0001
        "num_nodes": trainer.num_nodes or 1,
        "num_proc_per_node": trainer.num_proc_per_node,
    }
    if workspace is not None:  # two workspaces are two jobs (each with its own lock)
        identity["workspace"] = str(workspace)
    digest = json_digest(identity)[:10]
    model_part = _label_chars(runtime.removeprefix(RUNTIME_PREFIX).lower()).strip("-")
    keep = max_name_length(trainer.num_nodes or 1) - len(digest) - 1
    return f"{model_part[:keep].rstrip('-') or 'job'}-{digest}"


def _label_chars(text: str) -> str:
    """``text`` with every character a DNS label cannot hold as ``-``."""
    return re.sub(r"[^a-z0-9-]", "-", text)
