"""What the commands print besides their one-line messages: tables, a job's progress line, the end
of a ``train --local`` run, and tunepack's own log records on the console."""

from __future__ import annotations

import json
import logging
import sys
from pathlib import Path


def table(rows: list[list[str]], header: list[str]) -> str:
    widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(len(header))]
    lines = [
        "  ".join(str(c).ljust(w) for c, w in zip(row, widths, strict=True))
        for row in [header, *rows]
    ]
    return "\n".join(line.rstrip() for line in lines)


def count(n: int) -> str:
    for div, unit in ((1e9, "B"), (1e6, "M"), (1e3, "K")):
        if n >= div:
            return f"{n / div:.2f}{unit}"
    return str(n)


def percent(job) -> str:
    """A job's progress in ``tunepack jobs``: its percentage, or ``-`` where none was reported
    (``tunepack status`` says why)."""
    progress = getattr(job, "progress", None)
    return f"{progress.percent}%" if progress and progress.percent is not None else "-"


def progress_line(p, finished: bool) -> str:
    """``40%  loss 1.2345  val_loss 1.5000  812 tokens/s  eta 1m05s`` (no eta once finished)."""
    line = f"{p.percent}%"
    if p.loss is not None:
        line += f"  loss {p.loss:.4f}"
    if p.val_loss is not None:
        line += f"  val_loss {p.val_loss:.4f}"
    if p.reward is not None:
        line += f"  reward {p.reward:.3f}"
    if p.tokens_per_second is not None:
        line += f"  {p.tokens_per_second:.0f} tokens/s"
    if p.estimated_remaining_seconds is not None and not finished:
        line += f"  eta {duration(p.estimated_remaining_seconds)}"
    return line


def duration(seconds: int) -> str:
    minutes, s = divmod(int(seconds), 60)
    hours, m = divmod(minutes, 60)
    return f"{hours}h{m:02d}m" if hours else f"{m}m{s:02d}s" if m else f"{s}s"


def print_nothing_to_do(
    name: str, workspace: Path, export: str | None, jobs_dir: str | None, exported: bool = False
) -> None:
    """The end of a re-run whose trainer found its result complete: nothing trained, and the
    logs are still those of the run that did (``run_job`` put them back); ``exported``: but the
    exporter sent the result (its log is this run's)."""
    from tunepack.core.workspace import result_file

    result = json.loads(result_file(workspace).read_text())
    where = f" --jobs-dir {jobs_dir}" if jobs_dir else ""
    print()
    if exported:
        print(f"tunepack: job {name} had already trained; its result was exported")
    else:
        print(f"tunepack: job {name} already finished; nothing to do")
    print(f"  result      {result['artifact']}")
    if export:
        print(f"  exported    {export} (tunepack download {name} DIR)")
    this = "; --step exporter: this export's" if exported else ""
    print(f"  logs        tunepack logs {name} --local{where} (of the run that trained{this})")


def print_summary(
    name: str, runtime: str, workspace: Path, elapsed: float, export: str | None = None
) -> None:
    from tunepack.core.workspace import result_file
    from tunepack.runtimes import methods
    from tunepack.types import tracker_pointer

    result = json.loads(result_file(workspace).read_text())
    print()
    print("tunepack: training finished")
    print(f"  job         {name}")
    print(f"  runtime     {runtime}")
    print(f"  method      {result['method']}")
    print(f"  steps       {result['steps']}")
    first, last = result["first_loss"], result["final_loss"]
    print(f"  loss        {first:.4f} (first step) -> {last:.4f} (last step)")
    # A method with a loss of its own records its last step's metrics under the loss's name
    # (trainers/outputs/artifacts.py): dpo, orpo, kto, grpo.
    section = result.get(methods.get(result["method"]).loss.value) or {}
    if "reward_margin" in section:  # dpo, orpo, kto: whether it prefers the right answers
        print(
            f"  rewards     margin {section['reward_margin']:.4f}, accuracy "
            f"{section['reward_accuracy']:.2f} (last step)"
        )
    if "reward_mean" in section:  # grpo, grpo_full: how its answers score
        print(
            f"  rewards     {section['reward_mean']:.3f} mean, {section['reward_std']:.3f} std, "
            f"answers {section['completion_length']:.1f} tokens (last step; every step in "
            "metrics.jsonl)"
        )
    if result.get("val_loss") is not None:
        kept = ", published" if result.get("keep_best") else ""
        print(
            f"  val loss    {result['val_loss']:.4f} (last step); best "
            f"{result['best_val_loss']:.4f} at step {result['best_step']}{kept}"
        )
    print(f"  elapsed     {elapsed:.1f} s")
    print(f"  result      {result['artifact']}")
    if export:
        print(f"  exported    {export} (tunepack download {name} DIR)")
    print(f"  logs        {workspace / 'logs'}")
    if pointer := tracker_pointer(result.get("tracker")):
        print(f"  tracker     {pointer}")


class _ConsoleHandler(logging.Handler):
    """tunepack's own warnings (a memory plan passed with --memory-check warn, ...) on the
    console, as ``tunepack: warning: ...``; info messages too with --verbose."""

    def emit(self, record: logging.LogRecord) -> None:
        level = "" if record.levelno < logging.WARNING else f"{record.levelname.lower()}: "
        try:
            print(f"tunepack: {level}{record.getMessage()}", file=sys.stderr, flush=True)
        except (OSError, ValueError):
            pass  # no console left to say it on


def console_logging(verbose: bool = False) -> None:
    logger = logging.getLogger("tunepack")
    if not any(isinstance(h, _ConsoleHandler) for h in logger.handlers):
        logger.addHandler(_ConsoleHandler())
    logger.setLevel(logging.INFO if verbose else logging.WARNING)
