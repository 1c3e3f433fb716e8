"""What a hyperparameter search is given, parsed where it enters (tunepack.optimizer.space): the
search space over the trainer's vocabulary, the objectives a method reports, the algorithm, the
CLI's flags. Each refusal is pinned on the line a user sees."""

from __future__ import annotations

import pytest
from kubeflow.optimizer import GridSearch, Objective, RandomSearch, Search

from tunepack.core.errors import BadValueError, ConflictError, UnknownKeyError, UnsupportedError
from tunepack.optimizer import space as spaces
from tunepack.optimizer.space import CLI, Goal, Parameter, TPESearch
from tunepack.runtimes import methods

LORA, DPO, GRPO = methods.get("lora"), methods.get("dpo"), methods.get("grpo")


def test_a_space_is_typed_parameters_each_checked_by_its_arguments_parser():
    params = spaces.parse_space(
        {
            "lr": Search.loguniform(1e-5, 1e-3),
            "lora_rank": Search.choice([8, 16, 32]),
            "warmup_steps": Search.uniform(0, 20),
            "lora_mlp": Search.choice([True, False]),
        }
    )
    assert params == (
        Parameter("lr", low=1e-5, high=1e-3, log=True),
        Parameter("lora_rank", choices=("8", "16", "32"), integer=True),
        Parameter("warmup_steps", low=0.0, high=20.0, integer=True),
        Parameter("lora_mlp", choices=("True", "False")),
    )
    assert [p.describe() for p in params] == [
        "lr=loguniform:1e-05:0.001",
        "lora_rank=choice:8,16,32",
        "warmup_steps=uniform:0:20",
        "lora_mlp=choice:True,False",
    ]
    assert [p.largest() for p in params] == ["0.001", "32", "20", "True"]


@pytest.mark.parametrize(
    ("space", "error", "line"),
    [
        (
            {"learning_rate": Search.loguniform(1e-5, 1e-3)},
            UnknownKeyError,
            "search_space['learning_rate']: 'learning_rate' is not a trainer argument; tunepack "
            "calls it 'lr'",
        ),
        (
            {"lora_rnak": Search.choice([8])},
            UnknownKeyError,
            "search_space['lora_rnak']: 'lora_rnak' is not a trainer argument; did you mean "
            "'lora_rank', 'lora_alpha'?",
        ),
        (
            {"lora_rank": Search.choice([0, 8])},
            BadValueError,
            "search_space['lora_rank']: lora_rank='0' is not valid: expected an integer from 1 "
            "to 1024",
        ),
        (
            {"lr": Search.loguniform(0, 1e-3)},
            BadValueError,
            "search_space['lr']: lr='0' is not valid: expected a number > 0.0 and < 1.0",
        ),
        (
            {"lr": Search.uniform(1e-3, 1e-4)},
            BadValueError,
            "search_space['lr']: the range 0.001..0.0001 is empty: min must be below max",
        ),
        (
            {"method": Search.uniform(1, 2)},
            BadValueError,
            "search_space['method']: method takes one of lora, qlora, dora, full, dpo, orpo, kto, "
            "grpo, grpo_full, not a range; use Search.choice([...])",
        ),
        (
            {"lr": 0.001},
            BadValueError,
            "search_space['lr'] must be Search.uniform(min, max), Search.loguniform(min, max) or "
            "Search.choice([...]), got 0.001",
        ),
    ],
    ids=[
        "foreign-name",
        "typo",
        "refused-choice",
        "refused-bound",
        "empty",
        "range-of-words",
        "raw",
    ],
)
def test_a_key_or_value_the_vocabulary_refuses_is_one_line(space, error, line):
    with pytest.raises(error) as caught:
        spaces.parse_space(space)
    assert str(caught.value) == line


def test_plumbing_is_not_searched_and_the_line_lists_what_is():
    with pytest.raises(UnsupportedError) as caught:
        spaces.parse_space({"tracker_uri": Search.choice(["file:///x"])})
    line = str(caught.value)
    assert line.startswith(
        "search_space['tracker_uri']: tracker_uri is not searched (it does not change what a "
        "trial learns, or every trial must share it); set it in the trial template's FineTune; "
        "the searchable arguments are method, epochs, max_steps, batch_size, grad_accum, lr,"
    )
    assert "tracker" not in line.split("the searchable arguments are ")[1]


def test_objectives_are_metrics_the_method_reports():
    assert spaces.parse_objectives(None, LORA, validates=True) == (Goal("val_loss"),)
    assert spaces.parse_objectives(None, LORA, validates=False) == (Goal("loss"),)
    # The validation loss under the names other tools give it.
    assert spaces.parse_objectives([Objective(metric="eval_loss")], LORA, validates=True) == (
        Goal("val_loss"),
    )
    assert spaces.parse_objectives(
        [Objective(metric="reward_accuracy", direction="maximize")], DPO, validates=False
    ) == (Goal("reward_accuracy", "maximize"),)
    assert spaces.parse_objectives(
        [Objective(metric="reward_exact", direction="maximize")], GRPO, False, ("exact",)
    ) == (Goal("reward_exact", "maximize"),)


@pytest.mark.parametrize(
    ("objective", "method", "validates", "line"),
    [
        (
            "reward_accuracy",
            LORA,
            True,
            "Objective(metric='reward_accuracy'): no trial would report 'reward_accuracy': "
            "method=lora reports loss, val_loss",
        ),
        (
            "eval_loss",
            LORA,
            False,
            "Objective(metric='eval_loss'): no trial would report 'val_loss': the trial template "
            "holds out no rows: set val_fraction (e.g. FineTune(val_fraction=0.1), or "
            "val_fraction=0.1)",
        ),
        (
            "val_loss",
            GRPO,
            False,
            "Objective(metric='val_loss'): no trial would report 'val_loss': method=grpo has no "
            "validation loss",
        ),
    ],
)
def test_a_metric_the_method_never_reports_is_refused(objective, method, validates, line):
    with pytest.raises(UnsupportedError) as caught:
        spaces.parse_objectives([Objective(metric=objective)], method, validates)
    assert str(caught.value) == line


def test_the_algorithms_and_a_grid_that_needs_lists():
    choices = spaces.parse_space({"lora_rank": Search.choice([8, 16])})
    ranged = spaces.parse_space({"lr": Search.loguniform(1e-5, 1e-3)})
    assert spaces.parse_algorithm(None, ranged).name == "random"
    assert spaces.parse_algorithm(RandomSearch(random_state=3), ranged) == spaces.Algorithm(
        "random", 3
    )
    assert spaces.parse_algorithm(TPESearch(random_state=1), ranged) == spaces.Algorithm("tpe", 1)
    assert spaces.parse_algorithm(GridSearch(), choices).name == "grid"
    with pytest.raises(ConflictError) as caught:
        spaces.parse_algorithm(GridSearch(), ranged)
    assert str(caught.value) == (
        "algorithm: a grid search needs every parameter as a list of values (Search.choice, or "
        "choice:A,B,...), but lr=loguniform:1e-05:0.001 is a range"
    )
    assert TPESearch()._to_katib_spec().algorithm_name == "tpe"


def test_the_clis_search_and_objective_flags():
    name, spec = spaces.parse_search_flag("lr=loguniform:1e-5:1e-3")
    assert name == "lr" and spaces.parse_space({name: spec}, CLI) == (
        Parameter("lr", low=1e-5, high=1e-3, log=True),
    )
    name, spec = spaces.parse_search_flag("lora_rank=choice:8,16,32")
    assert spec.feasible_space.list == ["8", "16", "32"]
    assert spaces.parse_objective_flag("reward_margin:max") == Objective(
        "reward_margin", "maximize"
    )
    with pytest.raises(BadValueError) as caught:
        spaces.parse_search_flag("lr=between:1:2")
    assert str(caught.value) == (
        "--search 'lr=between:1:2' is not valid: expected NAME=loguniform:MIN:MAX, "
        "NAME=uniform:MIN:MAX or NAME=choice:A,B,... (e.g. lr=loguniform:1e-5:1e-3)"
    )
    with pytest.raises(UnknownKeyError) as caught:
        spaces.parse_search_flag("learning_rate=loguniform:1e-5:1e-3")
    assert str(caught.value) == (
        "--search learning_rate: 'learning_rate' is not a trainer argument; tunepack calls it 'lr'"
    )
    with pytest.raises(BadValueError) as caught:
        spaces.parse_objective_flag("val_loss:lowest")
    assert str(caught.value) == (
        "--objective 'val_loss:lowest' is not valid: expected METRIC[:min|:max], e.g. val_loss:min"
    )


def test_the_sdks_optimizer_given_a_finetune_is_pointed_at_tunepacks():
    from tunepack import FineTune

    with pytest.raises(UnsupportedError) as caught:
        FineTune(method="lora").func_args  # noqa: B018 (what the SDK's optimize() reads first)
    assert str(caught.value) == (
        "kubeflow.optimizer.OptimizerClient runs CustomTrainer trials only; for a FineTune trial "
        "template use tunepack.OptimizerClient, with the same arguments (docs/optimize.md)"
    )


def test_docs_list_the_searchable_arguments_and_each_methods_metrics():
    """docs/optimize.md says what is searched and what each method reports: as the code does."""
    from tests import REPO

    text = (REPO / "docs" / "optimize.md").read_text()
    listed = text.split("The arguments a search may draw:\n\n")[1].split("\n\n")[0]
    assert [k.strip() for k in listed.replace("\n", " ").split(",")] == list(spaces.SEARCHABLE)
    rows = {
        line.split("|")[1].strip(): line.split("|")[2] for line in text.splitlines() if "| " in line
    }
    assert all(f"`{m}`" in rows["dpo"] for m in DPO.metrics)
    assert all(f"`{m}`" in rows["orpo"] for m in methods.get("orpo").metrics[4:])
    assert all(f"`{m}`" in rows["kto"] for m in methods.get("kto").metrics[4:])
    assert all(f"`{m}`" in rows["grpo, grpo_full"] for m in GRPO.metrics)
