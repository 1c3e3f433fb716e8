"""tunepack: a Kubeflow Trainer V2 runtime pack for LLM fine-tuning with torchtune.

Everything a notebook needs comes from here, tunepack's own names and the Kubeflow SDK's trainer,
initializer and backend types (the very same classes as ``kubeflow.trainer``'s):

>>> from tunepack import TrainingClient, FineTune, Initializer, LocalBackendConfig
>>> from tunepack import BuiltinTrainer, TorchTuneConfig, LoraConfig, KubernetesBackendConfig
>>> from tunepack import OptimizerClient, TrainJobTemplate, Search, TrialConfig, Objective
"""

from tunepack.core import __version__

_SDK = "kubeflow.trainer"
_EXPORTS = {
    "TrainingClient": "tunepack.client",
    "FineTune": "tunepack.finetune",
    # tunepack's Initializer takes storage URIs or the SDK's initializer objects (below).
    "Initializer": "tunepack.jobs.translate",
    "LocalBackendConfig": "tunepack.backends.local",
    "plan": "tunepack.runtimes.planner",
    # Hyperparameter search: the Kubeflow SDK's OptimizerClient for tunepack runtimes, its
    # result types, and tunepack's TPE search and median early stopping.
    "OptimizerClient": "tunepack.optimizer.client",
    "OptimizationJob": "tunepack.optimizer.types",
    "Trial": "tunepack.optimizer.types",
    "Result": "tunepack.optimizer.types",
    "TPESearch": "tunepack.optimizer.space",
    "MedianStop": "tunepack.optimizer.space",
    **dict.fromkeys(
        ("Search", "Objective", "TrialConfig", "RandomSearch", "GridSearch", "TrainJobTemplate"),
        "kubeflow.optimizer",
    ),
    # The Kubeflow SDK's types, re-exported unchanged.
    **dict.fromkeys(
        (
            "TrainerClient",
            "BuiltinTrainer",
            "TorchTuneConfig",
            "LoraConfig",
            "TorchTuneInstructDataset",
            "DataFormat",
            "DataType",
            "Loss",
            "CustomTrainer",
            "CustomTrainerContainer",
            "HuggingFaceDatasetInitializer",
            "HuggingFaceModelInitializer",
            "S3DatasetInitializer",
            "S3ModelInitializer",
            "DataCacheInitializer",
            "KubernetesBackendConfig",
            "LocalProcessBackendConfig",
            "ContainerBackendConfig",
            "Runtime",
            "RuntimeKind",
            "RuntimeTrainer",
            "TrainerType",
        ),
        _SDK,
    ),
    # The SDK's train() options (Name, Labels, RuntimePatch, ...): ``tunepack.options``.
    "options": "tunepack.options",
}
__all__ = ["__version__", *_EXPORTS]


def __getattr__(name: str):
    # Lazy: the trainer and initializer programs import tunepack without needing the SDK.
    if name in _EXPORTS:
        import importlib

        module = importlib.import_module(_EXPORTS[name])
        return module if module.__name__ == f"tunepack.{name}" else getattr(module, name)
    raise AttributeError(f"module 'tunepack' has no attribute {name!r}")


def __dir__():
    return sorted([*globals(), *_EXPORTS])
