"""tunepack's Kubernetes backend: the Kubeflow SDK's, changed only where tunepack runtimes need it.

On a tunepack runtime: ``train()`` submits what ``tunepack.jobs.submit`` builds (the SDK's
options that set TrainJob fields honoured, others refused by name); runtimes are reported as the
SDK's torchtune ones are; jobs get progress, a failure's or a Pending pod's reason, and the
exporter's pod among their steps. Other runtimes and their jobs are the SDK's, untouched.
docs/sdk.md and docs/cluster.md, "From a notebook"."""

from __future__ import annotations

import dataclasses
import logging
import multiprocessing

from kubeflow.common import constants as common_constants
from kubeflow.common.types import KubernetesBackendConfig
from kubeflow.trainer import options as kf_options
from kubeflow.trainer.backends.kubernetes.backend import KubernetesBackend as SdkBackend
from kubeflow.trainer.backends.kubernetes.utils import get_runtime_trainer_container
from kubeflow.trainer.constants import constants as kc
from kubeflow.trainer.types import types as kf
from kubeflow_trainer_api import models

from tunepack.backends import scheduling
from tunepack.backends.api_errors import api_message, api_status
from tunepack.backends.base import TunepackBackend, builtin_torchtune_trainer
from tunepack.core.errors import BadValueError, GangNotPlaced, NotAvailableError, UnsupportedError
from tunepack.core.workspace import ADAPTER_DIR, MODEL_DIR, OUTPUT_DIR, in_pod
from tunepack.jobs import naming, submit
from tunepack.jobs.trainjob import export_of
from tunepack.runtimes import catalog
from tunepack.runtimes.contract import EXPORT_STEP, workspace_pvc
from tunepack.runtimes.planner import DEFAULT_GPU, DEFAULT_MEMORY_CHECK, MemoryCheck
from tunepack.spelling import SDK, Spelling
from tunepack.types import Progress, Result, RuntimeList, TrainJob, TunepackRuntime

logger = logging.getLogger(__name__)

# The SDK's options whose effect is a TrainJob field tunepack writes as given.
SUPPORTED_OPTIONS = (
    kf_options.Name,
    kf_options.Labels,
    kf_options.Annotations,
    kf_options.ActiveDeadlineSeconds,
    kf_options.RuntimePatch,
)
# The one private name of the Kubeflow SDK that tunepack uses, and why. The SDK's converter from a
# TrainJob object to its ``TrainJob`` (steps from the job's pods, status from its conditions) is
# private to its KubernetesBackend (name-mangled); its public get_job and list_jobs read the
# object themselves, and tunepack needs the same object's trainerStatus and Failed message:
# through them each TrainJob would be read twice, and the two reads could disagree. tunepack
# calls it, never overrides it; tests/unit/test_sdk_private.py fails when an SDK release moves it.
SDK_TRAINJOB_FROM_CR = "_KubernetesBackend__get_trainjob_from_cr"
# The API model of each kind of runtime object, to read its trainer container as the SDK does.
_RUNTIME_MODELS = {
    kf.RuntimeKind.CLUSTER_TRAINING_RUNTIME: models.TrainerV1alpha1ClusterTrainingRuntime,
    kf.RuntimeKind.TRAINING_RUNTIME: models.TrainerV1alpha1TrainingRuntime,
}
_WHY_NOT = {
    "TrainerCommand": "the trainer's command is tunepack's fine-tuning program, set by the runtime",
    "TrainerArgs": "the trainer's arguments come from trainer=FineTune(...) (or "
    "BuiltinTrainer(config=TorchTuneConfig(...)))",
}


class KubernetesBackend(SdkBackend, TunepackBackend):
    """The SDK's Kubernetes backend with tunepack runtimes (``tunepack.backends.base``)."""

    def __init__(
        self,
        cfg: KubernetesBackendConfig,
        gpu: str = DEFAULT_GPU,
        memory_check: MemoryCheck = DEFAULT_MEMORY_CHECK,
    ):
        gpu = submit.check_settings(gpu, memory_check)  # before the SDK reads the kubeconfig
        super().__init__(cfg)
        self.gpu = gpu
        self.memory_check = memory_check
        # The caller's words in train()'s refusals: the SDK's, or the CLI's (`tunepack train`).
        self.spelling: Spelling = SDK
        # What get_job last found of each job's unscheduled pods, for wait_for_job_status.
        self._unscheduled: dict[str, scheduling.Unscheduled | scheduling.NotStarting | None] = {}

    def list_runtimes(self) -> RuntimeList:
        runtimes = super().list_runtimes()
        ours = [r for r in runtimes if submit.is_tunepack_runtime(r)]
        # One LIST per kind that holds a tunepack runtime, not a GET per runtime.
        objects = {kind: self._runtime_objects(kind) for kind in {r.kind for r in ours}}
        return RuntimeList(
            self._reported(r, objects[r.kind].get(r.name))
            if submit.is_tunepack_runtime(r)
            else r  # another runtime: exactly the SDK's object (docs/sdk.md)
            for r in runtimes
        )

    def get_runtime(self, name: str) -> kf.Runtime:
        runtime = super().get_runtime(name)
        # Another runtime is exactly the SDK's object (docs/sdk.md: code written for the SDK
        # must see the SDK's object).
        return self._reported(runtime) if submit.is_tunepack_runtime(runtime) else runtime

    def _reported(self, runtime: kf.Runtime, obj: dict | None = None) -> TunepackRuntime:
        """A tunepack runtime as what it takes, a ``BuiltinTrainer`` of the ``torchtune``
        framework running its trainer container's command (``base.builtin_torchtune_trainer``),
        with the catalog's fields. ``obj``: the runtime's object, when it was listed; else it is
        read (the SDK's ``Runtime`` does not carry the container's command)."""
        if obj is None:
            obj = self._runtime_object(runtime.kind, runtime.name)
        model = _RUNTIME_MODELS[runtime.kind].from_dict(obj)
        container = get_runtime_trainer_container(model.spec.template.spec.replicated_jobs)
        trainer = builtin_torchtune_trainer(runtime.trainer, container.command)
        return TunepackRuntime.wrap(dataclasses.replace(runtime, trainer=trainer))

    def _runtime_object(self, kind: kf.RuntimeKind, name: str) -> dict:
        """The runtime object ``get_runtime`` found, read again through the API."""
        where = (
            name if kind == kf.RuntimeKind.CLUSTER_TRAINING_RUNTIME else f"{self.namespace}/{name}"
        )
        try:
            if kind == kf.RuntimeKind.CLUSTER_TRAINING_RUNTIME:
                thread = self.custom_api.get_cluster_custom_object(
                    kc.GROUP, kc.VERSION, kc.CLUSTER_TRAINING_RUNTIME_PLURAL, name, async_req=True
                )
            else:
                thread = self.custom_api.get_namespaced_custom_object(
                    kc.GROUP,
                    kc.VERSION,
                    self.namespace,
                    kc.TRAINING_RUNTIME_PLURAL,
                    name,
                    async_req=True,
                )
            return _as_dict(thread.get(common_constants.DEFAULT_TIMEOUT))
        except multiprocessing.TimeoutError as e:
            raise TimeoutError(f"Timeout to get {kind.value}: {where}") from e
        except Exception as e:
            raise RuntimeError(f"Failed to get {kind.value}: {where}") from e

    def _runtime_objects(self, kind: kf.RuntimeKind) -> dict[str, dict]:
        """The runtime objects of ``kind`` that ``list_runtimes`` listed, by name, listed again."""
        try:
            if kind == kf.RuntimeKind.CLUSTER_TRAINING_RUNTIME:
                thread = self.custom_api.list_cluster_custom_object(
                    kc.GROUP, kc.VERSION, kc.CLUSTER_TRAINING_RUNTIME_PLURAL, async_req=True
                )
            else:
                thread = self.custom_api.list_namespaced_custom_object(
                    kc.GROUP, kc.VERSION, self.namespace, kc.TRAINING_RUNTIME_PLURAL, async_req=True
                )
            items = _as_dict(thread.get(common_constants.DEFAULT_TIMEOUT)).get("items") or []
        except multiprocessing.TimeoutError as e:
            raise TimeoutError(f"Timeout to list {kind.value}s") from e
        except Exception as e:
            raise RuntimeError(f"Failed to list {kind.value}s") from e
        return {item["metadata"]["name"]: item for item in items}

    def train(self, runtime=None, initializer=None, trainer=None, options=None) -> str:
        if isinstance(runtime, str):
            runtime = self.resolve_runtime(runtime)
        elif submit.is_tunepack_runtime(runtime):
            runtime = self._installed_runtime(runtime.name)
        if not submit.is_tunepack_runtime(runtime):
            return super().train(runtime, initializer, trainer, options)
        fields = self._option_fields(options, trainer)
        if fields.get("name") is None:  # no Name(...): named as the SDK names a job
            fields["name"] = naming.random_job_name()
        trainjob = submit.build(
            runtime.name,
            initializer,
            trainer,
            namespace=self.namespace,
            gpu=self.gpu,
            memory_check=self.memory_check,
            runtime_kind=runtime.kind.value,
            spelling=self.spelling,
            **fields,
        )
        job_name = trainjob["metadata"]["name"]
        try:
            self.custom_api.create_namespaced_custom_object(
                kc.GROUP, kc.VERSION, self.namespace, kc.TRAINJOB_PLURAL, trainjob
            )
        except Exception as e:
            reason = api_message(e)
            raise RuntimeError(
                f"Failed to create {kc.TRAINJOB_KIND}: {self.namespace}/{job_name}"
                + (f": {reason}" if reason else "")
            ) from e
        return job_name

    def resolve_runtime(self, name: str) -> kf.Runtime:
        """The runtime ``train(runtime=name)`` uses: never a silent rewrite of ``name``.

        A runtime of exactly that name wins (a ``TrainingRuntime`` in the namespace first, then a
        ``ClusterTrainingRuntime``, as ``get_runtime``). Only when there is none does a catalog
        model's short name (``llama3.2-1b``) resolve to its runtime (``tunepack-llama3.2-1b``),
        and that is logged. Any other name is an error that lists the close matches.
        """
        try:
            return self.get_runtime(name)
        except RuntimeError as err:
            if api_status(err) != 404:
                raise
            missing = err
        target = submit.short_name_target(name)
        if target is not None:
            found = self._installed_runtime(target, also_missing=name)
            where = f"in namespace {self.namespace!r} or the cluster"
            submit.log_short_name(name, found.name, where)
            return found
        if submit.is_tunepack_runtime(name):
            return self._installed_runtime(name)  # raises: not installed, and what to do
        try:
            installed = [r.name for r in super().list_runtimes()]
        except Exception:  # the listing is a hint only; the lookup's error is the answer
            installed = []
        known = installed + [e.runtime_name for e in catalog.CATALOG.values()]
        matches = submit.close_matches(name, known)
        hint = (
            f"; did you mean {', '.join(map(repr, matches))}?"
            if matches
            else f"; runtimes here: {', '.join(sorted(installed))}"
            if installed
            else "; no runtime is installed (`tunepack install` installs tunepack's)"
        )
        raise RuntimeError(
            f"runtime {name!r} not found: no TrainingRuntime of that name in namespace "
            f"{self.namespace!r} and no ClusterTrainingRuntime{hint}"
        ) from missing.__cause__

    def _installed_runtime(self, name: str, also_missing: str | None = None) -> kf.Runtime:
        """The runtime as the SDK finds it (namespaced first); a clear error when not installed."""
        try:
            return self.get_runtime(name)
        except RuntimeError as err:
            if api_status(err) != 404:
                raise
            neither = f" (nor any runtime named {also_missing!r})" if also_missing else ""
            raise RuntimeError(
                f"runtime {name!r} is not installed on this cluster (no TrainingRuntime in "
                f"namespace {self.namespace!r}, no ClusterTrainingRuntime){neither}: run "
                f"`tunepack install` (or `tunepack install --namespace {self.namespace}`) or "
                "`kubectl apply --server-side -k manifests/base` first"
            ) from err.__cause__

    def _option_fields(self, options, trainer) -> dict:
        """``submit.build``'s keyword arguments from the SDK's options, applied as the SDK does."""
        if not options:
            return {}
        if not isinstance(options, list | tuple):
            raise BadValueError(
                f"options must be a list, e.g. options=[Labels({{...}})], got {options!r}"
            )
        supported = ", ".join(o.__name__ for o in SUPPORTED_OPTIONS)
        for option in options:
            if not isinstance(option, SUPPORTED_OPTIONS):
                kind = type(option).__name__
                why = _WHY_NOT.get(kind, "tunepack builds these TrainJobs itself")
                raise UnsupportedError(
                    f"option {kind} cannot be used with tunepack runtimes: {why}. "
                    f"Supported options: {supported}"
                )
        job_spec: dict = {}
        for option in options:
            try:
                option(job_spec, trainer, self)
            except ValueError as err:
                raise BadValueError(f"option {type(option).__name__}: {err}") from None
        metadata, spec = job_spec.get("metadata", {}), job_spec.get("spec", {})
        return {
            "name": metadata.get("name"),
            "labels": metadata.get("labels"),
            "annotations": metadata.get("annotations"),
            "active_deadline_seconds": spec.get("activeDeadlineSeconds"),
            "runtime_patches": spec.get("runtimePatches"),
        }

    def workspace_of(self, name: str) -> str:
        return f"pvc/{workspace_pvc(name)}"

    @property
    def location(self) -> str:
        return f"in namespace {self.namespace}"

    def metrics(self, name: str) -> list[dict]:
        raise NotAvailableError(
            "per-step metrics live on the job's workspace volume on a cluster; the TrainJob's "
            "trainerStatus carries only the latest values (get_job(name).progress). See "
            "docs/cluster.md for reading the PVC."
        )

    def trainjob_object(self, name: str) -> dict:
        try:
            raw = self.custom_api.get_namespaced_custom_object(
                kc.GROUP, kc.VERSION, self.namespace, kc.TRAINJOB_PLURAL, name
            )
        except Exception as e:  # as get_job: the CLI says the API's reason in one line
            raise RuntimeError(f"Failed to get {kc.TRAINJOB_KIND}: {self.namespace}/{name}") from e
        return _as_dict(raw)

    def _result(self, name: str):
        pvc = workspace_pvc(name)
        return Result(
            job=name,
            path=f"pvc/{pvc}:{in_pod(OUTPUT_DIR, ADAPTER_DIR)}",
            base_model=f"pvc/{pvc}:{in_pod(MODEL_DIR)}",
            local=False,
            export=export_of(self.trainjob_object(name)),
        )

    def get_job(self, name: str) -> TrainJob | kf.TrainJob:
        try:
            thread = self.custom_api.get_namespaced_custom_object(
                kc.GROUP, kc.VERSION, self.namespace, kc.TRAINJOB_PLURAL, name, async_req=True
            )
            raw = _as_dict(thread.get(common_constants.DEFAULT_TIMEOUT))
        except multiprocessing.TimeoutError as e:
            raise TimeoutError(f"Timeout to get {kc.TRAINJOB_KIND}: {self.namespace}/{name}") from e
        except Exception as e:
            raise RuntimeError(f"Failed to get {kc.TRAINJOB_KIND}: {self.namespace}/{name}") from e
        job = self._from_object(raw)
        if not isinstance(job, TrainJob):  # not a tunepack runtime's: the SDK's object
            return job
        if job.status == kc.TRAINJOB_FAILED:
            return dataclasses.replace(job, exit_code=self._failed_exit_code(name))
        waiting = None
        if job.status not in (kc.TRAINJOB_COMPLETE, kc.TRAINJOB_FAILED) and not job.message:
            held = scheduling.queued(self.custom_api, self.namespace, raw)
            if held is not None:
                return dataclasses.replace(job, message=held)
            waiting = scheduling.pending(self.core_api, self.custom_api, self.namespace, name)
        self._unscheduled[name] = waiting
        return dataclasses.replace(job, message=waiting.message()) if waiting else job

    def wait_for_job_status(
        self,
        name: str,
        status: set[str] = {kc.TRAINJOB_COMPLETE},  # noqa: B006 (the SDK's signature)
        timeout: int = 600,
        polling_interval: int = 2,
        callbacks=None,
    ):
        """As the SDK's, but a gang that the scheduler could not place whole within its
        PodGroup's scheduleTimeoutSeconds ends the wait with the scheduler's reason
        (``GangNotPlaced``, a TimeoutError) instead of the wait's own timeout."""

        def gang_overdue(job) -> None:
            waiting = self._unscheduled.get(name)
            if waiting is not None and waiting.overdue:
                raise GangNotPlaced(name, waiting)

        self._unscheduled.pop(name, None)
        return super().wait_for_job_status(
            name, status, timeout, polling_interval, [*(callbacks or []), gang_overdue]
        )

    def list_jobs(self, runtime=None) -> list[TrainJob | kf.TrainJob]:
        """The TrainJobs in the namespace, each as the LIST returned it (no GET per job, so a
        job deleted meanwhile cannot make the listing fail)."""
        try:
            thread = self.custom_api.list_namespaced_custom_object(
                kc.GROUP, kc.VERSION, self.namespace, kc.TRAINJOB_PLURAL, async_req=True
            )
            items = _as_dict(thread.get(common_constants.DEFAULT_TIMEOUT)).get("items") or []
        except multiprocessing.TimeoutError as e:
            raise TimeoutError(
                f"Timeout to list {kc.TRAINJOB_KIND}s in namespace: {self.namespace}"
            ) from e
        except Exception as e:
            raise RuntimeError(
                f"Failed to list {kc.TRAINJOB_KIND}s in namespace: {self.namespace}"
            ) from e
        if runtime is not None:
            items = [
                raw
                for raw in items
                if ((raw.get("spec") or {}).get("runtimeRef") or {}).get("name") == runtime.name
            ]
        return [self._from_object(_as_dict(raw)) for raw in items]

    def _from_object(self, raw: dict) -> TrainJob | kf.TrainJob:
        """tunepack's TrainJob from the API object: the SDK's reading (steps from the pods,
        status from the conditions) plus the failure message and progress. A job of a runtime
        that is not tunepack's is the SDK's object, exactly (docs/sdk.md)."""
        from_cr = getattr(self, SDK_TRAINJOB_FROM_CR)  # the SDK's reading, private: see there
        job = from_cr(models.TrainerV1alpha1TrainJob.from_dict(raw))
        if not submit.is_tunepack_runtime(job.runtime):
            return job
        status = raw.get("status") or {}
        message = next(
            (
                c.get("message")
                for c in status.get("conditions") or []
                if c.get("type") == kc.TRAINJOB_FAILED and c.get("status") == "True"
            ),
            None,
        )
        runtime = job.runtime  # the SDK's converter took it from get_runtime: reported already
        if not isinstance(runtime, TunepackRuntime):
            runtime = self._reported(runtime)
        fields = {**job.__dict__, "runtime": runtime}
        fields["steps"] = [*job.steps, *self._exporter_steps(raw["metadata"]["name"])]
        return TrainJob(
            **fields,
            message=message,
            progress=progress_from_status(status.get("trainerStatus")),
        )

    def _failed_exit_code(self, name: str) -> int | None:
        """The exit code of the container that failed first among the job's pods (one LIST),
        None where no pod holds one any more."""
        selector = f"{kc.JOBSET_NAME_LABEL}={name}"
        try:
            thread = self.core_api.list_namespaced_pod(
                self.namespace, label_selector=selector, async_req=True
            )
            pods = _as_dict(thread.get(common_constants.DEFAULT_TIMEOUT)).get("items") or []
        except Exception:  # the code refines the status; the job's status is known already
            logger.debug("listing the pods of %s failed", name, exc_info=True)
            return None
        ended = [
            (str(ended.get("finished_at") or ""), ended["exit_code"])
            for pod in pods
            for status in (pod.get("status") or {}).get("container_statuses") or []
            if (ended := (status.get("state") or {}).get("terminated")) and ended.get("exit_code")
        ]
        return min(ended)[1] if ended else None

    def _exporter_steps(self, name: str) -> list[kf.Step]:
        """The exporter's step (``exporter``, its newest pod), which the SDK's pod selector
        leaves out (it knows the initializers, launcher and node only): listed by
        ``get_job().steps`` and read by ``get_job_logs(name, step='exporter')``."""
        selector = f"{kc.JOBSET_NAME_LABEL}={name},{kc.JOBSET_RJOB_NAME_LABEL}={EXPORT_STEP.job}"
        try:
            thread = self.core_api.list_namespaced_pod(
                self.namespace, label_selector=selector, async_req=True
            )
            pods = _as_dict(thread.get(common_constants.DEFAULT_TIMEOUT)).get("items") or []
        except multiprocessing.TimeoutError as e:
            raise TimeoutError(
                f"Timeout to list {kc.TRAINJOB_KIND}'s steps: {self.namespace}/{name}"
            ) from e
        except Exception as e:
            raise RuntimeError(
                f"Failed to list {kc.TRAINJOB_KIND}'s steps: {self.namespace}/{name}"
            ) from e
        if not pods:
            return []
        pod = max(pods, key=lambda p: str(p["metadata"].get("creation_timestamp") or ""))
        phase = (pod.get("status") or {}).get("phase")
        return [kf.Step(name=EXPORT_STEP.job, status=phase, pod_name=pod["metadata"]["name"])]


def _as_dict(obj) -> dict:
    """The API object as the API returns it (a dict); the SDK's models too, as its tests pass."""
    return obj.to_dict() if hasattr(obj, "to_dict") else obj


def progress_from_status(trainer_status: dict | None) -> Progress | None:
    """Progress from ``TrainJob.status.trainerStatus`` (the TrainJobStatus feature); the trainer
    posts its metrics as strings (trainers/outputs/trainjob_status.py), validation ones after an
    evaluation."""
    if not trainer_status:
        return None
    metrics = {m.get("name"): m.get("value") for m in trainer_status.get("metrics") or []}
    step = _number(metrics.get("step"))
    return Progress(
        percent=trainer_status.get("progressPercentage"),
        step=int(step) if step is not None else None,
        loss=_number(metrics.get("loss")),
        estimated_remaining_seconds=trainer_status.get("estimatedRemainingSeconds"),
        val_loss=_number(metrics.get("val_loss")),
        val_perplexity=_number(metrics.get("val_perplexity")),
        tokens_per_second=_number(metrics.get("tokens_per_second")),
        reward=_number(metrics.get("reward_mean")),
    )


def _number(value: object) -> float | None:
    try:
        return float(value) if value is not None else None
    except (TypeError, ValueError):
        return None
