"""tunepack's Kubernetes backend: the Kubeflow SDK's, plus tunepack runtimes.

It subclasses ``kubeflow.trainer.backends.kubernetes.backend.KubernetesBackend`` (kubeconfig or
in-cluster config, the CustomObjects API, pods found by the JobSet labels the platform sets) and
changes only what tunepack needs:

- ``train()`` on a tunepack runtime submits the TrainJob ``tunepack.submit`` builds (validated
  strictly, trainer args in tunepack's vocabulary); other runtimes go to the SDK unchanged;
- ``list_runtimes()`` / ``get_runtime()`` add the catalog's model, methods and default GPUs;
- ``get_job()`` adds progress from ``status.trainerStatus`` and the Failed condition's message.
"""

from __future__ import annotations

import logging

from kubeflow.common.types import KubernetesBackendConfig
from kubeflow.trainer.backends.kubernetes.backend import KubernetesBackend as SdkBackend
from kubeflow.trainer.constants import constants as kc

from tunepack import submit
from tunepack.types import Progress, RuntimeList, TrainJob, TunepackRuntime

logger = logging.getLogger(__name__)


class KubernetesBackend(SdkBackend):
    def __init__(
        self,
        cfg: KubernetesBackendConfig,
        gpu: str = "H100-80GB",
        memory_check: submit.MemoryCheck = "refuse",
    ):
        super().__init__(cfg)
        self.gpu = gpu
        self.memory_check = memory_check

    def list_runtimes(self) -> RuntimeList:
        return RuntimeList(TunepackRuntime.wrap(r) for r in super().list_runtimes())

    def get_runtime(self, name: str) -> TunepackRuntime:
        return TunepackRuntime.wrap(super().get_runtime(name))

    def train(self, runtime=None, initializer=None, trainer=None, options=None) -> str:
        if not submit.is_tunepack_runtime(runtime):
            return super().train(runtime, initializer, trainer, options)
        if options:
            raise ValueError(
                "options are not supported with tunepack runtimes yet: the TrainJob is built "
                "from FineTune and Initializer"
            )
        name = runtime.name if hasattr(runtime, "name") else runtime
        # The runtime must exist on the cluster (clear error if `tunepack install` was not run).
        try:
            self.get_runtime(name)
        except RuntimeError as err:
            raise RuntimeError(
                f"runtime {name!r} is not installed on this cluster: run `tunepack install` or "
                f"`kubectl apply --server-side -k manifests/base` first"
            ) from err
        trainjob = submit.build(
            name,
            initializer,
            trainer,
            namespace=self.namespace,
            gpu=self.gpu,
            memory_check=self.memory_check,
        )
        job_name = trainjob["metadata"]["name"]
        try:
            self.custom_api.create_namespaced_custom_object(
                kc.GROUP, kc.VERSION, self.namespace, kc.TRAINJOB_PLURAL, trainjob
            )
        except Exception as e:
            raise RuntimeError(
                f"Failed to create {kc.TRAINJOB_KIND}: {self.namespace}/{job_name}: {e}"
            ) from e
        return job_name

    def get_job(self, name: str) -> TrainJob:
        job = super().get_job(name)
        raw = self.custom_api.get_namespaced_custom_object(
            kc.GROUP, kc.VERSION, self.namespace, kc.TRAINJOB_PLURAL, name
        )
        status = raw.get("status") or {}
        message = next(
            (
                c.get("message")
                for c in status.get("conditions") or []
                if c.get("type") == kc.TRAINJOB_FAILED and c.get("status") == "True"
            ),
            None,
        )
        return TrainJob(
            **{**job.__dict__, "runtime": TunepackRuntime.wrap(job.runtime)},
            message=message,
            progress=progress_from_status(status.get("trainerStatus")),
        )

    def list_jobs(self, runtime=None) -> list[TrainJob]:
        return [self.get_job(j.name) for j in super().list_jobs(runtime)]


def progress_from_status(trainer_status: dict | None) -> Progress | None:
    """Progress from ``TrainJob.status.trainerStatus`` (the TrainJobStatus feature)."""
    if not trainer_status:
        return None
    metrics = {m.get("name"): m.get("value") for m in trainer_status.get("metrics") or []}
    loss = metrics.get("loss")
    try:
        loss = float(loss) if loss is not None else None
    except ValueError:
        loss = None
    return Progress(
        percent=trainer_status.get("progressPercentage"),
        loss=loss,
        estimated_remaining_seconds=trainer_status.get("estimatedRemainingSeconds"),
    )
