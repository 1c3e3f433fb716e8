"""The Kubeflow SDK's own LocalProcess backend tests
(``kubeflow/trainer/backends/localprocess/backend_test.py``) run against the backend
``TrainingClient(LocalProcessBackendConfig())`` builds: tunepack's client passes the SDK's other
backend configs through unchanged, so a notebook that used the SDK's local backend keeps it. See
tests/unit/test_sdk_upstream_client.py."""

from __future__ import annotations

import pytest

upstream = pytest.importorskip("kubeflow.trainer.backends.localprocess.backend_test")

from kubeflow.trainer.backends.localprocess import backend as sdk_local  # noqa: E402

from tunepack import TrainingClient  # noqa: E402


def _through_training_client(cfg):
    backend = TrainingClient(cfg).backend
    assert type(backend) is sdk_local.LocalProcessBackend
    return backend


upstream.LocalProcessBackend = _through_training_client

from kubeflow.trainer.backends.localprocess.backend_test import *  # noqa: E402, F403
