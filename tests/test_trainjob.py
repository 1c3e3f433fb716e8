"""TrainJob building: the API shape, strict validation and clear errors for bad input."""

from __future__ import annotations

import importlib.util
import sys
import types

import pytest
import yaml

from tunepack.errors import BadInputError
from tunepack.runtimes.validate import validate_trainjob
from tunepack.trainjob import build_trainjob, max_name_length, to_yaml

ARGS_MODULE = "tunepack.trainers.args"


@pytest.fixture(autouse=True)
def real_trainer_args(monkeypatch) -> bool:
    """Stand in for the trainer's argument parser if it has not landed yet (accepts anything)."""
    if importlib.util.find_spec(ARGS_MODULE) is not None:
        return True
    stub = types.ModuleType(ARGS_MODULE)
    stub.parse_trainer_args = lambda args, entry: None
    monkeypatch.setitem(sys.modules, ARGS_MODULE, stub)
    return False


def _build(**overrides) -> dict:
    kwargs = {
        "name": "tiny-lora",
        "runtime": "tunepack-tiny-llama3",
        "dataset_uri": "file:///data/alpaca.jsonl",
        "model_uri": "file:///models/tiny-llama3",
        "trainer_args": ["method=lora", "epochs=2"],
    }
    return build_trainjob(**(kwargs | overrides))


def test_trainjob_has_the_api_fields():
    job = _build(num_nodes=2, namespace="team-a")
    assert job["apiVersion"] == "trainer.kubeflow.org/v1alpha1"
    assert job["kind"] == "TrainJob"
    assert job["metadata"] == {"name": "tiny-lora", "namespace": "team-a"}
    assert job["spec"] == {
        "runtimeRef": {
            "name": "tunepack-tiny-llama3",
            "apiGroup": "trainer.kubeflow.org",
            "kind": "ClusterTrainingRuntime",
        },
        "initializer": {
            "dataset": {"storageUri": "file:///data/alpaca.jsonl"},
            "model": {"storageUri": "file:///models/tiny-llama3"},
        },
        "trainer": {"args": ["method=lora", "epochs=2"], "numNodes": 2},
    }
    validate_trainjob(job)


def test_optional_fields_are_left_out_and_model_names_resolve():
    job = _build(runtime="tiny-llama3")
    assert job["spec"]["runtimeRef"]["name"] == "tunepack-tiny-llama3"
    assert "numNodes" not in job["spec"]["trainer"]
    assert "namespace" not in job["metadata"]


def test_to_yaml_round_trips():
    job = _build()
    text = to_yaml(job)
    assert yaml.safe_load(text) == job
    assert text.index("apiVersion") < text.index("spec")  # written in build order, not sorted


@pytest.mark.parametrize(
    ("name", "hint"),
    [
        ("Tiny_LoRA", "not a valid DNS-1123 label"),
        ("tiny-", "not a valid DNS-1123 label"),
        ("", "not a valid DNS-1123 label"),
        ("1st-run", "must start with a letter"),
        ("a" * 34, "at most 33 are allowed"),
    ],
)
def test_bad_names_are_explained(name, hint):
    with pytest.raises(BadInputError, match=hint):
        _build(name=name)


def test_longest_allowed_name_is_accepted():
    assert max_name_length() == 33  # <name>-dataset-initializer-0-0-xxxxx fits in 63
    _build(name="a" * 33)


def test_unknown_runtime_lists_the_runtimes():
    with pytest.raises(BadInputError) as caught:
        _build(runtime="torchtune-llama3.2-1b")
    assert "unknown runtime or model 'torchtune-llama3.2-1b'" in str(caught.value)
    assert "tunepack-llama3.2-1b" in str(caught.value)


@pytest.mark.parametrize(
    ("overrides", "hint"),
    [
        ({"namespace": "Team_A"}, "namespace 'Team_A' is not a valid DNS-1123 label"),
        ({"num_nodes": 0}, "num_nodes must be a positive integer"),
        ({"num_nodes": True}, "num_nodes must be a positive integer"),
        ({"dataset_uri": " "}, "dataset_uri must be a non-empty storage URI"),
        ({"trainer_args": "method=lora"}, "trainer_args must be a list"),
    ],
)
def test_other_bad_input(overrides, hint):
    with pytest.raises(BadInputError, match=hint):
        _build(**overrides)


def test_trainer_args_are_checked_against_the_vocabulary(real_trainer_args):
    if not real_trainer_args:
        pytest.skip(f"{ARGS_MODULE} is not there yet")
    with pytest.raises(BadInputError, match="lora_rnk"):
        _build(trainer_args=["method=lora", "lora_rnk=8"])
    with pytest.raises(BadInputError):
        _build(trainer_args=["model._component_=os.system"])
