"""torchrun's worker entry point: third-party noise silenced first, then the recipe.

A module of its own because torch and torchao speak while ``tunepack.trainers.recipe`` imports
them (``tunepack.trainers.noise``); the recipe's ``main`` does the rest.
"""

import sys

from tunepack.trainers import noise

noise.quiet()

from tunepack.trainers.recipe import main  # noqa: E402  (after quiet(), on purpose)

noise.quiet()  # the handlers torch attached while being imported

if __name__ == "__main__":
    sys.exit(main())
