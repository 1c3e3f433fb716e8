"""Trainer arguments are parsed once at each door where they enter, then passed typed.

A parse is counted where it makes its result: every ``parse_trainer_args`` builds exactly one
``TrainArgs``, so counting ``TrainArgs`` constructions counts parses, whichever module imported
the function under which name.
"""

from __future__ import annotations

import json

import pytest
import yaml

from tunepack.cli import main as cli_main
from tunepack.core import workspace
from tunepack.finetune import FineTune
from tunepack.initializers import trainer_args as initializer_check
from tunepack.jobs import submit
from tunepack.jobs.translate import Initializer
from tunepack.trainers import launch
from tunepack.trainers.args import TrainArgs

RUNTIME = "tunepack-tiny-llama3"
WORDS = ["method=lora", "lora_rank=4", "epochs=2", "max_steps=3"]


@pytest.fixture
def parses(monkeypatch) -> list[TrainArgs]:
    made: list[TrainArgs] = []
    init = TrainArgs.__init__

    def counted(self, *args, **kwargs):
        init(self, *args, **kwargs)
        made.append(self)

    monkeypatch.setattr(TrainArgs, "__init__", counted)
    return made


def test_the_sdk_parses_a_finetune_once(parses):
    # What both backends' train() build the TrainJob with (the local backend through
    # submit.local_trainjob): the FineTune's fields, parsed against the model once.
    job = submit.build(
        RUNTIME,
        Initializer(dataset="file:///data/train.jsonl", model="file:///models/tiny"),
        FineTune(method="lora", lora_rank=4, epochs=2, max_steps=3),
        name="job-1",
    )
    assert len(parses) == 1
    assert parses[0].lora_rank == 4 and parses[0].epochs == 2
    assert job["spec"]["trainer"]["args"] == parses[0].argv()


def test_the_cli_parses_its_words_once(parses, capsys):
    code = cli_main(
        ["render", "trainjob", "--runtime", RUNTIME, "--dataset", "/d", "--model", "/m", *WORDS]
    )
    assert code == 0, capsys.readouterr().err
    assert len(parses) == 1
    job = yaml.safe_load(capsys.readouterr().out)
    assert job["spec"]["trainer"]["args"] == WORDS


def test_a_trainjobs_arguments_are_parsed_once_by_each_program_that_reads_them(
    parses, monkeypatch, tmp_path
):
    # A TrainJob written as YAML reaches two programs as strings: the initializers (their env,
    # checked before any download) and the launcher (its argv). Each parses them once.
    monkeypatch.setenv(workspace.TRAINER_ARGS_ENV, json.dumps(WORDS))
    monkeypatch.setenv(workspace.MODEL_ENV, "tiny-llama3")
    assert initializer_check.check_from_env() == len(WORDS)
    assert len(parses) == 1

    class Parsed(Exception):
        pass

    def stop(entry, args, **kwargs):
        raise Parsed(args)

    # The launcher's argv, parsed, goes to the config builder and from there the trainer reads
    # the config: stop where it leaves the launcher.
    monkeypatch.setattr(launch, "build_config", stop)
    with pytest.raises(Parsed) as handed:
        launch.run(WORDS)
    assert len(parses) == 2
    assert handed.value.args[0] is parses[1]
