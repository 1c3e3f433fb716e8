"""TrainJob names: the name each entry point gives a job when none is asked for, and the limits
every name (and namespace, Secret name) meets.

``stable_job_name`` (``train --local``) is a digest of what the command trains, so that the same
command finds, and resumes, the same job (docs/sdk.md)."""

from __future__ import annotations

import random
import re
import string
import time
import uuid
from pathlib import Path
from typing import TYPE_CHECKING

from tunepack.core.errors import BadInputError, BadValueError
from tunepack.runtimes import contract
from tunepack.runtimes.catalog import RUNTIME_PREFIX

if TYPE_CHECKING:
    from tunepack.finetune import FineTune

DNS_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
DNS_LABEL_MAX = 63
_POD_SUFFIX = "-xxxxx"  # the random suffix Kubernetes appends to a Job's pod names


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
    from tunepack.initializers.transport import uri as storage

    def canonical(uri: str) -> str:
        try:
            parsed = storage.parse(uri)
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
    if trainer.resources_per_node:  # its GPUs set the processes; absent, names stay as before
        identity["resources_per_node"] = trainer.resources_per_node
    if workspace is not None:  # two workspaces are two jobs (each with its own lock)
        identity["workspace"] = str(workspace)
    digest = json_digest(identity)[:10]
    model_part = _label_chars(runtime.removeprefix(RUNTIME_PREFIX).lower()).strip("-")
    keep = max_name_length(trainer.num_nodes or 1) - len(digest) - 1
    return f"{model_part[:keep].rstrip('-') or 'job'}-{digest}"


def _label_chars(text: str) -> str:
    """``text`` with every character a DNS label cannot hold as ``-``."""
    return re.sub(r"[^a-z0-9-]", "-", text)


def max_name_length(num_nodes: int = 1) -> int:
    """The longest TrainJob name whose generated pod names stay valid.

    JobSet names pods ``<trainjob>-<job>-<job index>-<pod index>-<random>`` and rejects the
    JobSet unless each is a DNS label of at most 63 characters; ``dataset-initializer`` is the
    longest job name, so it sets the limit (33 characters).
    """
    suffixes = [
        f"-{step.job}-0-{num_nodes - 1 if step is contract.TRAINER_STEP else 0}{_POD_SUFFIX}"
        for step in contract.STEPS
    ]
    return DNS_LABEL_MAX - max(len(suffix) for suffix in suffixes)


def check_name(name: str, num_nodes: int) -> None:
    """``BadInputError`` unless ``name`` can name a TrainJob of ``num_nodes`` nodes."""
    check_dns_label("TrainJob name", name)
    # The JobSet's headless Service is named after the TrainJob, and Service names must start
    # with a letter (DNS-1035), which is stricter than a DNS-1123 label.
    if not name[0].isalpha():
        raise BadValueError(
            f"TrainJob name {name!r} must start with a letter: it also names the job's "
            "network Service"
        )
    limit = max_name_length(num_nodes)
    if len(name) > limit:
        raise BadValueError(
            f"TrainJob name {name!r} is {len(name)} characters; at most {limit} are allowed so "
            f"that the pod names JobSet derives from it fit in {DNS_LABEL_MAX} characters"
        )


def check_dns_label(what: str, value: object) -> None:
    """``BadInputError`` unless ``value`` is a DNS-1123 label (a namespace, a Secret name)."""
    if not isinstance(value, str) or not DNS_LABEL.match(value) or len(value) > DNS_LABEL_MAX:
        raise BadValueError(
            f"{what} {value!r} is not a valid DNS-1123 label: use at most {DNS_LABEL_MAX} "
            "lowercase letters, digits and '-', starting and ending with a letter or digit "
            "(e.g. 'llama-lora-1')"
        )
