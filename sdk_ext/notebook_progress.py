"""Progress bars and loss plots for notebooks (tqdm.auto picks the Jupyter widget)."""

from __future__ import annotations

import json
from pathlib import Path


class ProgressBar:
    """A bar that follows a job's ``progress`` (percent); use as a wait callback."""

    def __init__(self, name: str):
        from tqdm.auto import tqdm

        self.bar = tqdm(total=100, desc=name, unit="%")
        self.shown = 0

    def update(self, job) -> None:
        progress = getattr(job, "progress", None)
        percent = progress.percent if progress and progress.percent is not None else None
        if job.status == "Complete":
            percent = 100
        if percent is not None and percent > self.shown:
            self.bar.update(percent - self.shown)
            self.shown = percent
        if progress and progress.loss is not None:
            self.bar.set_postfix(loss=f"{progress.loss:.4f}", status=job.status)
        else:
            self.bar.set_postfix(status=job.status)

    def close(self) -> None:
        self.bar.close()


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
