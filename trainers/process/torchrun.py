"""torchrun (``torch.distributed.run``) as the launcher starts it: the same agent, less noise.

torchrun ends every stop with a traceback of its own ``SignalException`` and every failed worker
with a ``ChildFailedError`` one, after warning lines of its own; the launcher already reports
both in one line (the workers' exit codes decide the node's). Unless ``TUNEPACK_VERBOSE`` is set
those are kept out of the log; the exit status says the same: 128 + N for a signal, 1 for a
failed worker.
"""

import sys

from tunepack.trainers.process import noise


def main(argv: list[str]) -> int:
    noise.quiet()
    from torch.distributed import run
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    noise.quiet()  # the handlers torch attached while being imported

    try:
        run.main(argv)
    except SignalException as stopped:
        if noise.verbose():
            raise
        return 128 + int(stopped.sigval)
    except ChildFailedError:
        if noise.verbose():
            raise
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
