"""torchrun's worker entry point: it dies with torchrun, third-party noise is silenced, then the
recipe runs.

A module of its own because torch and torchao speak while ``tunepack.trainers.recipe`` imports
them (``tunepack.trainers.noise``); the recipe's ``main`` does the rest.
"""

import sys

from tunepack.core import lifetime

if __name__ == "__main__":
    # Before the seconds of importing torch: a worker whose torchrun is killed (with the
    # launcher's process group) dies with it, at once, and writes nothing more.
    lifetime.die_with_shimmed_parent()

from tunepack.trainers import noise  # noqa: E402

noise.quiet()

from tunepack.trainers.recipe import main  # noqa: E402  (after quiet(), on purpose)

noise.quiet()  # the handlers torch attached while being imported

if __name__ == "__main__":
    sys.exit(main())
