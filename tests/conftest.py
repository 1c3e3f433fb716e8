"""Shared fixtures: the tiny model, the tiny dataset and a prepared workspace, made once."""

from __future__ import annotations

import gc
import os
from pathlib import Path

# Before torch is imported (libgomp reads both when it loads): each test process, and every
# process it starts, computes on one thread that waits passively. pytest-xdist runs a worker per
# core; a worker training in-process on two spinning threads while the other core is busy
# spends most of its CPU spinning (test_trainer.py beside another suite: 134 s, 79 CPU-s with
# torch's defaults; 58 s, 33 CPU-s so). A test of the trainer's own thread choice unsets them.
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

# No cyclic collection while the test modules are collected (they import torch, torchtune and the
# Kubernetes client): the collector would scan the growing heap of their objects hundreds of
# times; once collected they are frozen out of later scans (pytest_collection_finish), as the
# trainer's programs do (tunepack.core.program.defer_collection).
gc.disable()

import pytest  # noqa: E402

from tests.helpers import run_program  # noqa: E402
from tunepack.tiny import write_tiny_dataset, write_tiny_model  # noqa: E402


def pytest_collection_finish(session):
    gc.freeze()
    gc.enable()


@pytest.fixture(scope="session", autouse=True)
def _tunepack_home(tmp_path_factory):
    """Local jobs (`train --local` registers one) go to a temporary $TUNEPACK_HOME, never to the
    developer's ~/.tunepack; a test that wants its own sets TUNEPACK_HOME or --jobs-dir."""
    if "TUNEPACK_HOME" in os.environ:
        yield
        return
    os.environ["TUNEPACK_HOME"] = str(tmp_path_factory.mktemp("tunepack-home"))
    yield
    os.environ.pop("TUNEPACK_HOME", None)


@pytest.fixture
def no_tiktoken_cache(monkeypatch):
    """tiktoken caches local files by path in /tmp: a stale copy would hide a changed tokenizer.
    (For modules that read tokenizers: ``pytestmark = pytest.mark.usefixtures(...)``.)"""
    monkeypatch.setenv("TIKTOKEN_CACHE_DIR", "")


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    return write_tiny_model(tmp_path_factory.mktemp("models") / "tiny-llama3")


@pytest.fixture(scope="session")
def tiny_dataset_file(tmp_path_factory) -> Path:
    return write_tiny_dataset(tmp_path_factory.mktemp("data") / "instructions.jsonl")


@pytest.fixture(scope="session")
def initialized_workspace(tmp_path_factory, tiny_model_dir, tiny_dataset_file) -> Path:
    """A workspace after both initializers ran (read-only for tests: copy before writing)."""
    root = tmp_path_factory.mktemp("workspace")
    base = {"TUNEPACK_WORKSPACE": str(root), "TUNEPACK_MODEL": "tiny-llama3"}
    for module, uri in (
        ("tunepack.initializers.dataset", f"file://{tiny_dataset_file}"),
        ("tunepack.initializers.model", f"file://{tiny_model_dir}"),
    ):
        done = run_program(module, {**base, "STORAGE_URI": uri})
        assert done.returncode == 0, done.stderr
    return root
