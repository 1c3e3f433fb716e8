"""Where tunepack's TrainJobs run: one interface, two implementations.

As in the Kubeflow SDK (``kubeflow.trainer.backends``: a ``RuntimeBackend`` base and one
subpackage per backend, chosen by ``TrainerClient`` from the config it is given), the facade,
``tunepack.client.TrainingClient``, talks to a backend only through an interface:

- ``base.TunepackBackend``: the SDK's ``RuntimeBackend`` plus what tunepack adds (a runtime
  resolved from a catalog model's short name, a finished job's ``Result``, its per-step metrics,
  where its workspace is);
- ``kubernetes.KubernetesBackend``: the SDK's Kubernetes backend, with tunepack runtimes;
- ``local.LocalBackend``: TrainJobs as processes on this machine, a subpackage laid out as the
  SDK's ``localprocess`` (``local.steps`` is its executor, which turns a runtime and a TrainJob
  into the steps' commands and runs them as the Trainer and JobSet would).
"""
