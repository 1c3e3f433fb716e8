"""GRPO's parts on fixed inputs: the rewards, the prompt schema, the arguments, the advantages,
the clipped objective with its KL penalty (against hand-computed values), sampling, and
generation with a KV cache on a small random torchtune model."""

from __future__ import annotations

import json
import math
from importlib import metadata

import pytest
import torch

from tests.helpers import TINY, adapted_lora_model
from tunepack.core.errors import BadValueError, ConflictError
from tunepack.initializers.data.schemas import SCHEMAS, detect
from tunepack.runtimes import reward_names
from tunepack.runtimes.args import parse_trainer_args
from tunepack.runtimes.reward_names import Weighted
from tunepack.trainers.objectives import grpo, rewards
from tunepack.trainers.objectives.rewards import Sample


def sample(completion: str, answer: str | None = "42", *, tokens: int = 4, pattern: str = ""):
    return Sample("q", completion, answer, tokens, 8, pattern)


# ------------------------------------------------------------------ rewards


@pytest.mark.parametrize(
    ("name", "completion", "answer", "expected"),
    [
        ("exact", " 42\n", "42", 1.0),
        ("exact", "42.", "42", 0.0),
        ("match", "  Paris. ", "paris", 1.0),
        ("match", "New   York", "new york", 1.0),
        ("match", "Paris is", "paris", 0.0),
        ("numeric", "The sum is 1,000.", "1000", 1.0),
        ("numeric", "7 then 8", "#### 8", 1.0),  # the last number of each
        ("numeric", "7.0", "7", 1.0),
        ("numeric", "7", "8", 0.0),
        ("numeric", "no number", "8", 0.0),
        ("exact", "42", None, 0.0),  # no reference answer: no match
    ],
)
def test_built_in_rewards_on_fixed_answers(name, completion, answer, expected):
    assert rewards.BUILT_IN[name](sample(completion, answer)) == expected


def test_the_trainer_computes_every_reward_the_vocabulary_names_built_in():
    assert tuple(rewards.BUILT_IN) == reward_names.BUILT_IN
    assert set(rewards.NEEDS_ANSWER) <= set(reward_names.BUILT_IN)


def test_format_searches_and_length_penalises_the_share_of_the_limit():
    assert rewards.format_(sample("<a>12</a>", pattern=r"^<a>\d+</a>$")) == 1.0
    assert rewards.format_(sample("<a>12</a> more", pattern=r"^<a>\d+</a>$")) == 0.0
    assert rewards.format_(sample("x 12", pattern=r"\d")) == 1.0  # a search, not a full match
    assert rewards.length(sample("", tokens=0)) == 0.0
    assert rewards.length(sample("abc", tokens=2)) == -0.25
    assert rewards.length(sample("abc", tokens=8)) == -1.0


def test_weighted_sum_and_each_value():
    functions = rewards.resolve(reward_names.parse("rewards", "numeric,length:-0.5"))
    total, values = rewards.score(functions, sample("42", tokens=2))
    assert values == [1.0, -0.25] and total == 1.0 + 0.125


NON_ZERO = "the weight of 'match' must be a non-zero number"


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        ("", f"rewards='' is not valid: expected {reward_names.EXPECTED}"),
        (
            "match,,length",
            f"rewards='match,,length' is not valid: expected {reward_names.EXPECTED}",
        ),
        ("os.system", f"rewards='os.system' is not valid: expected {reward_names.EXPECTED}"),
        ("match:x", f"rewards='match:x' is not valid: expected {reward_names.EXPECTED}"),
        ("match:0", "rewards='match:0' is not valid: " + NON_ZERO),
        ("match:nan", "rewards='match:nan' is not valid: " + NON_ZERO),
        ("match,match:2", "rewards='match,match:2' is not valid: 'match' is named twice"),
    ],
)
def test_reward_arguments_that_are_refused(raw, message):
    with pytest.raises(BadValueError) as err:
        reward_names.parse("rewards", raw)
    assert str(err.value) == message


def test_spelling_round_trips():
    parsed = reward_names.parse("rewards", " match , format:0.5,length:-1 ")
    assert parsed == (Weighted("match", 1.0), Weighted("format", 0.5), Weighted("length", -1.0))
    assert reward_names.spelled(parsed) == "match,format:0.5,length:-1"


def test_an_unknown_reward_names_the_built_ins_and_plugins(monkeypatch):
    monkeypatch.setattr(rewards, "plugins", lambda: {})
    with pytest.raises(BadValueError) as err:
        rewards.resolve((Weighted("mine", 1.0),))
    assert str(err.value) == (
        "rewards: 'mine' is neither a built-in reward nor an installed plugin (entry point group "
        "'tunepack.rewards'): expected one of exact, match, numeric, format, length"
    )


def shouting(sample: Sample) -> float:
    """A plugin's reward: the share of upper-case letters."""
    letters = [c for c in sample.completion if c.isalpha()]
    return sum(c.isupper() for c in letters) / max(len(letters), 1)


def test_a_plugin_is_found_through_its_entry_point(monkeypatch):
    entry = metadata.EntryPoint("shout", f"{__name__}:shouting", rewards.PLUGIN_GROUP)
    monkeypatch.setattr(rewards, "plugins", lambda: {"shout": entry})
    functions = rewards.resolve(reward_names.parse("rewards", "shout:2,length"))
    total, values = rewards.score(functions, sample("ABcd", tokens=4))
    assert values == [0.5, -0.5] and total == 0.5


def test_a_reward_pattern_must_compile():
    with pytest.raises(BadValueError) as err:
        reward_names.parse_pattern("reward_pattern", "([0-9]")
    assert str(err.value).startswith(
        "reward_pattern='([0-9]' is not valid: expected a Python regular expression (missing )"
    )


# ------------------------------------------------------------------ the prompt schema


USER = {"role": "user", "content": "2+2?"}
SYSTEM = {"role": "system", "content": "Be brief."}


@pytest.mark.parametrize(
    ("row", "normalized"),
    [
        ({"prompt": "2+2?", "answer": 4}, {"messages": [USER], "answer": "4"}),
        ({"prompt": "2+2?"}, {"messages": [USER], "answer": None}),
        ({"prompt": [SYSTEM, USER], "answer": "4"}, {"messages": [SYSTEM, USER], "answer": "4"}),
    ],
)
def test_prompt_rows_are_normalized(row, normalized):
    assert detect(row, "d.jsonl").name == "prompt"
    assert SCHEMAS["prompt"].normalize(row, False) == (normalized, None)


NOT_AN_ANSWER = "field 'answer' must be a string or a number"


@pytest.mark.parametrize(
    ("row", "problem"),
    [
        ({"prompt": "  "}, "field 'prompt' is empty"),
        ({"prompt": 3}, "field 'prompt' must be an array, got number"),
        ({"prompt": "q", "answer": [1]}, f"{NOT_AN_ANSWER}, got array"),
        ({"prompt": "q", "answer": True}, f"{NOT_AN_ANSWER}, got boolean"),
        (
            {"prompt": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]},
            "field 'prompt' must end with a user turn (the answer is sampled)",
        ),
    ],
)  # fmt: skip
def test_bad_prompt_rows_name_the_field(row, problem):
    assert SCHEMAS["prompt"].normalize(row, False) == (None, problem)


def test_preference_rows_with_a_prompt_stay_preference_rows():
    assert detect({"prompt": "q", "chosen": "a", "rejected": "b"}, "d").name == "preference"


# ------------------------------------------------------------------ arguments


def test_grpo_defaults_and_the_methods_own_beta():
    args = parse_trainer_args(["method=grpo"], TINY)
    assert (args.beta, args.lr, args.num_generations, args.max_new_tokens) == (0.04, 2e-5, 4, 64)
    assert (args.temperature, args.top_p, args.epsilon) == (1.0, 1.0, 0.2)
    assert args.rewards == (Weighted("match", 1.0),)
    assert parse_trainer_args(["method=dpo"], TINY).beta == 0.1  # DPO keeps its own
    assert parse_trainer_args(["method=grpo", "beta=0.2"], TINY).beta == 0.2


@pytest.mark.parametrize(
    ("argv", "kind", "message"),
    [
        (
            ["method=lora", "num_generations=8"],
            ConflictError,
            "num_generations=8: only method=grpo or grpo_full uses num_generations, but "
            "method=lora",
        ),
        (
            ["method=dpo", "rewards=match"],
            ConflictError,
            "rewards=match: only method=grpo or grpo_full uses rewards, but method=dpo",
        ),
        (
            ["method=grpo", "num_generations=1"],
            BadValueError,
            "num_generations='1' is not valid: expected an integer from 2 to 64",
        ),
        (
            ["method=grpo", "rewards=format"],
            ConflictError,
            "rewards=format needs reward_pattern, the regular expression an answer must match "
            "(for example reward_pattern='^\\d+$')",
        ),
        (
            ["method=grpo", "reward_pattern=x"],
            ConflictError,
            "reward_pattern is only read by the format reward, but rewards=match: add format to "
            "rewards or drop reward_pattern",
        ),
        (
            ["method=grpo", "max_seq_len=64", "max_new_tokens=64"],
            ConflictError,
            "max_new_tokens=64 leaves no room for the prompt in max_seq_len=64 (a prompt and its "
            "answer share it): lower max_new_tokens or raise max_seq_len",
        ),
        (
            ["method=grpo", "compile=true"],
            ConflictError,
            "compile=true is not available with method=grpo: answers are generated one token at a "
            "time into a growing cache, a new shape for torch.compile at every token; leave "
            "compile out",
        ),
        (
            ["method=grpo", "packed=true"],
            ConflictError,
            "packed=true is not available with method=grpo: each prompt's answers are generated "
            "and scored on their own; set packed=false",
        ),
    ],
)
def test_grpo_arguments_that_are_refused(argv, kind, message):
    with pytest.raises(kind) as err:
        parse_trainer_args(argv, TINY)
    assert type(err.value) is kind
    assert str(err.value) == message


# ------------------------------------------------------------------ advantages and the loss


def test_advantages_are_relative_to_each_group():
    scores = torch.tensor([[1.0, 0.0, 0.0, 1.0], [2.0, 2.0, 2.0, 2.0]])
    std = math.sqrt(4 * 0.25 / 3)  # the sample standard deviation of 1, 0, 0, 1
    expected = torch.tensor([[0.5, -0.5, -0.5, 0.5], [0.0] * 4]) / torch.tensor([[std], [0.0]])
    expected[0] = torch.tensor([0.5, -0.5, -0.5, 0.5]) / (std + 1e-4)
    expected[1] = 0.0  # a group that agrees teaches nothing
    assert torch.allclose(grpo.group_advantages(scores), expected)


def test_policy_loss_on_hand_computed_values():
    # Two answers of three tokens; the second's last token is padding.
    logps = torch.tensor([[-1.0, -2.0, -0.5], [-0.3, -1.2, -9.0]], requires_grad=True)
    old = torch.tensor([[-1.5, -2.0, -0.2], [-0.3, -1.0, -9.0]])
    ref = torch.tensor([[-1.0, -2.5, -0.5], [-0.5, -1.2, -9.0]])
    adv = torch.tensor([1.0, -2.0])
    mask = torch.tensor([[True, True, True], [True, True, False]])
    beta, eps = 0.1, 0.2

    def token(lp, o, r, a):
        ratio = math.exp(lp - o)
        objective = min(ratio * a, min(max(ratio, 1 - eps), 1 + eps) * a)
        kl = math.exp(r - lp) - (r - lp) - 1
        return -objective + beta * kl, kl, min(max(ratio, 1 - eps), 1 + eps) * a < ratio * a

    rows = [
        [token(-1.0, -1.5, -1.0, 1.0), token(-2.0, -2.0, -2.5, 1.0), token(-0.5, -0.2, -0.5, 1.0)],
        [token(-0.3, -0.3, -0.5, -2.0), token(-1.2, -1.0, -1.2, -2.0)],
    ]
    per_answer, kl, clipped = grpo.policy_loss(logps, old, ref, adv, mask, beta=beta, epsilon=eps)
    assert per_answer.tolist() == pytest.approx([sum(t[0] for t in r) / len(r) for r in rows])
    assert kl[0].tolist() == pytest.approx([t[1] for t in rows[0]])
    # Clipped where the ratio left [0.8, 1.2] in the advantage's direction: exp(0.5) > 1.2 with
    # A > 0; exp(-0.2) = 0.82 is inside.
    assert clipped.tolist() == [[True, False, False], [False, False, False]]
    assert [t[2] for t in rows[0]] == [True, False, False]
    # The clipped token has no gradient; the others have -A * ratio / length (+ the KL's).
    per_answer.sum().backward()
    assert logps.grad[0, 0] == pytest.approx(beta * (1 - math.exp(0.0)) / 3, abs=1e-7)
    assert logps.grad[1, 2] == 0  # padding


def test_the_ratio_is_one_for_answers_of_the_current_policy():
    logps = torch.tensor([[-1.0, -2.0]], requires_grad=True)
    per_answer, _, clipped = grpo.policy_loss(
        logps, logps.detach(), logps.detach(), torch.tensor([2.0]), torch.ones(1, 2, dtype=bool),
        beta=0.5, epsilon=0.2,
    )  # fmt: skip
    assert per_answer.item() == pytest.approx(-2.0) and not clipped.any()
    per_answer.backward()
    assert logps.grad.tolist() == [[-1.0, -1.0]]  # -A / length: raises what was rewarded


# ------------------------------------------------------------------ sampling and generation


def test_sampling_follows_the_nucleus_and_the_uniform_number():
    logits = torch.log(torch.tensor([[0.2, 0.5, 0.3]])).repeat(3, 1)
    u = torch.tensor([0.1, 0.6, 0.99])
    # Sorted: 0.5 (token 1), 0.3 (token 2), 0.2 (token 0); u picks where u * 1.0 falls.
    assert grpo.sample_tokens(logits, u, 1.0, 1.0).tolist() == [1, 2, 0]
    # top_p=0.6 keeps the tokens whose mass ahead of them is under 0.6, tokens 1 and 2 (0.8 in
    # all): u * 0.8 = 0.08, 0.48, 0.79.
    assert grpo.sample_tokens(logits, u, 1.0, 0.6).tolist() == [1, 1, 2]
    # A low temperature makes the likeliest token take nearly all the mass.
    assert grpo.sample_tokens(logits, u, 0.05, 1.0).tolist() == [1, 1, 1]


def test_answer_seeds_depend_on_what_is_answered_only():
    seeds = {grpo.answer_seed(0, s, r, k) for s in range(3) for r in range(3) for k in range(3)}
    assert len(seeds) == 27
    assert grpo.answer_seed(5, 1, 2, 3) == grpo.answer_seed(5, 1, 2, 3)
    assert grpo.answer_seed(5, 1, 2, 3) != grpo.answer_seed(6, 1, 2, 3)


@pytest.fixture(scope="module")
def small_model():
    return adapted_lora_model(
        vocab_size=40, num_layers=2, num_heads=4, num_kv_heads=2, embed_dim=32, max_seq_len=64,
        intermediate_dim=64, lora_rank=4, lora_alpha=8,
    ).eval()  # fmt: skip


SETTINGS = grpo.Settings(
    num_generations=2, max_new_tokens=6, temperature=1.0, top_p=1.0, beta=0.1, epsilon=0.2,
    rewards=(Weighted("length", 1.0),), pattern="", seed=0,
)  # fmt: skip


def _generate(model, prompts, group, seeds, settings=SETTINGS, every_step=False):
    return grpo.generate(
        model, prompts, group, seeds, settings, pad_id=0, stop_ids={39}, dtype=torch.float32,
        device=torch.device("cpu"), every_step=every_step,
    )  # fmt: skip


def _answer(generated, i):
    return generated.tokens[i, generated.prompt_len :][generated.answer_mask[i]].tolist()


def test_an_answer_depends_on_its_prompt_and_seed_not_on_its_batch(small_model):
    alone = _generate(small_model, [[5, 6, 7]], 1, [11])
    batched = _generate(small_model, [[1, 2, 3, 4, 8, 9], [5, 6, 7]], 2, [3, 4, 11, 12])
    # The short prompt is left-padded in the batch, and its cache is shared by its two answers:
    # padding, positions and the copied cache hide that.
    assert _answer(batched, 2) == _answer(alone, 0)
    assert _answer(batched, 3) != _answer(batched, 2)  # another seed, another answer
    again = _generate(small_model, [[5, 6, 7]], 1, [11], every_step=True)
    assert _answer(again, 0) == _answer(alone, 0)
    assert batched.tokens[2, :6].tolist() == batched.tokens[3, :6].tolist() == [0, 0, 0, 5, 6, 7]


def test_cached_generation_scores_like_a_full_forward(small_model):
    """With a temperature close to 0 sampling picks the likeliest token: each answer token is
    the argmax of a full forward pass over the sequence so far, without a cache."""
    cold = grpo.Settings(**{**SETTINGS.__dict__, "temperature": 1e-4})
    generated = _generate(small_model, [[1, 2, 3, 4, 8, 9], [5, 6, 7]], 1, [0, 1], cold)
    logps = grpo.answer_logps(small_model, generated, 1.0)
    start = generated.prompt_len
    with torch.no_grad():
        for i in range(2):
            answer = _answer(generated, i)
            real = generated.real[i].nonzero().squeeze(1)
            tokens = generated.tokens[i, real].unsqueeze(0)
            full = small_model(tokens)[0]
            prompt = len(real) - len(answer)
            assert full[prompt - 1 : -1].argmax(-1).tolist() == answer
            want = torch.log_softmax(full[prompt - 1 : -1], -1).gather(
                -1, torch.tensor(answer).unsqueeze(-1)
            )
            got = logps[i, : len(answer)]
            assert torch.allclose(got, want.squeeze(-1), atol=1e-5)
    assert generated.answer_mask[:, 0].all() and start == 6  # every answer has a first token


def test_the_reference_scores_answers_from_shared_prompt_caches(small_model):
    generated = _generate(small_model, [[1, 2, 3, 4, 8, 9], [5, 6, 7]], 3, list(range(6)))
    with torch.no_grad():
        whole = grpo.answer_logps(small_model, generated, 0.7)
    shared = grpo.shared_prompt_logps(small_model, generated, 3, 0.7, torch.float32)
    mask = generated.answer_mask
    assert torch.allclose(shared[mask], whole[mask], atol=1e-5)
    assert not small_model.caches_are_setup()  # the caches are gone: training goes on


def test_an_answer_ends_at_its_stop_token(small_model, monkeypatch):
    # Make the stop token the only likely one after the first answer token.
    real_sample = grpo.sample_tokens
    calls = []

    def stop_second(logits, uniforms, temperature, top_p):
        calls.append(1)
        picked = real_sample(logits, uniforms, temperature, top_p)
        return torch.full_like(picked, 39) if len(calls) == 2 else picked

    monkeypatch.setattr(grpo, "sample_tokens", stop_second)
    generated = _generate(small_model, [[5, 6, 7]], 1, [11])
    assert len(calls) == 2  # no forward pass after every answer has ended
    assert generated.answer_mask[0].tolist() == [True, True, False, False, False, False]
    assert _answer(generated, 0)[-1] == 39


# ------------------------------------------------------------------ where a user sees the reward


def test_the_reward_reaches_status_from_metrics_and_from_the_trainjob(tmp_path):
    from tunepack.backends.kubernetes import progress_from_status
    from tunepack.backends.local.progress import read_progress
    from tunepack.cli.output import progress_line

    metrics = tmp_path / "metrics.jsonl"
    step = {"event": "step", "step": 3, "total_steps": 12, "loss": 0.01, "reward_mean": 0.4375}
    metrics.write_text(json.dumps(step) + "\n")
    local = read_progress(metrics)
    assert local.reward == 0.4375
    assert progress_line(local, finished=False) == "25%  loss 0.0100  reward 0.438"
    status = {
        "progressPercentage": 25,
        "metrics": [{"name": "loss", "value": "0.01"}, {"name": "reward_mean", "value": "0.4375"}],
    }
    assert progress_from_status(status).reward == 0.4375
    assert read_progress(_write(tmp_path, {**step, "reward_mean": None})).reward is None


def _write(tmp_path, record):
    path = tmp_path / "other.jsonl"
    path.write_text(json.dumps({k: v for k, v in record.items() if v is not None}) + "\n")
    return path


# ------------------------------------------------------------------ the planner


def test_planner_counts_the_answers_and_the_generation_cache():
    from tunepack.runtimes.planner import plan

    ckpt = {"lora_rank": 8, "activation_checkpointing": True}  # the same step for all three
    whole = plan("llama3.1-8b", "lora", 1024, 2, fused_loss=False, **ckpt)
    grpo8 = plan("llama3.1-8b", "grpo", 1024, 2, num_generations=8, **ckpt)
    grpo4 = plan("llama3.1-8b", "grpo", 1024, 2, **ckpt)  # the default 4
    assert (grpo8.weights, grpo8.optimizer) == (whole.weights, whole.optimizer)
    # G answers of seq_len tokens per prompt, with their whole logits.
    assert (grpo8.activations, grpo8.logits) == (8 * whole.activations, 8 * whole.logits)
    assert (grpo4.activations, grpo4.logits) == (4 * whole.activations, 4 * whole.logits)
    # The KV cache of the 16 answers (32 layers, 8 KV heads of 128, bf16) and their sampling
    # buffers over the 128,256-token vocabulary.
    cache = 16 * 2 * 32 * 8 * 128 * 1024 * 2
    assert grpo8.generation == cache + 16 * 128_256 * (4 * 4 + 8)
    assert grpo8.moments()["generation"] == grpo8.generation
    assert "generation" not in whole.moments()
    assert any("num_generations sequences" in note for note in grpo8.notes)
    assert "  generation " in grpo8.summary()


def test_the_planner_refuses_a_group_of_one():
    from tunepack.runtimes.planner import estimate

    with pytest.raises(BadValueError) as err:
        estimate("llama3.1-8b", "grpo", 1024, 1, num_generations=1)
    assert str(err.value) == "num_generations=1 is not valid: expected an integer >= 2"


def test_grpo_full_trains_every_weight_and_plans_a_reference_copy():
    from tunepack.runtimes.planner import plan

    args = parse_trainer_args(["method=grpo_full"], TINY)
    assert (args.lr, args.beta, args.num_generations) == (1e-6, 0.04, 4)
    with pytest.raises(ConflictError) as err:
        parse_trainer_args(["method=grpo_full", "lora_rank=8"], TINY)
    assert str(err.value) == (
        "lora_rank=8 sets LoRA adapters, but method=grpo_full trains every weight and has none; "
        "leave it out, or use method=lora"
    )
    full = plan("llama3.1-8b", "full", 1024, 1, fused_loss=False, gpus_per_node=8)
    grpo_full = plan("llama3.1-8b", "grpo_full", 1024, 1, num_generations=4, gpus_per_node=8)
    # The weights and their frozen copy (the KL reference), in bf16, sharded over 8 devices.
    assert grpo_full.trainable == full.trainable == full.parameters
    assert grpo_full.weights - full.weights == pytest.approx(full.parameters * 2 / 8)
    assert (grpo_full.optimizer, grpo_full.logits) == (full.optimizer, 4 * full.logits)
