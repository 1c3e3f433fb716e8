"""Defence in depth: the initializers refuse bad trainer arguments before they download anything.

The initializer Pods cannot see ``spec.trainer.args``; tunepack's TrainJobs give them the
arguments as ``TUNEPACK_TRAINER_ARGS`` (``tunepack.jobs.trainjob``), and the programs check them
with the trainer's vocabulary first (``initializers/trainer_args.py``). Run as processes, as a
Pod and the local backend run them, against a hub on loopback that records every request.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.fakehub import FakeHub
from tests.helpers import DATASET_SETTINGS, run_dataset_initializer
from tunepack.core.errors import EXIT_BAD_INPUT, BadInputError, BadValueError
from tunepack.core.workspace import TRAINER_ARGS_ENV
from tunepack.jobs.trainjob import TrainJobSpec, build_trainjob
from tunepack.runtimes import catalog
from tunepack.runtimes.args import parse_trainer_args


@pytest.fixture
def hub():
    hub = FakeHub().start()
    yield hub
    hub.stop()


def _run(
    program: str, tmp_path, hub, args: list[str] | str | None, model: str | None, **extra: str
):
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in {"STORAGE_URI", "TUNEPACK_MODEL", TRAINER_ARGS_ENV, "HF_TOKEN"}
        and k not in DATASET_SETTINGS
    }
    env.update(
        TUNEPACK_WORKSPACE=str(tmp_path / "ws"),
        HF_ENDPOINT=hub.url,
        HF_HUB_OFFLINE="0",
        STORAGE_URI="hf://datasets/org/data" if program == "dataset" else "hf://org/model",
        **extra,
    )
    if model is not None:
        env["TUNEPACK_MODEL"] = model
    if args is not None:
        env[TRAINER_ARGS_ENV] = args if isinstance(args, str) else json.dumps(args)
    return subprocess.run(
        [sys.executable, "-m", f"tunepack.initializers.{program}"],
        env=env,
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
    )


def _trainer_says(args: list[str], model: str = "tiny-llama3") -> str:
    with pytest.raises(BadInputError) as refused:
        parse_trainer_args(args, catalog.get(model))
    return str(refused.value)


@pytest.mark.parametrize("program", ["dataset", "model"])
@pytest.mark.parametrize(
    "args",
    [["lora_rank=-1"], ["unknown_key=1"], ["method=full", "lora_rank=8"], ["method=qlora"]],
    ids=["range", "unknown", "conflict", "method the model lacks"],
)
def test_bad_trainer_arguments_fail_before_any_request(tmp_path, hub, program, args):
    done = _run(program, tmp_path, hub, args, "tiny-llama3")
    assert done.returncode == EXIT_BAD_INPUT, done.stderr
    assert done.stderr == f"{program}-initializer: error: {_trainer_says(args)}\n"
    assert hub.requests == []  # nothing asked of the hub, let alone downloaded
    assert not (tmp_path / "ws" / program).exists()


@pytest.mark.parametrize("program", ["dataset", "model"])
def test_valid_arguments_go_on_to_the_download(tmp_path, hub, program):
    """The same run with valid arguments reaches the hub (where the repository is missing)."""
    done = _run(program, tmp_path, hub, ["method=lora", "lora_rank=8"], "tiny-llama3")
    assert "the trainer's 2 arguments are valid" in done.stdout
    assert hub.requests, done.stderr  # it went on to the source


def test_without_a_model_the_keys_and_values_are_checked(tmp_path, hub):
    done = _run("dataset", tmp_path, hub, ["epochs=0"], None)
    assert done.returncode == EXIT_BAD_INPUT
    assert done.stderr == (
        "dataset-initializer: error: epochs='0' is not valid: expected an integer from 1 to 1000\n"
    )
    assert hub.requests == []


def test_a_malformed_variable_is_refused(tmp_path, hub):
    done = _run("model", tmp_path, hub, '"method=lora"', "tiny-llama3")
    assert done.returncode == EXIT_BAD_INPUT
    assert f"{TRAINER_ARGS_ENV} must be a JSON list of key=value strings" in done.stderr
    assert hub.requests == []


def test_tunepacks_trainjobs_give_both_initializers_the_arguments():
    args = ["method=lora", "system_prompt=Be brief, and kind."]
    job = build_trainjob(
        TrainJobSpec(
            name="j",
            runtime="tiny-llama3",
            dataset_uri="hf://datasets/org/data",
            model_uri="hf://org/model",
            trainer_args=args,
            initializer_env={"HF_HUB_ENABLE_HF_TRANSFER": "1"},
        )
    )
    for step in ("dataset", "model"):
        env = job["spec"]["initializer"][step]["env"]
        assert env[0] == {"name": "HF_HUB_ENABLE_HF_TRANSFER", "value": "1"}
        assert json.loads(env[1]["value"]) == args and env[1]["name"] == TRAINER_ARGS_ENV
    with pytest.raises(BadValueError) as err:
        build_trainjob(
            TrainJobSpec(
                name="j",
                runtime="tiny-llama3",
                dataset_uri="hf://datasets/org/data",
                model_uri="hf://org/model",
                trainer_args=args,
                initializer_env={TRAINER_ARGS_ENV: "[]"},
            )
        )
    assert str(err.value) == (
        f"initializer_env must not set {TRAINER_ARGS_ENV}: tunepack sets it to the trainer "
        "arguments, which the initializers check before they download anything"
    )


# --- the method against the dataset's schema (issue 49, item 6) ---------------------------------

DPO_NEEDS = (
    "method=dpo needs a preference dataset (rows with 'prompt', 'chosen' and 'rejected'), "
    "but the dataset's schema is"
)


def test_a_named_schema_the_method_cannot_learn_from_fails_before_any_request(tmp_path, hub):
    """The trainer found it after both initializers ran; DATASET_SCHEMA says it at once."""
    done = _run("dataset", tmp_path, hub, ["method=dpo"], "tiny-llama3", DATASET_SCHEMA="chat")
    assert done.returncode == EXIT_BAD_INPUT, done.stderr
    assert done.stderr == f"dataset-initializer: error: {DPO_NEEDS} 'chat'\n"
    assert hub.requests == []


@pytest.mark.parametrize(
    ("row", "method", "message"),
    [
        ({"instruction": "q", "output": "a"}, "dpo", f"{DPO_NEEDS} 'instruction'"),
        (
            {"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]},
            "grpo",
            "method=grpo needs a prompt dataset (rows with a 'prompt' (a string or chat turns) "
            "and, for rewards that check it, an 'answer'), but the dataset's schema is 'chat'",
        ),
    ],
    ids=["dpo-on-instructions", "grpo-on-chats"],
)
def test_rows_the_method_cannot_learn_from_are_refused_at_the_first_row(
    tmp_path, row, method, message
):
    data = tmp_path / "d.jsonl"
    data.write_text(json.dumps(row) + "\n")
    args = json.dumps([f"method={method}"])
    env = {TRAINER_ARGS_ENV: args, "TUNEPACK_MODEL": "tiny-llama3"}
    done = run_dataset_initializer(tmp_path / "ws", str(data), **env)
    assert done.returncode == EXIT_BAD_INPUT, done.stderr
    assert done.stderr == f"dataset-initializer: error: {message}\n"
    assert not (tmp_path / "ws" / "dataset").exists()
    # The same rows for a method that learns from them: delivered.
    fits = {"dpo": "lora", "grpo": "lora"}[method]
    env[TRAINER_ARGS_ENV] = json.dumps([f"method={fits}"])
    assert run_dataset_initializer(tmp_path / "ws", str(data), **env).returncode == 0
    # ... and once delivered, a run of the wrong method is refused by the complete workspace too.
    env[TRAINER_ARGS_ENV] = args
    again = run_dataset_initializer(tmp_path / "ws", str(data), **env)
    assert (again.returncode, again.stderr) == (EXIT_BAD_INPUT, done.stderr)
