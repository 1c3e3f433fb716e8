"""tunepack's local backend: TrainJobs as processes on this machine, laid out as the Kubeflow
SDK's ``kubeflow.trainer.backends.localprocess`` is, one module a concern:

- ``backend``: ``LocalBackend`` and ``LocalBackendConfig``, what ``TrainingClient`` talks to;
- ``job``: ``JobRecord``, one job's directory (``trainjob.yaml``, ``state.json``, its runner's
  pid, its workspace's logs, metrics and result); nothing else reads or writes those files;
- ``runner``: running a job, in the detached runner process ``train()`` starts
  (``python -m tunepack.backends.local <job dir>``) or in the foreground of
  ``tunepack train --local``;
- ``steps``: the executor, which turns a runtime and a TrainJob into each step's command and
  environment and runs them as processes, as the Trainer and JobSet would;
- ``progress``: a job's progress from the trainer's ``metrics.jsonl``.

    >>> from tunepack import TrainingClient, LocalBackendConfig
    >>> client = TrainingClient(LocalBackendConfig(root_dir="/tmp/tunepack-jobs"))
"""

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
