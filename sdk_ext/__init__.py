"""tunepack: a Kubeflow Trainer V2 runtime pack for LLM fine-tuning with torchtune."""

__version__ = "0.1.0"
