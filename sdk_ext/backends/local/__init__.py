"""tunepack's local backend: TrainJobs as processes on this machine (``backend``), run step by
step by its executor (``steps``)."""

from tunepack.backends.local.backend import (
    LocalBackend,
    LocalBackendConfig,
    read_progress,
    run_job,
    runner_main,
    update_state,
)

__all__ = [
    "LocalBackend",
    "LocalBackendConfig",
    "read_progress",
    "run_job",
    "runner_main",
    "update_state",
]
