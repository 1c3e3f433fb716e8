"""tunepack's Kubernetes backend: the Kubeflow SDK's, plus tunepack runtimes.

It subclasses ``kubeflow.trainer.backends.kubernetes.backend.KubernetesBackend`` (kubeconfig or
in-cluster config, the CustomObjects API, pods found by the JobSet labels the platform sets) and
changes only what tunepack needs:

- ``train()`` on a tunepack runtime submits the TrainJob ``tunepack.jobs.submit`` builds (validated
  strictly, trainer args in tunepack's vocabulary, the memory planner's check); other runtimes go
  to the SDK unchanged. The TrainJob references the runtime ``get_runtime`` finds, as the SDK
  does: a ``TrainingRuntime`` of that name in the job's namespace (``tunepack install
  --namespace``), else the ``ClusterTrainingRuntime``. The SDK's options that set TrainJob
  fields tunepack writes as given (``Name``, ``Labels``, ``Annotations``,
  ``ActiveDeadlineSeconds``, ``RuntimePatch``) are honoured; others are refused by name;
- ``list_runtimes()`` / ``get_runtime()`` report a tunepack runtime as what it takes, a
  ``BuiltinTrainer`` of the ``torchtune`` framework (``base.builtin_torchtune_trainer``), and add
  the catalog's model, methods and default GPUs; other runtimes are the SDK's objects, untouched;
- ``get_job()`` / ``list_jobs()`` of a tunepack runtime's job add progress from
  ``status.trainerStatus`` and the Failed condition's message, read from the same GET (or LIST)
  the job's status comes from; a job not finished whose pods the scheduler refuses gets the
  scheduler's reason as its message, and one whose placed pod cannot start (its image cannot be
  pulled) the kubelet's (``get_job`` only: one more LIST of its pods); their steps include the
  ``exporter``'s pod (one LIST per job), which the SDK's pod selector leaves out, so
  ``get_job_logs`` reads it; and ``wait_for_job_status`` stops waiting, with that reason, once a
  gang has waited longer than its PodGroup allows (``scheduling``); another runtime's job is the
  SDK's object, untouched.
"""

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
from tunepack.core.errors import BadInputError, NotAvailableError
from tunepack.core.workspace import ADAPTER_DIR, MODEL_DIR, OUTPUT_DIR, in_pod
from tunepack.jobs import naming, submit
from tunepack.jobs.trainjob import export_of
from tunepack.notebook import Progress, Result, RuntimeList, TrainJob, TunepackRuntime
from tunepack.runtimes import catalog
from tunepack.runtimes.contract import EXPORT_STEP, workspace_pvc
from tunepack.runtimes.planner import DEFAULT_GPU, DEFAULT_MEMORY_CHECK, MemoryCheck

logger = logging.getLogger(__name__)

# The SDK's options whose effect is a TrainJob field tunepack writes as given.
SUPPORTED_OPTIONS = (
    kf_options.Name,
    kf_options.Labels,
    kf_options.Annotations,
    kf_options.ActiveDeadlineSeconds,
    kf_options.RuntimePatch,
)
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
        # What get_job last found of each job's unscheduled pods, for wait_for_job_status.
        self._unscheduled: dict[str, scheduling.Unscheduled | scheduling.NotStarting | None] = {}

    # The SDK's private converter from a runtime object (name-mangled in its KubernetesBackend),
    # which list_runtimes and get_runtime call: tunepack runtimes report a BuiltinTrainer.
    def _KubernetesBackend__get_runtime_from_cr(self, runtime_cr) -> kf.Runtime:
        runtime = SdkBackend._KubernetesBackend__get_runtime_from_cr(self, runtime_cr)
        if submit.is_tunepack_runtime(runtime):
            container = get_runtime_trainer_container(runtime_cr.spec.template.spec.replicated_jobs)
            runtime.trainer = builtin_torchtune_trainer(runtime.trainer, container.command)
        return runtime

    def list_runtimes(self) -> RuntimeList:
        return RuntimeList(_reported(r) for r in super().list_runtimes())

    def get_runtime(self, name: str) -> kf.Runtime:
        return _reported(super().get_runtime(name))

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
            raise BadInputError(
                f"options must be a list, e.g. options=[Labels({{...}})], got {options!r}"
            )
        supported = ", ".join(o.__name__ for o in SUPPORTED_OPTIONS)
        for option in options:
            if not isinstance(option, SUPPORTED_OPTIONS):
                kind = type(option).__name__
                why = _WHY_NOT.get(kind, "tunepack builds these TrainJobs itself")
                raise BadInputError(
                    f"option {kind} cannot be used with tunepack runtimes: {why}. "
                    f"Supported options: {supported}"
                )
        job_spec: dict = {}
        for option in options:
            try:
                option(job_spec, trainer, self)
            except ValueError as err:
                raise BadInputError(f"option {type(option).__name__}: {err}") from None
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
        (``scheduling.GangNotPlaced``, a TimeoutError) instead of the wait's own timeout."""

        def gang_overdue(job) -> None:
            waiting = self._unscheduled.get(name)
            if waiting is not None and waiting.overdue:
                raise scheduling.GangNotPlaced(name, waiting)

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
        # The SDK's private converter (name-mangled in its KubernetesBackend class).
        from_cr = self._KubernetesBackend__get_trainjob_from_cr
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
        fields = {**job.__dict__, "runtime": _reported(job.runtime)}
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


def _reported(runtime: kf.Runtime) -> kf.Runtime:
    """A tunepack runtime with the catalog's fields; any other exactly as the SDK returned it
    (docs/sdk.md: code written for the SDK must see the SDK's object)."""
    return TunepackRuntime.wrap(runtime) if submit.is_tunepack_runtime(runtime) else runtime


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
