"""Errors carry their facts (issue 50, 4): each narrow type a caller would act on holds what went
wrong as attributes (``UnknownKeyError.key``, ``NotFoundError.what``, ...), as huggingface_hub's
errors carry ``repo_id``. Each case triggers a real refusal through the public path and checks
the narrow type, its facts and the whole line a user reads (the facts never change it).
"""

from __future__ import annotations

import ast
import pickle
from pathlib import Path

import pytest

from tunepack import FineTune, Initializer, LocalBackendConfig, TrainingClient
from tunepack.core import errors
from tunepack.core.errors import (
    BadValueError,
    DoesNotFitError,
    NoObjectsError,
    NotFoundError,
    TunepackError,
    UnknownKeyError,
    UnknownRuntimeError,
    WorkspaceClaimedError,
)
from tunepack.runtimes import catalog, planner

ROOT = Path(__file__).resolve().parents[2]
SOURCES = ("sdk_ext", "runtimes", "initializers", "trainers")


@pytest.fixture
def client(tmp_path):
    return TrainingClient(LocalBackendConfig(root_dir=str(tmp_path / "jobs")))


# --- UnknownKeyError: key, suggestions ------------------------------------------------------------


@pytest.mark.parametrize(
    ("given", "line", "suggestions"),
    [
        (
            {"learning_rate": 1e-4},
            "FineTune has no field 'learning_rate'; did you mean 'lr'?",
            ("lr",),
        ),
        (
            {"load_in_4bit": True},
            "FineTune has no field 'load_in_4bit'; did you mean method='qlora'?",
            ("method='qlora'",),
        ),
        (
            {"lora_rnak": 8},
            "FineTune has no field 'lora_rnak': its fields are the trainer arguments of `tunepack "
            "args` and num_nodes, num_proc_per_node, resources_per_node, env, export, "
            "export_secret; did you mean 'lora_rank', 'lora_alpha'?",
            ("lora_rank", "lora_alpha"),
        ),
    ],
    ids=["foreign-name", "foreign-name-with-value", "close-spelling"],
)
def test_a_finetune_field_that_does_not_exist(given, line, suggestions):
    with pytest.raises(UnknownKeyError) as caught:
        FineTune(**given)
    assert str(caught.value) == line
    assert caught.value.key == next(iter(given))
    assert caught.value.suggestions == suggestions


def test_an_unknown_and_a_repeated_trainer_argument():
    with pytest.raises(UnknownKeyError) as caught:
        FineTune.from_args(["epochz=2"])
    assert str(caught.value) == "unknown trainer argument 'epochz'; did you mean 'epochs'?"
    assert (caught.value.key, caught.value.suggestions) == ("epochz", ("epochs",))

    with pytest.raises(UnknownKeyError) as caught:
        FineTune.from_args(["epochs=2", "epochs=3"])
    assert str(caught.value) == "trainer argument 'epochs' is given twice"
    assert (caught.value.key, caught.value.suggestions) == ("epochs", ())


def test_a_search_space_key_that_is_not_a_trainer_argument():
    from kubeflow.optimizer import Search

    from tunepack.optimizer.space import parse_space

    with pytest.raises(UnknownKeyError) as caught:
        parse_space({"learning_rate": Search.loguniform(1e-5, 1e-3)})
    assert str(caught.value) == (
        "search_space['learning_rate']: 'learning_rate' is not a trainer argument; tunepack "
        "calls it 'lr'"
    )
    assert (caught.value.key, caught.value.suggestions) == ("learning_rate", ("lr",))


def test_an_unknown_flag_on_the_command_line():
    from tunepack.cli.parser import build_parser

    with pytest.raises(UnknownKeyError) as caught:
        build_parser().parse_args(
            ["train", "--runtime", "tunepack-tiny-llama3", "--dataset", "d", "--model", "m"]
            + ["--lr", "1e-4"]
        )
    assert str(caught.value) == (
        "unrecognized arguments: --lr (trainer arguments are key=value pairs: write lr=VALUE; "
        "see `tunepack args`)"
    )
    assert (caught.value.key, caught.value.suggestions) == ("--lr", ("lr=VALUE",))


# --- UnknownRuntimeError: runtime, suggestions ----------------------------------------------------


def test_an_unknown_runtime_on_the_local_backend(client):
    with pytest.raises(UnknownRuntimeError) as caught:
        client.get_runtime("tunepack-llama3.2-1bb")
    assert str(caught.value) == (
        "unknown runtime or model 'tunepack-llama3.2-1bb': tunepack has no model of that name; "
        "did you mean 'tunepack-llama3.2-1b', 'tunepack-llama3.2-3b', 'tunepack-llama2-13b'?"
    )
    assert caught.value.runtime == "tunepack-llama3.2-1bb"
    assert caught.value.suggestions == (
        "tunepack-llama3.2-1b",
        "tunepack-llama3.2-3b",
        "tunepack-llama2-13b",
    )


def test_an_unknown_model_in_the_catalog():
    known = ", ".join(entry.runtime_name for entry in catalog.CATALOG.values())
    with pytest.raises(UnknownRuntimeError) as caught:
        catalog.get("nosuch")
    assert str(caught.value) == f"unknown runtime or model 'nosuch'; tunepack runtimes are: {known}"
    assert (caught.value.runtime, caught.value.suggestions) == ("nosuch", ())


# --- BadValueError: name, value, expected ---------------------------------------------------------


@pytest.mark.parametrize(
    ("given", "line", "facts"),
    [
        (
            {"lora_rank": 0},
            "FineTune.lora_rank: lora_rank='0' is not valid: expected an integer from 1 to 1024",
            ("lora_rank", 0, "an integer from 1 to 1024"),
        ),
        (
            {"lora_rank": 2.5},
            "FineTune.lora_rank: lora_rank=2.5 is not valid: expected an integer (LoRA rank r "
            "(default: catalog))",
            ("lora_rank", 2.5, "an integer"),
        ),
        (
            {"num_nodes": 0},
            "FineTune.num_nodes=0 is not valid: expected an integer >= 1",
            ("num_nodes", 0, "an integer >= 1"),
        ),
    ],
    ids=["out-of-range", "wrong-type", "placement"],
)
def test_a_finetune_value_out_of_its_range(given, line, facts):
    with pytest.raises(BadValueError) as caught:
        FineTune(**given)
    assert str(caught.value) == line
    assert (caught.value.name, caught.value.value, caught.value.expected) == facts


def test_a_trainer_argument_value_and_an_unknown_gpu():
    with pytest.raises(BadValueError) as caught:
        FineTune.from_args(["lr=fast"])
    assert str(caught.value) == "lr='fast' is not valid: expected a number > 0.0 and < 1.0"
    assert (caught.value.name, caught.value.value, caught.value.expected) == (
        "lr",
        "fast",
        "a number > 0.0 and < 1.0",
    )
    with pytest.raises(BadValueError) as caught:
        planner.gpu_type("x100")
    known = ", ".join(planner.GPUS)
    assert str(caught.value) == (
        f"gpu='x100' is not known: expected one of {known} (any case; the size may be left out "
        "where only one exists, e.g. h100)"
    )
    assert (caught.value.name, caught.value.value, caught.value.expected) == (
        "gpu",
        "x100",
        f"one of {known}",
    )


# --- NotFoundError: what, name, available ---------------------------------------------------------


def test_a_job_that_does_not_exist(client, tmp_path):
    root = tmp_path / "jobs"
    with pytest.raises(NotFoundError) as caught:
        client.get_job("nosuch")
    assert str(caught.value) == (
        f"no local TrainJob 'nosuch' under {root}; see list_jobs() (tunepack jobs --local)"
    )
    assert caught.value.cli_message == (
        f"no local TrainJob 'nosuch' under {root}; `tunepack jobs --local` lists them"
    )
    assert (caught.value.what, caught.value.name, caught.value.available) == (
        "TrainJob",
        "nosuch",
        (),
    )


def test_a_dataset_path_that_does_not_exist(client, tmp_path):
    missing = tmp_path / "none.jsonl"
    (tmp_path / "model").mkdir()
    with pytest.raises(NotFoundError) as caught:
        client.train(
            runtime="tunepack-tiny-llama3",
            initializer=Initializer(dataset=str(missing), model=str(tmp_path / "model")),
            trainer=FineTune(),
        )
    assert str(caught.value) == (
        f"dataset '{missing}' does not exist; give an existing file or directory on this "
        "machine, or an hf://, s3:// or https:// URI"
    )
    assert (caught.value.what, caught.value.name) == ("dataset", str(missing))


def test_a_split_the_dataset_does_not_have(tmp_path):
    from tunepack.initializers.data import splits

    with pytest.raises(NotFoundError) as caught:
        splits.check_single_file("data.jsonl", "test", "/data/data.jsonl")
    assert str(caught.value) == (
        "dataset '/data/data.jsonl' is a single file, which has no 'test' split: a file is the "
        "train split unless its name says otherwise. Give the file of that split, or a "
        "directory with one file per split (train.jsonl, test.jsonl), and no split to train on "
        "the whole file"
    )
    assert (caught.value.what, caught.value.name, caught.value.available) == (
        "split",
        "test",
        ("train",),
    )


def test_s3_objects_that_are_not_there():
    from botocore.exceptions import ClientError

    from tunepack.initializers.transport import s3

    answer = {"Error": {"Code": "NoSuchBucket"}, "ResponseMetadata": {"HTTPStatusCode": 404}}
    missing = s3.problem(ClientError(answer, "ListObjectsV2"), shown="s3://b/p", bucket="b")
    assert type(missing) is NotFoundError
    assert str(missing) == (
        "bucket 'b' of 's3://b/p' does not exist; check the bucket name and AWS_ENDPOINT_URL"
    )
    assert (missing.what, missing.name) == ("bucket", "b")
    answer = {"Error": {"Code": "NoSuchKey"}, "ResponseMetadata": {"HTTPStatusCode": 404}}
    none = s3.problem(ClientError(answer, "GetObject"), shown="s3://b/p", bucket="b", key="p/a")
    assert type(none) is NoObjectsError
    assert (none.what, none.name) == ("objects", "s3://b/p")


# --- DoesNotFitError: need_gib, have_gib, gpu -----------------------------------------------------


def test_a_fine_tune_the_planner_says_does_not_fit():
    from tunepack.jobs import submit

    initializer = Initializer(dataset="file:///data/train.jsonl", model="file:///models/llama")
    with pytest.raises(DoesNotFitError) as caught:
        submit.build(
            "tunepack-llama3.1-8b",
            initializer,
            FineTune(method="full", num_proc_per_node=1),
            name="job-1",
            namespace="team-a",
            gpu="l4",
        )
    estimate = planner.plan(catalog.CATALOG["llama3.1-8b"], "full", 2048, 2, "L4-24GB")
    assert str(caught.value) == (
        f"this fine-tune is estimated not to fit in GPU memory:\n{estimate.summary()}\n"
        "Lower max_seq_len or batch_size, add GPUs (resources_per_node / num_nodes), choose "
        "method='qlora' where available, or pass memory_check='warn' to TrainingClient to "
        "submit anyway (see docs/planner.md)."
    )
    error = caught.value
    assert (error.need_gib, error.have_gib, error.gpu) == (
        pytest.approx(estimate.peak_gib),
        20.0,
        "L4-24GB",
    )
    assert error.need_gib > error.have_gib
    assert (error.need_gpus, error.have_gpus) == (None, None)


def test_a_model_vllm_cannot_serve_on_the_gpus_given():
    from tunepack.tools import serving_memory

    entry = catalog.CATALOG["llama3.1-70b"]
    with pytest.raises(DoesNotFitError) as caught:
        serving_memory.choose(entry, "H100-80GB", 2048, lora_rank=16, gpus=1)
    assert str(caught.value) == (
        "--gpus 1: llama3.1-70b needs 141.5 GiB per GPU on 1 x H100-80GB (131.4 weights + 5.0 "
        "KV cache (8 x 2048 tokens) + 0.3 LoRA + 4.8 vLLM), more than the 71.3 GiB vLLM uses of "
        "each; --gpus 4 fits (38.2 GiB of 71.3 per GPU)"
    )
    error = caught.value
    assert (round(error.need_gib, 1), round(error.have_gib, 1), error.gpu) == (
        141.5,
        71.3,
        "H100-80GB",
    )


# --- every type: the facts are keyword-only, listed in FACTS, and survive a pickle ---------------


FACT_TYPES = [
    (UnknownKeyError, {"key": "epochz", "suggestions": ("epochs",)}),
    (UnknownRuntimeError, {"runtime": "nosuch", "suggestions": ("tunepack-x",)}),
    (BadValueError, {"name": "lr", "value": "fast", "expected": "a number"}),
    (NotFoundError, {"what": "step", "name": "node-9", "available": ("node-0",)}),
    (NoObjectsError, {"what": "objects", "name": "s3://b/p", "available": ()}),
    (
        DoesNotFitError,
        {"need_gib": 74.9, "have_gib": 20.0, "gpu": "L4-24GB", "need_gpus": 4, "have_gpus": 2},
    ),
    (WorkspaceClaimedError, {"workspace": "/w", "owner": "a", "job": "b"}),
]


@pytest.mark.parametrize(("kind", "facts"), FACT_TYPES, ids=lambda v: getattr(v, "__name__", ""))
def test_the_facts_survive_a_pickle_and_leave_the_message_alone(kind, facts):
    error = kind("the line", cli_message="the command's line", **facts)
    assert kind.FACTS == tuple(facts)
    assert error.facts() == facts
    assert str(error) == "the line" and error.args == ("the line",)
    copy = pickle.loads(pickle.dumps(error))
    assert type(copy) is kind and str(copy) == "the line"
    assert copy.facts() == facts and copy.cli_message == "the command's line"
    # Without them: None, or () for the tuples; the message alone as before.
    bare = kind("the line")
    assert all(v in (None, (), "") for v in bare.facts().values())


def test_every_type_with_facts_has_them_in_its_docstring():
    for _, kind in vars(errors).items():
        if isinstance(kind, type) and issubclass(kind, TunepackError) and "FACTS" in vars(kind):
            for name in kind.FACTS:
                assert f"``{name}``" in kind.__doc__, (kind.__name__, name)


def _raise_sites(kind: str):
    """(path, line, keywords) of each ``kind(...)`` call in the source roots."""
    for root in SOURCES:
        for path in sorted((ROOT / root).rglob("*.py")):
            if path == ROOT / "sdk_ext/core/errors.py":
                continue
            for node in ast.walk(ast.parse(path.read_text())):
                if (
                    isinstance(node, ast.Call)
                    and isinstance(node.func, ast.Name)
                    and node.func.id == kind
                ):
                    keywords = {k.arg for k in node.keywords} - {"cli_message"}
                    yield f"{path.relative_to(ROOT)}:{node.lineno}", keywords


@pytest.mark.parametrize(
    "kind",
    [
        "UnknownKeyError",
        "UnknownRuntimeError",
        "NotFoundError",
        "NoObjectsError",
        "DoesNotFitError",
    ],
)
def test_every_raise_site_sets_some_facts(kind):
    """A new refusal of these types says its facts (BadValueError's are set where the refusal
    is about one named value, which not every site's is)."""
    sites = list(_raise_sites(kind))
    assert sites
    assert [where for where, keywords in sites if not keywords] == []
