# ruff: noqa: E501 (tables of cases read best one case per line)
"""Every user mistake is one clear message, on the command line and in Python alike.

Each row is a real mistake: CLI flags and ``key=value`` arguments, FineTune fields, Initializer
URIs, runtime and job names, workspaces and jobs dirs, dataset files (bad rows, wrong schema,
empty, a split that is not there), model directories (truncated or missing weights, a wrong
config), the other commands' arguments and the Python client's methods. Each asserts the exit
code (65: bad input, do not retry) or the exception type, and the message the user reads: it
names the offending value and says what was expected. Nothing is half-written: a refused
``train --local`` records no job.

Counts (the other files that test bad input) are in docs/sdk.md, "Bad input".
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from kubeflow.trainer import (
    BuiltinTrainer,
    CustomTrainer,
    DataCacheInitializer,
    HuggingFaceModelInitializer,
    LoraConfig,
    S3DatasetInitializer,
    TorchTuneConfig,
    TorchTuneInstructDataset,
)
from kubeflow.trainer.options import Name

from tunepack import FineTune, Initializer, LocalBackendConfig, TrainingClient
from tunepack.cli import main
from tunepack.core.errors import (
    BadValueError,
    ConflictError,
    DoesNotFitError,
    NotFoundError,
    UnknownKeyError,
    UnknownRuntimeError,
    UnsupportedError,
)

EXIT_BAD_INPUT = 65
RUNTIME = "tunepack-tiny-llama3"
BIG = "tunepack-llama3.1-8b"  # a runtime with GPUs: the memory planner applies


@pytest.fixture
def jobs(tmp_path, monkeypatch) -> Path:
    """A fresh jobs dir for each case, and the working directory (default workspaces) in tmp."""
    monkeypatch.setenv("TUNEPACK_HOME", str(tmp_path / "home"))
    monkeypatch.chdir(tmp_path)
    return tmp_path / "home" / "jobs"


def run_cli(capsys, argv: list[str]) -> tuple[int, str, str]:
    code = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    assert "Traceback" not in out + err
    return code, out, err


def assert_error(capsys, argv, *fragments: str, code: int = EXIT_BAD_INPUT) -> str:
    """One ``tunepack: error:`` line (the planner's table aside) with every fragment in it."""
    got, out, err = run_cli(capsys, argv)
    assert got == code, err + out
    assert err.startswith("tunepack: error: "), err
    for fragment in fragments:
        assert fragment in err, (fragment, err)
    return err


def _train(data, model, *extra) -> list[str]:
    return ["train", "--local", "--runtime", RUNTIME, "--dataset", data, "--model", model, *extra]


# --- train --local: flags and key=value arguments, refused before anything runs ----------------

D, M = "/data/train.jsonl", "/models/tiny"  # never read: every row is refused before a step runs

TRAIN_ARGS = [
    ("no-equals", ["epochs"], ["trainer argument 'epochs' is not of the form key=value"]),
    ("no-key", ["=3"], ["trainer argument '=3' is not of the form key=value"]),
    ("empty-value", ["epochs="], ["epochs='' is not valid", "an integer from 1 to 1000"]),
    ("epochs-0", ["epochs=0"], ["epochs='0' is not valid", "an integer from 1 to 1000"]),
    ("epochs-word", ["epochs=three"], ["epochs='three' is not valid"]),
    ("epochs-float", ["epochs=1.5"], ["epochs='1.5' is not valid", "an integer"]),
    ("lr-negative", ["lr=-1"], ["lr='-1' is not valid", "a number > 0.0 and < 1.0"]),
    ("lr-zero", ["lr=0"], ["lr='0' is not valid", "> 0.0"]),
    ("lr-word", ["lr=fast"], ["lr='fast' is not valid"]),
    ("unknown-key", ["lora_r=8"], ["unknown trainer argument 'lora_r'", "lora_rank"]),
    ("key-case", ["Epochs=2"], ["unknown trainer argument 'Epochs'"]),
    ("repeated", ["epochs=1", "epochs=2"], ["trainer argument 'epochs' is given twice"]),
    ("method", ["method=sft"], ["method='sft' is not valid", "lora, qlora, dora, full"]),
    ("component", ["_component_=os.system"], ["'_component_' is not part of tunepack's"]),
    ("dotted-override", ["optimizer.lr=1"], ["optimizer.lr"]),
    ("seq-len-too-long", ["max_seq_len=99999"], ["max_seq_len=99999 is larger than", "512"]),
    ("seq-len-tiny", ["max_seq_len=4"], ["max_seq_len='4' is not valid"]),
    ("batch-0", ["batch_size=0"], ["batch_size='0' is not valid", "from 1 to 4096"]),
    ("grad-accum-0", ["grad_accum=0"], ["grad_accum='0' is not valid"]),
    ("dtype", ["dtype=fp8"], ["dtype='fp8' is not valid", "auto, fp32, bf16"]),
    ("device", ["device=tpu"], ["device='tpu' is not valid"]),
    ("attn-modules", ["lora_attn_modules=q_proj,qkv"], ["lora_attn_modules='q_proj,qkv'"]),
    ("bool", ["train_on_input=maybe"], ["train_on_input='maybe' is not valid", "true or false"]),
    ("dropout", ["lora_dropout=1.5"], ["lora_dropout='1.5' is not valid"]),
    ("rank-0", ["lora_rank=0"], ["lora_rank='0' is not valid"]),
    ("alpha-negative", ["lora_alpha=-2"], ["lora_alpha='-2' is not valid"]),
    ("seed-negative", ["seed=-1"], ["seed='-1' is not valid"]),
    ("keep-0", ["keep_checkpoints=0"], ["keep_checkpoints='0' is not valid"]),
    ("qlora-on-tiny", ["method=qlora"], ["method=qlora cannot quantize tiny-llama3"]),
    ("full-with-lora-rank", ["method=full", "lora_rank=8"], ["lora_rank=8 sets LoRA adapters", "method=full trains every weight"]),
    # The CLI's words: the arguments as given (not FineTune's repr of them), no "FineTune:" before.
    ("full-with-lora-keys", ["method=full", "lora_alpha=16", "lora_mlp=false"], ["error: lora_alpha=16, lora_mlp=false set LoRA", "leave them out"]),
    ("full-with-merge", ["method=full", "merge=true"], ["error: merge=true merges a LoRA adapter into the base, but method=full trains every weight", "or use method=lora"]),
]  # fmt: skip


@pytest.mark.parametrize(
    ("args", "fragments"), [r[1:] for r in TRAIN_ARGS], ids=[r[0] for r in TRAIN_ARGS]
)
def test_train_arguments(capsys, jobs, args, fragments):
    assert_error(capsys, _train(D, M, *args), *fragments)
    assert not jobs.exists()  # nothing recorded


TRAIN_FLAGS = [
    # The flags' names, not FineTune's fields (issue 49, item 4).
    ("nodes-0", ["--num-nodes", "0"], ["error: --num-nodes 0 is not valid: expected an integer >= 1\n"]),
    ("nodes-negative", ["--num-nodes", "-2"], ["error: --num-nodes -2 is not valid"]),
    ("nproc-0", ["--num-proc-per-node", "0"], ["error: --num-proc-per-node 0 is not valid"]),
    ("export-secret-alone", ["--export-secret", "creds"], ["error: --export-secret names the exporter's credentials, but --export is not set; give --export s3://bucket/prefix (or hf://org/name) too\n"]),
    ("name-uppercase", ["--name", "My_Job"], ["TrainJob name 'My_Job' is not a valid DNS-1123 label"]),
    ("name-digit-first", ["--name", "1job"], ["TrainJob name '1job' must start with a letter"]),
    ("name-too-long", ["--name", "j" * 40], ["is 40 characters; at most 33 are allowed"]),
    ("name-path", ["--name", "../escape"], ["TrainJob name '../escape' is not a valid DNS-1123"]),
    ("name-empty", ["--name", ""], ["TrainJob name '' is not a valid DNS-1123 label"]),
    ("name-trailing-dash", ["--name", "job-"], ["TrainJob name 'job-' is not a valid"]),
    ("queue-local", ["--queue", "team"], ["--queue team names a Kueue queue on a cluster"]),
    ("gpu-unknown", ["--gpu", "RTX-4090"], ["gpu='RTX-4090' is not known", "H100-80GB"]),
]  # fmt: skip


@pytest.mark.parametrize(
    ("args", "fragments"), [r[1:] for r in TRAIN_FLAGS], ids=[r[0] for r in TRAIN_FLAGS]
)
def test_train_flags(capsys, jobs, args, fragments):
    assert_error(capsys, _train(D, M, *args), *fragments)
    assert not jobs.exists()


RUNTIMES = [
    ("unknown", "gpt-5", ["runtime 'gpt-5' is not available on the local backend", "tunepack-tiny-llama3"]),
    ("model-typo", "tunepack-tiny-lama3", ["unknown runtime or model 'tunepack-tiny-lama3'", "did you mean 'tunepack-tiny-llama3'?"]),
    ("short-typo", "tiny-lama3", ["runtime 'tiny-lama3' is not available", "did you mean"]),
    ("upstream-name", "torchtune-llama3.2-1b", ["runtime 'torchtune-llama3.2-1b' is not available", "tunepack runtimes only"]),
    ("empty", "", ["runtime '' is not available"]),
]  # fmt: skip


@pytest.mark.parametrize(
    ("runtime", "fragments"), [r[1:] for r in RUNTIMES], ids=[r[0] for r in RUNTIMES]
)
def test_train_runtime_names(capsys, jobs, runtime, fragments):
    argv = ["train", "--local", "--runtime", runtime, "--dataset", D, "--model", M]
    assert_error(capsys, argv, *fragments)
    assert not jobs.exists()


URIS = [
    ("empty", "", M, ["dataset_uri must be a non-empty storage URI, got ''"]),
    ("blank", "   ", M, ["dataset_uri must be a non-empty storage URI"]),
    ("ftp", "ftp://host/d.jsonl", M, ["unsupported storage URI 'ftp://host/d.jsonl'", "file://, hf://, s3://, https://"]),
    ("file-host", "file://host/d.jsonl", M, ["file URI 'file://host/d.jsonl' has a host part", "three slashes"]),
    ("file-option", "file:///d.jsonl?spilt=test", M, ["has unknown option 'spilt'", "?split=<name>"]),
    ("file-query", "file:///d.jsonl?test", M, ["file URI 'file:///d.jsonl?test=***' has unknown option 'test'"]),
    ("s3-no-bucket", D, "s3://", ["names bucket '', which is not a valid bucket name"]),
    ("s3-bad-bucket", "s3://My_Bucket/d.jsonl", M, ["names bucket 'My_Bucket', which is not a valid bucket name"]),
    ("hf-empty", D, "hf://", ["does not name a repository", "hf://org/name"]),
    ("hf-org-only", D, "hf://meta-llama", ["hub URI 'hf://meta-llama' does not name a repository"]),
    ("hf-option", "hf://datasets/org/d?subsett=x", M, ["has unknown option 'subsett'"]),
    ("https-sha", "https://host/d.jsonl#sha256=abc", M, ["is not 64 hexadecimal digits"]),
    ("password-hidden", "ftp://user:hunter2@host/d", M, ["unsupported storage URI", "***"]),
]  # fmt: skip


@pytest.mark.parametrize(
    ("dataset", "model", "fragments"), [r[1:] for r in URIS], ids=[r[0] for r in URIS]
)
def test_train_storage_uris(capsys, jobs, dataset, model, fragments):
    err = assert_error(capsys, _train(dataset, model), *fragments)
    assert "hunter2" not in err  # a password in a URI never reaches the console
    assert not jobs.exists()


def test_split_of_a_single_file(capsys, jobs, tiny_dataset_file, tiny_model_dir):
    """A file has one split (train): asking it for another is refused, not trained on whole."""
    dataset = f"file://{tiny_dataset_file}?split=test"
    assert_error(
        capsys,
        _train(dataset, str(tiny_model_dir)),
        f"dataset '{dataset}' is a single file, which has no 'test' split",
        "a directory with one file per split",
    )
    assert not jobs.exists()


@pytest.mark.parametrize("kind", ["file", "below-a-file"])
def test_workspace_that_cannot_be_one(capsys, jobs, tmp_path, kind):
    (tmp_path / "f").write_text("")
    workspace = tmp_path / "f" if kind == "file" else tmp_path / "f" / "ws"
    expected = "is a file, not a directory" if kind == "file" else f"{tmp_path / 'f'} is a file"
    # Sources that exist, so the workspace is what is refused (nothing reads them).
    sources = (str(tmp_path / "f"), str(tmp_path))
    assert_error(
        capsys, _train(*sources, "--workspace", workspace), f"--workspace {workspace}", expected
    )


EMPTY_PATHS = [
    ("workspace", _train(D, M, "--workspace", ""), "--workspace is empty; give a directory"),
    ("jobs-dir", ["jobs", "--local", "--jobs-dir", ""], "--jobs-dir is empty; give a directory"),
    ("jobs-dir-train", _train(D, M, "--jobs-dir", " "), "--jobs-dir is empty"),
]  # fmt: skip


@pytest.mark.parametrize(
    ("argv", "fragment"), [r[1:] for r in EMPTY_PATHS], ids=[r[0] for r in EMPTY_PATHS]
)
def test_empty_paths_are_refused_not_defaulted(capsys, jobs, argv, fragment):
    assert_error(capsys, argv, fragment)
    assert not jobs.exists()


@pytest.mark.parametrize("command", ["tiny-model", "tiny-dataset"])
def test_tiny_writers_below_a_file(capsys, jobs, tmp_path, command):
    (tmp_path / "f").write_text("")
    assert_error(
        capsys,
        [command, tmp_path / "f" / "out"],
        f"cannot write {tmp_path / 'f' / 'out'}: {tmp_path / 'f'} is a file",
    )


def test_tiny_dataset_into_a_directory(capsys, jobs, tmp_path):
    assert_error(
        capsys,
        ["tiny-dataset", tmp_path],
        f"{tmp_path} is a directory; give the path of the dataset file",
        "instructions.jsonl",
    )


@pytest.mark.parametrize("command", ["jobs", "status", "train"])
def test_jobs_dir_that_is_a_file(capsys, jobs, tmp_path, command):
    (tmp_path / "jobs-file").write_text("")
    argv = {
        "jobs": ["jobs", "--local"],
        "status": ["status", "j", "--local"],
        "train": _train(D, M),
    }[command]
    assert_error(
        capsys,
        [*argv, "--jobs-dir", tmp_path / "jobs-file"],
        f"--jobs-dir {tmp_path / 'jobs-file'} is a file, not a directory",
    )


USAGE = [
    ("memory-check", _train(D, M, "--memory-check", "never"), ["argument --memory-check: invalid choice: 'never' (choose from 'refuse', 'warn', 'off')", "(see `tunepack train --help`)"]),
    ("nodes-word", _train(D, M, "--num-nodes", "two"), ["argument --num-nodes: invalid int value: 'two'"]),
    ("no-runtime", ["train", "--local", "--dataset", D, "--model", M], ["the following arguments are required: --runtime"]),
    ("no-command", [], ["the following arguments are required: command", "(see `tunepack --help`)"]),
    ("unknown-command", ["fine-tune"], ["argument command: invalid choice: 'fine-tune'"]),
    ("unknown-flag", [*_train(D, M), "--epochs", "3"], ["unrecognized arguments: --epochs"]),
    ("plan-seq-len-word", ["plan", "--model", "llama3.2-1b", "--seq-len", "2k"], ["argument --seq-len: invalid int value: '2k'"]),
    ("logs-no-name", ["logs", "--local"], ["the following arguments are required: name"]),
]  # fmt: skip


@pytest.mark.parametrize(("argv", "fragments"), [r[1:] for r in USAGE], ids=[r[0] for r in USAGE])
def test_usage_mistakes_are_bad_input_too(capsys, jobs, argv, fragments):
    err = assert_error(capsys, argv, *fragments)
    assert len(err.splitlines()) == 1


# --- the same plan that does not fit, refused the same way on both local paths ------------------


def test_a_plan_that_does_not_fit_is_refused_alike_by_cli_and_python(capsys, jobs):
    data, model = "/data/train.jsonl", "/models/llama3.1-8b"
    args = ["method=full", "batch_size=64", "max_seq_len=8192"]
    argv = ["train", "--local", "--runtime", BIG, "--dataset", data, "--model", model, *args]
    err = assert_error(capsys, argv, "this fine-tune is estimated not to fit in GPU memory:")
    assert "does NOT fit in 77.2 GiB usable per device" in err
    # Each caller's words for the ways out: the command's flags here, the SDK's in Python.
    assert err.splitlines()[-1] == (
        "Lower max_seq_len or batch_size, add GPUs (--gpus-per-node / --num-nodes), choose "
        "method=qlora where available, or pass --memory-check warn to submit anyway (see "
        "docs/planner.md)."
    )

    client = TrainingClient(LocalBackendConfig(root_dir=str(jobs)))
    with pytest.raises(DoesNotFitError) as refused:
        client.train(
            runtime=BIG,
            initializer=Initializer(dataset=data, model=model),
            trainer=FineTune(method="full", batch_size=64, max_seq_len=8192),
        )
    assert str(refused.value).splitlines()[-1] == (
        "Lower max_seq_len or batch_size, add GPUs (resources_per_node / num_nodes), choose "
        "method='qlora' where available, or pass memory_check='warn' to TrainingClient to submit "
        "anyway (see docs/planner.md)."
    )
    # The plan itself is the very same.
    assert err.splitlines()[:-1] == f"tunepack: error: {refused.value}".splitlines()[:-1]
    assert not jobs.exists()

    # On a smaller GPU type both refuse too, and say which (spelled as users do: l4, L4-24gb).
    assert_error(capsys, [*argv, "--gpu", "l4"], "1 node(s) x 1 L4-24GB")
    small = TrainingClient(LocalBackendConfig(root_dir=str(jobs), gpu="L4-24gb"))
    with pytest.raises(DoesNotFitError) as refused:
        small.train(
            runtime=BIG,
            initializer=Initializer(dataset=data, model=model),
            trainer=FineTune(method="full", batch_size=64, max_seq_len=8192),
        )
    assert str(refused.value).splitlines()[1] == (
        "llama3.1-8b full, seq_len 8192, batch 64/device, 1 node(s) x 1 L4-24GB"
    )
    assert (refused.value.gpu, refused.value.have_gib) == ("L4-24GB", 20.0)
    assert refused.value.need_gib > refused.value.have_gib


def test_memory_check_warn_lets_the_run_go_on_both_paths(capsys, jobs, tiny_dataset_file):
    """With warn, the plan is said and the submission goes on to its next check: here the model
    directory that does not exist, refused before any step runs."""
    missing = jobs.parent / "no-model"
    argv = [
        "train", "--local", "--runtime", BIG, "--dataset", tiny_dataset_file, "--model", missing,
        "--memory-check", "warn", "method=full", "batch_size=64", "max_seq_len=8192",
    ]  # fmt: skip
    code, out, err = run_cli(capsys, argv)
    assert code == EXIT_BAD_INPUT, err
    assert "tunepack: warning: this fine-tune is estimated not to fit in GPU memory" in err
    assert err.splitlines()[-1] == (
        f"tunepack: error: model '{missing}' does not exist; give an existing file or directory "
        "on this machine, or an hf://, s3:// or https:// URI"
    )
    assert "==> " not in out and not jobs.exists()


@pytest.mark.parametrize("form", ["path", "file-uri"])
@pytest.mark.parametrize("what", ["dataset", "model"])
def test_a_local_source_that_does_not_exist_is_refused_at_submission(
    capsys, jobs, tmp_path, tiny_dataset_file, tiny_model_dir, what, form
):
    missing = tmp_path / f"no-{what}"
    given = str(missing) if form == "path" else missing.as_uri()
    sources = {"dataset": str(tiny_dataset_file), "model": str(tiny_model_dir), what: given}
    argv = ["train", "--local", "--runtime", RUNTIME, "--dataset", sources["dataset"],
            "--model", sources["model"], "max_steps=1"]  # fmt: skip
    err = assert_error(capsys, argv, f"{what} '{given}' does not exist")
    assert err == (
        f"tunepack: error: {what} '{given}' does not exist"
        + ("" if form == "path" else f" ({missing})")
        + "; give an existing file or directory on this machine, or an hf://, s3:// or https:// URI\n"
    )
    client = TrainingClient(LocalBackendConfig(root_dir=str(jobs)))
    with pytest.raises(NotFoundError) as refused:
        client.train(
            runtime=RUNTIME,
            initializer=Initializer(dataset=sources["dataset"], model=sources["model"]),
            trainer=FineTune(max_steps=1),
        )
    assert err == f"tunepack: error: {refused.value}\n"  # the very same message
    assert not jobs.exists()  # nothing recorded, nothing ran


@pytest.mark.parametrize(
    ("rows", "method", "schema_flag", "needs"),
    [
        (
            "instructions",
            "dpo",
            None,
            "a preference dataset (rows with 'prompt', 'chosen' and 'rejected')",
        ),
        (
            "chats",
            "grpo",
            None,
            "a prompt dataset (rows with a 'prompt' (a string or chat turns) and, for rewards that check it, an 'answer')",
        ),
        (
            "instructions",
            "kto",
            "preference",
            "an unpaired dataset (rows with 'prompt', 'completion' and a boolean 'label' (whether the answer is desirable))",
        ),
    ],
    ids=["dpo-on-instructions", "grpo-on-chats", "kto-on-a-named-schema"],
)
def test_a_method_the_dataset_does_not_fit_is_refused_at_submission(
    capsys, jobs, tmp_path, tiny_dataset_file, tiny_model_dir, rows, method, schema_flag, needs
):
    """Issue 49, item 6: the trainer found it, after both initializers ran. A local file's first
    row (or --dataset-schema) shows the schema: refused before any step, in one line."""
    data = tiny_dataset_file
    if rows == "chats":
        turns = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]
        data = _write(tmp_path / "chats.jsonl", [json.dumps({"messages": turns})])
    schema = schema_flag or {"instructions": "instruction", "chats": "chat"}[rows]
    flags = ["--dataset-schema", schema_flag] if schema_flag else []
    argv = _train(data, tiny_model_dir, *flags, f"method={method}", "max_steps=1")
    code, out, err = run_cli(capsys, argv)
    assert code == EXIT_BAD_INPUT, err
    assert err == (
        f"tunepack: error: method={method} needs {needs}, but the dataset's schema is {schema!r}\n"
    )
    assert "==> " not in out and not jobs.exists()  # no step ran, nothing recorded


# --- dataset files and model directories: the step's error, with its rows, on the console -------


def _rows(tiny_dataset_file, n=12) -> list[dict]:
    return [json.loads(line) for line in tiny_dataset_file.read_text().splitlines()[:n]]


def _write(path: Path, lines: list[str]) -> Path:
    path.write_text("".join(line + "\n" for line in lines))
    return path


def _datasets(tmp: Path, rows: list[dict]) -> dict[str, tuple[Path, list[str]]]:
    good = [json.dumps(r) for r in rows]
    bad_json = list(good)
    bad_json[3] = bad_json[8] = "{oops"
    wrong_type = list(good)
    wrong_type[4] = json.dumps({"instruction": 5, "output": "x"})
    no_output = list(good)
    no_output[1] = json.dumps({"instruction": "hi"})
    many_bad = ["[1, 2]"] * 9
    (tmp / "empty-dir").mkdir()
    (tmp / "empty-dir" / "notes.txt").write_text("not data")
    return {
        "empty": (_write(tmp / "empty.jsonl", []), ["has no rows", "'instruction' and 'output'"]),
        "bad-json-rows": (
            _write(tmp / "bad.jsonl", bad_json),
            ["has 2 invalid rows", "bad.jsonl row 4: not valid JSON", "bad.jsonl row 9: not valid"],
        ),
        "wrong-type": (
            _write(tmp / "types.jsonl", wrong_type),
            ["has 1 invalid row", "types.jsonl row 5: field 'instruction' must be a string"],
        ),
        "missing-field": (
            _write(tmp / "missing.jsonl", no_output),
            ["has 1 invalid row", "missing.jsonl row 2:", "'output'"],
        ),
        "first-rows-only": (
            _write(tmp / "lists.jsonl", many_bad),
            ["has 9 invalid rows", "lists.jsonl row 1:", "lists.jsonl row 5:"],
        ),
        "wrong-schema": (
            _write(tmp / "qa.jsonl", [json.dumps({"question": "q", "answer": "a"})]),
            # the CLI's words: its flags, not the initializer's variables
            [
                "cannot tell the schema",
                "'question', 'answer'",
                "rename columns with --column-map from:to,... or set --dataset-schema\n",
            ],
        ),
        "json-object": (
            _write(tmp / "obj.json", [json.dumps({"rows": []})]),
            ["holds a JSON object, not an array of rows"],
        ),
        "no-data-files": (tmp / "empty-dir", ["has no", "files"]),
    }


DATASET_CASES = [
    "empty", "bad-json-rows", "wrong-type", "missing-field", "first-rows-only", "wrong-schema",
    "json-object", "no-data-files",  # a path that is not there: refused at submission (below)
]  # fmt: skip


@pytest.mark.parametrize("case", DATASET_CASES)
def test_dataset_files(capsys, jobs, tmp_path, tiny_dataset_file, tiny_model_dir, case):
    path, fragments = _datasets(tmp_path, _rows(tiny_dataset_file))[case]
    code, out, err = run_cli(capsys, _train(path, tiny_model_dir, "--quiet", "max_steps=1"))
    assert code == EXIT_BAD_INPUT, err
    head, *detail = err.splitlines()
    assert head.startswith("tunepack: step 'dataset-initializer' failed with exit code 65")
    assert detail[0].startswith("  dataset-initializer: error: ")
    for fragment in fragments:
        assert fragment in err, (fragment, err)
    if case == "first-rows-only":  # the first few rows, not all nine
        assert "lists.jsonl row 9" not in err and len(detail) <= 6
    assert list(Path(".tunepack/runs").glob("*/dataset/*.jsonl")) == []  # nothing half-written


def test_the_offending_rows_reach_status_and_python_too(
    capsys, jobs, tmp_path, tiny_dataset_file, tiny_model_dir
):
    """A `train --local` job whose rows were refused: `tunepack status` and `get_job().message`
    name the rows as the console did."""
    path, _ = _datasets(tmp_path, _rows(tiny_dataset_file))["bad-json-rows"]
    code, out, _ = run_cli(capsys, _train(path, tiny_model_dir, "--quiet", "--name", "rows"))
    assert code == EXIT_BAD_INPUT
    code, out, _ = run_cli(capsys, ["status", "rows", "--local"])
    assert code == EXIT_BAD_INPUT  # the failed step's: bad input (README, Exit codes)
    assert "bad.jsonl row 4: not valid JSON" in out and "bad.jsonl row 9: not valid JSON" in out
    job = TrainingClient(LocalBackendConfig(root_dir=str(jobs))).get_job("rows")
    assert job.exit_code == EXIT_BAD_INPUT
    message = job.message
    assert message.startswith("step 'dataset-initializer' failed with exit code 65")
    assert "\n  bad.jsonl row 4: not valid JSON" in message


def _models(tmp: Path, source: Path) -> dict[str, tuple[Path, list[str]]]:
    def copy(name: str) -> Path:
        return Path(shutil.copytree(source, tmp / name, copy_function=shutil.copy2))

    truncated = copy("truncated")
    data = (truncated / "model.safetensors").read_bytes()
    (truncated / "model.safetensors").write_bytes(data[: len(data) // 2])
    garbage = copy("garbage")
    (garbage / "model.safetensors").write_bytes(b"<html>403 Forbidden</html>")
    empty = copy("empty-weights")
    (empty / "model.safetensors").write_bytes(b"")
    missing = copy("no-weights")
    (missing / "model.safetensors").unlink()
    no_tokenizer = copy("no-tokenizer")
    (no_tokenizer / "tokenizer.json").unlink()
    bad_config = copy("bad-config")
    (bad_config / "config.json").write_text("{not json")
    other = copy("other-model")
    config = json.loads((other / "config.json").read_text())
    (other / "config.json").write_text(json.dumps({**config, "hidden_size": 128}))
    a_file = tmp / "model.safetensors"
    a_file.write_bytes(data)
    return {
        "truncated-weights": (truncated, ["damaged model.safetensors", f"has {len(data) // 2} bytes, but its header describes {len(data)}", "truncated"]),
        "not-safetensors": (garbage, ["damaged model.safetensors", "not a safetensors file"]),
        "empty-weights": (empty, ["damaged model.safetensors", "has 0 bytes"]),
        "missing-weights": (missing, ["is missing model.safetensors", "checkpoint loader"]),
        "missing-tokenizer": (no_tokenizer, ["is missing tokenizer.json", "tokenizer needs"]),
        "config-not-json": (bad_config, ["config.json that is not valid JSON"]),
        "other-model": (other, ["is not tiny-llama3", "hidden_size=128 (expected 96)"]),
        "a-file": (a_file, ["is not a directory"]),
    }  # fmt: skip


MODEL_CASES = [
    "truncated-weights", "not-safetensors", "empty-weights", "missing-weights",
    "missing-tokenizer", "config-not-json", "other-model", "a-file",
]  # fmt: skip


@pytest.mark.parametrize("case", MODEL_CASES)
def test_model_directories(capsys, jobs, tmp_path, tiny_dataset_file, tiny_model_dir, case):
    path, fragments = _models(tmp_path, tiny_model_dir)[case]
    code, out, err = run_cli(capsys, _train(tiny_dataset_file, path, "--quiet", "max_steps=1"))
    assert code == EXIT_BAD_INPUT, err
    head, detail = err.splitlines()[:2]
    assert head.startswith("tunepack: step 'model-initializer' failed with exit code 65"), err
    assert detail.startswith("  model-initializer: error: model at "), err
    for fragment in fragments:
        assert fragment in detail, (fragment, detail)
    assert list(Path(".tunepack/runs").glob("*/model/*")) == []  # the trainer never started


FAILED_STEP = (
    "tunepack: step '{}' failed with exit code 65 (bad input: fix it and run again); log: "
)


def test_a_model_initializer_run_by_the_cli_names_its_flag_and_says_it_once(
    capsys, jobs, tmp_path, tiny_dataset_file, tiny_model_dir
):
    """Issue 49, item 4: the source is the --model the user gave (STORAGE_URI only in a Pod);
    each purpose once, with its files; the error line once (it was echoed as the step wrote it,
    then repeated under the step's failure)."""
    model = Path(shutil.copytree(tiny_model_dir, tmp_path / "partial"))
    for name in ("config.json", "model.safetensors", "tokenizer.json"):
        (model / name).unlink()
    code, out, err = run_cli(capsys, _train(tiny_dataset_file, model, "max_steps=1"))
    assert code == EXIT_BAD_INPUT, err
    head, line = err.splitlines()
    assert head.startswith(FAILED_STEP.format("model-initializer"))
    assert head.endswith("/logs/model-initializer.log")
    assert line == (
        f"  model-initializer: error: model at '{model}' is missing config.json and "
        "model.safetensors, which the tiny-llama3 checkpoint loader needs; and tokenizer.json, "
        "which the tiny-llama3 tokenizer needs. Point --model at a complete copy of "
        "tunepack/tiny-llama3"
    )
    assert "error:" not in out, out  # the console's echo of the step held it back


def test_the_error_and_its_rows_are_shown_once(
    capsys, jobs, tmp_path, tiny_dataset_file, tiny_model_dir
):
    """The rows that detail a failed step's error come with it, once, under the step's failure
    on stderr, as with --quiet (test_dataset_files)."""
    path, _ = _datasets(tmp_path, _rows(tiny_dataset_file))["bad-json-rows"]
    code, out, err = run_cli(capsys, _train(path, tiny_model_dir, "max_steps=1"))
    assert code == EXIT_BAD_INPUT, err
    head, *detail = err.splitlines()
    assert head.startswith(FAILED_STEP.format("dataset-initializer"))
    assert detail[0].startswith(
        f"  dataset-initializer: error: dataset '{path}' has 2 invalid rows"
    )
    assert detail[1:] == [
        f"    bad.jsonl row {n}: not valid JSON (Expecting property name enclosed in double "
        "quotes at column 2)"
        for n in (4, 9)
    ]
    assert "error:" not in out and "bad.jsonl row" not in out, out
    assert "[dataset-initializer] dataset-initializer: read 10 rows and 2 invalid rows" in out


@pytest.mark.parametrize("given", ["flag", "shell"])
def test_a_setting_from_the_shell_is_named_as_the_variable(
    capsys, jobs, tmp_path, monkeypatch, tiny_dataset_file, tiny_model_dir, given
):
    """Issue 49, item 4: COLUMN_MAP exported in the shell reaches the dataset initializer of
    `train --local`, whose message named it --column-map, a flag the user never passed."""
    flags = ["--column-map", "questoin:instruction"] if given == "flag" else []
    if given == "shell":
        monkeypatch.setenv("COLUMN_MAP", "questoin:instruction")
    argv = _train(tiny_dataset_file, tiny_model_dir, "--quiet", *flags, "max_steps=1")
    code, _, err = run_cli(capsys, argv)
    assert code == EXIT_BAD_INPUT, err
    name = "--column-map" if given == "flag" else "COLUMN_MAP"
    assert err.splitlines()[1] == (
        f"  dataset-initializer: error: {name} names column 'questoin', which no row of dataset "
        f"'{tiny_dataset_file}' has; its columns are 'instruction', 'input', 'output'"
    )


# --- the other commands -------------------------------------------------------------------------

OTHER_COMMANDS = [
    ("plan-model", ["plan", "--model", "gpt-5"], ["unknown runtime or model 'gpt-5'"]),
    ("plan-method", ["plan", "--model", "llama3.2-1b", "--method", "sft"], ["method='sft' is not valid", "lora, qlora, dora, full, dpo"]),
    ("plan-seq-len", ["plan", "--model", "llama3.2-1b", "--seq-len", "0"], ["seq_len=0 is not valid", "an integer >= 1"]),
    ("plan-seq-too-long", ["plan", "--model", "tiny-llama3", "--seq-len", "4096"], ["seq_len=4096 is larger than tiny-llama3's context of 512"]),
    ("plan-batch", ["plan", "--model", "llama3.2-1b", "--batch-size", "0"], ["batch_size=0 is not valid"]),
    ("plan-gpu", ["plan", "--model", "llama3.2-1b", "--gpu", "H300"], ["gpu='H300' is not known", "H100-80GB"]),
    ("plan-nodes", ["plan", "--model", "llama3.2-1b", "--nodes", "0"], ["nodes=0 is not valid"]),
    ("plan-gpus-per-node", ["plan", "--model", "llama3.2-1b", "--gpus-per-node", "0"], ["gpus_per_node=0 is not valid"]),
    ("plan-lora-rank", ["plan", "--model", "llama3.2-1b", "--lora-rank", "0"], ["lora_rank=0 is not valid", "an integer >= 1"]),
    ("plan-full-lora-rank", ["plan", "--model", "llama3.2-1b", "--method", "full", "--lora-rank", "8"], ["--lora-rank 8 is a LoRA setting, but --method full"]),
    ("install-runtime", ["install", "--runtime", "tunepack-gpt-5"], ["unknown runtime or model 'tunepack-gpt-5'"]),
    ("install-namespace", ["install", "--namespace", "Team_A"], ["--namespace 'Team_A' is not a valid DNS-1123 label"]),
    ("install-delete-timeout", ["install", "--delete-timeout", "-1"], ["--delete-timeout -1 is not valid", "> 0"]),
    ("install-registry", ["install", "--registry", "https://registry.example.com/ml"], ["--registry 'https://registry.example.com/ml' is not an image registry", "(no scheme, no image name, no tag)"]),
    ("install-tag", ["install", "--tag", "v1/x"], ["--tag 'v1/x' is not an image tag"]),
    ("install-image-check-timeout", ["install", "--image-check-timeout", "0"], ["--image-check-timeout 0 is not valid", "> 0"]),
    ("render-relative", ["render", "trainjob", "--runtime", RUNTIME, "--dataset", "data.jsonl", "--model", "/m"], ["dataset storage URI 'data.jsonl' is a relative path", "must be absolute"]),
    ("render-namespace", ["render", "trainjob", "--runtime", RUNTIME, "--dataset", "/d", "--model", "/m", "--namespace", "Team"], ["namespace 'Team' is not a valid DNS-1123 label"]),
    ("render-runtime", ["render", "trainjob", "--runtime", "gpt-5", "--dataset", "/d", "--model", "/m"], ["unknown runtime or model 'gpt-5'"]),
    ("render-full-lora", ["render", "trainjob", "--runtime", RUNTIME, "--dataset", "/d", "--model", "/m", "method=full", "lora_rank=4"], ["lora_rank=4 sets LoRA adapters, but method=full trains every weight"]),
    ("render-full-merge", ["render", "trainjob", "--runtime", RUNTIME, "--dataset", "/d", "--model", "/m", "method=full", "merge=1"], ["merge=1 merges a LoRA adapter into the base, but method=full"]),
    ("render-args", ["render", "trainjob", "--runtime", RUNTIME, "--dataset", "/d", "--model", "/m", "epochs=0"], ["epochs='0' is not valid"]),
    ("status-unknown", ["status", "nope", "--local"], ["no local TrainJob 'nope' under", "tunepack jobs --local"]),
    ("status-path", ["status", "../etc", "--local"], ["no local TrainJob '../etc'"]),
    ("logs-unknown", ["logs", "nope", "--local"], ["no local TrainJob 'nope'"]),
    ("result-unknown", ["result", "nope", "--local"], ["no local TrainJob 'nope'"]),
    ("delete-unknown", ["delete", "nope", "--local"], ["no local TrainJob 'nope'"]),
    ("delete-workspace-too-cluster", ["delete", "j", "--workspace-too"], ["--workspace-too is for local jobs", "kubectl delete pvc"]),
    ("tiny-dataset-rows", ["tiny-dataset", "out.jsonl", "--rows", "0"], ["rows must be at least 1, got 0"]),
    ("tiny-model-name", ["tiny-model", "m", "--model", "nope"], ["argument --model: invalid choice: 'nope' (choose from 'tiny-llama3', 'tiny-llama3.2-vision')"]),
    ("tiny-dataset-images-rows", ["tiny-dataset", "--images", "pics", "--rows", "0"], ["rows must be at least 1, got 0"]),
]  # fmt: skip


@pytest.mark.parametrize(
    ("argv", "fragments"), [r[1:] for r in OTHER_COMMANDS], ids=[r[0] for r in OTHER_COMMANDS]
)
def test_other_commands(capsys, jobs, argv, fragments):
    assert_error(capsys, argv, *fragments)


def test_tiny_model_over_a_file(capsys, jobs, tmp_path):
    (tmp_path / "taken").write_text("mine")
    assert_error(
        capsys, ["tiny-model", tmp_path / "taken"], "exists but is not a complete tiny model"
    )
    assert (tmp_path / "taken").read_text() == "mine"


# --- jobs that exist: their steps, their results -------------------------------------------------


@pytest.fixture(scope="module")
def failed_job(tmp_path_factory, tiny_model_dir):
    """A local job whose dataset initializer refused its rows (no training)."""
    home = tmp_path_factory.mktemp("failed-home")
    bad = _write(home / "bad.jsonl", ["{oops"])
    client = TrainingClient(LocalBackendConfig(root_dir=str(home / "jobs")))
    name = client.train(
        runtime=RUNTIME,
        initializer=Initializer(dataset=str(bad), model=str(tiny_model_dir)),
        trainer=FineTune(max_steps=1),
    )
    with pytest.raises(RuntimeError) as failed:
        client.wait_for_job_status(name, timeout=120, polling_interval=1)
    return client, name, str(failed.value)


@pytest.mark.parametrize("step", ["node-3", "trainer", "initializer"])
def test_logs_of_a_step_that_is_not_there(capsys, failed_job, step):
    client, name, _ = failed_job
    assert_error(
        capsys,
        ["logs", name, "--local", "--jobs-dir", client.backend.root, "--step", step],
        f"TrainJob {name} has no step {step!r}",
        "its steps are dataset-initializer, model-initializer, node-0",
    )


def test_result_of_a_failed_job(capsys, failed_job):
    client, name, _ = failed_job
    assert_error(
        capsys,
        ["result", name, "--local", "--jobs-dir", client.backend.root],
        f"TrainJob {name} is Failed, not Complete",
        "dataset-initializer",
        "it has no result",
    )
    code, out, _ = run_cli(capsys, ["status", name, "--local", "--jobs-dir", client.backend.root])
    assert code == EXIT_BAD_INPUT  # status of a failed job: its failed step's code, the reason
    assert out.startswith(f"{name}  Failed  runtime {RUNTIME}\n")
    assert "  message: step 'dataset-initializer' failed with exit code 65" in out


def test_python_sees_the_failed_step_and_its_reason(failed_job):
    _, name, message = failed_job
    assert f"TrainJob {name} is Failed" in message
    assert "step 'dataset-initializer' failed with exit code 65" in message
    assert "has 1 invalid row" in message


def test_python_result_of_a_failed_job_says_it_failed_not_to_wait(failed_job):
    """Issue 49, item 4: result() said "wait_for_job_status(name) first" of a job that had
    failed, which no wait would change."""
    client, name, _ = failed_job
    with pytest.raises(ValueError) as err:
        client.result(name)
    head = str(err.value).splitlines()[0]
    assert head.startswith(
        f"TrainJob {name} failed and has no result (its log: get_job_logs({name!r}, "
        "step='dataset-initializer')): step 'dataset-initializer' failed with exit code 65"
    ), head
    assert "wait_for_job_status" not in str(err.value)


def test_python_exception_names_the_offending_rows(failed_job):
    _, _, message = failed_job
    assert "bad.jsonl row 1: not valid JSON" in message


def test_python_logs_of_a_step_the_job_does_not_have(failed_job):
    client, name, _ = failed_job
    with pytest.raises(NotFoundError) as err:
        list(client.get_job_logs(name, step="node-3"))
    assert str(err.value) == (
        f"local TrainJob {name!r} has no step 'node-3'; its steps are dataset-initializer, "
        "model-initializer, node-0"
    )


# --- Python: FineTune, Initializer, the client's methods -----------------------------------------

FINETUNE = [
    ("unknown-field", {"lora_r": 8}, "FineTune has no field 'lora_r'", "did you mean 'lora_rank'"),
    ("epochs-str", {"epochs": "3"}, "epochs='3' is not valid", "expected an integer"),
    ("epochs-0", {"epochs": 0}, "epochs='0' is not valid", "from 1 to 1000"),
    ("rank-bool", {"lora_rank": True}, "lora_rank=True is not valid", "expected an integer"),
    ("lr-str", {"lr": "1e-4"}, "lr='1e-4' is not valid", "expected a number"),
    ("lr-big", {"lr": 2.0}, "lr='2.0' is not valid", "< 1.0"),
    ("method-case", {"method": "LoRA"}, "method='LoRA' is not valid", "lora, qlora, dora, full"),
    ("modules-unknown", {"lora_attn_modules": ["q_proj", "qkv"]}, "lora_attn_modules", "q_proj,k_proj,v_proj,output_proj"),
    ("full-lora", {"method": "full", "lora_rank": 8}, "lora_rank=8 sets LoRA adapters", "method=full trains every weight"),
    ("full-merge", {"method": "full", "merge": True}, "FineTune: merge=True merges a LoRA adapter", "method=full trains every weight"),
    ("nodes-0", {"num_nodes": 0}, "FineTune.num_nodes=0 is not valid", ">= 1"),
    ("nodes-str", {"num_nodes": "2"}, "FineTune.num_nodes='2' is not valid", ">= 1"),
    ("nproc-bool", {"num_proc_per_node": True}, "num_proc_per_node=True is not valid", ">= 1"),
    ("resources-str", {"resources_per_node": "gpu=1"}, "resources_per_node must be a dict", "'gpu=1'"),
    ("env-int", {"env": {"A": 1}}, "FineTune.env must map names to string values", "{'A': 1}"),
]  # fmt: skip


# The narrow type each mistake above raises (tunepack.core.errors): what a caller catches.
FINETUNE_KINDS = {name: BadValueError for name, *_ in FINETUNE} | {
    "unknown-field": UnknownKeyError,
    "full-lora": ConflictError,
    "full-merge": ConflictError,
}


@pytest.mark.parametrize(
    ("name", "fields", "first", "second"), FINETUNE, ids=[r[0] for r in FINETUNE]
)
def test_finetune_fields(name, fields, first, second):
    with pytest.raises(FINETUNE_KINDS[name]) as err:
        FineTune(**fields)
    assert type(err.value) is FINETUNE_KINDS[name]
    assert first in str(err.value) and second in str(err.value), str(err.value)


def test_finetune_from_args_wants_a_list():
    with pytest.raises(BadValueError) as err:
        FineTune.from_args("epochs=2")
    assert (
        str(err.value) == "trainer arguments must be a list of 'key=value' strings, got 'epochs=2'"
    )


@pytest.fixture
def client(tmp_path) -> TrainingClient:
    return TrainingClient(LocalBackendConfig(root_dir=str(tmp_path / "jobs")))


def _init(dataset=D, model=M, **kw) -> Initializer:
    return Initializer(dataset=dataset, model=model, **kw)


TRAIN_CALLS = [
    ("no-runtime", {"initializer": _init()}, "pass runtime=, e.g. runtime='tunepack-tiny-llama3'"),
    ("runtime-unknown", {"runtime": "gpt-5", "initializer": _init()}, "runtime 'gpt-5' is not available on the local backend"),
    ("no-initializer", {"runtime": RUNTIME}, "tunepack runtimes need an initializer: pass initializer=Initializer("),
    ("no-dataset", {"runtime": RUNTIME, "initializer": Initializer(model=M)}, "Initializer.dataset is missing"),
    ("no-model", {"runtime": RUNTIME, "initializer": Initializer(dataset=D)}, "Initializer.model is missing"),
    ("dataset-int", {"runtime": RUNTIME, "initializer": _init(dataset=5)}, "Initializer.dataset of type int is not supported"),
    ("initializer-dict", {"runtime": RUNTIME, "initializer": {"dataset": D}}, "initializer must be tunepack.Initializer or kubeflow.trainer.Initializer, got dict"),
    ("data-cache", {"runtime": RUNTIME, "initializer": _init(dataset=DataCacheInitializer(storage_uri="cache://x/y", metadata_loc="s3://b/m", num_data_nodes=2))}, "DataCacheInitializer is not supported by tunepack runtimes"),
    ("hf-token", {"runtime": RUNTIME, "initializer": _init(model=HuggingFaceModelInitializer(storage_uri="hf://org/m", access_token="hf_secret"))}, "HuggingFaceModelInitializer.access_token: tunepack does not put tokens into the TrainJob"),
    ("s3-keys", {"runtime": RUNTIME, "initializer": _init(dataset=S3DatasetInitializer(storage_uri="s3://b/d", access_key_id="AKIA"))}, "S3DatasetInitializer.access_key_id cannot be translated"),
    ("secret-local", {"runtime": RUNTIME, "initializer": _init(model_secret="hf-token")}, "secretRef is a cluster feature"),
    ("env-credential", {"runtime": RUNTIME, "initializer": _init(), "trainer": FineTune(env={"HF_TOKEN": "x"})}, "environment variable HF_TOKEN looks like a credential"),
    ("custom-trainer", {"runtime": RUNTIME, "initializer": _init(), "trainer": CustomTrainer(func=print)}, "CustomTrainer cannot run on a tunepack runtime"),
    ("trainer-str", {"runtime": RUNTIME, "initializer": _init(), "trainer": "lora"}, "trainer must be tunepack.FineTune or kubeflow.trainer.BuiltinTrainer, got str"),
    ("lora-output", {"runtime": RUNTIME, "initializer": _init(), "trainer": BuiltinTrainer(config=TorchTuneConfig(peft_config=LoraConfig(apply_lora_to_output=True)))}, "LoraConfig.apply_lora_to_output=True cannot be translated"),
    ("qlora-dora", {"runtime": RUNTIME, "initializer": _init(), "trainer": BuiltinTrainer(config=TorchTuneConfig(peft_config=LoraConfig(quantize_base=True, use_dora=True)))}, "quantize_base and use_dora cannot be combined"),
    ("split-config", {"runtime": RUNTIME, "initializer": _init(), "trainer": BuiltinTrainer(config=TorchTuneConfig(dataset_preprocess_config=TorchTuneInstructDataset(split="train[:10pct]")))}, "TorchTuneInstructDataset.split: dataset split 'train[:10pct]': bound '10pct' is not a whole number of rows or a percentage"),
    ("options-local", {"runtime": RUNTIME, "initializer": _init(), "options": [Name("x")]}, "options (Name) are not supported by tunepack's local backend"),
    ("uri-scheme", {"runtime": RUNTIME, "initializer": _init(dataset="gs://b/d.jsonl")}, "unsupported storage URI 'gs://b/d.jsonl'"),
    ("seq-len", {"runtime": RUNTIME, "initializer": _init(), "trainer": FineTune(max_seq_len=4096)}, "max_seq_len=4096 is larger than tiny-llama3's context window of 512 tokens"),
]  # fmt: skip


UNSUPPORTED = (
    "data-cache",
    "hf-token",
    "s3-keys",
    "secret-local",
    "env-credential",
    "custom-trainer",
    "lora-output",
    "options-local",
)
TRAIN_KINDS = (
    {name: BadValueError for name, *_ in TRAIN_CALLS}
    | dict.fromkeys(UNSUPPORTED, UnsupportedError)
    | {"runtime-unknown": UnknownRuntimeError, "qlora-dora": ConflictError}
)


@pytest.mark.parametrize(
    ("name", "kwargs", "fragment"), TRAIN_CALLS, ids=[r[0] for r in TRAIN_CALLS]
)
def test_client_train(client, name, kwargs, fragment):
    with pytest.raises(TRAIN_KINDS[name]) as err:
        client.train(**kwargs)
    assert type(err.value) is TRAIN_KINDS[name]
    assert fragment in str(err.value), str(err.value)
    assert client.list_jobs() == []  # nothing recorded


@pytest.mark.parametrize(
    ("config", "fragment"),
    [
        ({"memory_check": "never"}, "memory_check='never' is not valid: expected one of 'refuse'"),
        ({"gpu": "RTX-4090"}, "gpu='RTX-4090' is not known: expected one of H100-80GB"),
    ],
    ids=["memory-check", "gpu"],
)
def test_client_settings(tmp_path, config, fragment):
    client = TrainingClient(LocalBackendConfig(root_dir=str(tmp_path / "jobs"), **config))
    with pytest.raises(BadValueError) as err:
        client.train(runtime=RUNTIME, initializer=_init())
    assert fragment in str(err.value)
    assert client.list_jobs() == []


@pytest.mark.parametrize(
    "call",
    ["get_job", "get_job_logs", "delete_job", "result", "wait_for_job_status", "get_job_events"],
)
def test_client_methods_on_a_job_that_is_not_there(client, call):
    with pytest.raises(NotFoundError) as err:
        result = getattr(client, call)("nope")
        list(result) if call == "get_job_logs" else None
    assert str(err.value) == (
        f"no local TrainJob 'nope' under {client.backend.root}; see list_jobs() "
        "(tunepack jobs --local)"
    )


def test_client_get_runtime_of_an_unknown_name(client):
    with pytest.raises(UnknownRuntimeError) as err:
        client.get_runtime("tunepack-tiny-lama3")
    assert str(err.value) == (
        "unknown runtime or model 'tunepack-tiny-lama3': tunepack has no model of that name; "
        "did you mean 'tunepack-tiny-llama3'?"
    )
    assert (err.value.runtime, err.value.suggestions) == (
        "tunepack-tiny-lama3",
        ("tunepack-tiny-llama3",),
    )


def test_client_wait_for_a_status_that_does_not_exist(client):
    with pytest.raises(ValueError, match=r"Expected status \{'Done'\} must be a subset of"):
        client.wait_for_job_status("nope", status={"Done"})
