"""Progress bars and loss plots for notebooks (tqdm.auto picks the Jupyter widget)."""

from __future__ import annotations

import json
from pathlib import Path

# Why a cluster job that finished shows no progress (``tunepack status``, the progress bar).
NO_TRAINER_STATUS = (
    "the TrainJob has no status.trainerStatus (the Kubeflow Trainer's TrainJobStatus feature "
    "gate is off, or the trainer never reached its status server)"
)


class ProgressBar:
    """A bar of a job's optimizer steps (``12/40 step``), with the latest training and validation
    loss; use as a wait callback. Where a job reports only a percentage (a cluster's
    ``trainerStatus``), the bar counts percent. ``reported``: whether any progress came."""

    def __init__(self, name: str):
        from tqdm.auto import tqdm

        self.bar = tqdm(total=None, desc=name, unit="step")
        self.shown = 0
        self.reported = False

    def update(self, job) -> None:
        progress = getattr(job, "progress", None)
        self.reported = self.reported or progress is not None
        done = None
        if progress and progress.total_steps:
            self._total(progress.total_steps, "step")
            done = progress.step
        elif progress and progress.percent is not None:
            self._total(100, "%")
            done = progress.percent
        if job.status == "Complete" and self.bar.total:
            done = self.bar.total
        if done is not None and done > self.shown:
            self.bar.update(done - self.shown)
            self.shown = done
        postfix = {}
        if progress and progress.loss is not None:
            postfix["loss"] = f"{progress.loss:.4f}"
        if progress and progress.val_loss is not None:
            postfix["val_loss"] = f"{progress.val_loss:.4f}"
        if progress and progress.reward is not None:
            postfix["reward"] = f"{progress.reward:.3f}"
        self.bar.set_postfix(**postfix, status=job.status)

    def _total(self, total: int, unit: str) -> None:
        if self.bar.total != total or self.bar.unit != unit:
            self.bar.total, self.bar.unit = total, unit
            self.bar.refresh()

    def close(self) -> None:
        self.bar.close()


def summary_lines(result) -> list[str]:
    """What a finished job's result says under its progress bar: the losses and, when an
    experiment tracker took the run, where to look at it."""
    lines = []
    if result.final_loss is not None:
        lines.append(f"final loss {result.final_loss:.4f}")
    if result.val_loss is not None:
        best = f" (best {result.best_val_loss:.4f})" if result.best_val_loss is not None else ""
        lines.append(f"val loss {result.val_loss:.4f}{best}")
    pointer = result.tracker_line()
    if pointer:
        lines.append(f"tracker: {pointer}")
    return lines


def read_metrics(path: Path) -> list[dict]:
    if not path.exists():
        return []
    rows = []
    for line in path.read_text().splitlines():
        try:
            rows.append(json.loads(line))
        except ValueError:
            continue
    # Training steps carry "loss"; evaluations ("event": "eval") carry "val_loss".
    return [r for r in rows if ("loss" in r or "val_loss" in r) and "step" in r]


def plot_loss(rows: list[dict], title: str = ""):
    """A matplotlib figure of loss per step, or a clear message when matplotlib is missing."""
    if not rows:
        raise ValueError(f"no metrics yet for {title or 'this job'}: has training started?")
    try:
        import matplotlib.pyplot as plt
    except ImportError:
        raise ImportError(
            "plot_loss needs matplotlib: pip install matplotlib (the metrics are available "
            "without it from the job's output/metrics.jsonl)"
        ) from None
    train = [r for r in rows if "loss" in r]
    val = [r for r in rows if r.get("event") == "eval" and "val_loss" in r]
    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.plot([r["step"] for r in train], [r["loss"] for r in train], label="training loss")
    if val:
        ax.plot(
            [r["step"] for r in val],
            [r["val_loss"] for r in val],
            marker="o",
            label="validation loss",
        )
        best = min(val, key=lambda r: r["val_loss"])
        ax.annotate(f"best {best['val_loss']:.3f}", (best["step"], best["val_loss"]))
        ax.legend()
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    ax.set_title(f"loss {title}".strip())
    fig.tight_layout()
    return fig
