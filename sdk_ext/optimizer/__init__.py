"""Hyperparameter search over tunepack runtimes: ``tunepack.OptimizerClient`` (docs/optimize.md)."""
