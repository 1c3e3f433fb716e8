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
from tunepack.core.errors import EXIT_BAD_INPUT, BadInputError
from tunepack.core.workspace import TRAINER_ARGS_ENV
from tunepack.jobs.trainjob import TrainJobSpec, build_trainjob
from tunepack.runtimes import catalog
from tunepack.trainers.args import parse_trainer_args


@pytest.fixture
def hub():
    hub = FakeHub().start()
    yield hub
    hub.stop()


def _run(program: str, tmp_path, hub, args: list[str] | str | None, model: str | None):
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in {"STORAGE_URI", "TUNEPACK_MODEL", TRAINER_ARGS_ENV, "HF_TOKEN"}
    }
    env.update(
        TUNEPACK_WORKSPACE=str(tmp_path / "ws"),
        HF_ENDPOINT=hub.url,
        HF_HUB_OFFLINE="0",
        STORAGE_URI="hf://datasets/org/data" if program == "dataset" else "hf://org/model",
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
    with pytest.raises(BadInputError, match=f"must not set {TRAINER_ARGS_ENV}"):
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
