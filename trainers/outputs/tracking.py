"""Experiment tracking: metrics sent to TensorBoard, MLflow or W&B (docs/trainer.md,
"Experiment tracking").

``tracker=`` names one entry of a fixed allowlist mapped here to torchtune's metric logger, so
user input never names a Python object. A tracker is a bystander: when it fails the run prints
one warning line and trains on without it.
"""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Mapping
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

from tunepack.runtimes.args import TRACKERS

log = logging.getLogger("tunepack.trainer")

# MLflow's client retries a refused connection for minutes by default; a tracker must not hold
# up training, so a down server fails fast (unless the user's environment says otherwise).
_MLFLOW_FAIL_FAST = {"MLFLOW_HTTP_REQUEST_MAX_RETRIES": "0", "MLFLOW_HTTP_REQUEST_TIMEOUT": "10"}


def _open_tensorboard(settings: Mapping) -> object:
    from torchtune.training.metric_logging import TensorBoardLogger

    return TensorBoardLogger(log_dir=str(settings["log_dir"]), organize_logs=False)


def _open_mlflow(settings: Mapping) -> object:
    for key, value in _MLFLOW_FAIL_FAST.items():
        os.environ.setdefault(key, value)
    from torchtune.training.metric_logging import MLFlowLogger

    return MLFlowLogger(
        experiment_name=str(settings["project"]),
        tracking_uri=str(settings["uri"]) or None,
        run_name=str(settings.get("run_name") or "") or None,
    )


def _open_wandb(settings: Mapping) -> object:
    from torchtune.training.metric_logging import WandBLogger

    return WandBLogger(
        project=str(settings["project"]),
        log_dir=str(settings["log_dir"]),
        name=str(settings.get("run_name") or "") or None,
    )


_OPENERS = {"tensorboard": _open_tensorboard, "mlflow": _open_mlflow, "wandb": _open_wandb}


def _tensorboard_run(logger) -> dict:
    return {"log_dir": str(logger.log_dir)}


def _mlflow_run(logger) -> dict:
    import mlflow

    run = mlflow.active_run()  # the run the logger started
    # MLFLOW_TRACKING_URI may carry credentials (user:password@host): never recorded.
    parts = urlsplit(mlflow.get_tracking_uri())
    uri = urlunsplit(parts._replace(netloc=parts.netloc.rpartition("@")[2]))
    record = {"tracking_uri": uri, "run_id": run.info.run_id}
    if uri.startswith(("http://", "https://")):  # the MLflow UI's page of the run
        base = uri.rstrip("/")
        record["run_url"] = f"{base}/#/experiments/{run.info.experiment_id}/runs/{run.info.run_id}"
    return record


def _wandb_run(logger) -> dict:
    import wandb

    run = wandb.run
    # Offline (WANDB_MODE=offline) a run has no page until `wandb sync` uploads its directory.
    return {"run_url": run.url or None, "run_dir": str(Path(run.dir).parent)}


_RECORDERS = {"tensorboard": _tensorboard_run, "mlflow": _mlflow_run, "wandb": _wandb_run}


class Tracker:
    """Rank 0's tracker; every call is a no-op after the first failure (one warning line)."""

    def __init__(self, kind: str, logger: object | None) -> None:
        self.kind, self._logger = kind, logger
        # Where the tool has the run (result.json's "tracker"): the summary and Result point there.
        self.record: dict | None = None

    @classmethod
    def open(cls, settings: Mapping | None, *, is_main: bool) -> Tracker:
        kind = str((settings or {}).get("kind", "none"))
        if kind not in TRACKERS:  # the argument parser refused it already: a tunepack bug
            raise RuntimeError(f"unknown tracker {kind!r}")
        if kind == "none" or not is_main:
            return cls(kind, None)
        tracker = cls(kind, None)
        try:
            tracker._logger = _OPENERS[kind](settings)
        except ImportError as err:
            tracker._warn(f"the {kind} package is not installed ({err.name})")
        except Exception as err:  # noqa: BLE001 - any tracker failure is only a warning
            tracker._warn(_describe(err))
        if tracker.active:
            try:
                tracker.record = {"kind": kind, **_RECORDERS[kind](tracker._logger)}
            except Exception:  # noqa: BLE001 - only the pointer is missing; tracking goes on
                tracker.record = {"kind": kind}
        return tracker

    @property
    def active(self) -> bool:
        return self._logger is not None

    def log(self, metrics: Mapping[str, float], step: int) -> None:
        if self._logger is None:
            return
        try:
            self._logger.log_dict(dict(metrics), step=step)
        except Exception as err:  # noqa: BLE001
            self._warn(_describe(err))

    def close(self) -> None:
        logger, self._logger = self._logger, None
        if logger is None:
            return
        try:
            logger.close()
        except Exception as err:  # noqa: BLE001
            _warn_line(self.kind, _describe(err))

    def _warn(self, why: str) -> None:
        self._logger = None
        _warn_line(self.kind, why)


def _describe(err: BaseException) -> str:
    text = " ".join(str(err).split()) or type(err).__name__
    return text[:300]


def _warn_line(kind: str, why: str) -> None:
    try:
        print(
            f"trainer: warning: tracker={kind} is unavailable ({why}); training goes on without it",
            file=sys.stderr,
            flush=True,
        )
    except (OSError, ValueError):
        pass
