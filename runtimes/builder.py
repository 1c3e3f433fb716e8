"""The builder: the ClusterTrainingRuntime of one catalog entry, and the files ``generated/`` holds.

The names are the contract's (``runtimes/contract.py``); what is decided here is how a runtime
runs: resources, environment, security, failure handling (docs/architecture.md, "Runtimes").
The platform facts it encodes (the ``torch`` framework label, no ``numProcPerNode``, no
``podGroupPolicy``, the exporter's ``EXPORT_URI`` by ``runtimePatches``): docs/sdk.md, "How
tunepack runtimes are reported"; docs/cluster.md, "From a notebook" and "Gang scheduling and
queues"; docs/export.md, "On a cluster"."""

from __future__ import annotations

import yaml

from tunepack.core.errors import EXIT_BAD_INPUT
from tunepack.core.workspace import (
    DEFAULT_WORKSPACE,
    JOB_NAME_ENV,
    JOB_UID_ENV,
    MODEL_ENV,
    WORKSPACE_ENV,
)
from tunepack.runtimes import catalog, host
from tunepack.runtimes.catalog import ModelEntry
from tunepack.runtimes.contract import (
    ANCESTOR_LABEL,
    ANNOTATION_PREFIX,
    API_VERSION,
    DATASET_STEP,
    EXPORT_STEP,
    FRAMEWORK_LABEL,
    HUB_TOKEN_ENV,
    HUB_TOKEN_SECRET,
    INITIALIZER_VOLUME,
    KIND,
    MODEL_LABEL,
    MODEL_STEP,
    PART_OF_LABEL,
    S3_CREDENTIAL_ENV,
    S3_CREDENTIALS_SECRET,
    TRACKER_SECRET,
    TRAINER_STEP,
    Step,
)
from tunepack.runtimes.validate import validate_runtime

KUSTOMIZATION = "kustomization.yaml"
HEADER = (
    "# Generated from runtimes/catalog.py by `make runtimes`; do not edit.\n"
    "# Change the catalog and regenerate: a test fails when this file is stale.\n"
)

# JobSet deletes the PVCs of its volumeClaimPolicies with the JobSet (that is, with the TrainJob)
# unless retained. The result (adapter or model under /workspace/output) must outlive the job:
# the user deletes the PVC once the result is fetched or served.
WORKSPACE_RETENTION = "Retain"
SHM_VOLUME = "dshm"
RUN_AS = 1000  # the non-root user of the tunepack images

# Small: initializers download and verify files; they do not hold a model in memory.
INITIALIZER_RESOURCES = {"requests": {"cpu": "1", "memory": "2Gi"}}
GPU_RESOURCE = "nvidia.com/gpu"  # what the Kubeflow SDK's {"gpu": n} asks for

# Credentials reach the initializers only by reference to Secrets the user creates in the
# TrainJob's namespace; optional, so public sources need no Secret at all. The hub token is
# HF_TOKEN (ACCESS_TOKEN stays free for Kubeflow's per-job initializer secretRef, which wins).
INITIALIZER_SECRET_ENV = (
    (HUB_TOKEN_ENV, HUB_TOKEN_SECRET, "token"),
    *((name, S3_CREDENTIALS_SECRET, name) for name in S3_CREDENTIAL_ENV),
)
# The experiment tracker's credentials (trainers/outputs/tracking.py reads them from the
# environment), by reference to one optional Secret with a key per variable; a run without a
# tracker, or with a tracker that needs none, works without it.
TRACKER_SECRET_ENV = tuple(
    (name, TRACKER_SECRET, name)
    for name in (
        "MLFLOW_TRACKING_TOKEN",
        "MLFLOW_TRACKING_USERNAME",
        "MLFLOW_TRACKING_PASSWORD",
        "WANDB_API_KEY",
    )
)

# Trainer environment from field practice (DESIGN.md). NCCL interface/IB settings are
# cluster-specific and belong in an overlay. The model initializer already fetched the model,
# so the trainer must never reach for the hub itself.
TRAINER_ENV = {
    "PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True",
    "TOKENIZERS_PARALLELISM": "false",
    "NCCL_DEBUG": "WARN",
    "HF_HUB_OFFLINE": "1",
}

# Failure handling keyed on tunepack's exit codes (tunepack.core.errors): bad input fails the Job at
# once, and the JobSet rule below then fails the whole TrainJob; anything else (network,
# preemption) restarts the JobSet, whose initializers skip verified files and whose trainer
# resumes from its newest checkpoint.
MAX_JOBSET_RESTARTS = 3
# On eviction the trainer checkpoints, then exits 75; torchrun gives its workers 30 s for that
# before killing them. Kubernetes' default grace (30 s) would kill the Pod first.
TRAINER_GRACE_SECONDS = 90


def build_runtime(entry: ModelEntry) -> dict:
    """The ClusterTrainingRuntime for one catalog entry, as a plain dict."""
    return {
        "apiVersion": API_VERSION,
        "kind": KIND,
        "metadata": {
            "name": entry.runtime_name,
            "labels": {
                FRAMEWORK_LABEL: "torch",
                PART_OF_LABEL: "tunepack",
                MODEL_LABEL: entry.name,
            },
            "annotations": {
                ANNOTATION_PREFIX + "description": entry.description,
                ANNOTATION_PREFIX + "hub-id": entry.hub_id,
                ANNOTATION_PREFIX + "methods": ",".join(entry.methods),
                # A bring-your-own runtime's size is its checkpoint's (config.json).
                **(
                    {}
                    if entry.custom
                    else {ANNOTATION_PREFIX + "parameters": str(entry.parameter_count)}
                ),
                ANNOTATION_PREFIX + "default-gpus": str(entry.resources.gpus),
            },
        },
        "spec": {
            "mlPolicy": {"numNodes": entry.resources.nodes, "torch": {}},
            # No podGroupPolicy: its PodGroup counts every step's pods while JobSet orders the
            # steps, so the gang could never be whole (docs/cluster.md, "Gang scheduling and
            # queues"), and without the PodGroup CRD the controller cannot build the TrainJob.
            "template": {"spec": _jobset_spec(entry)},
        },
    }


def _jobset_spec(entry: ModelEntry) -> dict:
    return {
        # JobSet creates this PVC once per TrainJob (initializer-<trainjob>) and adds it to every
        # pod that mounts it. ReadWriteOnce suits one node; pods on several nodes must share it:
        # ReadWriteMany. Retained when the TrainJob is deleted: it holds the result.
        "volumeClaimPolicies": [
            {
                "templates": [
                    {
                        "metadata": {"name": INITIALIZER_VOLUME},
                        "spec": {
                            "accessModes": [_access_mode(entry)],
                            "resources": {
                                "requests": {"storage": entry.resources.workspace_storage}
                            },
                        },
                    }
                ],
                "retentionPolicy": {"whenDeleted": WORKSPACE_RETENTION},
            }
        ],
        "failurePolicy": {
            "maxRestarts": MAX_JOBSET_RESTARTS,
            "rules": [
                {
                    # A Job failed by its podFailurePolicy saw EXIT_BAD_INPUT: do not retry.
                    "name": "BadInput",
                    "action": "FailJobSet",
                    "onJobFailureReasons": ["PodFailurePolicy"],
                }
            ],
        },
        "replicatedJobs": [
            _replicated_job(DATASET_STEP, _initializer_container(DATASET_STEP, entry)),
            _replicated_job(MODEL_STEP, _initializer_container(MODEL_STEP, entry)),
            _replicated_job(
                TRAINER_STEP,
                _trainer_container(entry),
                volumes=[_shm_volume(entry)],
                depends_on=(DATASET_STEP, MODEL_STEP),
            ),
            _replicated_job(
                EXPORT_STEP, _initializer_container(EXPORT_STEP, entry), depends_on=(TRAINER_STEP,)
            ),
        ],
    }


def _access_mode(entry: ModelEntry) -> str:
    return "ReadWriteMany" if entry.resources.nodes > 1 else "ReadWriteOnce"


def _replicated_job(
    step: Step,
    container: dict,
    volumes: list[dict] | None = None,
    depends_on: tuple[Step, ...] = (),
) -> dict:
    job: dict = {"name": step.job, "replicas": 1}
    if depends_on:
        job["dependsOn"] = [{"name": dep.job, "status": "Complete"} for dep in depends_on]
    pod_spec: dict = {
        "restartPolicy": "Never",  # podFailurePolicy requires it
        # The programs never call the Kubernetes API (progress goes to the Trainer's status
        # server with its own projected token): no API credentials in the pods.
        "automountServiceAccountToken": False,
        "securityContext": {
            "runAsNonRoot": True,
            "runAsUser": RUN_AS,
            "fsGroup": RUN_AS,  # makes the workspace volume writable by that user
            "seccompProfile": {"type": "RuntimeDefault"},
        },
        "containers": [container],
    }
    if volumes:
        pod_spec["volumes"] = volumes
    if step is TRAINER_STEP:
        pod_spec["terminationGracePeriodSeconds"] = TRAINER_GRACE_SECONDS
    job["template"] = {
        "metadata": {"labels": {ANCESTOR_LABEL: step.ancestor}},
        "spec": {
            "backoffLimit": step.backoff_limit,
            "podFailurePolicy": _pod_failure_policy(step),
            "template": {"spec": pod_spec},
        },
    }
    return job


def _pod_failure_policy(step: Step) -> dict:
    return {
        "rules": [
            {
                "action": "FailJob",
                "onExitCodes": {
                    "containerName": step.job,
                    "operator": "In",
                    "values": [EXIT_BAD_INPUT],
                },
            },
            # Evictions and preemptions are not the program's fault: do not count them.
            {"action": "Ignore", "onPodConditions": [{"type": "DisruptionTarget"}]},
        ]
    }


def _container(step: Step, entry: ModelEntry, extra_env: dict[str, str]) -> dict:
    env = {MODEL_ENV: entry.name, WORKSPACE_ENV: DEFAULT_WORKSPACE, **extra_env}
    return {
        "name": step.job,
        "image": step.image_ref,
        "command": step.command,
        "env": [{"name": name, "value": value} for name, value in env.items()] + _job_env(),
        "volumeMounts": [{"name": INITIALIZER_VOLUME, "mountPath": DEFAULT_WORKSPACE}],
        # A failed step's pod status then carries its last log lines, the one-line error among
        # them (`kubectl describe pod`); the programs write no termination-log file.
        "terminationMessagePolicy": "FallbackToLogsOnError",
        "securityContext": {
            "allowPrivilegeEscalation": False,
            "capabilities": {"drop": ["ALL"]},
        },
    }


# The job each step runs for, so that a program refuses a workspace that holds another job's work
# (tunepack.core.workspace, "the job that owns the workspace"): JobSet labels every pod with its
# JobSet's name and uid, the TrainJob's JobSet being named after the TrainJob.
JOB_LABEL_ENV = (
    (JOB_NAME_ENV, "jobset.sigs.k8s.io/jobset-name"),
    (JOB_UID_ENV, "jobset.sigs.k8s.io/jobset-uid"),
)


def _job_env() -> list[dict]:
    return [
        {"name": name, "valueFrom": {"fieldRef": {"fieldPath": f"metadata.labels['{label}']"}}}
        for name, label in JOB_LABEL_ENV
    ]


def _secret_env(refs: tuple[tuple[str, str, str], ...]) -> list[dict]:
    return [
        {
            "name": name,
            "valueFrom": {"secretKeyRef": {"name": secret, "key": key, "optional": True}},
        }
        for name, secret, key in refs
    ]


def _initializer_container(step: Step, entry: ModelEntry) -> dict:
    container = _container(step, entry, {})
    container["env"] += _secret_env(INITIALIZER_SECRET_ENV)
    container["resources"] = INITIALIZER_RESOURCES
    return container


def _trainer_container(entry: ModelEntry) -> dict:
    container = _container(TRAINER_STEP, entry, TRAINER_ENV)
    container["env"] += _secret_env(TRACKER_SECRET_ENV)
    container["resources"] = trainer_resources(entry)
    container["volumeMounts"].append({"name": SHM_VOLUME, "mountPath": "/dev/shm"})
    return container


def trainer_resources(entry: ModelEntry) -> dict:
    """The runtime's ``node`` container resources (what a TrainJob's ``resourcesPerNode`` is
    merged into: ``tunepack.jobs.trainjob.pod_resources``)."""
    resources: dict = {"requests": host.trainer_requests(entry)}
    if entry.resources.gpus:
        resources["limits"] = {GPU_RESOURCE: entry.resources.gpus}
    return resources


def _shm_volume(entry: ModelEntry) -> dict:
    # NCCL and data loader workers share memory through /dev/shm; the container runtime's
    # default of 64Mi makes them crash. It counts against the Pod's memory.
    size = "16Gi" if entry.resources.gpus else "1Gi"
    return {"name": SHM_VOLUME, "emptyDir": {"medium": "Memory", "sizeLimit": size}}


# --- files ------------------------------------------------------------------------------------


class _Dumper(yaml.SafeDumper):
    """Indent list items under their key, as kubectl and most Kubernetes docs do."""

    def increase_indent(self, flow: bool = False, indentless: bool = False):
        return super().increase_indent(flow, False)

    def ignore_aliases(self, data) -> bool:
        # Shared constants (INITIALIZER_RESOURCES) would otherwise become &id001 anchors.
        return True


def to_yaml(obj: dict) -> str:
    return yaml.dump(obj, Dumper=_Dumper, sort_keys=False, default_flow_style=False, width=100)


def generated_files() -> dict[str, str]:
    """File name -> content of everything under ``generated/``, in a stable order."""
    files = {}
    for entry in sorted(catalog.CATALOG.values(), key=lambda e: e.runtime_name):
        runtime = build_runtime(entry)
        validate_runtime(runtime)  # never write what the API would silently truncate
        files[f"{entry.runtime_name}.yaml"] = HEADER + to_yaml(runtime)
    kustomization = {
        "apiVersion": "kustomize.config.k8s.io/v1beta1",
        "kind": "Kustomization",
        "resources": sorted(files),
    }
    files[KUSTOMIZATION] = HEADER + to_yaml(kustomization)
    return files
