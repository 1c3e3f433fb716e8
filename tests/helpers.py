"""Helpers shared by test modules (fixtures live in conftest.py)."""

from __future__ import annotations

import os
import subprocess
import sys


def run_program(module: str, env: dict[str, str], *args: str, timeout: int = 600):
    """Run a tunepack program as the local backend would: a separate Python process."""
    return subprocess.run(
        [sys.executable, "-m", module, *args],
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        timeout=timeout,
    )
