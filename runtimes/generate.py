"""Generate one ClusterTrainingRuntime per catalog entry, plus a kustomization listing them.

    python -m tunepack.runtimes.generate          # (re)write runtimes/generated/
    python -m tunepack.runtimes.generate --check  # exit 1 if the committed files are stale

The YAML is committed (``make runtimes``) so that ``kubectl apply -k`` needs no Python; a test
fails when it no longer matches the catalog. Each runtime is a JobSet template with four steps
sharing a ``/workspace`` volume:

    dataset-initializer ─┐
                         ├─> node (the trainer; torchrun inside, one Pod per node) ─> exporter
    model-initializer ───┘

The exporter (``tunepack.initializers.export``, in the model initializer's image) uploads the
result where the TrainJob's ``EXPORT_URI`` says, and does nothing when it is unset. The TrainJob
sets it through ``runtimePatches`` (the only per-job way to give a container of a job other than
the initializers and the trainer its environment; Trainer v2.3 refuses patched env only on the
dataset-initializer, model-initializer and node containers). JobSet's default success policy
(every replicatedJob) keeps the JobSet running until the exporter has finished.

Platform contract (Kubeflow Trainer v2.3) this file encodes: the step labels and container names
the controller looks for, ``trainer.kubeflow.org/framework: torch`` (the torchtune plugin would
refuse a tunepack runtime, see DESIGN.md), ``mlPolicy.torch`` with no ``numProcPerNode`` (gone in
v2.3: it comes from the TrainJob), the shared volume named ``initializer`` (the TrainJob webhook
requires it), no ``podGroupPolicy`` (see ``build_runtime``), and ``STORAGE_URI`` / ``PET_*``
being injected by the controller.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

import yaml

from tunepack.core import __version__
from tunepack.core.errors import EXIT_BAD_INPUT
from tunepack.core.workspace import DEFAULT_WORKSPACE, MODEL_ENV, WORKSPACE_ENV
from tunepack.runtimes import catalog
from tunepack.runtimes.catalog import ModelEntry
from tunepack.runtimes.validate import validate_runtime

API_GROUP = "trainer.kubeflow.org"
API_VERSION = f"{API_GROUP}/v1alpha1"
KIND = "ClusterTrainingRuntime"

GENERATED_DIR = Path(__file__).resolve().parent / "generated"
KUSTOMIZATION = "kustomization.yaml"
HEADER = (
    "# Generated from runtimes/catalog.py by `make runtimes`; do not edit.\n"
    "# Change the catalog and regenerate: a test fails when this file is stale.\n"
)

IMAGE_REGISTRY = "ghcr.io/tunepack"

# Labels the Trainer controller reads.
FRAMEWORK_LABEL = "trainer.kubeflow.org/framework"
ANCESTOR_LABEL = "trainer.kubeflow.org/trainjob-ancestor-step"
# Labels and annotations of our own, for `kubectl get -l` and the runtime list.
PART_OF_LABEL = "app.kubernetes.io/part-of"
MODEL_LABEL = "tunepack.dev/model"
ANNOTATION_PREFIX = "tunepack.dev/"

# The shared workspace volume (mounted at /workspace). Its name is not ours to choose: Trainer
# v2.3's TrainJob webhook rejects a TrainJob that sets spec.initializer.dataset/.model unless the
# dataset-initializer/model-initializer container mounts a volume named exactly "initializer"
# (jobsetplgconsts.VolumeNameInitializer). JobSet names the PVC it creates <claim>-<jobset>, and
# the JobSet is named after the TrainJob: see workspace_pvc().
INITIALIZER_VOLUME = "initializer"
WORKSPACE_VOLUME = INITIALIZER_VOLUME  # the older name, still imported by sdk_ext
# JobSet deletes the PVCs of its volumeClaimPolicies with the JobSet (that is, with the TrainJob)
# unless retained. The result (adapter or model under /workspace/output) must outlive the job:
# the user deletes the PVC once the result is fetched or served.
WORKSPACE_RETENTION = "Retain"
SHM_VOLUME = "dshm"
RUN_AS = 1000  # the non-root user of the tunepack images

# Small: initializers download and verify files; they do not hold a model in memory.
INITIALIZER_RESOURCES = {"requests": {"cpu": "1", "memory": "2Gi"}}

# Credentials reach the initializers only by reference to Secrets the user creates in the
# TrainJob's namespace; optional, so public sources need no Secret at all. The hub token is
# HF_TOKEN (ACCESS_TOKEN stays free for Kubeflow's per-job initializer secretRef, which wins).
HUB_TOKEN_SECRET = "tunepack-hub-token"
S3_CREDENTIALS_SECRET = "tunepack-s3-credentials"
INITIALIZER_SECRET_ENV = (
    ("HF_TOKEN", HUB_TOKEN_SECRET, "token"),
    ("AWS_ACCESS_KEY_ID", S3_CREDENTIALS_SECRET, "AWS_ACCESS_KEY_ID"),
    ("AWS_SECRET_ACCESS_KEY", S3_CREDENTIALS_SECRET, "AWS_SECRET_ACCESS_KEY"),
    ("AWS_SESSION_TOKEN", S3_CREDENTIALS_SECRET, "AWS_SESSION_TOKEN"),
    ("AWS_ENDPOINT_URL", S3_CREDENTIALS_SECRET, "AWS_ENDPOINT_URL"),
    ("AWS_REGION", S3_CREDENTIALS_SECRET, "AWS_REGION"),
)
# The experiment tracker's credentials (trainers/tracking.py reads them from the environment),
# by reference to one optional Secret with a key per variable; a run without a tracker, or
# with a tracker that needs none, works without it.
TRACKER_SECRET = "tunepack-tracker-credentials"
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


@dataclass(frozen=True)
class Step:
    """One replicatedJob of the runtime. Its container has the same name as the job."""

    job: str  # replicatedJob and container name, as the controller expects
    ancestor: str  # value of ANCESTOR_LABEL
    image: str  # image name under IMAGE_REGISTRY
    module: str  # the program: python -m <module>
    # Pod retries inside the Job. Initializers retry transient failures in place; trainer
    # ranks cannot rejoin a running torchrun group one by one, so the JobSet restarts instead.
    backoff_limit: int

    @property
    def command(self) -> list[str]:
        return ["python", "-m", self.module]

    @property
    def image_ref(self) -> str:
        return f"{IMAGE_REGISTRY}/{self.image}:{__version__}"


DATASET_STEP = Step(
    job="dataset-initializer",
    ancestor="dataset-initializer",
    image="dataset-initializer",
    module="tunepack.initializers.dataset",
    backoff_limit=3,
)
MODEL_STEP = Step(
    job="model-initializer",
    ancestor="model-initializer",
    image="model-initializer",
    module="tunepack.initializers.model",
    backoff_limit=3,
)
TRAINER_STEP = Step(
    job="node",
    ancestor="trainer",
    image="trainer",
    module="tunepack.trainers.launch",
    backoff_limit=0,
)
# After the trainer: uploads the result (EXPORT_URI), CPU only. The label value is tunepack's own:
# the Trainer acts only on the dataset-initializer, model-initializer and trainer values.
EXPORT_STEP = Step(
    job="exporter",
    ancestor="exporter",
    image="model-initializer",  # the initializers' image holds the exporter and its libraries
    module="tunepack.initializers.export",
    backoff_limit=3,
)
STEPS = (DATASET_STEP, MODEL_STEP, TRAINER_STEP, EXPORT_STEP)


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
            # No podGroupPolicy: the Trainer's coscheduling and Volcano plugins make a PodGroup
            # whose minMember counts the pods of every replicatedJob, initializers included,
            # while JobSet creates the node Job only after both initializers complete, so the
            # gang could never be whole (and without the PodGroup CRD the controller cannot
            # build the TrainJob at all). Upstream's torchtune runtimes carry none either. Kueue
            # admits a TrainJob labelled kueue.x-k8s.io/queue-name as a whole.
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


def workspace_pvc(trainjob: str) -> str:
    """The name of the PVC JobSet creates for a TrainJob's workspace: ``initializer-<trainjob>``.

    It is retained when the TrainJob is deleted; delete it once the result is fetched.
    """
    return f"{INITIALIZER_VOLUME}-{trainjob}"


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
        "env": [{"name": name, "value": value} for name, value in env.items()],
        "volumeMounts": [{"name": INITIALIZER_VOLUME, "mountPath": DEFAULT_WORKSPACE}],
        "securityContext": {
            "allowPrivilegeEscalation": False,
            "capabilities": {"drop": ["ALL"]},
        },
    }


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
    res = entry.resources
    container["resources"] = {"requests": {"cpu": res.cpu, "memory": res.memory}}
    if res.gpus:
        container["resources"]["limits"] = {"nvidia.com/gpu": res.gpus}
    container["volumeMounts"].append({"name": SHM_VOLUME, "mountPath": "/dev/shm"})
    return container


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


def check(directory: Path | None = None) -> list[str]:
    """Problems with the files on disk: stale, missing or extra. Empty when up to date."""
    directory = directory or GENERATED_DIR
    expected = generated_files()
    present = {path.name for path in directory.glob("*.yaml")} if directory.is_dir() else set()
    problems = [f"missing: {name}" for name in sorted(set(expected) - present)]
    problems += [f"extra: {name}" for name in sorted(present - set(expected))]
    problems += [
        f"stale: {name}"
        for name in sorted(present & set(expected))
        if (directory / name).read_text(encoding="utf-8") != expected[name]
    ]
    return problems


def write(directory: Path | None = None) -> list[str]:
    """Write the generated files and remove extra ones; return the names written."""
    directory = directory or GENERATED_DIR
    directory.mkdir(parents=True, exist_ok=True)
    expected = generated_files()
    for path in directory.glob("*.yaml"):
        if path.name not in expected:
            path.unlink()  # a runtime removed from the catalog must leave the kustomization too
    for name, text in expected.items():
        (directory / name).write_text(text, encoding="utf-8")
    return list(expected)


# --- reading the committed runtimes --------------------------------------------------------------


def load_runtime(name: str) -> dict:
    """The committed ClusterTrainingRuntime for a runtime or model name.

    Raises ``BadInputError`` listing the runtimes when the name is unknown.
    """
    entry = catalog.get(name)
    path = resources.files("tunepack.runtimes").joinpath("generated", f"{entry.runtime_name}.yaml")
    return yaml.safe_load(path.read_text(encoding="utf-8"))


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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m tunepack.runtimes.generate", description=__doc__.splitlines()[0]
    )
    parser.add_argument(
        "--check", action="store_true", help="exit 1 if runtimes/generated/ is out of date"
    )
    args = parser.parse_args(argv)
    if args.check:
        problems = check()
        if problems:
            print("runtimes/generated/ is out of date; run `make runtimes`:", file=sys.stderr)
            for problem in problems:
                print(f"  {problem}", file=sys.stderr)
            return 1
        print("runtimes/generated/ is up to date")
        return 0
    for name in write():
        print(f"wrote runtimes/generated/{name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
