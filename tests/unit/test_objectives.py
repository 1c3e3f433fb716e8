"""The objectives' declared interface (trainers/objectives/base.py, table.py) and the checklist
of docs/architecture.md, "A new objective", held true."""

from __future__ import annotations

import re
import types

import pytest
from omegaconf import OmegaConf

from tests import REPO
from tests.helpers import TINY
from tunepack.runtimes import methods
from tunepack.runtimes.args import parse_trainer_args
from tunepack.trainers.objectives.base import Objective
from tunepack.trainers.objectives.table import OBJECTIVES

OWN_LOSS = [m.name for m in methods.METHODS.values() if m.loss is not methods.Loss.CROSS_ENTROPY]
# What a protocol declares: its annotated attributes and the functions of its body.
MEMBERS = (
    *Objective.__annotations__,
    *(n for n, v in vars(Objective).items() if not n.startswith("_") and callable(v)),
    *(n for n, v in vars(Objective).items() if isinstance(v, classmethod)),
)


def test_the_protocol_declares_what_the_recipe_calls():
    assert sorted(MEMBERS) == sorted(
        [
            "stat_names", "batch_stats", "fill", "reference", "from_config", "collate",
            "needs_reference", "start_step", "forward", "metrics",
        ]
    )  # fmt: skip


def test_every_loss_of_a_methods_own_has_one_entry():
    used = {m.loss for m in methods.METHODS.values()} - {methods.Loss.CROSS_ENTROPY}
    assert set(OBJECTIVES) == used
    assert methods.Loss.CROSS_ENTROPY not in OBJECTIVES


@pytest.mark.parametrize("loss", sorted(OBJECTIVES, key=lambda loss: loss.value))
def test_every_entrys_class_has_each_member_of_the_protocol(loss):
    declared = OBJECTIVES[loss]
    assert (REPO / "trainers" / "objectives" / f"{declared.module}.py").is_file()
    cls = declared.load()
    assert cls.__module__ == f"tunepack.trainers.objectives.{declared.module}"
    # (the annotated ones are an instance's: GRPO's stat names depend on its rewards)
    methods_of = [name for name in MEMBERS if name not in Objective.__annotations__]
    missing = [name for name in methods_of if not hasattr(cls, name)]
    assert not missing, f"{cls.__name__} lacks {missing}"


@pytest.mark.parametrize("name", OWN_LOSS)
def test_every_objective_is_built_from_its_config_node_and_reports_its_records_metrics(name):
    method = methods.get(name)
    declared = OBJECTIVES[method.loss]
    args = parse_trainer_args([f"method={name}", "batch_size=2"], TINY)
    cfg = OmegaConf.create({method.loss.value: declared.settings(args), "seed": 0})
    tokenizer = types.SimpleNamespace(eos_id=2, pad_id=0)
    objective = declared.load().from_config(cfg, tokenizer, distributed=False)
    assert isinstance(objective, Objective)
    assert [m for m in Objective.__annotations__ if not hasattr(objective, m)] == []
    assert objective.stat_names[0] == "tokens"
    assert objective.batch_stats == [0.0] * len(objective.stat_names)
    reported = objective.metrics([0.0] * len(objective.stat_names), 0.0)
    assert set(method.metrics) <= set(reported)
    extra = set(reported) - set(method.metrics)
    if method.loss is methods.Loss.GRPO:  # and each reward's own mean
        extra = {n for n in extra if not n.startswith(methods.GRPO_REWARD_METRIC.format(""))}
    assert not extra, f"{name} reports {extra}, which its record does not declare"


def _checklist() -> str:
    text = (REPO / "docs" / "architecture.md").read_text()
    match = re.search(r"^### A new objective\n(.*?)(?=^#)", text, re.S | re.M)
    assert match, 'docs/architecture.md has no "### A new objective" section'
    return match.group(1)


def test_the_checklist_names_files_that_exist():
    checklist = _checklist()
    paths = re.findall(r"`([\w/<>]+\.py)`", checklist)
    named = {p for p in paths if "<" not in p}
    assert {
        "trainers/objectives/base.py",
        "trainers/objectives/table.py",
        "runtimes/methods.py",
        "tests/unit/test_objectives.py",
    } <= named
    assert [p for p in sorted(named) if not (REPO / p).is_file()] == []
    assert "trainers/objectives/<name>.py" in paths  # the new module, beside the others


def test_the_checklist_names_every_member_of_the_protocol():
    checklist = _checklist()
    assert [m for m in MEMBERS if f"`{m}`" not in checklist] == []
