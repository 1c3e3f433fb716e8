"""The local optimizer backend: Optuna studies whose trials are the local backend's TrainJobs."""

from tunepack.optimizer.local.backend import LocalOptimizerBackend

__all__ = ["LocalOptimizerBackend"]
