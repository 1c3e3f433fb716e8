"""The ``TrainingClient`` (``tunepack.client``) a command works through, as a notebook does: the
local backend's (``--local``) or the cluster's."""

from __future__ import annotations

import argparse
import os

from tunepack.cli.cluster import backend_config, check_cluster


def client(ns: argparse.Namespace):
    """The ``TrainingClient`` a command works through: the local backend's or the cluster's."""
    return local_client(ns) if ns.local else cluster_client(ns)


def cluster_client(ns: argparse.Namespace):
    """``TrainingClient()`` on the cluster the kubeconfig names, once its API server answers."""
    from tunepack.client import TrainingClient

    check_cluster(ns.context)
    return TrainingClient(backend_config(ns))


def local_client(ns: argparse.Namespace):
    """``TrainingClient(LocalBackendConfig(root_dir=..., gpu=..., memory_check=...))``."""
    from tunepack.backends.local import LocalBackendConfig
    from tunepack.client import TrainingClient
    from tunepack.core.errors import BadValueError

    if ns.jobs_dir is not None and not ns.jobs_dir.strip():
        raise BadValueError(
            "--jobs-dir is empty; give a directory, or leave --jobs-dir out for the default "
            "($TUNEPACK_HOME/jobs or ~/.tunepack/jobs)"
        )
    checks = {k: getattr(ns, k) for k in ("gpu", "memory_check") if hasattr(ns, k)}
    client = TrainingClient(LocalBackendConfig(root_dir=ns.jobs_dir, **checks))
    root = client.backend.root
    if os.path.exists(root) and not os.path.isdir(root):  # False if unreadable
        given = f"--jobs-dir {ns.jobs_dir}" if ns.jobs_dir else f"the jobs dir {root}"
        raise BadValueError(
            f"{given} is a file, not a directory; give a directory for the local jobs (or set "
            "TUNEPACK_HOME)"
        )
    return client


def complete_job(client, name: str, has_no: str):
    """``client.get_job(name)``, or BadInputError when the job has not completed: it has no
    ``has_no`` (``result``, ``result to serve``), yet or ever."""
    from tunepack.core.errors import ConflictError

    job = client.get_job(name)
    if job.status != "Complete":
        message = f": {job.message}" if getattr(job, "message", None) else ""
        raise ConflictError(
            f"TrainJob {name} is {job.status}, not Complete{message}; it has no {has_no}"
            + (" yet (tunepack status)" if job.status != "Failed" else "")
        )
    return job
