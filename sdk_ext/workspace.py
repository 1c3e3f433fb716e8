"""The workspace contract shared by the initializers, the trainer and the backends.

In a Pod the workspace is the volume mounted at ``/workspace``; the local backend points
``TUNEPACK_WORKSPACE`` at a local directory instead. Every program finds its paths here.
"""

from __future__ import annotations

import os
from pathlib import Path

WORKSPACE_ENV = "TUNEPACK_WORKSPACE"
DEFAULT_WORKSPACE = "/workspace"

# Environment the platform (Kubeflow Trainer) gives each step.
STORAGE_URI_ENV = "STORAGE_URI"  # initializers: where to fetch from
MODEL_ENV = "TUNEPACK_MODEL"  # every step: the catalog entry the runtime was generated for

DATASET_DIR = "dataset"
MODEL_DIR = "model"
OUTPUT_DIR = "output"
MANIFEST_FILE = "tunepack-manifest.json"


def workspace_root() -> Path:
    return Path(os.environ.get(WORKSPACE_ENV, DEFAULT_WORKSPACE))


def dataset_dir() -> Path:
    return workspace_root() / DATASET_DIR


def model_dir() -> Path:
    return workspace_root() / MODEL_DIR


def output_dir() -> Path:
    return workspace_root() / OUTPUT_DIR
