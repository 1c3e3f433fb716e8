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

# Cases that compare ``dataclasses.asdict`` of what the backend returns with the SDK's objects:
# tunepack's ``TrainJob`` is a subclass with more fields (a job's failure message and progress),
# so the dicts differ by those keys only. docs/sdk.md. (Upstream's runtimes are not tunepack's:
# get_runtime and list_runtimes return them exactly as the SDK does, and its cases pass.)
EXTRA_FIELDS = {
    "test_get_job[test_case0]",
    "test_get_job[test_case1]",
    "test_list_jobs[test_case0]",
}


@pytest.fixture(autouse=True)
def _known_differences(request):
    if request.node.name in EXTRA_FIELDS:
        request.applymarker(
            pytest.mark.xfail(
                reason="asdict() of tunepack's subclasses has their extra fields", strict=True
            )
        )
