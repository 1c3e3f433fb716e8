"""tunepack.core with processes: a stop signal ends a program's body with a retriable error; a
program leaves without the interpreter's teardown, having done what of it matters. The
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


def test_leave_exits_with_the_code_after_what_of_the_teardown_matters(tmp_path):
    """program.leave: a thread still writing is waited for, atexit handlers and logging's files
    are finished, buffered stdout reaches the pipe, and the exit code is the one given; the
    modules are not torn down (an object of one, finalized at teardown, never is)."""
    log, flag = tmp_path / "run.log", tmp_path / "finalized"
    code = (
        "import atexit, logging, sys, threading, time\n"
        "from tunepack.core import program\n"
        "class Kept:\n"
        f"    def __del__(self, open=open): open({str(flag)!r}, 'w').close()\n"
        "kept = Kept()  # a module's global: finalized only by the interpreter's teardown\n"
        f"logging.basicConfig(filename={str(log)!r}, level=logging.INFO)\n"
        "logging.getLogger('run').info('the last line')\n"
        "atexit.register(lambda: print('atexit ran', flush=True))\n"
        "def late():\n"
        "    time.sleep(0.5)  # still running when leave is called\n"
        "    print('thread done')\n"
        "threading.Thread(target=late).start()\n"
        "sys.stdout.write('buffered ')  # no newline, no flush: left in the buffer\n"
        "program.leave(7)\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 7, done.stderr
    assert done.stdout == "buffered thread done\natexit ran\n"
    assert log.read_text() == "INFO:run:the last line\n"
    assert not flag.exists()
