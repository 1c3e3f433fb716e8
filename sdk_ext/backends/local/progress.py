"""A local job's progress, read from the trainer's ``metrics.jsonl`` (a cluster's comes from the
TrainJob's ``trainerStatus`` instead)."""

from __future__ import annotations

import json
from pathlib import Path

from tunepack.types import Progress


def read_progress(metrics: Path) -> Progress | None:
    """Progress from the trainer's ``metrics.jsonl``: the last step record (one per optimizer
    step) and the last evaluation record (runs with a validation split)."""
    if not metrics.exists():
        return None
    last: dict[str, dict] = {}
    for line in metrics.read_text().splitlines():
        try:
            record = json.loads(line)
        except ValueError:
            continue  # a line being written
        if isinstance(record, dict) and record.get("event") in ("step", "eval"):
            last[record["event"]] = record
    if "step" not in last:
        return None
    step, total = last["step"].get("step"), last["step"].get("total_steps")
    evaluation = last.get("eval", {})
    return Progress(
        percent=int(100 * step / total) if step and total else None,
        step=step,
        total_steps=total,
        loss=last["step"].get("loss"),
        val_loss=evaluation.get("val_loss"),
        val_perplexity=evaluation.get("val_perplexity"),
        tokens_per_second=last["step"].get("tokens_per_second"),
        reward=last["step"].get("reward_mean"),
    )
