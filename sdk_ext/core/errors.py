"""Errors every tunepack program raises, and the exit codes they map to.

The codes are part of the runtime contract: the JobSet failure policy in the generated runtimes
restarts a step only when its exit code says retrying can help.
"""

from __future__ import annotations

# sysexits(3) values, so the codes mean the same thing outside tunepack.
EXIT_OK = 0
EXIT_BAD_INPUT = 65  # EX_DATAERR: bad URI, argument, dataset row or model files. Do not retry.
EXIT_TRANSIENT = 75  # EX_TEMPFAIL: network or preemption. Retrying may succeed.


class TunepackError(Exception):
    """Base error: its message is written for the user and says what to do next.

    ``cli_message``: the same message for a user of the ``tunepack`` command, where the next
    step differs (a command to run rather than a Python method to call); None: the message.
    """

    exit_code = EXIT_BAD_INPUT
    cli_message: str | None = None

    def __init__(self, *args, cli_message: str | None = None):
        super().__init__(*args)
        self.cli_message = cli_message


class BadInputError(TunepackError, ValueError):
    """The user's input (argument, URI, dataset, model files) is wrong; retrying cannot help.

    It is also a ``ValueError``, which is what the Kubeflow SDK raises for invalid input, so code
    written against ``TrainerClient`` catches it unchanged.
    """

    exit_code = EXIT_BAD_INPUT


class NotAvailableError(TunepackError):
    """An operation this backend cannot do (the files it needs are on the cluster's volume);
    the message says how to get the same thing another way."""


class TransientError(TunepackError):
    """A failure that may pass on its own (network, preemption); the step may be retried."""

    exit_code = EXIT_TRANSIENT
