"""The metrics the trainer prints for Katib's StdOut collector (``name=value``) and the figures a
finished run reports (``methods.result_metrics``: the local search's objective, the trainer's
last line), read as Katib v0.19's collector reads a line: its default metrics format."""

from __future__ import annotations

import re

from tunepack.runtimes import methods

# Katib v0.19.0's default StdOut/File TEXT format (pkg/metricscollector/v1beta1/common).
KATIB_FORMAT = re.compile(r"([\w|-]+)\s*=\s*([+-]?\d*(\.\d+)?([Ee][+-]?\d+)?)")


def _katib_reads(line: str) -> dict[str, float]:
    return {m.group(1): float(m.group(2)) for m in KATIB_FORMAT.finditer(line)}


def test_a_record_is_read_back_exactly_under_katibs_names():
    record = {
        "event": "eval",
        "step": 12,
        "val_loss": 4.738040808475379,
        "val_perplexity": 114.2,
        "best_val_loss": None,
        "lr": 1e-05,
        "keep": True,
    }
    line = methods.stdout_metrics(record)
    assert line == ("step=12 eval_loss=4.738040808475379 eval_perplexity=114.2 lr=1e-05")
    assert _katib_reads(line) == {
        "step": 12.0,
        "eval_loss": 4.738040808475379,
        "eval_perplexity": 114.2,
        "lr": 1e-05,
    }


def test_a_results_figures_are_the_published_ones():
    result = {"method": "lora", "final_loss": 4.7, "val_loss": 4.9, "best_val_loss": 4.8}
    assert methods.result_metrics(result) == {"loss": 4.7, "val_loss": 4.9}
    # keep_best publishes the best step's weights: its validation loss is the run's figure.
    assert methods.result_metrics({**result, "keep_best": True})["val_loss"] == 4.8
    # No validation rows: no val_loss at all (not None, not nan).
    assert methods.result_metrics({"method": "lora", "final_loss": 4.7, "val_loss": None}) == {
        "loss": 4.7
    }


def test_a_methods_own_metrics_come_without_its_settings():
    dpo = {
        "method": "dpo",
        "final_loss": 0.6,
        "val_loss": None,
        "dpo": {"beta": 0.1, "label_smoothing": 0.0, "reward_margin": 0.25, "reward_accuracy": 1},
    }
    assert methods.result_metrics(dpo) == {
        "loss": 0.6,
        "reward_margin": 0.25,
        "reward_accuracy": 1.0,
    }
    grpo = {
        "method": "grpo",
        "final_loss": 0.1,
        "grpo": {"beta": 0.04, "rewards": ["format"], "reward_mean": 0.5, "reward_format": 0.7},
    }
    assert methods.result_metrics(grpo) == {"loss": 0.1, "reward_mean": 0.5, "reward_format": 0.7}
