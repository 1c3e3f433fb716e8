"""The ``tunepack`` command line: ``main``, every failure as one error line and an exit code.

The commands, the exit codes (besides which ``train --local`` passes on a failed step's own) and
where local jobs live: README, "The command line" and "Exit codes"."""

from __future__ import annotations

import os
import sys

from tunepack.backends.api_errors import api_message
from tunepack.cli import cluster
from tunepack.cli.optimize import ACTIONS as _OPTIMIZE_ACTIONS
from tunepack.cli.output import console_logging
from tunepack.cli.parser import build_parser, optimize_action_parser
from tunepack.core import program
from tunepack.core.errors import EXIT_BAD_INPUT, EXIT_TRANSIENT, TunepackError

EXIT_INTERRUPTED = 130  # 128 + SIGINT, as a shell reports a command stopped by Ctrl-C
EXIT_BROKEN_PIPE = 141  # 128 + SIGPIPE, as for any command whose reader went away

PROGRAM = "tunepack"  # the name its error lines start with


def main(argv: list[str] | None = None) -> int:
    try:
        code = _main(argv)
        sys.stdout.flush()  # here, where a closed pipe is handled, not at interpreter exit
        return code
    except KeyboardInterrupt:
        print("tunepack: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    except BrokenPipeError:
        # The reader went away (`tunepack runtimes | head -1`): stop quietly, as Unix tools do.
        # stdout is pointed at /dev/null so that flushing it at exit cannot fail again.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return EXIT_BROKEN_PIPE


def _main(argv: list[str] | None = None) -> int:
    console_logging()
    try:
        argv = sys.argv[1:] if argv is None else list(argv)
        if len(argv) > 1 and argv[0] == "optimize" and argv[1] in optimize_actions():
            ns = optimize_action_parser().parse_args(argv[1:])
        else:
            ns = build_parser().parse_args(argv)
        return ns.func(ns)
    except TunepackError as err:
        print(program.error_line(PROGRAM, err.cli_message or err), file=sys.stderr)
        return err.exit_code
    except (RuntimeError, TimeoutError) as err:
        # The Kubeflow SDK wraps the cluster's API and connection errors (a missing TrainJob, a
        # refused request, no API server) in RuntimeError (TimeoutError when the API does not
        # answer in time): say those in one line with the server's reason. Any other
        # RuntimeError is a bug and keeps its traceback.
        if not _is_cluster_error(err.__cause__):
            raise
        if cluster.is_connection_error(err.__cause__):
            server = cluster.last_server or "configured in your kubeconfig"
            print(
                program.error_line(
                    PROGRAM,
                    f"{err}: cannot reach the Kubernetes API server {server}; check that the "
                    "cluster is running, then run the command again",
                ),
                file=sys.stderr,
            )
            return EXIT_TRANSIENT
        cause = api_message(err.__cause__)
        detail = f": {cause}" if cause and cause not in str(err) else ""
        print(program.error_line(PROGRAM, f"{err}{detail}"), file=sys.stderr)
        return 1
    except _config_exception() as err:
        print(
            program.error_line(
                PROGRAM,
                f"invalid Kubernetes configuration: {err}; fix your kubeconfig (KUBECONFIG or "
                "~/.kube/config)",
            ),
            file=sys.stderr,
        )
        return EXIT_BAD_INPUT


def optimize_actions() -> tuple[str, ...]:
    return _OPTIMIZE_ACTIONS


def _is_cluster_error(err: BaseException | None) -> bool:
    import multiprocessing

    from kubernetes.client.exceptions import ApiException
    from urllib3.exceptions import HTTPError

    return isinstance(err, ApiException | HTTPError | OSError | multiprocessing.TimeoutError)


def _config_exception() -> type[Exception]:
    """The kubernetes client's error for a missing or broken kubeconfig."""
    from kubernetes.config.config_exception import ConfigException

    return ConfigException
