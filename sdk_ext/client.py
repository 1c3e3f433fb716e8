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

from collections.abc import Callable, Iterator

from kubeflow.common.types import KubernetesBackendConfig
from kubeflow.trainer import TrainerClient
from kubeflow.trainer.constants import constants as kc
from kubeflow.trainer.types import types as kf

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

    Every method is the SDK's, with its arguments and results; on tunepack's backends each says
    below what it raises. Bad input is a ``tunepack.core.errors.BadInputError`` narrowed to what
    went wrong (a ``ValueError``, as the SDK raises), its facts as attributes
    (``UnknownKeyError.key``, ``NotFoundError.name``, ...: docs/sdk.md, "Bad input").

    Raises:
        BadValueError: If ``gpu`` or ``memory_check`` is not one the planner knows, or there
            is no Kubernetes configuration, or a broken one (``KubernetesBackendConfig``; a
            ``LocalBackendConfig``'s ``gpu`` and ``memory_check`` are checked by ``train``).
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

    def list_runtimes(self) -> list[kf.Runtime]:
        """The runtimes: on the local backend tunepack's, on a cluster those installed, a
        tunepack runtime reported as what it takes (docs/sdk.md).

        Raises:
            TimeoutError: If the API server did not answer the listing in time (a cluster).
            RuntimeError: If the listing failed (a cluster).
        """
        return super().list_runtimes()

    def get_runtime(self, name: str) -> kf.Runtime:
        """The runtime of exactly ``name`` (on the local backend a model's short name resolves).

        Raises:
            UnknownRuntimeError: If the local backend has no runtime of that name;
                ``.runtime`` is the name, ``.suggestions`` the close ones.
            TimeoutError: If the API server did not answer in time (a cluster).
            RuntimeError: If there is no runtime of that name, or the lookup failed (a cluster).
        """
        return super().get_runtime(name)

    def get_runtime_packages(self, runtime: kf.Runtime):
        """Print the Python and packages the runtime's steps run with.

        Raises:
            ValueError: If ``runtime`` is not a runtime the SDK can run (a cluster).
            RuntimeError: If the packages could not be read (a cluster).
        """
        return super().get_runtime_packages(runtime)

    def train(
        self,
        runtime: str | kf.Runtime | None = None,
        initializer=None,
        trainer=None,
        options: list | None = None,
    ) -> str:
        """Create and submit a TrainJob; on a tunepack runtime ``trainer`` is a ``FineTune``
        (or the SDK's ``BuiltinTrainer``), checked whole before anything is created.

        Returns:
            The TrainJob's name.

        Raises:
            UnknownRuntimeError: If the local backend has no runtime ``runtime``.
            UnknownKeyError: If a trainer argument is not in tunepack's vocabulary.
            BadValueError: If a value is of the wrong type, form or range (a trainer argument, a
                storage URI, an option, the local backend's ``gpu`` or ``memory_check``), or no
                ``runtime`` is given (the local backend).
            ConflictError: If settings exclude each other (LoRA settings with
                ``method='full'``, more processes a node than its GPUs, ...).
            UnsupportedError: If the runtime, the model or the backend does not do what is asked
                (a method it does not offer, an option tunepack runtimes refuse, a
                ``CustomTrainer``).
            DoesNotFitError: If the memory planner says the job cannot fit in GPU memory
                (``memory_check='refuse'``); ``.need_gib`` and ``.have_gib`` say by how much.
            NotFoundError: If a local dataset or model path does not exist, or a single data
                file has no such split (the local backend).
            DeniedError: If the local backend cannot write its job's record.
            TimeoutError: If the API server did not answer in time (a cluster).
            RuntimeError: If the runtime is not installed or not found, or the TrainJob could not
                be created (a cluster).
        """
        return super().train(runtime, initializer, trainer, options)

    def list_jobs(self, runtime: kf.Runtime | None = None) -> list[kf.TrainJob]:
        """The TrainJobs, oldest first (of ``runtime`` only, if given).

        Raises:
            TimeoutError: If the API server did not answer in time (a cluster).
            RuntimeError: If the listing failed (a cluster).
        """
        return super().list_jobs(runtime)

    def get_job(self, name: str) -> kf.TrainJob:
        """The TrainJob ``name``, with its steps, progress and failure message.

        Raises:
            NotFoundError: If the local backend has no job ``name`` (``.name``).
            TimeoutError: If the API server did not answer in time (a cluster).
            RuntimeError: If there is no such TrainJob, or getting it failed (a cluster).
        """
        return super().get_job(name)

    def get_job_logs(
        self, name: str, step: str = kc.NODE + "-0", follow: bool | None = False
    ) -> Iterator[str]:
        """The log lines of one step of the job (``node-0``, ``dataset-initializer``, ...).

        Raises:
            NotFoundError: If the local backend has no job ``name``, or the job no step
                ``step`` (``.available``: its steps).
            TimeoutError: If the API server did not answer in time (a cluster).
            RuntimeError: If the logs could not be read (a cluster).
        """
        return super().get_job_logs(name, step, follow)

    def get_job_events(self, name: str) -> list[kf.Event]:
        """The job's events: on the local backend each step's start and end.

        Raises:
            NotFoundError: If the local backend has no job ``name``.
            TimeoutError: If the API server did not answer in time (a cluster).
            RuntimeError: If the events could not be read (a cluster).
        """
        return super().get_job_events(name)

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
        on a cluster whose trainer reported no progress, that it is unavailable, and why).

        Raises:
            ValueError: If ``status``, ``timeout`` or ``polling_interval`` is not valid.
            NotFoundError: If the local backend has no job ``name``.
            RuntimeError: If the job ended Failed (or Stopped) instead, with its message, or
                getting it failed (a cluster).
            GangNotPlaced: If a gang-scheduled job could not be placed whole in time (a
                ``TimeoutError``; a cluster).
            TimeoutError: If ``timeout`` passed first.
        """
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
        and the workspace kept, if any, is returned.

        Raises:
            NotFoundError: If the local backend has no job ``name``.
            ConflictError: If the local job runs in the foreground of ``tunepack train --local``.
            TimeoutError: If the API server did not answer in time (a cluster).
            RuntimeError: If the deletion failed (a cluster).
        """
        if keep_workspace is None:
            return self.backend.delete_job(name)
        return self.backend.delete_job(name, keep_workspace=keep_workspace)

    def plot_loss(self, name: str):
        """Plot the training loss per step (matplotlib; local jobs read ``metrics.jsonl``).

        Raises:
            NotFoundError: If the local backend has no job ``name``.
            NotAvailableError: If the metrics are not readable from here (a cluster's are on
                the job's volume), or the backend is the SDK's.
            ValueError: If the job has no metrics yet.
            ImportError: If matplotlib is not installed.
        """
        return notebook_progress.plot_loss(self._tunepack_backend().metrics(name), title=name)

    def result(self, name: str) -> Result:
        """Where the job's adapter or model is, with a loader for a quick generation.

        Raises:
            ValueError: If the job is not Complete (failed, still running or stopped), saying
                why.
            NotFoundError: If the local backend has no job ``name``.
            NotAvailableError: If the backend is the SDK's.
            RuntimeError: If getting the job failed (a cluster).
        """
        return self._tunepack_backend().result(name)

    def _tunepack_backend(self) -> TunepackBackend:
        if not isinstance(self.backend, TunepackBackend):
            raise NotAvailableError(
                f"{type(self.backend).__name__} is the Kubeflow SDK's backend: results and "
                "metrics are tunepack's, on TrainingClient(LocalBackendConfig()) or a cluster"
            )
        return self.backend
