"""Upstream inputs keep their meaning (issue 29, 3): each data format and split of a notebook's
``TorchTuneInstructDataset`` becomes the TrainJob's initializer settings, and ``access_token`` is
pointed at the Secret way without being repeated. That the Parquet slice reads exactly those rows:
tests/integration/test_upstream_inputs.py."""

from __future__ import annotations

import json

import pytest
from kubeflow.trainer import (
    BuiltinTrainer,
    DataFormat,
    HuggingFaceDatasetInitializer,
    HuggingFaceModelInitializer,
    LoraConfig,
    TorchTuneConfig,
    TorchTuneInstructDataset,
)
from kubeflow.trainer import Initializer as KfInitializer

from tunepack.core.errors import BadValueError, ConflictError, UnsupportedError
from tunepack.jobs import submit
from tunepack.jobs.translate import Initializer
from tunepack.runtimes.validate import validate_trainjob

TINY = "tunepack-tiny-llama3"
MODEL = "file:///models/tiny"


def _trainer(**dataset) -> BuiltinTrainer:
    return BuiltinTrainer(
        config=TorchTuneConfig(
            peft_config=LoraConfig(lora_rank=4),
            dataset_preprocess_config=TorchTuneInstructDataset(**dataset),
        )
    )


def _build(trainer, dataset="file:///data/train", **kw) -> dict:
    job = submit.build(TINY, Initializer(dataset=dataset, model=MODEL), trainer, name="j", **kw)
    validate_trainjob(job)
    return job


def _env(job: dict, step: str) -> dict:
    return {e["name"]: e.get("value") for e in job["spec"]["initializer"][step].get("env", [])}


@pytest.mark.parametrize("source", [DataFormat.JSON, DataFormat.CSV, DataFormat.ARROW])
def test_every_format_the_initializer_reads_is_accepted(source):
    assert _build(_trainer(source=source))["spec"]["trainer"]["args"][0] == "method=lora"


def test_a_format_it_does_not_read_is_refused_by_name():
    with pytest.raises(UnsupportedError) as err:
        _build(_trainer(source=DataFormat.TEXT))
    assert str(err.value) == (
        "TorchTuneInstructDataset.source='text' cannot be translated: tunepack's dataset "
        "initializer reads JSON (.json, .jsonl), CSV, Parquet and Arrow files; convert the data "
        "to one of them"
    )


def test_the_default_split_adds_nothing():
    assert "DATASET_SPLIT" not in _env(_build(_trainer(split="train")), "dataset")


def test_a_split_given_twice_must_agree():
    with pytest.raises(ConflictError) as err:
        _build(_trainer(split="train[:10]"), dataset="hf://datasets/org/d?split=train[:20]")
    assert str(err.value) == (
        "the dataset split is given twice and differs: dataset_split 'train[:10]', the dataset "
        "URI's ?split= 'train[:20]'; give it once"
    )
    same = _build(_trainer(split="train[:10]"), dataset="hf://datasets/org/d?split=train[:10]")
    assert "DATASET_SPLIT" not in _env(same, "dataset")  # the URI already says it


def test_a_malformed_split_in_the_uri_is_refused_at_submission():
    with pytest.raises(BadValueError) as err:
        _build(_trainer(), dataset="hf://datasets/org/d?split=train[5]")
    assert str(err.value) == (
        "dataset split 'train[5]' is not a split name or a slice of one; write "
        "<name>[<from>:<to>], e.g. train[:1000], train[10%:20%] or train[-100:] (one slice; no "
        "'+' or rounding suffix)"
    )


def test_an_access_token_is_pointed_at_the_secret_way_and_never_repeated():
    token = "hf_NotARealTokenButSecretLooking123"
    init = KfInitializer(
        dataset=HuggingFaceDatasetInitializer(storage_uri="org/ds"),
        model=HuggingFaceModelInitializer(storage_uri="org/m", access_token=token),
    )
    with pytest.raises(UnsupportedError) as err:
        submit.build(TINY, init, _trainer(), name="j")
    message = str(err.value)
    assert token not in message and "\n" not in message
    assert message.endswith(
        "Create a Secret (kubectl create secret generic hf-token --from-literal=HF_TOKEN=<token>) "
        "and pass it by reference: tunepack.Initializer(model=HuggingFaceModelInitializer("
        "storage_uri=...) without access_token, model_secret='hf-token'); on the local backend, "
        "export HF_TOKEN instead"
    )
    # Followed, it works: the token goes by reference.
    fixed = Initializer(
        dataset=HuggingFaceDatasetInitializer(storage_uri="org/ds"),
        model=HuggingFaceModelInitializer(storage_uri="org/m"),
        model_secret="hf-token",
    )
    job = submit.build(TINY, fixed, _trainer(), name="j")
    assert job["spec"]["initializer"]["model"]["secretRef"] == {"name": "hf-token"}
    assert token not in json.dumps(job)


def test_column_map_and_new_system_prompt_keep_torchtunes_meaning():
    """torchtune's ``column_map`` maps its fields ('input', the prompt, and 'output') to the
    dataset's columns; tunepack's COLUMN_MAP maps a column to its field ('from:to'): the map is
    turned around, torchtune's 'input' being tunepack's 'instruction'. ``new_system_prompt`` is
    the trainer's system_prompt."""
    job = _build(
        _trainer(
            column_map={"input": "question", "output": "answer"}, new_system_prompt="Be terse."
        )
    )
    assert _env(job, "dataset")["COLUMN_MAP"] == "question:instruction,answer:output"
    assert job["spec"]["trainer"]["args"][-1] == "system_prompt=Be terse."
    odd = _build(_trainer(column_map={"input": "q:1", "output": "a,2"}))
    assert json.loads(_env(odd, "dataset")["COLUMN_MAP"]) == {"q:1": "instruction", "a,2": "output"}


@pytest.mark.parametrize(
    "column_map, message",
    [
        (
            {"input": "question"},
            "TorchTuneInstructDataset.column_map={'input': 'question'} is not valid: it has no key "
            "'output' (torchtune needs both); its keys are 'input' (the prompt) and 'output' (the "
            "answer), each mapped to the dataset's column, e.g. {'input': 'question', 'output': "
            "'answer'}",
        ),
        (
            {"prompt": "q", "output": "a"},
            "TorchTuneInstructDataset.column_map={'prompt': 'q', 'output': 'a'} is not valid: key "
            "'prompt' is not one of torchtune's instruction fields; its keys are 'input' (the "
            "prompt) and 'output' (the answer), each mapped to the dataset's column, e.g. "
            "{'input': 'question', 'output': 'answer'}",
        ),
        (
            {"input": "q", "output": "q"},
            "TorchTuneInstructDataset.column_map={'input': 'q', 'output': 'q'} maps 'input' and "
            "'output' to the same column: the prompt and the answer need a column each",
        ),
    ],
)
def test_a_column_map_torchtune_would_refuse_is_refused_by_name(column_map, message):
    with pytest.raises(BadValueError) as err:
        _build(_trainer(column_map=column_map))
    assert str(err.value) == message


def test_a_column_map_given_twice_must_agree():
    init = Initializer(
        dataset="file:///data/train", model=MODEL, env={"COLUMN_MAP": "q:instruction,a:output"}
    )
    with pytest.raises(ConflictError) as err:
        submit.build(
            TINY, init, _trainer(column_map={"input": "question", "output": "answer"}), name="j"
        )
    assert str(err.value) == (
        "the column map is given twice and differs: Initializer env COLUMN_MAP="
        "'q:instruction,a:output', TorchTuneInstructDataset.column_map as COLUMN_MAP="
        "'question:instruction,answer:output'; give it once"
    )
    same = Initializer(
        dataset="file:///data/train",
        model=MODEL,
        env={"COLUMN_MAP": "question:instruction,answer:output"},
    )
    job = submit.build(
        TINY, same, _trainer(column_map={"input": "question", "output": "answer"}), name="j"
    )
    assert _env(job, "dataset")["COLUMN_MAP"] == "question:instruction,answer:output"
