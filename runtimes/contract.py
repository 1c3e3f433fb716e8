"""The runtime contract: the names a tunepack runtime shares with Kubeflow Trainer v2.3, JobSet,
the steps' programs and the SDK, and the one way to walk to its jobs and containers.

The accessors take any object holding a JobSet template (a runtime's ``spec.template.spec``, a
``runtimePatches`` entry's ``trainingRuntimeSpec.template.spec``, a JobSet's ``spec``); nothing
else walks these paths. docs/architecture.md, "Runtimes"."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass

from tunepack.core import __version__

API_GROUP = "trainer.kubeflow.org"
API_VERSION = f"{API_GROUP}/v1alpha1"
KIND = "ClusterTrainingRuntime"
NAMESPACED_KIND = "TrainingRuntime"  # what `tunepack install --namespace` registers instead
TRAINJOB_KIND = "TrainJob"

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
WORKSPACE_VOLUME = INITIALIZER_VOLUME  # the older name, still imported by the SDK

# Credentials reach the steps only by reference to Secrets the user creates in the TrainJob's
# namespace (docs/cluster.md); all optional, so public sources need none.
HUB_TOKEN_SECRET = "tunepack-hub-token"
S3_CREDENTIALS_SECRET = "tunepack-s3-credentials"
TRACKER_SECRET = "tunepack-tracker-credentials"
# The environment the programs take credentials from (huggingface_hub's and boto3's own names):
# the initializers and the exporter get them from those Secrets or a TrainJob's export Secret.
HUB_TOKEN_ENV = "HF_TOKEN"
S3_CREDENTIAL_ENV = (
    "AWS_ACCESS_KEY_ID",
    "AWS_SECRET_ACCESS_KEY",
    "AWS_SESSION_TOKEN",
    "AWS_ENDPOINT_URL",
    "AWS_REGION",
)


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
STEPS = (DATASET_STEP, MODEL_STEP, TRAINER_STEP, EXPORT_STEP)  # in the runtime's order


def workspace_pvc(trainjob: str) -> str:
    """The name of the PVC JobSet creates for a TrainJob's workspace: ``initializer-<trainjob>``.

    It is retained when the TrainJob is deleted; delete it once the result is fetched.
    """
    return f"{INITIALIZER_VOLUME}-{trainjob}"


# --- accessors ----------------------------------------------------------------------------------
# ``partial=True`` reads a user-written runtime patch, where any level may be missing: a missing
# level reads as empty. Otherwise a missing level is a KeyError, as for any malformed runtime.


def _get(obj: Mapping, keys: tuple[str, ...], partial: bool) -> dict:
    for key in keys:
        obj = (obj.get(key) or {}) if partial else obj[key]
    return obj


def jobset_spec(obj: Mapping, *, partial: bool = False) -> dict:
    """The JobSet spec of a runtime, a ``runtimePatches`` entry or a JobSet."""
    if "trainingRuntimeSpec" in obj:
        return _get(obj, ("trainingRuntimeSpec", "template", "spec"), partial)
    if obj.get("kind") == "JobSet":
        return _get(obj, ("spec",), partial)
    return _get(obj, ("spec", "template", "spec"), partial)


def replicated_jobs(obj: Mapping, *, partial: bool = False) -> list[dict]:
    """The replicatedJobs of a runtime, a ``runtimePatches`` entry or a JobSet, in order."""
    spec = jobset_spec(obj, partial=partial)
    return (spec.get("replicatedJobs") or []) if partial else spec["replicatedJobs"]


def replicated_job(obj: Mapping, name: str) -> dict:
    """The replicatedJob called ``name`` (a step's ``job``); KeyError naming those there."""
    jobs = replicated_jobs(obj)
    for job in jobs:
        if job.get("name") == name:
            return job
    raise KeyError(f"no replicatedJob {name!r}; there are {[j.get('name') for j in jobs]}")


def job_spec(job: Mapping) -> dict:
    """The Job spec of a replicatedJob (backoffLimit, podFailurePolicy, parallelism...)."""
    return job["template"]["spec"]


def step_label(job: Mapping) -> str | None:
    """A replicatedJob's ANCESTOR_LABEL value (a step's ``ancestor``), None if it has none."""
    labels = ((job.get("template") or {}).get("metadata") or {}).get("labels") or {}
    return labels.get(ANCESTOR_LABEL)


def pod_spec(job: Mapping, *, partial: bool = False) -> dict:
    """The Pod spec of a replicatedJob."""
    return _get(job, ("template", "spec", "template", "spec"), partial)


def containers(job: Mapping, *, partial: bool = False) -> list[dict]:
    """The containers of a replicatedJob's Pod."""
    pod = pod_spec(job, partial=partial)
    return (pod.get("containers") or []) if partial else pod["containers"]


def container(job: Mapping, name: str | None = None) -> dict:
    """The container called ``name``, by default the job's own (the controller finds a step's
    container by the job's name); KeyError naming those there."""
    name = name or job["name"]
    found = containers(job)
    for candidate in found:
        if candidate.get("name") == name:
            return candidate
    raise KeyError(f"no container {name!r}; there are {[c.get('name') for c in found]}")


def env(container: Mapping) -> dict[str, str]:
    """A container's plain-value environment (``value``), name -> value, later entries winning.
    Variables given by reference (``valueFrom``) are in ``env_refs``."""
    return {var["name"]: var["value"] for var in container.get("env") or [] if "value" in var}


def env_refs(container: Mapping) -> dict[str, dict]:
    """A container's environment given by reference: name -> its ``valueFrom``."""
    return {
        var["name"]: var["valueFrom"] for var in container.get("env") or [] if "valueFrom" in var
    }


def job_patch(name: str, container: dict) -> dict:
    """A partial replicatedJob for a ``runtimePatches`` entry: job ``name``, one container."""
    return {"name": name, "template": {"spec": {"template": {"spec": {"containers": [container]}}}}}


def runtime_patch(manager: str, jobs: list[dict]) -> dict:
    """A TrainJob ``runtimePatches`` entry owned by ``manager`` that patches ``jobs``."""
    return {
        "manager": manager,
        "trainingRuntimeSpec": {"template": {"spec": {"replicatedJobs": jobs}}},
    }


def runtime_patches(trainjob: Mapping, manager: str | None = None) -> Iterator[dict]:
    """A TrainJob's ``runtimePatches`` entries (only ``manager``'s when given), in order."""
    for patch in (trainjob.get("spec") or {}).get("runtimePatches") or []:
        if manager is None or patch.get("manager") == manager:
            yield patch
