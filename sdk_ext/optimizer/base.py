"""``OptimizerBackend``: what ``tunepack.OptimizerClient`` drives, one interface for both
backends (``local/``: an Optuna study on this machine; ``kubernetes/``: a Katib Experiment), as
the Kubeflow SDK's optimizer has ``backends.base.RuntimeBackend``. What does not depend on where
the trials run is here once: a search is prepared (``template.prepare``) then submitted, and a
trial's log, the best trial, the wait and the result are read from ``get_job``."""

from __future__ import annotations

import abc
import time
from collections.abc import Iterator

from tunepack.core.errors import NotFoundError
from tunepack.optimizer import space as spaces
from tunepack.optimizer.template import Template
from tunepack.optimizer.types import OptimizationJob, Result

CREATED, RUNNING, COMPLETE, FAILED = "Created", "Running", "Complete", "Failed"


class OptimizerBackend(abc.ABC):
    """An optimization job's life on one backend. ``trainer`` is the backend's TrainingClient
    backend (each trial is one of its TrainJobs)."""

    # The statuses a job has here, and those it ends in without reaching what was waited for.
    STATUSES: frozenset[str] = frozenset({CREATED, RUNNING, COMPLETE, FAILED})
    ENDED: frozenset[str] = frozenset({FAILED})

    trainer: object

    @abc.abstractmethod
    def prepare(self, trial_template: object, **asked) -> tuple[Template, spaces.Space]:
        """The template and the search, checked; ``BadInputError`` before anything is made."""

    @abc.abstractmethod
    def submit(self, template: Template, space: spaces.Space) -> str:
        """Start the prepared search; its name."""

    @abc.abstractmethod
    def get_job(self, name: str) -> OptimizationJob: ...

    @abc.abstractmethod
    def list_jobs(self) -> list[OptimizationJob]: ...

    @abc.abstractmethod
    def get_best_results(self, name: str) -> Result | None: ...

    @abc.abstractmethod
    def delete_job(self, name: str) -> None: ...

    @abc.abstractmethod
    def trial_logs(self, trial: str, follow: bool) -> Iterator[str]:
        """The trainer's output of the trial whose TrainJob is ``trial``."""

    def optimize(
        self,
        trial_template,
        *,
        search_space,
        trial_config=None,
        objectives=None,
        algorithm=None,
        early_stopping=None,
    ) -> str:
        template, space = self.prepare(
            trial_template,
            search_space=search_space,
            trial_config=trial_config,
            objectives=objectives,
            algorithm=algorithm,
            early_stopping=early_stopping,
        )
        return self.submit(template, space)

    def best_trial(self, name: str) -> str:
        """The best finished trial's TrainJob (``NotFoundError`` while there is none)."""
        job = self.get_job(name)
        if job.best_trial is None:
            raise NotFoundError(
                f"optimization {name!r} has no finished trial yet ({job.status}"
                + (f": {job.message}" if job.message else "")
                + ")",
                what="finished trial",
                name=name,
            )
        return job.best_trial

    def get_job_logs(
        self, name: str, trial_name: str | None = None, follow: bool = False
    ) -> Iterator[str]:
        """A trial's trainer log: ``trial_name``'s, else the best trial's, else the first's."""
        job = self.get_job(name)
        names = [t.name for t in job.trials]
        if trial_name is None:
            trial_name = job.best_trial or (names[0] if names else None)
        if trial_name is None:
            return iter(())
        if trial_name not in names:
            raise NotFoundError(
                f"optimization {name!r} has no trial {trial_name!r}; its trials are "
                f"{', '.join(names) or 'none yet'}",
                what="trial",
                name=trial_name,
                available=names,
            )
        return self.trial_logs(trial_name, follow)

    def wait_for_job_status(
        self,
        name: str,
        status: set[str] = {COMPLETE},  # noqa: B006 (the SDK's signature)
        timeout: int = 3600,
        polling_interval: int = 2,
        callbacks=None,
    ) -> OptimizationJob:
        if not set(status) <= self.STATUSES:
            raise ValueError(f"Expected status {status} must be a subset of {set(self.STATUSES)}")
        deadline = time.monotonic() + timeout
        while True:
            job = self.get_job(name)
            for callback in callbacks or []:
                callback(job)
            if job.status in status:
                return job
            if job.status in self.ENDED:
                raise RuntimeError(
                    f"OptimizationJob {name} is {job.status}"
                    + (f": {job.message}" if job.message else "")
                )
            if time.monotonic() >= deadline:
                raise TimeoutError(f"Timeout waiting for OptimizationJob {name} to reach {status}")
            time.sleep(polling_interval)

    def result(self, name: str, trial_name: str | None = None):
        """The best trial's (or ``trial_name``'s) result, as ``TrainingClient.result`` gives it."""
        return self.trainer.result(trial_name or self.best_trial(name))
