"""``python -m tunepack.cli``: the ``tunepack`` command."""

import sys

from tunepack.cli import main

if __name__ == "__main__":
    sys.exit(main())
