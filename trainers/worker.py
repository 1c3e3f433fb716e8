"""torchrun's worker: ``python -m tunepack.trainers.worker --config <output>/config.yaml``.

The launcher (``trainers/launch.py``) has torchrun start one per process; each trains with the
recipe (``tunepack.trainers.recipe.run``) and leaves its exit code where the launcher reads it.
In this order: it dies with torchrun, third-party noise is silenced, then torch is imported
(torch and torchao speak while being imported; ``tunepack.trainers.process.noise``).
"""

import argparse
import logging
import os
import signal
import sys
from pathlib import Path

from tunepack.core import lifetime, program
from tunepack.core.errors import TunepackError

if __name__ == "__main__":
    # Before the seconds of importing torch: a worker whose torchrun is killed (with the
    # launcher's process group) dies with it, at once, and writes nothing more.
    lifetime.die_with_shimmed_parent()
    # In the launcher's process group, a worker gets a terminal's Ctrl-C too: until the recipe
    # handles stop signals it ends as on torchrun's SIGTERM, without a KeyboardInterrupt traceback.
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    program.defer_collection(__name__)  # until the recipe is imported

from tunepack.trainers.process import noise  # noqa: E402

noise.quiet()

# After quiet(), on purpose: the recipe imports torch, torchao and torchtune.
from omegaconf import OmegaConf  # noqa: E402

from tunepack.trainers.process import distributed  # noqa: E402
from tunepack.trainers.recipe import run, say  # noqa: E402

noise.quiet()  # the handlers torch attached while being imported
program.imports_done()


def main(argv: list[str] | None = None) -> int:
    """Train from a config file and leave the exit code for the launcher."""
    parser = argparse.ArgumentParser(prog="python -m tunepack.trainers.worker")
    parser.add_argument("--config", required=True, type=Path)
    parser.add_argument("--digest", default=None, help="recorded as config_digest in result.json")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    exit_dir = os.environ.get(program.EXIT_DIR_ENV)
    rank = os.environ.get("RANK", "0")
    if exit_dir:  # lets the launcher make sure no worker outlives it
        Path(exit_dir, f"pid-{rank}").write_text(str(os.getpid()))
    code = 0
    try:
        cfg = OmegaConf.load(args.config)
        run(cfg, extra={"config_digest": args.digest} if args.digest else None)
    except TunepackError as err:
        print(program.error_line("trainer", err), file=sys.stderr, flush=True)
        code = err.exit_code
    except BaseException as err:
        code = 1
        if not distributed.peer_failed(err):
            raise
        # The process that failed says why (one killed by a signal: the launcher says which);
        # this one only says that it followed. Its code (1) does not hide the other's: the
        # launcher prefers 65, 75 and a worker's signal over it.
        say(
            program.error_line(
                "trainer",
                f"process {rank} stopped because another process of the run failed first (that "
                "process's error is on a line of its own)",
            )
        )
    finally:
        if exit_dir:
            Path(exit_dir, f"rank-{rank}").write_text(str(code))
    return code


if __name__ == "__main__":
    program.leave(main())  # the run is over and its exit code recorded: no teardown
