"""Where tunepack's TrainJobs run: one interface (``base.TunepackBackend``), two implementations.

Laid out as the Kubeflow SDK's ``kubeflow.trainer.backends``; docs/architecture.md, "The backend
interface"."""
