"""The contract between tunepack's steps: what the initializers, the trainer, the runtimes and the
SDK agree on, written once (docs/architecture.md, "The contract: tunepack.core").

It imports only the standard library, so every step's image can carry it
(tests/integration/test_architecture.py checks it)."""

# The version of tunepack's programs; the runtimes name the images tagged with it. ``tunepack``
# re-exports it.
__version__ = "0.1.0"
