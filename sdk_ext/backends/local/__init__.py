"""tunepack's local backend: TrainJobs as processes on this machine, one module a concern.

Laid out as the Kubeflow SDK's ``backends.localprocess``; the modules: docs/architecture.md, "The
SDK" (Backends).

    >>> from tunepack import TrainingClient, LocalBackendConfig
    >>> client = TrainingClient(LocalBackendConfig(root_dir="/tmp/tunepack-jobs"))"""

from tunepack.backends.local.backend import LocalBackend, LocalBackendConfig
from tunepack.backends.local.job import JobRecord, update_state
from tunepack.backends.local.progress import read_progress
from tunepack.backends.local.runner import run_job, runner_main

__all__ = [
    "JobRecord",
    "LocalBackend",
    "LocalBackendConfig",
    "read_progress",
    "run_job",
    "runner_main",
    "update_state",
]
