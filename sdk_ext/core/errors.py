"""Errors every tunepack program raises, and the exit codes they map to.

The codes are part of the runtime contract: the JobSet failure policy in the generated runtimes
restarts a step only when its exit code says retrying can help.

This module holds the whole vocabulary, so a caller tells errors apart by type, never by their
words: the kinds (``BadInputError``, ``TransientError``, ``NotAvailableError``) carry the exit
code, and the narrow types under them say what went wrong. A narrow type is still its kind, so
``except BadInputError`` (or ``ValueError``) and the exit codes work as before.

Where a caller would act on what went wrong, a narrow type carries the facts as attributes (as
huggingface_hub's errors carry ``repo_id``): ``UnknownKeyError.key`` and ``.suggestions``,
``NotFoundError.what`` and ``.name``, ``DoesNotFitError.need_gib`` and ``.have_gib``, ... A
type's ``FACTS`` names them, ``facts()`` returns them; they are keyword-only, default ``None``
(or ``()``) where the refusal has no such fact, and never change the message. An error pickles
with them (``BaseException`` pickles the message and restores the attributes).
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
    FACTS: tuple[str, ...] = ()  # the names of the attributes that carry the error's facts

    def __init__(self, *args, cli_message: str | None = None):
        super().__init__(*args)
        self.cli_message = cli_message

    def facts(self) -> dict[str, object]:
        """The error's facts by name (``FACTS``): what a copy with other words passes on."""
        return {name: getattr(self, name) for name in self.FACTS}


# The kinds, one per exit code and meaning.


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


# Bad input, narrowed (exit 65): what the user gave must change. A message that fits none of
# these stays a plain BadInputError.


class UnknownRuntimeError(BadInputError):
    """A runtime, model or model family that tunepack does not know.

    ``runtime``: the name as given (a runtime, a model or a model family); ``suggestions``: the
    known names the message proposes instead (``did you mean ...?``), the closest first; ``()``
    where it proposes none.
    """

    FACTS = ("runtime", "suggestions")

    def __init__(
        self,
        *args,
        runtime: str | None = None,
        suggestions: tuple[str, ...] = (),
        cli_message: str | None = None,
    ):
        super().__init__(*args, cli_message=cli_message)
        self.runtime, self.suggestions = runtime, tuple(suggestions)


class UnknownKeyError(BadInputError):
    """A key outside its vocabulary, or given twice: a trainer argument, FineTune field, option.

    ``key``: the key as given (``epochz``, ``--bogus``); ``suggestions``: what the message
    proposes instead, as it spells it (``epochs``, ``method=qlora``), the closest first; ``()``
    where it proposes none (a key given twice, or none is close).
    """

    FACTS = ("key", "suggestions")

    def __init__(
        self,
        *args,
        key: object = None,
        suggestions: tuple[str, ...] = (),
        cli_message: str | None = None,
    ):
        super().__init__(*args, cli_message=cli_message)
        self.key, self.suggestions = key, tuple(suggestions)


class BadValueError(BadInputError):
    """A value missing or of the wrong type, form or range: argument, option, URI, variable.

    Where the refusal is about one named value (a trainer argument, a ``FineTune`` field, a
    client setting): ``name`` (``lora_rank``), ``value`` (as given: ``'abc'``, ``0``) and
    ``expected`` (the message's words: ``an integer >= 1``); ``None`` elsewhere.
    """

    FACTS = ("name", "value", "expected")

    def __init__(
        self,
        *args,
        name: str | None = None,
        value: object = None,
        expected: str | None = None,
        cli_message: str | None = None,
    ):
        super().__init__(*args, cli_message=cli_message)
        self.name, self.value, self.expected = name, value, expected


class ConflictError(BadInputError):
    """Settings that exclude each other or disagree, or a request the job's state refuses."""


class NotFoundError(BadInputError):
    """What the input names is not there: a file, URI, bucket, repository, job, step, split.

    ``what``: the kind of thing missing (``dataset``, ``model``, ``path``, ``TrainJob``,
    ``step``, ``split``, ``repository``, ``revision``, ``bucket``, ``objects``, ``file``,
    ``result``, ...); ``name``: which one, as the message names it (a path, URI, job or step
    name); ``available``: what is there instead where the message lists it (a job's steps, a
    dataset's splits), else ``()``.
    """

    FACTS = ("what", "name", "available")

    def __init__(
        self,
        *args,
        what: str | None = None,
        name: str | None = None,
        available: tuple[str, ...] = (),
        cli_message: str | None = None,
    ):
        super().__init__(*args, cli_message=cli_message)
        self.what, self.name, self.available = what, name, tuple(available)


class NoObjectsError(NotFoundError):
    """An s3:// URI that matches no objects: fetching an export reads it as "no export there"."""


class DeniedError(BadInputError):
    """Credentials or permissions refused: no or a rejected token, access denied, unwritable."""


class BadDatasetError(BadInputError):
    """The dataset's files or rows cannot be trained on: format, encoding, schema, rows."""


class BadModelError(BadInputError):
    """A model's files (a checkpoint, an exported result) are missing, damaged or not its own."""


class DoesNotFitError(BadInputError):
    """The run needs more than the hardware has: GPU memory, GPUs, a CUDA device.

    ``need_gib`` and ``have_gib``: the memory per GPU the estimate needs and the GPU offers
    (floats, GiB), for a refusal by an estimate (the planner's, the serving plan's); ``gpu``:
    the GPU type (``H100-80GB``) or device (``cuda``); ``need_gpus`` and ``have_gpus``: GPUs
    asked for and present, for a refusal by count. ``None`` where the refusal has no such figure
    (an out-of-memory error during training).
    """

    FACTS = ("need_gib", "have_gib", "gpu", "need_gpus", "have_gpus")

    def __init__(
        self,
        *args,
        need_gib: float | None = None,
        have_gib: float | None = None,
        gpu: str | None = None,
        need_gpus: int | None = None,
        have_gpus: int | None = None,
        cli_message: str | None = None,
    ):
        super().__init__(*args, cli_message=cli_message)
        self.need_gib, self.have_gib, self.gpu = need_gib, have_gib, gpu
        self.need_gpus, self.have_gpus = need_gpus, have_gpus


class WorkspaceClaimedError(ConflictError):
    """The workspace holds another job's work, which this job would replace. ``workspace``,
    ``owner`` (the job whose work it holds) and ``job`` (the one refused) carry the facts."""

    FACTS = ("workspace", "owner", "job")

    def __init__(
        self,
        *args,
        workspace: str = "",
        owner: str = "",
        job: str = "",
        cli_message: str | None = None,
    ):
        super().__init__(*args, cli_message=cli_message)
        self.workspace, self.owner, self.job = workspace, owner, job


class UnsupportedError(BadInputError):
    """What tunepack, the chosen model or backend, or vLLM does not do (nor would, for a secret)."""


# Transient, narrowed (exit 75): retrying the same input can succeed.


class WorkspaceBusyError(TransientError):
    """Another run holds the workspace; retrying once it has finished succeeds."""


class DiskFullError(TransientError):
    """A write failed for want of space (ENOSPC) or quota (EDQUOT).

    Exit code 75: the input is fine; once space is freed (or the volume enlarged) a restart
    resumes from the newest checkpoint. The message names the path and the space needed.
    """


class RuntimeInUseError(TransientError):
    """A runtime that must be re-created is still being deleted: TrainJobs hold it."""


class StoppedError(TransientError):
    """The process was asked to stop (a signal: preemption, eviction, shutdown)."""


class NonFiniteLossError(TransientError):
    """The loss became NaN or infinite after some steps: the run stops before applying it."""


# Outside the kinds.


class ImageNotPullable(TunepackError):
    """An image the runtimes name cannot be pulled by the cluster's nodes (exit 65)."""


class GangNotPlaced(TimeoutError):
    """``wait_for_job_status`` gave up on a gang that could not be placed whole in time.

    A ``TimeoutError``, as the Kubeflow SDK's wait raises, not a ``TunepackError``. ``waiting``:
    the scheduler's refusal, a ``tunepack.backends.scheduling.Unscheduled`` (not imported here:
    core imports only the standard library).
    """

    def __init__(self, name: str, waiting) -> None:
        super().__init__(
            f"TrainJob {name} could not be placed whole within its gang's "
            f"{waiting.gang_timeout} s (pod {waiting.pod}: {waiting.reason}); it stays queued "
            "until the nodes it needs are free: free them, ask for fewer nodes or GPUs, or "
            "delete it"
        )
        self.waiting = waiting
