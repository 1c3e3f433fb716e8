"""tunepack.core with processes: a stop signal ends a program's body with a retriable error. The
rest of tunepack.core (the error line parser, program.run, durable writes, digests):
tests/unit/test_core.py."""

from __future__ import annotations

import signal
import subprocess
import sys

from tunepack.core.errors import EXIT_TRANSIENT


def test_a_stop_signal_ends_the_body_with_a_retriable_error():
    code = (
        "import os, signal, time\n"
        "from tunepack.core import program\n"
        "def body():\n"
        "    os.kill(os.getpid(), signal.SIGTERM)\n"
        "    time.sleep(30)\n"
        "raise SystemExit(program.run('dataset-initializer', body))\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == EXIT_TRANSIENT, done.stderr
    assert done.stderr == (
        f"dataset-initializer: error: stopped by {signal.SIGTERM.name} (preemption or "
        "shutdown); nothing was published, the step can be retried\n"
    )
