"""Trainer arguments are parsed once at each door where they arrive as words, and resolved
against the model once; a ``FineTune`` is never written out as words and read back.

Two steps, both in ``tunepack.runtimes.args``: the parse (``parse_args``: words to typed values,
which reads the words with ``split_pairs``) and the resolve (``resolve_args``: typed values to
``TrainArgs`` for a model). The counts below are of calls to those functions' code, so they hold
whichever module imported a function under which name; a round trip (``to_args()`` parsed again,
``argv()`` parsed again) shows up as a parse that should not be there.
"""

from __future__ import annotations

import json
import sys
from collections import Counter

import pytest
import yaml
from kubeflow.trainer import BuiltinTrainer, LoraConfig, TorchTuneConfig

from tunepack.cli import main as cli_main
from tunepack.cli import train as cli_train
from tunepack.core import workspace
from tunepack.core.errors import BadValueError
from tunepack.finetune import FineTune
from tunepack.initializers import trainer_args as initializer_check
from tunepack.jobs import submit
from tunepack.jobs.translate import Initializer
from tunepack.runtimes import args as vocabulary
from tunepack.runtimes import catalog
from tunepack.trainers import launch

RUNTIME = "tunepack-tiny-llama3"
WORDS = ["method=lora", "lora_rank=4", "epochs=2", "max_steps=3"]
INITIALIZER = Initializer(dataset="file:///data/train.jsonl", model="file:///models/tiny")
# The functions counted, by their code: the parse, the reading of words, the resolve, and
# FineTune's own spelling of itself as words.
COUNTED = {
    vocabulary.parse_args.__code__: "parse",
    vocabulary.split_pairs.__code__: "words read",
    vocabulary.resolve_args.__code__: "resolve",
    FineTune.to_args.__code__: "to_args",
}


@pytest.fixture
def calls():
    """How often each counted function ran while the test ran (a profile hook on calls)."""
    counted: Counter[str] = Counter()

    def hook(frame, event, arg):
        if event == "call" and frame.f_code in COUNTED:
            counted[COUNTED[frame.f_code]] += 1

    previous = sys.getprofile()
    sys.setprofile(hook)
    try:
        yield counted
    finally:
        sys.setprofile(previous)


def test_the_sdk_resolves_a_finetune_once_and_parses_nothing(calls):
    # What both backends' train() build the TrainJob with (the local backend through
    # submit.local_trainjob): the FineTune's values, parsed when it was made, resolved once.
    finetune = FineTune(method="lora", lora_rank=4, epochs=2, max_steps=3)
    calls.clear()  # making the FineTune checks its fields; counted from here: the job
    job = submit.build(RUNTIME, INITIALIZER, finetune, name="job-1")
    assert calls == {"resolve": 1}
    assert job["spec"]["trainer"]["args"] == WORDS[:1] + ["epochs=2", "max_steps=3", "lora_rank=4"]


def test_the_upstream_trainer_is_resolved_once_too(calls):
    # BuiltinTrainer(config=TorchTuneConfig(...)) becomes a FineTune (jobs/translate.py), which
    # takes the same way.
    trainer = BuiltinTrainer(
        config=TorchTuneConfig(epochs=2, peft_config=LoraConfig(lora_rank=4, lora_alpha=8))
    )
    job = submit.build(RUNTIME, INITIALIZER, trainer, name="job-2")
    assert calls == {"resolve": 1}
    assert job["spec"]["trainer"]["args"] == [
        "method=lora",
        "epochs=2",
        "lora_rank=4",
        "lora_alpha=8.0",
        "lora_attn_modules=q_proj,v_proj,output_proj",
    ]


def test_the_local_backend_resolves_once(calls, tmp_path):
    data, model = tmp_path / "train.jsonl", tmp_path / "model"
    data.write_text("{}\n")
    model.mkdir()

    class Backend:  # what local_trainjob reads of the local backend
        class cfg:
            gpu, memory_check = "h100", "refuse"

        @staticmethod
        def resolve_runtime(name):
            return catalog.get(name)

    job = submit.local_trainjob(
        Backend,
        RUNTIME,
        Initializer(dataset=str(data), model=str(model)),
        FineTune(method="lora", lora_rank=4),
        name="job-3",
    )
    assert calls == {"resolve": 1}
    assert job["spec"]["trainer"]["args"] == ["method=lora", "lora_rank=4"]


# The TrainJob's spec.trainer.args are what the SDK wrote before FineTune held its values: the
# FineTune spelled as words (to_args), parsed and written back (argv). Pinned byte for byte,
# with the spellings that change on the way (a float, an int for a float, a list, a bool, spaces
# around a string, a reward list).
PINNED = [
    (
        FineTune(
            method="lora",
            epochs=2,
            lr=1e-4,
            lora_rank=16,
            lora_alpha=32,
            lora_attn_modules=["q_proj", "v_proj"],
            lora_mlp=False,
            system_prompt="  Be terse.  ",
        ),
        [
            "method=lora",
            "epochs=2",
            "lr=0.0001",
            "lora_rank=16",
            "lora_alpha=32",
            "lora_attn_modules=q_proj,v_proj",
            "lora_mlp=false",
            "system_prompt=Be terse.",
        ],
    ),
    (
        FineTune(
            method="grpo",
            max_seq_len=128,
            temperature=0.7,
            rewards=["exact", "format:0.5"],
            reward_pattern="^\\d+$",
            activation_checkpointing=True,
            loss_chunk="auto",
        ),
        [
            "method=grpo",
            "max_seq_len=128",
            "activation_checkpointing=true",
            "loss_chunk=auto",
            "temperature=0.7",
            "rewards=exact,format:0.5",
            "reward_pattern=^\\d+$",
        ],
    ),
]


@pytest.mark.parametrize(("finetune", "expected"), PINNED)
def test_the_trainjobs_arguments_are_byte_identical_to_the_words_round_trip(finetune, expected):
    job = submit.build(RUNTIME, INITIALIZER, finetune, name="job-4")
    assert job["spec"]["trainer"]["args"] == expected
    # ... and to what the round trip makes today, value for value too.
    entry = catalog.get(RUNTIME)
    round_trip = vocabulary.parse_trainer_args(finetune.to_args(), entry)
    assert vocabulary.resolve_args(finetune.parsed_args(), entry) == round_trip
    assert round_trip.argv() == expected


def test_a_value_the_words_would_refuse_is_refused_when_the_job_is_built():
    # A pattern that compiles with its trailing space and not without it: the FineTune accepts
    # it as given, the job reads it as a key=value word would (stripped), with the parser's
    # message, at the same moment as before.
    finetune = FineTune(method="grpo", rewards="format", reward_pattern="\\ ")
    with pytest.raises(BadValueError) as refused:
        submit.build(RUNTIME, INITIALIZER, finetune, name="job-5")
    with pytest.raises(BadValueError) as by_words:
        vocabulary.parse_trainer_args(finetune.to_args(), catalog.get(RUNTIME))
    assert str(refused.value) == str(by_words.value)
    assert str(refused.value).startswith("reward_pattern='\\\\' is not valid")


def test_cli_train_parses_its_words_once(calls, monkeypatch, tmp_path):
    data, model = tmp_path / "train.jsonl", tmp_path / "model"
    data.write_text("{}\n")
    model.mkdir()
    ran = []
    monkeypatch.setattr(cli_train, "_run_local", lambda ns, trainjob, *rest: ran.append(trainjob))
    code = cli_main(
        ["train", "--local", "--runtime", RUNTIME, "--dataset", str(data), "--model", str(model)]
        + ["--workspace", str(tmp_path / "ws"), "--name", "job-6", *WORDS]
    )
    assert code is None or code == 0
    # FineTune.from_args reads the words once; the job resolves the FineTune's values once (the
    # default job name is a hash of to_args(), a spelling, not a parse).
    assert (calls["parse"], calls["words read"], calls["resolve"]) == (1, 1, 1)
    assert ran[0]["spec"]["trainer"]["args"] == [
        "method=lora",
        "epochs=2",
        "max_steps=3",
        "lora_rank=4",
    ]


def test_render_trainjob_parses_its_words_once(calls, capsys):
    code = cli_main(
        ["render", "trainjob", "--runtime", RUNTIME, "--dataset", "/d", "--model", "/m", *WORDS]
    )
    assert code == 0, capsys.readouterr().err
    assert calls == {"parse": 1, "words read": 1, "resolve": 1}
    job = yaml.safe_load(capsys.readouterr().out)
    # As `train` submits them (FineTune.from_args, as above): in the vocabulary's order.
    assert job["spec"]["trainer"]["args"] == [
        "method=lora",
        "epochs=2",
        "max_steps=3",
        "lora_rank=4",
    ]


def test_a_trainjobs_arguments_are_parsed_once_by_each_program_that_reads_them(calls, monkeypatch):
    # A TrainJob reaches two programs as strings: the initializers (their env, checked before
    # any download) and the launcher (its argv). Each parses and resolves them once.
    monkeypatch.setenv(workspace.TRAINER_ARGS_ENV, json.dumps(WORDS))
    monkeypatch.setenv(workspace.MODEL_ENV, "tiny-llama3")
    assert initializer_check.check_from_env() == len(WORDS)
    assert calls == {"parse": 1, "words read": 1, "resolve": 1}

    class Parsed(Exception):
        pass

    def stop(entry, args, **kwargs):
        raise Parsed(args)

    # The launcher's argv, parsed, goes to the config builder and from there the trainer reads
    # the config: stop where it leaves the launcher.
    monkeypatch.setattr(launch, "build_config", stop)
    calls.clear()
    with pytest.raises(Parsed) as handed:
        launch.run(WORDS)
    assert calls == {"parse": 1, "words read": 1, "resolve": 1}
    assert handed.value.args[0].argv() == WORDS
