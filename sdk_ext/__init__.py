"""tunepack: a Kubeflow Trainer V2 runtime pack for LLM fine-tuning with torchtune.

>>> from tunepack import TrainingClient, FineTune, Initializer, LocalBackendConfig
"""

__version__ = "0.1.0"

_EXPORTS = {
    "TrainingClient": "tunepack.client",
    "FineTune": "tunepack.finetune",
    "Initializer": "tunepack.translate",
    "LocalBackendConfig": "tunepack.backend_local",
    "plan": "tunepack.planner",
}
__all__ = ["__version__", *_EXPORTS]


def __getattr__(name: str):
    # Lazy: the trainer and initializer programs import tunepack without needing the SDK.
    if name in _EXPORTS:
        import importlib

        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'tunepack' has no attribute {name!r}")
