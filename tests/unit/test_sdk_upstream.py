"""The Kubeflow SDK's own Kubernetes backend tests (shipped in the ``kubeflow`` wheel), run against
the backend ``tunepack.TrainingClient`` builds. Differences are listed in docs/sdk.md."""

from __future__ import annotations

import pytest

upstream = pytest.importorskip("kubeflow.trainer.backends.kubernetes.backend_test")

from tunepack.backends.kubernetes import KubernetesBackend as TunepackBackend  # noqa: E402
from tunepack.client import TrainingClient  # noqa: E402


def _tunepack_backend(cfg):
    backend = TrainingClient(cfg).backend
    assert isinstance(backend, TunepackBackend)
    return backend


upstream.KubernetesBackend = _tunepack_backend

from kubeflow.trainer.backends.kubernetes.backend_test import *  # noqa: E402, F403
