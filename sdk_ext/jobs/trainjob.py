"""Build TrainJob objects that reference a tunepack runtime, from one typed ``TrainJobSpec``.

Everything checkable without a cluster is checked here, so mistakes surface before any Pod
starts. What the Trainer needs of a TrainJob (``storageUri`` as ``scheme://``,
``numProcPerNode``, resources merged key by key): docs/cluster.md, "From a notebook"."""

from __future__ import annotations

import json
import logging
import math
import os
import re
from dataclasses import dataclass
from pathlib import PurePosixPath
from typing import TYPE_CHECKING

from tunepack.core import workspace
from tunepack.core.errors import BadValueError, ConflictError, UnsupportedError
from tunepack.initializers.transport import uri as storage
from tunepack.jobs.naming import DNS_LABEL_MAX, check_dns_label, check_name
from tunepack.runtimes import builder, catalog, contract, custom, host
from tunepack.runtimes.validate import validate_trainjob
from tunepack.spelling import SDK, Spelling

if TYPE_CHECKING:
    from tunepack.runtimes.args import TrainArgs

logger = logging.getLogger(__name__)

TRAINJOB_KIND = contract.TRAINJOB_KIND
CLUSTER_RUNTIME_KIND = contract.KIND  # what `tunepack install` registers
NAMESPACED_RUNTIME_KIND = contract.NAMESPACED_KIND
RUNTIME_KINDS = (CLUSTER_RUNTIME_KIND, NAMESPACED_RUNTIME_KIND)
# Kueue's TrainJob integration admits a TrainJob into the LocalQueue this label names.
QUEUE_LABEL = "kueue.x-k8s.io/queue-name"

# The API's rule for storageUri (TrainJob CRD, CEL): a scheme, "://", and something after it.
_STORAGE_URI = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*://.+$")
# Label values and the name part of label/annotation keys (Kubernetes "qualified names").
_LABEL_NAME = re.compile(r"^([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9]$")
_DNS_SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")


@dataclass(frozen=True)
class TrainJobSpec:
    """Everything a TrainJob of a tunepack runtime says, as one typed record (checked by
    ``build_trainjob``, never here).

    ``runtime``: a runtime or catalog model name. ``trainer_args``: resolved (``TrainArgs``;
    ``submit.build`` resolves a ``FineTune``'s values) or ``key=value`` strings, which
    ``build_trainjob`` parses once. ``dataset_uri``/``model_uri``: the
    initializers' ``STORAGE_URI``; ``dataset_split`` their ``DATASET_SPLIT`` (``train[:1000]``).
    ``resources_per_node``: the Kubeflow SDK's dict; ``num_proc_per_node`` defaults to its GPUs
    (else the runtime's), or 1. Credentials go by reference only: ``*_secret`` name Secrets in the
    TrainJob's namespace. ``runtime_kind``: ``ClusterTrainingRuntime`` or ``TrainingRuntime``
    (``install --namespace``). ``queue``: the Kueue LocalQueue label. ``export_uri`` and
    ``export_secret`` reach the exporter through a ``runtimePatches`` entry (``export_patch``).
    ``local=True``: for the local backend (plain paths kept, ``numProcPerNode`` only when given)."""

    name: str
    runtime: str
    dataset_uri: str
    model_uri: str
    trainer_args: TrainArgs | list[str]
    num_nodes: int | None = None
    namespace: str | None = None
    num_proc_per_node: int | None = None
    resources_per_node: dict | None = None
    trainer_env: dict[str, str] | None = None
    initializer_env: dict[str, str] | None = None
    dataset_secret: str | None = None
    model_secret: str | None = None
    dataset_split: str | None = None
    labels: dict[str, str] | None = None
    annotations: dict[str, str] | None = None
    queue: str | None = None
    runtime_kind: str = CLUSTER_RUNTIME_KIND
    active_deadline_seconds: int | None = None
    runtime_patches: list[dict] | None = None
    export_uri: str | None = None
    export_secret: str | None = None
    local: bool = False


def build_trainjob(job: TrainJobSpec, spelling: Spelling = SDK) -> dict:
    """The validated TrainJob (a dict) that ``job`` describes.

    Raises ``BadInputError`` with a hint on bad input (the processes per node in ``spelling``'s
    words: the caller's fields or flags).
    """
    # The checks run in this order, so that a job with several mistakes is told of the same one
    # first every time.
    _check_placement(job)
    entry = catalog.get(job.runtime)  # BadInputError listing the runtimes when unknown
    args = trainer_args_of(job)
    uris = _storage_uris(job)
    dataset_env = _dataset_split_env(job)
    _check_counts(job)
    patches = _runtime_patches(job)
    _check_secret_names(job)
    metadata = _metadata(job)
    words = args.argv()  # the words, written once: the trainer's args, the initializers' env
    trainer = _trainer(job, entry, words, spelling)
    initializer = _initializer(job, uris, dataset_env, words)
    spec: dict = {
        "runtimeRef": {
            "name": entry.runtime_name,
            "apiGroup": contract.API_GROUP,
            "kind": job.runtime_kind,
        },
        "initializer": initializer,
        "trainer": trainer,
    }
    if job.active_deadline_seconds is not None:
        spec["activeDeadlineSeconds"] = job.active_deadline_seconds
    if patches:
        spec["runtimePatches"] = patches
    trainjob = {
        "apiVersion": contract.API_VERSION,
        "kind": TRAINJOB_KIND,
        "metadata": metadata,
        "spec": spec,
    }
    validate_trainjob(trainjob)
    return trainjob


def _check_placement(job: TrainJobSpec) -> None:
    """The job's node count, name, namespace and runtime kind."""
    if job.num_nodes is not None and (
        isinstance(job.num_nodes, bool) or not isinstance(job.num_nodes, int) or job.num_nodes < 1
    ):
        raise BadValueError(f"num_nodes must be a positive integer, got {job.num_nodes!r}")
    check_name(job.name, job.num_nodes or 1)
    if job.namespace is not None:
        check_dns_label("namespace", job.namespace)
    if job.runtime_kind not in RUNTIME_KINDS:
        raise BadValueError(
            f"runtime_kind {job.runtime_kind!r} is not a runtime kind: expected "
            f"{CLUSTER_RUNTIME_KIND} (cluster-wide) or {NAMESPACED_RUNTIME_KIND} (in the "
            "TrainJob's namespace)"
        )


def _storage_uris(job: TrainJobSpec) -> dict[str, str]:
    """The initializers' ``storageUri`` by step ("dataset", "model"), each checked."""
    uris = {}
    for what, uri in (("dataset", job.dataset_uri), ("model", job.model_uri)):
        if not isinstance(uri, str) or not uri.strip():
            raise BadValueError(f"{what}_uri must be a non-empty storage URI, got {uri!r}")
        # The initializers' own parser: an unknown scheme fails here, before any step runs.
        # (Whether the data exists can only be known where the initializer runs.)
        storage.parse(uri)
        storage.refuse_credentials(uri, what, f"--{what}-secret, Initializer({what}_secret=)")
        uris[what] = uri if job.local else cluster_storage_uri(uri, what)
    return uris


def _check_counts(job: TrainJobSpec) -> None:
    """num_proc_per_node and active_deadline_seconds, when given."""
    if job.num_proc_per_node is not None and (
        isinstance(job.num_proc_per_node, bool)
        or not isinstance(job.num_proc_per_node, int)
        or job.num_proc_per_node < 1
    ):
        raise BadValueError(
            f"num_proc_per_node must be a positive integer, got {job.num_proc_per_node!r}"
        )
    if job.active_deadline_seconds is not None and (
        isinstance(job.active_deadline_seconds, bool)
        or not isinstance(job.active_deadline_seconds, int)
        or job.active_deadline_seconds < 1
    ):
        raise BadValueError(
            "active_deadline_seconds must be a positive integer, got "
            f"{job.active_deadline_seconds!r}"
        )


def _runtime_patches(job: TrainJobSpec) -> list[dict]:
    """The caller's runtimePatches, and the export's when the job exports its result."""
    patches = list(job.runtime_patches or [])
    if job.export_uri is not None or job.export_secret is not None:
        patches.append(export_patch(job.export_uri, job.export_secret, local=job.local))
    return patches


def _check_secret_names(job: TrainJobSpec) -> None:
    for what, secret in (
        ("dataset_secret", job.dataset_secret),
        ("model_secret", job.model_secret),
    ):
        if secret is not None:
            check_dns_label(what, secret)


def _metadata(job: TrainJobSpec) -> dict:
    """The TrainJob's metadata: name, namespace, labels (the queue's among them), annotations."""
    metadata_labels = _labels(job.labels, job.queue)
    if job.annotations is not None:
        _check_annotations(job.annotations)
    metadata: dict = {"name": job.name}
    if job.namespace is not None:
        metadata["namespace"] = job.namespace
    if metadata_labels:
        metadata["labels"] = metadata_labels
    if job.annotations:
        metadata["annotations"] = dict(job.annotations)
    return metadata


def _trainer(
    job: TrainJobSpec, entry: catalog.ModelEntry, words: list[str], spelling: Spelling
) -> dict:
    """``spec.trainer``: arguments, nodes, processes and resources per node, env."""
    resources = requested_resources(job.resources_per_node, entry)
    num_proc_per_node = processes_per_node(
        entry, job.num_proc_per_node, job.resources_per_node, local=job.local, spelling=spelling
    )
    trainer: dict = {"args": words}
    if job.num_nodes is not None:
        trainer["numNodes"] = job.num_nodes
    if num_proc_per_node is not None:
        trainer["numProcPerNode"] = num_proc_per_node
    if resources:
        trainer["resourcesPerNode"] = resources
    if job.trainer_env:
        trainer["env"] = _env(job.trainer_env)
    return trainer


def _initializer(
    job: TrainJobSpec, uris: dict[str, str], dataset_env: list[dict], trainer_args: list[str]
) -> dict:
    """``spec.initializer``: each step's storageUri, env and Secret."""
    dataset: dict = {"storageUri": uris["dataset"]}
    model: dict = {"storageUri": uris["model"]}
    initializer_env = _initializer_env(job.initializer_env, trainer_args)
    for block, secret in ((dataset, job.dataset_secret), (model, job.model_secret)):
        if initializer_env:
            block["env"] = [dict(var) for var in initializer_env]
        if dataset_env and block is dataset:
            block.setdefault("env", []).extend(dataset_env)
        if secret:
            block["secretRef"] = {"name": secret}
    return {"dataset": dataset, "model": model}


# The runtimePatches entry that carries the export settings to the exporter container.
EXPORT_PATCH_MANAGER = "tunepack.dev/export"
EXPORT_SECRET_KEYS = (contract.HUB_TOKEN_ENV, *contract.S3_CREDENTIAL_ENV)


def export_patch(uri: str | None, secret: str | None, *, local: bool = False) -> dict:
    """The ``runtimePatches`` entry giving the exporter step ``EXPORT_URI`` (checked here) and,
    by reference, the keys of Secret ``secret``. Raises ``BadInputError`` on a bad value."""
    from tunepack.initializers.export import EXPORT_URI_ENV, export_uri_problem

    if not isinstance(uri, str) or not uri.strip():
        raise BadValueError(
            f"export must be a destination such as s3://bucket/prefix, hf://org/name or an "
            f"absolute path, got {uri!r}"
        )
    uri = uri.strip()
    problem = export_uri_problem(uri)
    if problem:
        raise BadValueError(problem)
    storage.refuse_credentials(uri, "export", "--export-secret, FineTune(export_secret=)")
    if not _STORAGE_URI.match(uri):
        if local:
            uri = os.path.abspath(os.path.expanduser(uri.removeprefix("file:")))
        elif uri.startswith("/") or uri.startswith("file:/"):
            uri = cluster_storage_uri(uri, "export")
        else:
            raise BadValueError(
                f"export path {uri!r} is relative: on a cluster the exporter writes it inside its "
                "Pod, so give an absolute path on a volume mounted there, or s3://bucket/prefix "
                "or hf://org/name"
            )
    env: list[dict] = [{"name": EXPORT_URI_ENV, "value": uri}]
    if secret is not None:
        check_dns_label("export_secret", secret)
        env += [
            {
                "name": key,
                "valueFrom": {"secretKeyRef": {"name": secret, "key": key, "optional": True}},
            }
            for key in EXPORT_SECRET_KEYS
        ]
    container = {"name": contract.EXPORT_STEP.job, "env": env}
    return contract.runtime_patch(
        EXPORT_PATCH_MANAGER, [contract.job_patch(contract.EXPORT_STEP.job, container)]
    )


def export_of(trainjob: dict) -> str | None:
    """The export destination a TrainJob names (its exporter's ``EXPORT_URI``), if any."""
    from tunepack.initializers.export import EXPORT_URI_ENV

    for patch in contract.runtime_patches(trainjob, EXPORT_PATCH_MANAGER):
        for job in contract.replicated_jobs(patch):
            for container in contract.containers(job):
                for var in container.get("env") or []:
                    if var["name"] == EXPORT_URI_ENV:
                        return var.get("value")
    return None


def cluster_storage_uri(uri: str, what: str = "storage") -> str:
    """``uri`` as a TrainJob's ``storageUri`` must be written: ``scheme://...``.

    ``/abs/path`` becomes ``file:///abs/path`` (and ``file:/abs`` ``file:///abs``); a relative
    path raises ``BadInputError``: the initializer reads it inside its container, where the
    directory it was written relative to does not exist.
    """
    if _STORAGE_URI.match(uri):
        return uri
    if uri.startswith("file:/"):  # one slash: a file URI to the initializers, not to the API
        return "file://" + uri.removeprefix("file:")
    if uri.startswith("/"):
        return PurePosixPath(uri).as_uri()
    raise BadValueError(
        f"{what} storage URI {uri!r} is a relative path: a TrainJob's storage URI is read inside "
        f"the {what} initializer container on the cluster, so a path must be absolute "
        f"(/abs/path or file:///abs/path), or use a URI such as hf://org/name or s3://bucket/key"
    )


def pod_resources(resources: dict | None, entry: catalog.ModelEntry) -> dict:
    """What a trainer pod of ``entry``'s runtime holds given ``resources`` (the
    ``resourcesPerNode`` ResourceRequirements ``resource_requirements`` returns).

    Trainer v2.3.0 merges resourcesPerNode into the runtime's ``node`` container key by key (a
    strategic merge of limits and of requests, ``pkg/runtime/core/trainingruntime.go``): a key
    the request names replaces the runtime's, every other key of the runtime stays. So
    ``{"cpu": 4}`` on a GPU runtime keeps its ``nvidia.com/gpu``; ``{"gpu": 0}`` asks for none.
    """
    base = builder.trainer_resources(entry)
    resources = resources or {}
    merged = {}
    for kind in ("limits", "requests"):
        values = {**(base.get(kind) or {}), **(resources.get(kind) or {})}
        if values:
            merged[kind] = values
    return merged


def requested_resources(resources_per_node: dict | None, entry: catalog.ModelEntry) -> dict | None:
    """The ``resourcesPerNode`` a TrainJob on ``entry``'s runtime gets for the SDK's dict.

    Another number of GPUs than the runtime's, with no CPU or memory named, also gets the CPU
    and memory requests of that many trainer processes (``runtimes/host.py``): the runtime's
    are sized for its own GPUs, and the Trainer would keep them.
    """
    if not resources_per_node:
        return None
    resources = _mig_replaces_gpu(resource_requirements(resources_per_node), entry)
    gpus = gpus_per_node(resources, entry)
    named = {key for kind in resources.values() for key in kind}
    if gpus != entry.resources.gpus and not named & {"cpu", "memory"}:
        shape = host.node_shape(entry, gpus)
        sized = {"cpu": shape.cpu, "memory": shape.memory}
        if sized != host.trainer_requests(entry):
            resources["requests"] = {**(resources.get("requests") or {}), **sized}
    return resources


def names_gpus(resources: dict | None) -> bool:
    """Whether ``resources`` (ResourceRequirements) say how many GPUs (or MIG slices) a pod
    holds; when not, the runtime's GPUs stay (``pod_resources``)."""
    named = {key for kind in (resources or {}).values() for key in kind}
    return any("gpu" in key.lower() or key.startswith(_MIG_PREFIX) for key in named)


def _mig_replaces_gpu(resources: dict, entry: catalog.ModelEntry) -> dict:
    """A MIG slice (``{"mig-1g.10gb": 1}``) instead of the runtime's whole GPUs: the merge
    would keep both (the SDK refuses asking for both), so the runtime's GPUs are set to 0."""
    if not entry.resources.gpus:
        return resources
    named = {key for kind in resources.values() for key in kind}
    if builder.GPU_RESOURCE in named or not any(k.startswith(_MIG_PREFIX) for k in named):
        return resources
    return {kind: {**values, builder.GPU_RESOURCE: 0} for kind, values in resources.items()}


_MIG_PREFIX = "nvidia.com/mig-"


def gpus_per_node(resources: dict | None, entry: catalog.ModelEntry) -> int:
    """GPUs each trainer pod holds: those of ``pod_resources`` (``resources`` merged into the
    runtime's, as the Trainer merges them).

    As the Trainer counts them: the first resource whose name contains ``gpu`` in the requests,
    unless that is 0, then in the limits.
    """
    merged = pod_resources(resources, entry)
    for kind in ("requests", "limits"):
        for key, value in (merged.get(kind) or {}).items():
            if "gpu" in key.lower():
                try:
                    count = max(int(math.ceil(float(value))), 0)
                except (TypeError, ValueError):
                    raise BadValueError(
                        f"resources_per_node: {key}={value!r} is not a number of GPUs"
                    ) from None
                if count:
                    return count
                break
    return 0


def processes_per_node(
    entry: catalog.ModelEntry,
    num_proc: int | None,
    resources_per_node: dict | None,
    *,
    local: bool = False,
    spelling: Spelling = SDK,
) -> int | None:
    """The one rule for a job's trainer processes per node (``numProcPerNode``), for the SDK,
    ``tunepack train`` (cluster and ``--local``) and ``render trainjob`` alike.

    On a pod that holds GPUs (``resources_per_node`` merged into the runtime's: ``gpus_per_node``)
    there is one process per GPU: ``num_proc`` defaults to the GPUs, and another number is
    refused (the launcher would refuse more processes than GPUs on the node, after the
    downloads, and fewer leave GPUs idle). On a pod without GPUs the processes are free (default
    1; never the platform's "auto", which means the CPU request there). ``local=True``: the
    job runs on this machine, whose GPUs are its own: the runtime's count does not bind
    ``num_proc``, and when neither says, the launcher chooses (None: one process per visible
    GPU, else one); GPUs ``resources_per_node`` names still set the processes.
    """
    requested = requested_resources(resources_per_node, entry)
    gpus = gpus_per_node(requested, entry)
    named = names_gpus(requested)
    if not gpus or (local and not named):
        return num_proc if num_proc is not None or local else 1
    if num_proc is None:
        return gpus
    if num_proc != gpus:
        source = (
            spelling.gpus_given.format(value=resources_per_node, gpus=gpus)
            if named
            else f"runtime {entry.runtime_name}'s"
        )
        processes = f"{num_proc} process{'' if num_proc == 1 else 'es'}"
        raise ConflictError(
            f"{spelling.given('num_proc_per_node', num_proc)} asks for {processes} a node, but a "
            f"trainer node holds {_gpus(gpus)} ({source}) and runs one process per GPU: give "
            f"{spelling.gpus.format(num_proc)} for {_gpus(num_proc)} a node, or leave "
            f"{spelling.named('num_proc_per_node')} out"
        )
    return num_proc


def _gpus(count: int) -> str:
    return f"{count} GPU" if count == 1 else f"{count} GPUs"


def _labels(labels: dict[str, str] | None, queue: str | None) -> dict[str, str]:
    out = {}
    if labels is not None:
        if not isinstance(labels, dict):
            raise BadValueError(f"labels must be a dict of strings, got {labels!r}")
        for key, value in labels.items():
            _check_key("label", key)
            if key == QUEUE_LABEL:
                _check_queue(value)
            elif not isinstance(value, str) or (value and not _label_value_ok(value)):
                raise BadValueError(
                    f"label {key}={value!r} has an invalid value: use at most 63 letters, "
                    "digits, '-', '_' and '.', starting and ending with a letter or digit "
                    "(or an empty string)"
                )
        out.update(labels)
    if queue is not None:
        _check_queue(queue)
        given = out.get(QUEUE_LABEL)
        if given is not None and given != queue:
            raise ConflictError(
                f"queue {queue!r} and the label {QUEUE_LABEL}={given!r} disagree: give the "
                "queue once"
            )
        out[QUEUE_LABEL] = queue
    return out


def _check_queue(queue: object) -> None:
    if not (isinstance(queue, str) and _label_value_ok(queue) and _DNS_SUBDOMAIN.match(queue)):
        raise BadValueError(
            f"queue {queue!r} (label {QUEUE_LABEL}) is not a valid Kueue LocalQueue name: use "
            "at most 63 lowercase letters, digits, '-' and '.', starting and ending with a "
            "letter or digit"
        )


def _check_annotations(annotations: dict[str, str]) -> None:
    if not isinstance(annotations, dict):
        raise BadValueError(f"annotations must be a dict of strings, got {annotations!r}")
    for key, value in annotations.items():
        _check_key("annotation", key)
        if not isinstance(value, str):
            raise BadValueError(f"annotation {key!r} must have a string value, got {value!r}")


def _label_value_ok(value: str) -> bool:
    return len(value) <= DNS_LABEL_MAX and bool(_LABEL_NAME.match(value))


def _check_key(what: str, key: object) -> None:
    """A label or annotation key: ``[prefix/]name`` (prefix a DNS subdomain)."""
    prefix, _, name = key.rpartition("/") if isinstance(key, str) else ("", "", "")
    if not (
        isinstance(key, str)
        and _label_value_ok(name)
        and (not prefix or (len(prefix) <= 253 and _DNS_SUBDOMAIN.match(prefix)))
    ):
        raise BadValueError(
            f"{what} key {key!r} is not valid: write [prefix/]name, with a name of at most 63 "
            "letters, digits, '-', '_' and '.' starting and ending with a letter or digit, and "
            "an optional DNS-subdomain prefix (e.g. 'team' or 'example.com/team')"
        )


_SECRET_LIKE = re.compile(r"(TOKEN|SECRET|PASSWORD|ACCESS_KEY)", re.IGNORECASE)


def _dataset_split_env(job: TrainJobSpec) -> list[dict]:
    """The dataset initializer's ``DATASET_SPLIT`` for ``job.dataset_split``; every split the
    job names (that, the URI's ``?split=``, ``initializer_env``) checked now, as the initializer
    would, and refused when two disagree."""
    from tunepack.initializers.data import splits

    named = {}
    if job.dataset_split is not None:
        if not isinstance(job.dataset_split, str):
            raise BadValueError(f"dataset_split must be a string, got {job.dataset_split!r}")
        named["dataset_split"] = job.dataset_split.strip()
    uri_split = storage.parse(job.dataset_uri).options.get("split")
    if uri_split is not None:
        named["the dataset URI's ?split="] = uri_split.strip()
    env_split = (job.initializer_env or {}).get(splits.SPLIT_ENV)
    if isinstance(env_split, str):
        named[f"initializer_env {splits.SPLIT_ENV}"] = env_split.strip()
    for spec in named.values():
        splits.parse(spec)
    if len(set(named.values())) > 1:
        said = ", ".join(f"{where} {spec!r}" for where, spec in named.items())
        raise ConflictError(f"the dataset split is given twice and differs: {said}; give it once")
    if job.dataset_split is None or len(named) > 1:
        return []  # already said where the initializer reads it
    return [{"name": splits.SPLIT_ENV, "value": named["dataset_split"]}]


def _initializer_env(env: dict[str, str] | None, trainer_args: list[str]) -> list[dict]:
    """The initializers' env: ``env``, and the trainer's arguments as ``TUNEPACK_TRAINER_ARGS``
    (the initializers cannot see ``spec.trainer.args``; they check these before downloading:
    initializers/trainer_args.py)."""
    out = _env(env) if env else []
    if any(var["name"] == workspace.TRAINER_ARGS_ENV for var in out):
        raise BadValueError(
            f"initializer_env must not set {workspace.TRAINER_ARGS_ENV}: tunepack sets it to the "
            "trainer arguments, which the initializers check before they download anything"
        )
    if trainer_args:
        out.append({"name": workspace.TRAINER_ARGS_ENV, "value": json.dumps(list(trainer_args))})
    return out


def _env(env: dict[str, str]) -> list[dict]:
    out = []
    for key, value in env.items():
        if not isinstance(key, str) or not isinstance(value, str):
            raise BadValueError(f"environment variables must be strings, got {key!r}={value!r}")
        if _SECRET_LIKE.search(key):
            raise UnsupportedError(
                f"environment variable {key} looks like a credential: tunepack does not put "
                "secrets into the TrainJob in plain text. Store it in a Secret and pass "
                "dataset_secret=/model_secret= (initializers) instead"
            )
        out.append({"name": key, "value": value})
    return out


def resource_requirements(resources_per_node: dict) -> dict:
    """The Kubeflow SDK's resource dict as ResourceRequirements (its own helper translates)."""
    from kubeflow.trainer.backends.kubernetes.utils import get_resources_per_node

    if not isinstance(resources_per_node, dict):
        raise BadValueError(
            f"resources_per_node must be a dict such as {{'gpu': 1}}, got {resources_per_node!r}"
        )
    try:
        resources = get_resources_per_node(resources_per_node).to_dict()
    except ValueError as err:
        raise BadValueError(
            f"resources_per_node={resources_per_node!r} is not valid: {err}"
        ) from None
    # The SDK's quantities come back as floats (4 -> 4.0); keep whole numbers whole.
    return {
        kind: {k: int(v) if isinstance(v, float) and v.is_integer() else v for k, v in qty.items()}
        for kind, qty in resources.items()
    }


def to_yaml(obj: dict) -> str:
    """YAML in the same style as the generated runtimes."""
    return builder.to_yaml(obj)


def trainer_args_of(job: TrainJobSpec) -> TrainArgs:
    """``job``'s trainer arguments, parsed: as given when they are, else parsed here once."""
    from tunepack.runtimes.args import TrainArgs

    if isinstance(job.trainer_args, TrainArgs):
        return job.trainer_args
    return parse_trainer_args_for(job.trainer_args, job.runtime, job.model_uri)


def parse_trainer_args_for(words: object, runtime: str, model_uri: str | None) -> TrainArgs:
    """Where ``key=value`` strings enter a job (the CLI's words, a spec's strings): parsed once
    for ``runtime``'s model (a bring-your-own runtime's from a local checkpoint's config.json)."""
    if isinstance(words, str) or not all(isinstance(a, str) for a in words):
        raise BadValueError(f"trainer_args must be a list of 'key=value' strings, got {words!r}")
    # Imported here so that importing tunepack.jobs.trainjob does not need the trainer package.
    from tunepack.runtimes.args import parse_trainer_args

    return parse_trainer_args(words, model_entry_for(runtime, model_uri))


def model_entry_for(runtime: str, model_uri: str | None) -> catalog.ModelEntry:
    """``runtime``'s catalog entry; a bring-your-own runtime with a local checkpoint resolved
    against its config.json, so its arguments and memory are checked now (with a remote one the
    trainer checks them when it starts)."""
    entry = catalog.get(runtime)
    if not entry.custom or not model_uri:
        return entry
    parsed = storage.parse(model_uri)
    if not parsed.is_local:
        logger.info(
            "%s: the model is remote, so its config.json sizes it when the trainer starts",
            entry.runtime_name,
        )
        return entry
    path = storage.resolve(parsed)
    return custom.resolve(entry, path, f"model at {parsed.display!r}")
