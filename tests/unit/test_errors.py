"""tunepack.core.errors: each narrow type, its kind and exit code, and one real case's line.

A caller tells errors apart by these types, never by their words; the words stay what a user
reads, so each case below checks the whole line too. The command-line cases run ``tunepack``
in-process and record the error the CLI turned into its line (``_cli``).
"""

from __future__ import annotations

import errno
import inspect
import os
import signal

import pytest

from tunepack.core import errors, program
from tunepack.core.errors import (
    EXIT_BAD_INPUT,
    EXIT_TRANSIENT,
    BadDatasetError,
    BadInputError,
    BadModelError,
    BadValueError,
    ConflictError,
    DeniedError,
    DiskFullError,
    DoesNotFitError,
    GangNotPlaced,
    ImageNotPullable,
    NonFiniteLossError,
    NoObjectsError,
    NotAvailableError,
    NotFoundError,
    RuntimeInUseError,
    StoppedError,
    TransientError,
    TunepackError,
    UnknownKeyError,
    UnknownRuntimeError,
    UnsupportedError,
    WorkspaceBusyError,
    WorkspaceClaimedError,
)

# Every error type, the kind it narrows (the class whose exit code and meaning it keeps) and the
# exit code a program ends with. RuntimeInUseError, ImageNotPullable and NonFiniteLossError are
# raised only against a cluster or by a training run, WorkspaceClaimedError by a program in a
# workspace: their lines are pinned where those run (tests/integration/test_sdk_kubernetes.py,
# test_trainer_integrity.py, test_workspace_owner.py, test_cli_jobs.py).
KINDS = {
    BadInputError: (TunepackError, EXIT_BAD_INPUT),
    TransientError: (TunepackError, EXIT_TRANSIENT),
    NotAvailableError: (TunepackError, EXIT_BAD_INPUT),
    UnknownRuntimeError: (BadInputError, EXIT_BAD_INPUT),
    UnknownKeyError: (BadInputError, EXIT_BAD_INPUT),
    BadValueError: (BadInputError, EXIT_BAD_INPUT),
    ConflictError: (BadInputError, EXIT_BAD_INPUT),
    NotFoundError: (BadInputError, EXIT_BAD_INPUT),
    NoObjectsError: (NotFoundError, EXIT_BAD_INPUT),
    DeniedError: (BadInputError, EXIT_BAD_INPUT),
    BadDatasetError: (BadInputError, EXIT_BAD_INPUT),
    BadModelError: (BadInputError, EXIT_BAD_INPUT),
    DoesNotFitError: (BadInputError, EXIT_BAD_INPUT),
    UnsupportedError: (BadInputError, EXIT_BAD_INPUT),
    WorkspaceClaimedError: (ConflictError, EXIT_BAD_INPUT),
    WorkspaceBusyError: (TransientError, EXIT_TRANSIENT),
    DiskFullError: (TransientError, EXIT_TRANSIENT),
    RuntimeInUseError: (TransientError, EXIT_TRANSIENT),
    StoppedError: (TransientError, EXIT_TRANSIENT),
    NonFiniteLossError: (TransientError, EXIT_TRANSIENT),
    ImageNotPullable: (TunepackError, EXIT_BAD_INPUT),
}


def test_every_error_type_is_defined_once_here_and_has_a_row_above():
    defined = {
        obj
        for _, obj in inspect.getmembers(errors, inspect.isclass)
        if issubclass(obj, Exception) and obj.__module__ == errors.__name__
    }
    assert defined == {TunepackError, GangNotPlaced, *KINDS}


@pytest.mark.parametrize("narrow", list(KINDS), ids=lambda t: t.__name__)
def test_a_narrow_type_is_its_kind_with_the_kinds_exit_code(narrow):
    kind, code = KINDS[narrow]
    assert narrow.__bases__ == (kind,) or narrow is BadInputError
    assert narrow("message").exit_code == code
    # Bad input stays a ValueError, as the Kubeflow SDK raises for invalid input.
    assert issubclass(narrow, ValueError) == issubclass(narrow, BadInputError)
    assert narrow.__doc__ and narrow.__doc__.strip()


def test_the_gang_error_stays_the_timeout_error_the_sdks_wait_raises():
    from tunepack.backends.scheduling import Unscheduled

    waiting = Unscheduled(
        pod="job-node-0-0", reason="0/2 nodes are available", seconds=90.0, gang_timeout=60
    )
    error = GangNotPlaced("job", waiting)
    assert isinstance(error, TimeoutError) and not isinstance(error, TunepackError)
    assert error.waiting is waiting
    assert str(error) == (
        "TrainJob job could not be placed whole within its gang's 60 s (pod job-node-0-0: 0/2 "
        "nodes are available); it stays queued until the nodes it needs are free: free them, ask "
        "for fewer nodes or GPUs, or delete it"
    )


# --- the command line: `tunepack render serving` checks a run's arguments without a cluster ----


def _cli(capsys, monkeypatch, *argv: str) -> tuple[int, str, BaseException]:
    """Run ``tunepack render serving ARGV``: its exit code, its stderr and the error it said."""
    said = []

    def error_line(name: str, message: object) -> str:
        said.append(message)
        return real(name, message)

    real = program.error_line
    monkeypatch.setattr(program, "error_line", error_line)
    from tunepack.cli import main

    code = main(["render", "serving", "--name", "job", *argv])
    _, err = capsys.readouterr()
    assert len(said) == 1, said
    return code, err, said[0]


def test_an_unknown_runtime(capsys, monkeypatch):
    from tunepack.runtimes import catalog

    code, err, error = _cli(capsys, monkeypatch, "--runtime", "tunepack-nosuch")
    known = ", ".join(entry.runtime_name for entry in catalog.CATALOG.values())
    assert (code, type(error)) == (EXIT_BAD_INPUT, UnknownRuntimeError)
    assert err == (
        f"tunepack: error: unknown runtime or model 'tunepack-nosuch'; tunepack runtimes are: "
        f"{known}\n"
    )


@pytest.mark.parametrize(
    ("argv", "kind", "line"),
    [
        (
            ["epochz=2"],
            UnknownKeyError,
            "unknown trainer argument 'epochz'; did you mean 'epochs'?",
        ),
        (
            ["--bogus"],
            UnknownKeyError,
            "unrecognized arguments: --bogus (see `tunepack --help`)",
        ),
        (
            ["--max-model-len", "0"],
            BadValueError,
            "--max-model-len 0 is not valid: expected at least 1",
        ),
        (
            ["method=full", "lora_rank=8"],
            ConflictError,
            "lora_rank=8 sets LoRA adapters, but method=full trains every weight and has none; "
            "leave it out, or use method=lora",
        ),
        (
            ["method=dora"],
            UnsupportedError,
            "method=dora: vLLM does not load DoRA adapters; train with merge=true as well and "
            "serve the merged model (render serving with the same arguments then serves it)",
        ),
        (
            ["--result", "/nonexistent/run"],
            NotFoundError,
            "--result /nonexistent/run: no result.json there; give a finished run's result.json, "
            "or the workspace whose output/result.json the trainer wrote when it finished",
        ),
    ],
    ids=lambda v: v.__name__ if isinstance(v, type) else None,
)
def test_a_bad_argument_on_the_command_line(capsys, monkeypatch, argv, kind, line):
    code, err, error = _cli(capsys, monkeypatch, "--runtime", "tunepack-tiny-llama3", *argv)
    assert (code, type(error)) == (EXIT_BAD_INPUT, kind)
    assert err == f"tunepack: error: {line}\n"


def test_a_model_that_does_not_fit_the_gpus(capsys, monkeypatch):
    code, err, error = _cli(
        capsys, monkeypatch, "--runtime", "tunepack-llama3.1-70b", "--gpus", "1"
    )
    assert (code, type(error)) == (EXIT_BAD_INPUT, DoesNotFitError)
    assert err == (
        "tunepack: error: --gpus 1: llama3.1-70b needs 141.5 GiB per GPU on 1 x H100-80GB (131.4 "
        "weights + 5.0 KV cache (8 x 2048 tokens) + 0.3 LoRA + 4.8 vLLM), more than the 71.3 GiB "
        "vLLM uses of each; --gpus 4 fits (38.2 GiB of 71.3 per GPU)\n"
    )


# --- the initializers' and trainer's functions ---------------------------------------------------


def test_a_dataset_file_that_is_not_json(tmp_path):
    from tunepack.initializers.data import formats

    path = tmp_path / "train.json"
    path.write_text("[1, 2")
    with pytest.raises(BadDatasetError) as caught:
        list(formats.read_rows("train.json", path))
    assert str(caught.value) == (
        "train.json: not valid JSON (Expecting ',' delimiter at line 1 column 6); expected an "
        "array of rows"
    )


def test_a_model_directory_without_its_config(tmp_path):
    from tunepack.runtimes import custom

    with pytest.raises(BadModelError) as caught:
        custom.load_config(tmp_path / "config.json", f"model directory {tmp_path}")
    assert str(caught.value) == f"model directory {tmp_path} has no config.json"


def test_s3_answers_become_denied_and_no_objects():
    from botocore.exceptions import ClientError, NoCredentialsError

    from tunepack.initializers.transport import s3

    where = {"shown": "s3://bucket/data", "bucket": "bucket"}
    denied = s3.problem(NoCredentialsError(), **where)
    assert type(denied) is DeniedError
    assert (
        str(denied)
        == f"no AWS credentials were found for 's3://bucket/data'; {s3.CREDENTIALS_HINT}"
    )
    answer = {"Error": {"Code": "NoSuchKey"}, "ResponseMetadata": {"HTTPStatusCode": 404}}
    missing = s3.problem(ClientError(answer, "GetObject"), key="data/a.jsonl", **where)
    # An export fetch reads this type (only) as "no export there".
    assert type(missing) is NoObjectsError
    assert str(missing) == (
        "S3 URI 's3://bucket/data' matches no objects (object 'data/a.jsonl' not found); check "
        "the bucket and prefix"
    )


def test_a_busy_workspace(tmp_path):
    from tunepack.core.workspace import lock_workspace

    with lock_workspace(tmp_path, "local TrainJob 'first'"):
        with pytest.raises(WorkspaceBusyError) as caught:
            lock_workspace(tmp_path, "local TrainJob 'second'")
    assert str(caught.value).startswith(
        f"workspace {tmp_path} is in use by local TrainJob 'first' (pid {os.getpid()} on host "
    )


# --- a program's end: core.program.run turns these into the line and the exit code -------------


def _run(capsys, body) -> tuple[int, str]:
    code = program.run("tunepack-step", body)
    return code, capsys.readouterr().err


def test_a_full_disk_ends_the_program_with_the_retriable_code(capsys):
    def body():
        raise OSError(errno.ENOSPC, "No space left on device")

    assert _run(capsys, body) == (
        EXIT_TRANSIENT,
        "tunepack-step: error: no space left on the device (or quota): free space or enlarge "
        "the volume, then run again\n",
    )


def test_a_stop_signal_is_a_stopped_error_with_the_retriable_code(capsys):
    seen = []

    def body():
        try:
            os.kill(os.getpid(), signal.SIGTERM)  # the handler raises in this thread
        except StoppedError as error:
            seen.append(error)
            raise

    assert _run(capsys, body) == (
        EXIT_TRANSIENT,
        "tunepack-step: error: stopped by SIGTERM (preemption or shutdown); nothing was "
        "published, the step can be retried\n",
    )
    assert len(seen) == 1


def test_an_initializers_narrow_error_ends_it_with_its_line_and_its_kinds_code(capsys):
    from tunepack.initializers.transport import uri

    def body():
        uri.resolve(uri.parse("file:///nonexistent/data"))

    assert _run(capsys, body) == (
        EXIT_BAD_INPUT,
        "tunepack-step: error: storage URI 'file:///nonexistent/data' points to "
        "/nonexistent/data, which does not exist (file:// paths are read on the machine that "
        "runs the initializer)\n",
    )
