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


def test_collection_waits_for_a_programs_imports_and_then_skips_what_they_made(tmp_path):
    """program.defer_collection: in a program run as ``__main__`` no cyclic collection runs
    while it imports; after imports_done collection is back, the import's objects frozen out of
    its scans, and a cycle made then is collected. Called from a module that is not the program
    (a test, another program importing it), neither changes anything."""
    code = (
        "import gc, sys\n"
        "from tunepack.core import program\n"
        "program.defer_collection('tunepack.trainers.launch')  # imported, not run\n"
        "assert gc.isenabled() and gc.get_freeze_count() == 0\n"
        "program.imports_done()\n"
        "assert gc.isenabled() and gc.get_freeze_count() == 0\n"
        "program.defer_collection(__name__)\n"
        "assert not gc.isenabled()\n"
        "import json, email.parser  # what a program imports\n"
        "program.imports_done()\n"
        "assert gc.isenabled() and gc.get_freeze_count() > 0\n"
        "class Node: pass\n"
        "a, b = Node(), Node(); a.other, b.other = b, a\n"
        "import weakref; gone = weakref.ref(a); del a, b\n"
        "gc.collect()\n"
        "print('collected' if gone() is None else 'kept')\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert done.stdout == "collected\n"
