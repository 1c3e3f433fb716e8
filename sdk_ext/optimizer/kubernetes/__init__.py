"""tunepack.OptimizerClient's cluster backend: Katib Experiments of tunepack TrainJobs."""

from tunepack.optimizer.kubernetes.backend import KubernetesOptimizerBackend

__all__ = ["KubernetesOptimizerBackend"]
