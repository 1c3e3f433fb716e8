"""The contract between tunepack's steps: what the initializers, the trainer, the runtimes and
the SDK agree on, written once.

- ``errors``: the exceptions every program raises and the exit codes they map to;
- ``workspace``: the workspace layout (directory and file names), the environment names the
  steps share, and the workspace lock;
- ``durable``: all-or-nothing, crash-safe writes (one stage-then-rename);
- ``program``: the program entry/exit wrapper (the ``<program>: error: ...`` line, produced and
  parsed here);
- ``lifetime``: every process of a run dies with the one that started it;
- ``digest``: the one way a configuration is hashed.

This package imports only the standard library: nothing of tunepack outside it, no torch, no
Kubernetes client, no Kubeflow SDK (tests/integration/test_architecture.py checks it).
"""

# The version of tunepack's programs; the runtimes name the images tagged with it. ``tunepack``
# re-exports it.
__version__ = "0.1.0"
