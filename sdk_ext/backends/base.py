"""The interface every tunepack backend implements: the Kubeflow SDK's, plus tunepack's needs.

``TrainingClient`` and the CLI call a backend only through these methods, so neither asks which
backend it has. The SDK's methods (``list_runtimes``, ``get_runtime``, ``train``, ``list_jobs``,
``get_job``, ``get_job_logs``, ``get_job_events``, ``wait_for_job_status``, ``delete_job``) keep
the SDK's signatures and meaning (``kubeflow.trainer.backends.base.RuntimeBackend``).
"""

from __future__ import annotations

import abc

from kubeflow.trainer.backends.base import RuntimeBackend
from kubeflow.trainer.constants import constants as kc


class TunepackBackend(RuntimeBackend):
    """A backend that runs tunepack runtimes (Kubernetes or local)."""

    @abc.abstractmethod
    def resolve_runtime(self, name: str):
        """The runtime ``train(runtime=name)`` uses (a ``TunepackRuntime``): a runtime of that
        name, else a catalog model's short name's runtime (said in the log), else an error that
        names close matches."""

    @abc.abstractmethod
    def workspace_of(self, name: str) -> str:
        """Where job ``name``'s steps keep their files, as a person finds it (a directory, or
        ``pvc/<claim>`` on a cluster)."""

    @property
    @abc.abstractmethod
    def location(self) -> str:
        """Where this backend's jobs are, for messages: ``under <dir>``, ``in namespace <ns>``."""

    @abc.abstractmethod
    def metrics(self, name: str) -> list[dict]:
        """Job ``name``'s per-step metrics records (``NotAvailableError`` where they cannot be
        read from here)."""

    def result(self, name: str):
        """Where the finished job's adapter or model is (a ``tunepack.notebook.Result``).
        ``ValueError`` while the job is not Complete."""
        job = self.get_job(name)
        if job.status != kc.TRAINJOB_COMPLETE:
            raise ValueError(
                f"TrainJob {name} is {job.status}, not Complete"
                + (f": {job.message}" if getattr(job, "message", None) else "")
                + "; wait_for_job_status(name) first"
            )
        return self._result(name)

    @abc.abstractmethod
    def _result(self, name: str):
        """``result`` for a job known to be Complete."""
