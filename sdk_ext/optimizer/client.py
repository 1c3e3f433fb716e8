"""``OptimizerClient``: the Kubeflow SDK's ``kubeflow.optimizer.OptimizerClient`` for tunepack
runtimes, as ``TrainingClient`` is its ``TrainerClient``.

The same methods, arguments and result types; the trial template's trainer is tunepack's
``FineTune``, the search space's keys are its trainer arguments, and on the local backend the
trials are local TrainJobs run on an Optuna study (docs/optimize.md).

    >>> from tunepack import OptimizerClient, LocalBackendConfig, FineTune, Initializer
    >>> from tunepack import TrainJobTemplate, Search, TrialConfig, Objective
    >>> client = OptimizerClient(LocalBackendConfig())
    >>> name = client.optimize(
    ...     trial_template=TrainJobTemplate(
    ...         runtime="tunepack-tiny-llama3",
    ...         trainer=FineTune(method="lora", val_fraction=0.1),
    ...         initializer=Initializer(dataset="file:///data/train.jsonl",
    ...                                 model="file:///models/tiny-llama3"),
    ...     ),
    ...     search_space={"lr": Search.loguniform(1e-5, 1e-3),
    ...                   "lora_rank": Search.choice([8, 16, 32])},
    ...     trial_config=TrialConfig(num_trials=8),
    ... )
    >>> client.wait_for_job_status(name, progress=True)
    >>> client.get_best_results(name).parameters"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from kubeflow.common.types import KubernetesBackendConfig
from kubeflow.optimizer import OptimizerClient as _SdkOptimizerClient
from kubeflow.optimizer.types.optimization_types import Objective, TrialConfig
from kubeflow.trainer.types.types import Event, TrainJobTemplate

from tunepack.backends.local import LocalBackendConfig
from tunepack.core.errors import BadValueError
from tunepack.optimizer.local.record import COMPLETE
from tunepack.optimizer.space import MedianStop
from tunepack.optimizer.types import OptimizationJob, Result
from tunepack.runtimes.planner import DEFAULT_GPU, DEFAULT_MEMORY_CHECK, MemoryCheck


class OptimizerClient(_SdkOptimizerClient):
    """A Kubeflow Optimizer client that knows tunepack runtimes.

    Args:
        backend_config: tunepack's ``LocalBackendConfig`` (trials run on this machine, on an
            Optuna study) or ``KubernetesBackendConfig`` (the default, as the SDK's: a Katib
            v1beta1 Experiment whose trials are TrainJobs).
        gpu, memory_check: the GPU the cluster's trials are planned for, as
            ``TrainingClient``'s (the local backend's config has its own).

    Raises:
        BadValueError: If the backend config is of another kind, or ``gpu`` or
            ``memory_check`` is not one the planner knows (a cluster).
        NotAvailableError: If Optuna, which runs the local trials, is not installed.
    """

    def __init__(
        self,
        backend_config: LocalBackendConfig | KubernetesBackendConfig | None = None,
        gpu: str = DEFAULT_GPU,
        memory_check: MemoryCheck = DEFAULT_MEMORY_CHECK,
    ):
        if isinstance(backend_config, LocalBackendConfig):
            from tunepack.optimizer.local import LocalOptimizerBackend

            self.backend = LocalOptimizerBackend(backend_config)
        elif backend_config is None or isinstance(backend_config, KubernetesBackendConfig):
            from tunepack.optimizer.kubernetes import KubernetesOptimizerBackend

            self.backend = KubernetesOptimizerBackend(
                backend_config or KubernetesBackendConfig(), gpu, memory_check
            )
        else:
            raise BadValueError(
                "backend_config must be LocalBackendConfig() or KubernetesBackendConfig(), got "
                f"{type(backend_config).__name__}"
            )

    def optimize(
        self,
        trial_template: TrainJobTemplate,
        *,
        trial_config: TrialConfig | None = None,
        search_space: dict,
        objectives: list[Objective] | None = None,
        algorithm=None,
        early_stopping: MedianStop | None = None,
    ) -> str:
        """Start a hyperparameter search: trials of ``trial_template`` with the values drawn
        from ``search_space``. The same call again resumes it (its name is the call's).

        Args:
            trial_template: ``TrainJobTemplate(runtime=, trainer=FineTune(...), initializer=)``.
            trial_config: trials in all, at once (GPUs allowing), failures allowed.
            search_space: trainer arguments to ``Search.loguniform/uniform/choice``.
            objectives: metrics the trainer reports (default: ``val_loss`` where the template
                holds out rows, else ``loss``; minimised).
            algorithm: ``RandomSearch()`` (default), ``GridSearch()`` or ``TPESearch()``.
            early_stopping: ``MedianStop(...)`` to stop trials worse than the median.

        Returns:
            The OptimizationJob's name.

        Raises:
            UnknownKeyError: If a ``search_space`` key is not a trainer argument (``.key``,
                ``.suggestions``).
            UnknownRuntimeError: If the local backend has no such runtime.
            BadValueError: If a value, metric, count or algorithm setting is refused.
            ConflictError: If settings disagree (a grid search over a range, early stopping
                of a template that evaluates only at its end), or the cluster's namespace would
                report no metric of the trials.
            UnsupportedError: If an argument is not searched, no trial would report the
                objective's metric, or the algorithm or early stopping is not one tunepack runs.
            DoesNotFitError: If the planner says a trial cannot fit in GPU memory.
            NotAvailableError: If the cluster has no Katib, or ``early_stopping`` is asked of a
                cluster.
            WorkspaceBusyError: If the same search is running.
            RuntimeError: If the runtime is not installed, or the OptimizationJob could not be
                created (a cluster).

        All of these but the last are refused, in one line, before anything is created; the
        bad-input ones are ``BadInputError``, also a ``ValueError``, as the SDK raises.
        """
        return self.backend.optimize(
            trial_template,
            search_space=search_space,
            trial_config=trial_config,
            objectives=objectives,
            algorithm=algorithm,
            early_stopping=early_stopping,
        )

    def list_jobs(self) -> list[OptimizationJob]:
        """The OptimizationJobs of this backend, oldest first.

        Raises:
            RuntimeError: If the listing failed (a cluster).
        """
        return self.backend.list_jobs()

    def get_job(self, name: str) -> OptimizationJob:
        """The OptimizationJob ``name`` with its trials.

        Raises:
            NotFoundError: If there is no such job (``.name``).
            RuntimeError: If getting it or its trials failed (a cluster).
        """
        return self.backend.get_job(name)

    def get_job_logs(
        self, name: str, trial_name: str | None = None, follow: bool = False
    ) -> Iterator[str]:
        """A trial's trainer log (default: the best trial's, else the first's).

        Raises:
            NotFoundError: If there is no such job, or no trial ``trial_name`` (``.available``:
                its trials).
        """
        return self.backend.get_job_logs(name, trial_name=trial_name, follow=follow)

    def get_best_results(self, name: str) -> Result | None:
        """The best finished trial's parameters and metrics (None while there is none).

        Raises:
            NotFoundError: If there is no such job.
        """
        return self.backend.get_best_results(name)

    def wait_for_job_status(
        self,
        name: str,
        status: set[str] = {COMPLETE},  # noqa: B006 (the SDK's signature)
        timeout: int = 3600,
        polling_interval: int = 2,
        callbacks: list[Callable[[OptimizationJob], None]] | None = None,
        progress: bool = False,
    ) -> OptimizationJob:
        """As the SDK's; ``progress=True`` also shows a bar of the finished trials.

        Raises:
            ValueError: If ``status`` is not a subset of the job's statuses.
            NotFoundError: If there is no such job.
            RuntimeError: If the job ended Failed or Stopped instead.
            TimeoutError: If ``timeout`` passed first.
        """
        callbacks = list(callbacks or [])
        bar = _TrialsBar(name) if progress else None
        if bar:
            callbacks.append(bar.update)
        try:
            return self.backend.wait_for_job_status(
                name, set(status), timeout, polling_interval, callbacks
            )
        finally:
            if bar:
                bar.close()

    def delete_job(self, name: str):
        """Stop the job, delete its trials' TrainJobs and its record.

        Raises:
            NotFoundError: If there is no such job.
            RuntimeError: If the deletion failed (a cluster).
        """
        return self.backend.delete_job(name)

    def get_job_events(self, name: str) -> list[Event]:
        """The trials' steps' starts and ends, in time order.

        Raises:
            NotFoundError: If there is no such job.
            RuntimeError: If the events could not be read (a cluster).
        """
        return self.backend.get_job_events(name)

    def result(self, name: str, trial_name: str | None = None):
        """The best trial's (or ``trial_name``'s) adapter or model, as ``TrainingClient.result``
        gives any job's (``tunepack.types.Result``: ``path``, ``generate()``, ...).

        Raises:
            NotFoundError: If there is no such job, no trial ``trial_name``, or no finished
                trial yet.
            ValueError: If the trial's TrainJob is not Complete, saying why.
        """
        return self.backend.result(name, trial_name)

    def plot(self, name: str):
        """The objective of each finished trial against its number, with the best so far
        (matplotlib).

        Raises:
            NotFoundError: If there is no such job.
            ValueError: If no trial has finished yet.
            ImportError: If matplotlib is not installed.
        """
        job = self.get_job(name)
        done = [t for t in job.trials if t.objective is not None]
        if not done:
            raise ValueError(f"no finished trial yet in {name}")
        try:
            import matplotlib.pyplot as plt
        except ImportError:
            raise ImportError(
                "plot needs matplotlib: pip install matplotlib (get_job(name).trials has the "
                "figures without it)"
            ) from None
        goal = job.objectives[0]
        better = min if goal.direction.value == "minimize" else max
        best, line = None, []
        for t in done:
            best = t.objective if best is None else better(best, t.objective)
            line.append(best)
        fig, ax = plt.subplots(figsize=(6, 3.5))
        ax.plot([t.number for t in done], [t.objective for t in done], "o", label="trial")
        ax.plot([t.number for t in done], line, label="best so far")
        ax.set_xlabel("trial")
        ax.set_ylabel(goal.metric)
        ax.set_title(name)
        ax.legend()
        fig.tight_layout()
        return fig


class _TrialsBar:
    """A progress bar of finished trials (tqdm.auto: the Jupyter widget in a notebook)."""

    def __init__(self, name: str):
        from tqdm.auto import tqdm

        self.bar = tqdm(total=None, desc=name, unit="trial")

    def update(self, job: OptimizationJob) -> None:
        finished = sum(t.state not in ("Running", "Stopped") for t in job.trials)
        self.bar.total = job.trial_config.num_trials
        self.bar.n = finished
        if job.best_trial:
            best = next(t for t in job.trials if t.name == job.best_trial)
            self.bar.set_postfix_str(f"best {job.objectives[0].metric} {best.objective:.4f}")
        self.bar.refresh()

    def close(self) -> None:
        self.bar.close()
