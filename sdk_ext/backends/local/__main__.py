"""The detached runner process ``LocalBackend.train()`` starts:
``python -m tunepack.backends.local <job dir>``."""

import sys
from pathlib import Path

from tunepack.backends.local.runner import runner_main

if __name__ == "__main__":
    sys.exit(runner_main(Path(sys.argv[1])))
