"""tunepack's additions to the Kubeflow SDK's types (``kubeflow.trainer.types``).

``TunepackRuntime`` and ``TrainJob`` subclass the SDK's dataclasses, so code written for
``TrainerClient`` (``runtime.name``, ``job.status``, ``job.steps``) keeps working; the extra fields
carry what a fine-tune needs: the catalog model and methods, progress, and why a job failed.
"""

from __future__ import annotations

import html
from dataclasses import dataclass

from kubeflow.trainer.types import types as kf

from tunepack.runtimes import catalog

COLUMNS = ("name", "model", "methods", "parameters", "default_gpus", "description")


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


@dataclass
class TunepackRuntime(kf.Runtime):
    """A runtime, with the catalog's facts when it is a tunepack runtime."""

    model: str | None = None
    methods: tuple[str, ...] = ()
    parameters: int | None = None
    default_gpus: int | None = None
    description: str = ""

    @classmethod
    def wrap(cls, runtime: kf.Runtime) -> TunepackRuntime:
        """Add the catalog's facts to an SDK ``Runtime`` (unchanged when not tunepack's)."""
        extra: dict = {}
        if runtime.name.startswith(catalog.RUNTIME_PREFIX):
            key = runtime.name.removeprefix(catalog.RUNTIME_PREFIX)
            entry = catalog.CATALOG.get(key)
            if entry is not None:
                extra = {
                    "model": entry.name,
                    "methods": entry.methods,
                    "parameters": None if entry.custom else entry.parameter_count,
                    "default_gpus": entry.resources.gpus,
                    "description": entry.description,
                }
        return cls(
            name=runtime.name,
            trainer=runtime.trainer,
            kind=runtime.kind,
            pretrained_model=runtime.pretrained_model,
            **extra,
        )

    def __eq__(self, other):
        """Equal to the SDK's ``Runtime`` (or another ``TunepackRuntime``) that describes the same
        runtime: the catalog's extra fields are derived from the name, so they are not compared."""
        if not isinstance(other, kf.Runtime):
            return NotImplemented
        fields = ("name", "trainer", "kind", "pretrained_model")
        return all(getattr(self, f) == getattr(other, f) for f in fields)

    __hash__ = None  # as the SDK's Runtime (a mutable dataclass)

    def row(self) -> dict:
        return {
            "name": self.name,
            "model": self.model or "",
            "methods": ",".join(self.methods),
            "parameters": _count(self.parameters) if self.parameters else "",
            "default_gpus": "" if self.default_gpus is None else self.default_gpus,
            "description": self.description,
        }


class RuntimeList(list):
    """A list of runtimes that shows as a table in Jupyter (and converts to pandas).

    >>> client.list_runtimes()                      # an HTML table in a notebook
    >>> pandas.DataFrame(client.list_runtimes().rows())
    """

    def rows(self) -> list[dict]:
        return [
            TunepackRuntime.wrap(r).row() if not isinstance(r, TunepackRuntime) else r.row()
            for r in self
        ]

    def _repr_html_(self) -> str:
        head = "".join(f"<th>{html.escape(c)}</th>" for c in COLUMNS)
        body = "".join(
            "<tr>" + "".join(f"<td>{html.escape(str(row[c]))}</td>" for c in COLUMNS) + "</tr>"
            for row in self.rows()
        )
        return f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"

    def __str__(self) -> str:
        rows = [[str(r[c]) for c in COLUMNS] for r in self.rows()]
        widths = [max(len(x) for x in col) for col in zip(COLUMNS, *rows, strict=False)]
        lines = [
            "  ".join(v.ljust(w) for v, w in zip(line, widths, strict=True)).rstrip()
            for line in [list(COLUMNS), *rows]
        ]
        return "\n".join(lines)


@dataclass
class Progress:
    """Training progress, from the TrainJob's ``trainerStatus`` or a local ``metrics.jsonl``."""

    percent: int | None = None
    step: int | None = None
    total_steps: int | None = None
    loss: float | None = None
    estimated_remaining_seconds: int | None = None
    val_loss: float | None = None  # the latest validation loss (runs with val_fraction)
    val_perplexity: float | None = None


@dataclass
class TrainJob(kf.TrainJob):
    """The SDK's ``TrainJob`` plus a failure ``message`` and training ``progress``."""

    message: str | None = None
    progress: Progress | None = None


def _count(n: int) -> str:
    for div, unit in ((1e9, "B"), (1e6, "M"), (1e3, "K")):
        if n >= div:
            return f"{n / div:.2f}{unit}"
    return str(n)
