"""The Kubeflow SDK's own type tests (``kubeflow/trainer/types/types_test.py``) run against the
types as ``tunepack`` re-exports them: each ``types.X`` the upstream tests use is looked up in
``tunepack``, so a type a notebook cannot import from ``tunepack`` fails here. See
tests/unit/test_sdk_upstream_client.py."""

from __future__ import annotations

import pytest

upstream = pytest.importorskip("kubeflow.trainer.types.types_test")

import tunepack  # noqa: E402


class _TunepackTypes:
    """``types.X`` as ``tunepack.X`` (AttributeError when tunepack does not export it)."""

    def __getattr__(self, name: str):
        if name not in tunepack.__all__:
            raise AttributeError(f"tunepack does not export {name}")
        return getattr(tunepack, name)


upstream.types = _TunepackTypes()

from kubeflow.trainer.types.types_test import *  # noqa: E402, F403


def test_the_upstream_tests_use_tunepack_exports():
    from kubeflow.trainer.types import types as sdk_types

    assert upstream.types.HuggingFaceModelInitializer is sdk_types.HuggingFaceModelInitializer
    with pytest.raises(AttributeError, match="tunepack does not export"):
        upstream.types.SomethingElse  # noqa: B018
