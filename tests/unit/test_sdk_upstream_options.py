"""The Kubeflow SDK's own option tests (``kubeflow/trainer/options/kubernetes_test.py``) run
against ``tunepack.options`` and tunepack's Kubernetes backend (the class ``TrainingClient``
builds for a cluster): every option name the upstream tests use is ``tunepack.options``'s, and
the mocked backend is tunepack's. See tests/unit/test_sdk_upstream_client.py."""

from __future__ import annotations

import pytest

upstream = pytest.importorskip("kubeflow.trainer.options.kubernetes_test")

from tunepack import options as tunepack_options  # noqa: E402
from tunepack.backends.kubernetes import KubernetesBackend  # noqa: E402

for _name in tunepack_options.__all__:
    if hasattr(upstream, _name):
        setattr(upstream, _name, getattr(tunepack_options, _name))
upstream.KubernetesBackend = KubernetesBackend

from kubeflow.trainer.options.kubernetes_test import *  # noqa: E402, F403


def test_the_upstream_tests_use_tunepack_options_and_backend():
    assert upstream.KubernetesBackend is KubernetesBackend
    used = [n for n in ("Labels", "Name", "RuntimePatch", "ActiveDeadlineSeconds")]
    assert all(getattr(upstream, n) is getattr(tunepack_options, n) for n in used)
