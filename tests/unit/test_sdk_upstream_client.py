"""The Kubeflow SDK's own client, types, options and LocalProcess backend tests (shipped in the
``kubeflow`` wheel), run against tunepack: ``TrainingClient`` in place of ``TrainerClient``, the
types and options as ``tunepack`` re-exports them, the backends ``TrainingClient`` builds.

Each upstream module is imported in its own test module (tests/test_sdk_upstream_*.py: their
test names collide); the names the upstream tests look up in their module's globals are
replaced before the tests run, as tests/unit/test_sdk_upstream.py does for the Kubernetes backend's
tests. Differences are listed in docs/sdk.md, "The SDK's own tests".

This module: ``kubeflow/trainer/api/trainer_client_test.py`` (which backend a config selects).
"""

from __future__ import annotations

import pytest

upstream = pytest.importorskip("kubeflow.trainer.api.trainer_client_test")

from tunepack import TrainingClient  # noqa: E402

upstream.TrainerClient = TrainingClient

from kubeflow.trainer.api.trainer_client_test import *  # noqa: E402, F403


def test_the_upstream_tests_ran_against_training_client():
    assert upstream.TrainerClient is TrainingClient
    assert upstream.test_backend_selection.__globals__ is vars(upstream)
