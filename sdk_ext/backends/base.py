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
from kubeflow.trainer.types import types as kf


def sdk_step(step: str, steps: list[str]) -> str:
    """The SDK's name of the step ``step`` names among a job's ``steps``: ``node`` (what the
    console's ``==> node:`` and ``logs/node.log`` call a one-node job's trainer) is ``node-0``
    where the job has one node; any other name is itself."""
    nodes = [s for s in steps if s.startswith(f"{kc.NODE}-")]
    return nodes[0] if step == kc.NODE and len(nodes) == 1 else step


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

    @abc.abstractmethod
    def trainjob_object(self, name: str) -> dict:
        """Job ``name``'s TrainJob as it was submitted and stored (``spec.runtimeRef``,
        ``spec.trainer.args``, ...)."""

    def result(self, name: str):
        """Where the finished job's adapter or model is (a ``tunepack.types.Result``).
        ``ValueError`` while the job is not Complete."""
        job = self.get_job(name)
        if job.status != kc.TRAINJOB_COMPLETE:
            why = f": {job.message}" if getattr(job, "message", None) else ""
            if job.status == kc.TRAINJOB_FAILED:  # waiting would give it no result
                failed = [s.name for s in job.steps or [] if s.status == kc.TRAINJOB_FAILED]
                step = f", step={failed[0]!r}" if failed else ""
                raise ValueError(
                    f"TrainJob {name} failed and has no result (its log: "
                    f"get_job_logs({name!r}{step})){why}"
                )
            if job.status in (kc.TRAINJOB_CREATED, kc.TRAINJOB_RUNNING):
                raise ValueError(
                    f"TrainJob {name} is {job.status}, not Complete{why}; "
                    "wait_for_job_status(name) first"
                )
            # Stopped: its message says how to resume it.
            raise ValueError(f"TrainJob {name} is {job.status} and has no result{why}")
        return self._result(name)

    @abc.abstractmethod
    def _result(self, name: str):
        """``result`` for a job known to be Complete."""


def builtin_torchtune_trainer(
    trainer: kf.RuntimeTrainer, command: tuple[str, ...] | None = None
) -> kf.RuntimeTrainer:
    """How a tunepack runtime is really driven, in the SDK's terms: a ``BuiltinTrainer`` of the
    ``torchtune`` framework, as the SDK reports its own torchtune runtimes.

    The runtimes' framework label stays ``torch`` (the Trainer's torch plugin sets the ``PET_*``
    variables the launcher reads; its torchtune plugin would not take tunepack's runtimes), so
    the SDK, which derives the trainer type from that label, would report a ``CustomTrainer``
    runtime, which tunepack runtimes refuse. ``command`` is the trainer container's command (the
    launcher that runs), else the one ``trainer`` carries.
    """
    builtin = kf.RuntimeTrainer(
        trainer_type=kf.TrainerType.BUILTIN_TRAINER,
        framework=kf.TORCH_TUNE,
        image=trainer.image,
        num_nodes=trainer.num_nodes,
        device=trainer.device,
        device_count=trainer.device_count,
    )
    builtin.set_command(tuple(command) if command else trainer.command)
    return builtin
