"""Build TrainJob objects that reference a tunepack runtime.

The SDK and the CLI submit what this module builds, and ``tunepack render`` prints it for people
who apply YAML themselves. Everything that can be checked without a cluster is checked here
(name, runtime, trainer arguments, the API schema), so mistakes surface before any Pod starts.
"""

from __future__ import annotations

import re

from tunepack.errors import BadInputError
from tunepack.initializers import uri as storage_uri
from tunepack.runtimes import catalog, generate
from tunepack.runtimes.validate import validate_trainjob

TRAINJOB_KIND = "TrainJob"

_DNS_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
_DNS_LABEL_MAX = 63
_POD_SUFFIX = "-xxxxx"  # the random suffix Kubernetes appends to a Job's pod names


def build_trainjob(
    name: str,
    runtime: str,
    dataset_uri: str,
    model_uri: str,
    trainer_args: list[str],
    num_nodes: int | None = None,
    namespace: str | None = None,
    *,
    num_proc_per_node: int | None = None,
    resources_per_node: dict | None = None,
    trainer_env: dict[str, str] | None = None,
    initializer_env: dict[str, str] | None = None,
    dataset_secret: str | None = None,
    model_secret: str | None = None,
    labels: dict[str, str] | None = None,
) -> dict:
    """A validated TrainJob for ``runtime`` (a runtime name or model name from the catalog).

    ``trainer_args`` are tunepack's ``key=value`` arguments; ``dataset_uri`` and ``model_uri``
    become the initializers' ``STORAGE_URI``. ``resources_per_node`` takes the Kubeflow SDK's
    dict (``{"gpu": 4, "memory": "200Gi"}``, translated by the SDK's own helper). Credentials are
    passed only by reference: ``dataset_secret`` / ``model_secret`` name a Secret in the
    TrainJob's namespace (the initializer's ``secretRef``). Raises ``BadInputError`` with a hint
    on bad input.
    """
    if num_nodes is not None and (
        isinstance(num_nodes, bool) or not isinstance(num_nodes, int) or num_nodes < 1
    ):
        raise BadInputError(f"num_nodes must be a positive integer, got {num_nodes!r}")
    _check_name(name, num_nodes or 1)
    if namespace is not None:
        _check_dns_label("namespace", namespace)
    entry = catalog.get(runtime)  # BadInputError listing the runtimes when unknown
    _check_trainer_args(trainer_args, entry)
    for what, uri in (("dataset_uri", dataset_uri), ("model_uri", model_uri)):
        if not isinstance(uri, str) or not uri.strip():
            raise BadInputError(f"{what} must be a non-empty storage URI, got {uri!r}")
        # The initializers' own parser: an unknown scheme fails here, before any step runs.
        # (Whether the data exists can only be known where the initializer runs.)
        storage_uri.parse(uri)

    if num_proc_per_node is not None and (
        isinstance(num_proc_per_node, bool)
        or not isinstance(num_proc_per_node, int)
        or num_proc_per_node < 1
    ):
        raise BadInputError(
            f"num_proc_per_node must be a positive integer, got {num_proc_per_node!r}"
        )
    for what, secret in (("dataset_secret", dataset_secret), ("model_secret", model_secret)):
        if secret is not None:
            _check_dns_label(what, secret)

    metadata: dict = {"name": name}
    if namespace is not None:
        metadata["namespace"] = namespace
    if labels:
        metadata["labels"] = dict(labels)
    trainer: dict = {"args": list(trainer_args)}
    if num_nodes is not None:
        trainer["numNodes"] = num_nodes
    if num_proc_per_node is not None:
        trainer["numProcPerNode"] = num_proc_per_node
    if resources_per_node:
        trainer["resourcesPerNode"] = _resources(resources_per_node)
    if trainer_env:
        trainer["env"] = _env(trainer_env)
    dataset: dict = {"storageUri": dataset_uri}
    model: dict = {"storageUri": model_uri}
    for block, secret in ((dataset, dataset_secret), (model, model_secret)):
        if initializer_env:
            block["env"] = _env(initializer_env)
        if secret:
            block["secretRef"] = {"name": secret}
    trainjob = {
        "apiVersion": generate.API_VERSION,
        "kind": TRAINJOB_KIND,
        "metadata": metadata,
        "spec": {
            "runtimeRef": {
                "name": entry.runtime_name,
                "apiGroup": generate.API_GROUP,
                "kind": generate.KIND,
            },
            "initializer": {"dataset": dataset, "model": model},
            "trainer": trainer,
        },
    }
    validate_trainjob(trainjob)
    return trainjob


_SECRET_LIKE = re.compile(r"(TOKEN|SECRET|PASSWORD|ACCESS_KEY)", re.IGNORECASE)


def _env(env: dict[str, str]) -> list[dict]:
    out = []
    for key, value in env.items():
        if not isinstance(key, str) or not isinstance(value, str):
            raise BadInputError(f"environment variables must be strings, got {key!r}={value!r}")
        if _SECRET_LIKE.search(key):
            raise BadInputError(
                f"environment variable {key} looks like a credential: tunepack does not put "
                "secrets into the TrainJob in plain text. Store it in a Secret and pass "
                "dataset_secret=/model_secret= (initializers) instead"
            )
        out.append({"name": key, "value": value})
    return out


def _resources(resources_per_node: dict) -> dict:
    """The Kubeflow SDK's resource dict as ResourceRequirements (its own helper translates)."""
    from kubeflow.trainer.backends.kubernetes.utils import get_resources_per_node

    if not isinstance(resources_per_node, dict):
        raise BadInputError(
            f"resources_per_node must be a dict such as {{'gpu': 1}}, got {resources_per_node!r}"
        )
    try:
        resources = get_resources_per_node(resources_per_node).to_dict()
    except ValueError as err:
        raise BadInputError(
            f"resources_per_node={resources_per_node!r} is not valid: {err}"
        ) from None
    # The SDK's quantities come back as floats (4 -> 4.0); keep whole numbers whole.
    return {
        kind: {k: int(v) if isinstance(v, float) and v.is_integer() else v for k, v in qty.items()}
        for kind, qty in resources.items()
    }


def to_yaml(obj: dict) -> str:
    """YAML in the same style as the generated runtimes."""
    return generate.to_yaml(obj)


def max_name_length(num_nodes: int = 1) -> int:
    """The longest TrainJob name whose generated pod names stay valid.

    JobSet names pods ``<trainjob>-<job>-<job index>-<pod index>-<random>`` and rejects the
    JobSet unless each is a DNS label of at most 63 characters; ``dataset-initializer`` is the
    longest job name, so it sets the limit (33 characters).
    """
    suffixes = [
        f"-{step.job}-0-{num_nodes - 1 if step is generate.TRAINER_STEP else 0}{_POD_SUFFIX}"
        for step in generate.STEPS
    ]
    return _DNS_LABEL_MAX - max(len(suffix) for suffix in suffixes)


def _check_name(name: str, num_nodes: int) -> None:
    _check_dns_label("TrainJob name", name)
    # The JobSet's headless Service is named after the TrainJob, and Service names must start
    # with a letter (DNS-1035), which is stricter than a DNS-1123 label.
    if not name[0].isalpha():
        raise BadInputError(
            f"TrainJob name {name!r} must start with a letter: it also names the job's "
            "network Service"
        )
    limit = max_name_length(num_nodes)
    if len(name) > limit:
        raise BadInputError(
            f"TrainJob name {name!r} is {len(name)} characters; at most {limit} are allowed so "
            f"that the pod names JobSet derives from it fit in {_DNS_LABEL_MAX} characters"
        )


def _check_dns_label(what: str, value: object) -> None:
    if not isinstance(value, str) or not _DNS_LABEL.match(value) or len(value) > _DNS_LABEL_MAX:
        raise BadInputError(
            f"{what} {value!r} is not a valid DNS-1123 label: use at most {_DNS_LABEL_MAX} "
            "lowercase letters, digits and '-', starting and ending with a letter or digit "
            "(e.g. 'llama-lora-1')"
        )


def _check_trainer_args(trainer_args: list[str], entry: catalog.ModelEntry) -> None:
    if isinstance(trainer_args, str) or not all(isinstance(a, str) for a in trainer_args):
        raise BadInputError(
            f"trainer_args must be a list of 'key=value' strings, got {trainer_args!r}"
        )
    # Imported here so that importing tunepack.trainjob does not need the trainer package.
    from tunepack.trainers.args import parse_trainer_args

    parse_trainer_args(trainer_args, entry)
