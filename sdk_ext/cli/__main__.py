"""``python -m tunepack.cli``: the ``tunepack`` command."""

import sys

from tunepack.cli import main

sys.exit(main())
