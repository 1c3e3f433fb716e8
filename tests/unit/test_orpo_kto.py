"""ORPO and KTO on fixed inputs: their losses against hand-computed values, KTO's batches and
reference point, the unpaired schema and the arguments."""

from __future__ import annotations

import math

import pytest
import torch
from torchtune.data import CROSS_ENTROPY_IGNORE_IDX as IGNORE

from tests.helpers import TINY, adapted_lora_model
from tunepack.core.errors import ConflictError
from tunepack.initializers.data.schemas import SCHEMAS, detect
from tunepack.runtimes.args import parse_trainer_args
from tunepack.tiny.dataset import tiny_unpaired_rows
from tunepack.trainers.objectives import kto, orpo


def _sigmoid(x: float) -> float:
    return 1 / (1 + math.exp(-x))


# ------------------------------------------------------------------ ORPO


def test_orpo_loss_on_hand_computed_values():
    chosen = torch.tensor([-0.5, -2.0])  # mean log-probability per answer token
    rejected = torch.tensor([-1.5, -1.0])
    beta = 0.25
    losses, ratio, nll = orpo.pair_losses(chosen, rejected, beta)

    def odds(lp):
        p = math.exp(lp)
        return math.log(p / (1 - p))

    for i, (c, r) in enumerate(((-0.5, -1.5), (-2.0, -1.0))):
        want_ratio = odds(c) - odds(r)
        assert ratio[i].item() == pytest.approx(want_ratio, rel=1e-6)
        assert nll[i].item() == pytest.approx(-c)
        want = -c - beta * math.log(_sigmoid(want_ratio))
        assert losses[i].item() == pytest.approx(want, rel=1e-6)
    # The first pair prefers the chosen answer (positive log odds ratio), the second does not.
    assert ratio[0] > 0 > ratio[1]


def test_orpo_log_odds_stay_finite_near_certainty():
    assert torch.isfinite(orpo.log_odds(torch.tensor([0.0, -1e-9, -50.0]))).all()


# ------------------------------------------------------------------ KTO


def test_kto_loss_on_hand_computed_values():
    rewards = torch.tensor([0.8, -0.4, 0.3])
    desirable = torch.tensor([True, True, False])
    z, beta, wd, wu = 0.2, 0.5, 1.0, 1.5
    got = kto.losses(
        rewards, desirable, torch.tensor(z), beta=beta, desirable_weight=wd, undesirable_weight=wu
    )
    want = [
        wd * (1 - _sigmoid(beta * (0.8 - z))),
        wd * (1 - _sigmoid(beta * (-0.4 - z))),
        wu * (1 - _sigmoid(beta * (z - 0.3))),
    ]
    assert got.tolist() == pytest.approx(want, rel=1e-6)


def test_kto_batches_hold_the_rows_then_mismatched_pairs():
    batch = [
        {"prompt": [1, 2], "answer": [3], "label": True},
        {"prompt": [4], "answer": [5, 6], "label": False},
        {"prompt": [7, 8, 9], "answer": [10], "label": True},
    ]
    out = kto.collate(batch, padding_idx=0)
    assert out["tokens"].tolist() == [
        [1, 2, 3, 0],
        [4, 5, 6, 0],
        [7, 8, 9, 10],
        [1, 2, 5, 6],  # prompt 0, answer 1
        [4, 10, 0, 0],  # prompt 1, answer 2
        [7, 8, 9, 3],  # prompt 2, answer 0
    ]
    i = IGNORE
    assert out["labels"].tolist() == [
        [i, i, 3, i],
        [i, 5, 6, i],
        [i, i, i, 10],
        [i, i, 5, 6],
        [i, 10, i, i],
        [i, i, i, 3],
    ]
    assert out["label"].tolist() == [True, False, True]


@pytest.fixture(scope="module")
def small_model():
    return adapted_lora_model(
        vocab_size=20, num_layers=1, num_heads=2, num_kv_heads=1, embed_dim=16, max_seq_len=32,
        intermediate_dim=32, lora_rank=2, lora_alpha=4,
    )  # fmt: skip


def test_kto_forward_uses_the_reference_point_of_the_mismatched_pairs(small_model):
    from torchtune.modules.peft import disable_adapter

    from tunepack.trainers.objectives.dpo import answer_logps

    batch = kto.collate(
        [
            {"prompt": [1, 2], "answer": [3, 4], "label": True},
            {"prompt": [5, 6, 7], "answer": [8], "label": False},
        ],
        padding_idx=0,
    )
    objective = kto.KTO(beta=0.1, desirable_weight=1.0, undesirable_weight=1.0)
    loss, count = objective.forward(small_model, batch, torch.device("cpu"))
    with torch.no_grad():
        policy, _ = answer_logps(small_model(batch["tokens"]), batch["labels"])
        with disable_adapter(small_model):
            reference, _ = answer_logps(small_model(batch["tokens"]), batch["labels"])
    z = max((policy[2:] - reference[2:]).mean().item(), 0.0)
    r = (policy[:2] - reference[:2]).tolist()
    want = (1 - _sigmoid(0.1 * (r[0] - z))) + (1 - _sigmoid(0.1 * (z - r[1])))
    assert count == 2 and loss.item() == pytest.approx(want, rel=1e-5)
    metrics = objective.metrics(objective.batch_stats, 2)
    assert metrics["kl"] == pytest.approx(z, abs=1e-6)
    assert metrics["reward_chosen"] == pytest.approx(r[0], abs=1e-5)
    assert metrics["reward_rejected"] == pytest.approx(r[1], abs=1e-5)


# ------------------------------------------------------------------ the unpaired schema, arguments


def test_unpaired_rows_are_normalized_and_detected():
    row = {"prompt": "2+2?", "completion": "4", "label": True}
    assert detect(row, "d").name == "unpaired"
    assert SCHEMAS["unpaired"].normalize(row, False) == (
        {
            "messages": [
                {"role": "user", "content": "2+2?"},
                {"role": "assistant", "content": "4"},
            ],
            "label": True,
        },
        None,
    )
    # A CSV cell spells the label.
    assert SCHEMAS["unpaired"].normalize({**row, "label": "False"}, True)[0]["label"] is False


NOT_A_LABEL = "field 'label' must be true (a desirable answer) or false"


@pytest.mark.parametrize(
    ("row", "problem"),
    [
        ({"prompt": "q", "completion": "a"}, "field 'label' is missing"),
        ({"prompt": "q", "completion": "a", "label": 1}, f"{NOT_A_LABEL}, got number"),
        ({"prompt": "q", "completion": "a", "label": "yes"}, f"{NOT_A_LABEL}, got string"),
        ({"prompt": "q", "completion": " ", "label": True}, "field 'completion' is empty"),
        ({"completion": "a", "label": True}, "field 'prompt' is missing"),
    ],
)
def test_bad_unpaired_rows_name_the_field(row, problem):
    assert SCHEMAS["unpaired"].normalize(row, False) == (None, problem)


def test_tiny_unpaired_rows_alternate_desirable_answers():
    rows = tiny_unpaired_rows(6)
    assert [r["label"] for r in rows] == [True, False] * 3
    assert all(SCHEMAS["unpaired"].normalize(r, False)[1] is None for r in rows)


def test_orpo_and_kto_arguments():
    assert parse_trainer_args(["method=orpo"], TINY).beta == 0.1
    args = parse_trainer_args(["method=kto", "undesirable_weight=1.5", "batch_size=4"], TINY)
    assert (args.desirable_weight, args.undesirable_weight, args.lr) == (1.0, 1.5, 5e-5)
    for argv, message in (
        (
            ["method=orpo", "desirable_weight=2"],
            "desirable_weight=2: only method=kto uses desirable_weight, but method=orpo",
        ),
        (
            ["method=kto", "batch_size=1"],
            "batch_size=1 is too small for method=kto: its reference point comes from each "
            "batch's prompts paired with other rows' answers; use batch_size=2 or more",
        ),
        (
            ["method=orpo", "packed=true"],
            "packed=true is not available with method=orpo: each preference pair is its own "
            "sequence; set packed=false",
        ),
    ):
        with pytest.raises(ConflictError) as err:
            parse_trainer_args(argv, TINY)
        assert str(err.value) == message
