"""``python -m tunepack.optimizer.local DIR ROOT GPU MEMORY_CHECK``: a detached study runner."""

import sys

from tunepack.optimizer.local.backend import runner_main

if __name__ == "__main__":
    sys.exit(runner_main(sys.argv[1:]))
