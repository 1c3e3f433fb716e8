"""torchrun (``torch.distributed.run``) as the launcher starts it: the same agent, less noise, and
its workers in the launcher's process group.

torchrun ends every stop with a traceback of its own ``SignalException`` and every failed worker
with a ``ChildFailedError`` one, after warning lines of its own; the launcher already reports
both in one line (the workers' exit codes decide the node's). Unless ``TUNEPACK_VERBOSE`` is set
those are kept out of the log; the exit status says the same: 128 + N for a signal, 1 for a
failed worker. A worker that died of a signal torchrun did not send it (``kill -9``, the OOM
killer) is recorded in the launcher's exit directory as ``killed-<rank>`` ("<pid> <signal>"): the
launcher names it, and the node exits 128 + N as a one-process run killed so does.

torchrun starts each worker in a session of its own and stops it by signalling that session's
group. Here the workers stay in torchrun's process group, which is the launcher's (and the CLI's,
locally): a SIGKILL to that group reaches every process of the run in the one ``kill``, instead of
a chain of parent-death signals, each a scheduling round later. A stop signal sent to the whole
group then reaches torchrun and each worker directly as well as forwarded (by the launcher, then
by torchrun): like the launcher and the recipe, torchrun takes such a burst as one request
(``tunepack.core.lifetime.StopRequests``). docs/architecture.md, "Process lifetime".
"""

import signal
import sys

# Until the handlers below are in place (the seconds of importing torch), Ctrl-C at a terminal
# ends this process as SIGTERM would, without a KeyboardInterrupt traceback: the launcher's
# forwarded SIGTERM arrives too.
signal.signal(signal.SIGINT, signal.SIG_DFL)

from tunepack.core import lifetime, program  # noqa: E402
from tunepack.trainers.process import noise  # noqa: E402

program.defer_collection(__name__)  # until main() has imported torch

# The workers torchrun itself signalled (stopping them after a failure or a stop request): their
# deaths are its doing, not the cause of the failure.
_closed: set[int] = set()


def _keep_workers_in_the_group() -> None:
    """torchrun's worker processes started in torchrun's own process group (no session of
    their own), and each stopped by signalling it alone."""
    import os
    import subprocess

    from torch.distributed.elastic.multiprocessing.subprocess_handler import (
        subprocess_handler as handler,
    )

    def popen(self, args, env):
        return subprocess.Popen(args=args, env=env, stdout=self._stdout, stderr=self._stderr)

    def close(self, death_sig=None):
        _closed.add(self.proc.pid)
        try:
            os.kill(self.proc.pid, death_sig or signal.SIGTERM)  # the worker, not the group
        except ProcessLookupError:
            pass
        for out in (self._stdout, self._stderr):
            if out:
                out.close()

    handler.SubprocessHandler._popen = popen
    handler.SubprocessHandler.close = close


def _one_request_per_burst() -> None:
    """torchrun's stop signal handler, taking a burst of stop signals as one request."""
    from torch.distributed.elastic.multiprocessing import api

    raising = api._terminate_process_handler
    requests = lifetime.StopRequests()

    def handle(signum, frame):
        if signum in lifetime.STOP_SIGNALS and not requests.add(signum):
            return  # the group's signal and its forwarded copy: one request
        raising(signum, frame)

    api._terminate_process_handler = handle  # looked up when the agent starts its workers


def _record_killed(failures: dict) -> None:
    """``killed-<rank>`` in the launcher's exit directory for each worker that died of a signal
    torchrun did not send it."""
    import os
    from pathlib import Path

    exit_dir = os.environ.get(program.EXIT_DIR_ENV)
    if not exit_dir:
        return
    for rank, failure in failures.items():
        if failure.exitcode < 0 and failure.pid not in _closed:
            Path(exit_dir, f"killed-{rank}").write_text(f"{failure.pid} {-failure.exitcode}")


def main(argv: list[str]) -> int:
    noise.quiet()
    from torch.distributed import run
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    noise.quiet()  # the handlers torch attached while being imported
    program.imports_done()
    _keep_workers_in_the_group()
    _one_request_per_burst()

    try:
        run.main(argv)
    except SignalException as stopped:
        if noise.verbose():
            raise
        return 128 + int(stopped.sigval)
    except ChildFailedError as failed:
        _record_killed(failed.failures)
        if noise.verbose():
            raise
        return 1
    return 0


if __name__ == "__main__":
    program.leave(main(sys.argv[1:]))
