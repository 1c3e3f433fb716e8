"""The result types of ``tunepack.OptimizerClient``: the Kubeflow SDK's (``kubeflow.optimizer``),
with what a tunepack trial also knows (its state, objective value and why it ended) and a table
for notebooks."""

from __future__ import annotations

import html
from dataclasses import dataclass

from kubeflow.optimizer.types.optimization_types import Metric
from kubeflow.optimizer.types.optimization_types import OptimizationJob as _Job
from kubeflow.optimizer.types.optimization_types import Result as _Result
from kubeflow.optimizer.types.optimization_types import Trial as _Trial

__all__ = ["Metric", "OptimizationJob", "Result", "Trial"]

# A trial's state, in Optuna's words as Katib's trials have them too.
TRIAL_COMPLETE, TRIAL_PRUNED, TRIAL_FAILED = "Complete", "EarlyStopped", "Failed"
TRIAL_RUNNING, TRIAL_WAITING, TRIAL_STOPPED = "Running", "Waiting", "Stopped"


@dataclass
class Trial(_Trial):
    """The SDK's ``Trial`` (name, parameters, trainjob, metrics) plus its ``state``
    (Complete, EarlyStopped, Failed, Running, Waiting, Stopped), its ``objective`` value and, for
    a failed trial, the ``message`` and ``exit_code`` of its failure (65: a value the trainer
    refuses)."""

    number: int = 0
    state: str = TRIAL_WAITING
    objective: float | None = None
    message: str | None = None
    exit_code: int | None = None


@dataclass
class Result(_Result):
    """The SDK's ``Result`` (the best ``parameters`` and their ``metrics``), and which ``trial``
    found them."""

    trial: str | None = None


@dataclass
class OptimizationJob(_Job):
    """The SDK's ``OptimizationJob`` plus a ``message`` (why it failed or stopped) and the
    ``best_trial``'s name; shown as a table of its trials in Jupyter."""

    message: str | None = None
    best_trial: str | None = None

    def rows(self) -> list[list[str]]:
        names = [p for p in self.search_space]
        goal = self.objectives[0].metric
        header = ["trial", "state", *names, goal]
        body = []
        for trial in self.trials:
            value = "" if trial.objective is None else f"{trial.objective:.4f}"
            mark = " *" if trial.name == self.best_trial else ""
            body.append(
                [
                    trial.name + mark,
                    trial.state,
                    *(trial.parameters.get(n, "") for n in names),
                    value,
                ]
            )
        return [header, *body]

    def table(self) -> str:
        rows = self.rows()
        widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
        return "\n".join(
            "  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)) for r in rows
        )

    def _repr_html_(self) -> str:
        rows = self.rows()
        head = "".join(f"<th>{html.escape(c)}</th>" for c in rows[0])
        body = "".join(
            "<tr>" + "".join(f"<td>{html.escape(c)}</td>" for c in row) + "</tr>"
            for row in rows[1:]
        )
        caption = html.escape(
            f"{self.name}: {self.status}, {len(self.trials)} of {self.trial_config.num_trials} "
            f"trials; {self.objectives[0].metric} ({self.objectives[0].direction.value})"
        )
        return f"<table><caption>{caption}</caption><tr>{head}</tr>{body}</table>"
