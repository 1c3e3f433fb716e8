"""``TrainingClient``: the Kubeflow SDK's ``TrainerClient`` with tunepack's runtimes.

Same methods and semantics, so notebooks keep working; on tunepack runtimes ``train`` takes a
``FineTune`` (or the SDK's ``BuiltinTrainer``), and the client adds ``progress``, ``plot_loss``
and ``result`` (docs/sdk.md).

    >>> from tunepack import TrainingClient, FineTune, Initializer, LocalBackendConfig
    >>> client = TrainingClient(LocalBackendConfig())        # or TrainingClient() for a cluster
    >>> job = client.train(
    ...     runtime="tunepack-tiny-llama3",
    ...     initializer=Initializer(dataset="file:///data/train.jsonl",
    ...                             model="file:///models/tiny-llama3"),
    ...     trainer=FineTune(method="lora", epochs=1),
    ... )
    >>> client.wait_for_job_status(job, progress=True)
    >>> client.result(job).generate("Write a haiku about GPUs")"""

from __future__ import annotations

from collections.abc import Callable

from kubeflow.common.types import KubernetesBackendConfig
from kubeflow.trainer import TrainerClient
from kubeflow.trainer.constants import constants as kc

from tunepack import notebook_progress
from tunepack.backends.base import TunepackBackend
from tunepack.backends.kubeconfig import configuration_problem
from tunepack.backends.local import LocalBackend, LocalBackendConfig
from tunepack.core.errors import BadValueError, NotAvailableError
from tunepack.runtimes import planner
from tunepack.types import Result


class TrainingClient(TrainerClient):
    """A Kubeflow Trainer client that knows tunepack runtimes.

    Args:
        backend_config: ``KubernetesBackendConfig`` (default: kubeconfig or in-cluster) or
            tunepack's ``LocalBackendConfig``. The SDK's other configs work as in the SDK.
        gpu: GPU type the memory planner checks cluster jobs against
            (``tunepack.runtimes.planner.GPUS``).
        memory_check: ``refuse`` (default), ``warn`` or ``off`` when a job cannot fit.
    """

    def __init__(
        self,
        backend_config=None,
        gpu: str = planner.DEFAULT_GPU,
        memory_check: str = planner.DEFAULT_MEMORY_CHECK,
    ):
        if backend_config is None:
            backend_config = KubernetesBackendConfig()
        if isinstance(backend_config, LocalBackendConfig):
            self.backend = LocalBackend(backend_config)
        elif isinstance(backend_config, KubernetesBackendConfig):
            from kubernetes.config.config_exception import ConfigException

            from tunepack.backends.kubernetes import KubernetesBackend

            try:
                self.backend = KubernetesBackend(backend_config, gpu=gpu, memory_check=memory_check)
            except ConfigException as err:  # the kubernetes library's wording: tunepack's line
                local = ", or pass LocalBackendConfig() to use the local backend"
                raise BadValueError(configuration_problem(err, local)) from None
        else:
            super().__init__(backend_config)

    def wait_for_job_status(
        self,
        name: str,
        status: set[str] = {kc.TRAINJOB_COMPLETE},  # noqa: B006 (the SDK's signature)
        timeout: int = 600,
        polling_interval: int = 2,
        callbacks: list[Callable] | None = None,
        progress: bool = False,
    ):
        """As the SDK's; ``progress=True`` also shows a progress bar (tqdm, Jupyter-aware) and,
        once the job is complete, a line with its losses and its experiment tracker's run (or,
        on a cluster whose trainer reported no progress, that it is unavailable, and why)."""
        callbacks = list(callbacks or [])
        bar = notebook_progress.ProgressBar(name) if progress else None
        if bar:
            callbacks.append(bar.update)
        try:
            job = super().wait_for_job_status(name, status, timeout, polling_interval, callbacks)
        finally:
            if bar:
                bar.close()
        if bar and job.status == kc.TRAINJOB_COMPLETE and isinstance(self.backend, TunepackBackend):
            lines = notebook_progress.summary_lines(self.backend.result(name))
            if not bar.reported and not isinstance(self.backend, LocalBackend):
                lines.append(f"progress unavailable: {notebook_progress.NO_TRAINER_STATUS}")
            if lines:
                print(f"{name}: " + "; ".join(lines))
        return job

    def delete_job(self, name: str, keep_workspace: bool | None = None):
        """As the SDK's. On the local backend ``keep_workspace`` decides the job's workspace
        (``LocalBackend.delete_job``; by default one under the job's directory goes with it),
        and the workspace kept, if any, is returned."""
        if keep_workspace is None:
            return self.backend.delete_job(name)
        return self.backend.delete_job(name, keep_workspace=keep_workspace)

    def plot_loss(self, name: str):
        """Plot the training loss per step (matplotlib; local jobs read ``metrics.jsonl``)."""
        return notebook_progress.plot_loss(self._tunepack_backend().metrics(name), title=name)

    def result(self, name: str) -> Result:
        """Where the job's adapter or model is, with a loader for a quick generation."""
        return self._tunepack_backend().result(name)

    def _tunepack_backend(self) -> TunepackBackend:
        if not isinstance(self.backend, TunepackBackend):
            raise NotAvailableError(
                f"{type(self.backend).__name__} is the Kubeflow SDK's backend: results and "
                "metrics are tunepack's, on TrainingClient(LocalBackendConfig()) or a cluster"
            )
        return self.backend
