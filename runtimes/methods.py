"""The fine-tuning methods: one record each, the one place that says what a method is.

Adding a method is one record here plus its loss in the trainer (docs/architecture.md,
"Runtimes"). Standard library and ``tunepack.core`` only: the initializer images read it through
the vocabulary."""

from __future__ import annotations

import math
from dataclasses import dataclass
from enum import Enum

from tunepack.core.errors import BadValueError


class Loss(Enum):
    """What a training step minimises (the recipe maps each to its implementation)."""

    CROSS_ENTROPY = "cross_entropy"  # next-token cross-entropy on the trained tokens
    DPO = "dpo"  # the preference loss against the model with its adapters switched off
    # The clipped policy objective on sampled completions scored by rewards, with a KL penalty
    # against the model with its adapters switched off (trainers/objectives/grpo.py).
    GRPO = "grpo"
    ORPO = "orpo"  # the chosen answer's likelihood plus an odds-ratio term, no reference
    KTO = "kto"  # unpaired answers against a reference point, the model without its adapters


@dataclass(frozen=True)
class Data:
    """A kind of dataset a method learns from: the dataset schemas of that kind
    (``tunepack.initializers.data.schemas.SCHEMAS``) and what its rows hold, for errors."""

    name: str
    schemas: tuple[str, ...]
    rows: str  # what each row must hold
    holds: str  # what such a dataset holds, in a few words


SUPERVISED = Data(
    "supervised",
    ("instruction", "chat", "sharegpt", "text", "image_chat"),
    "instructions, chats, image-text chats or text",
    "instructions, chats, image-text chats or text",
)
PREFERENCE = Data(
    "preference",
    ("preference",),
    "rows with 'prompt', 'chosen' and 'rejected'",
    "chosen/rejected pairs",
)
PROMPTS = Data(
    "prompt",
    ("prompt",),
    "rows with a 'prompt' (a string or chat turns) and, for rewards that check it, an 'answer'",
    "prompts to answer",
)
UNPAIRED = Data(
    "unpaired",
    ("unpaired",),
    "rows with 'prompt', 'completion' and a boolean 'label' (whether the answer is desirable)",
    "answers labelled desirable or undesirable",
)
DATA = (SUPERVISED, PREFERENCE, PROMPTS, UNPAIRED)


@dataclass(frozen=True)
class Method:
    name: str
    help: str  # what it trains, for the docs' method table
    tag: str  # a few words after its name in the ``method`` argument's help ("" for none)
    lr: float  # the default learning rate (a catalog entry's rate may override it, see owns)
    adapters: bool = True  # LoRA adapters on a frozen base; False: every weight is trained
    quantize_base: bool = False  # the frozen base is stored in NF4 (4 bits)
    dora: bool = False  # the adapters learn a per-row magnitude too
    data: Data = SUPERVISED
    loss: Loss = Loss.CROSS_ENTROPY
    sequences: int = 1  # sequences each example puts through the model (the planner's tokens)
    no_packing: str = ""  # why packed=true cannot pack its examples ("": it can)
    # Defaults that are the method's rather than the model's: a catalog entry's lr is a
    # supervised rate, while a preference loss sets its own scale, so there the method's wins.
    owns: tuple[str, ...] = ()
    keys: tuple[str, ...] = ()  # trainer arguments only the methods listing them take
    # Its defaults for keys of its own whose vocabulary default is another method's (beta).
    defaults: tuple[tuple[str, object], ...] = ()
    # The trainer argument that says how many sequences each example puts through the model,
    # where the method's number (``sequences``) is not fixed ("": it is).
    sequences_key: str = ""
    validates: bool = True  # has a validation loss (held-out rows are next-token losses)
    # The metrics its objective reports each step besides the loss (metrics.jsonl, the TrainJob
    # status, result.json's method_metrics): what a hyperparameter search may optimise.
    metrics: tuple[str, ...] = ()
    plan_note: str = ""  # what the planner adds to a plan of this method

    @property
    def builder(self) -> str:
        """The catalog builder the method builds its model with (``ModelEntry.builders``)."""
        return "lora" if self.adapters else "full"


# The arguments of both GRPO methods.
GRPO_KEYS = (
    "beta",
    "num_generations",
    "max_new_tokens",
    "temperature",
    "top_p",
    "epsilon",
    "rewards",
    "reward_pattern",
)

# What GRPO's two records (LoRA, every weight) share.
_GRPO = dict(
    data=PROMPTS,
    loss=Loss.GRPO,
    no_packing="each prompt's answers are generated and scored on their own",
    owns=("lr",),
    keys=GRPO_KEYS,
    defaults=(("beta", 0.04),),
    sequences_key="num_generations",
    validates=False,
    # and reward_<name> for each of its rewards (GRPO_REWARD_METRIC)
    metrics=(
        "reward_mean",
        "reward_std",
        "kl",
        "completion_length",
        "clip_fraction",
        "zero_std_fraction",
    ),
)
# GRPO reports each reward's own mean as reward_<the reward's name>.
GRPO_REWARD_METRIC = "reward_{}"
# What DPO, ORPO and KTO report of the implicit rewards of chosen and rejected answers.
PREFERENCE_METRICS = ("reward_chosen", "reward_rejected", "reward_margin", "reward_accuracy")
# The metrics every run reports (result.json's figures; the validation loss where rows are held
# out), under the names tunepack's searches, its TrainJob status and metrics.jsonl use.
LOSS_METRIC = "loss"
VAL_LOSS_METRIC = "val_loss"
# Katib's StdOut metrics collector reads ``name=value`` pairs from the trainer's output; the
# validation figures go there under the Hugging Face names a Katib objective is written with.
STDOUT_NAMES = {"val_loss": "eval_loss", "val_perplexity": "eval_perplexity"}


def stdout_metrics(values: dict) -> str:
    """One line of ``name=value`` pairs (Katib's StdOut collector format) for the finite numbers
    in ``values``, each exact (``repr``: a search compares the figures result.json holds)."""
    pairs = [
        f"{STDOUT_NAMES.get(name, name)}={value!r}"
        for name, value in values.items()
        if isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)
    ]
    return " ".join(pairs)


def result_metrics(result: dict) -> dict[str, float]:
    """A finished run's metrics from its ``result.json``: the final loss, the validation loss of
    the published weights (the best step's with keep_best) and the method's last-step metrics."""
    val_loss = result.get("best_val_loss" if result.get("keep_best") else "val_loss")
    values = {LOSS_METRIC: result.get("final_loss"), VAL_LOSS_METRIC: val_loss}
    method = METHODS.get(result.get("method") or "")
    if method is not None:
        own = result.get(method.loss.value) or {}  # its settings beside its metrics
        values |= {
            name: value
            for name, value in own.items()
            if name in method.metrics
            or (method.loss is Loss.GRPO and name.startswith(GRPO_REWARD_METRIC.format("")))
        }
    return {
        k: float(v)
        for k, v in values.items()
        if isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v)
    }


METHODS: dict[str, Method] = {
    m.name: m
    for m in (
        Method("lora", "LoRA adapters on a frozen base", "", 3e-4),
        Method(
            "qlora",
            "LoRA adapters on a frozen base stored in NF4 (4-bit)",
            "NF4-quantized base",
            3e-4,
            quantize_base=True,
        ),
        Method("dora", "LoRA plus a learned per-row magnitude (DoRA)", "", 3e-4, dora=True),
        Method("full", "every weight trained", "", 2e-5, adapters=False),
        Method(
            "dpo",
            "preference tuning (DPO) of LoRA adapters on a preference dataset; the reference "
            "model is the base with the adapters switched off",
            "preference tuning",
            5e-5,
            data=PREFERENCE,
            loss=Loss.DPO,
            sequences=2,
            no_packing="each preference pair is its own sequence",
            owns=("lr",),
            keys=("beta", "dpo_loss"),
            metrics=PREFERENCE_METRICS,
            plan_note="dpo: each example is two sequences (chosen, rejected) and each step adds "
            "a reference forward pass without gradients (compute, not memory)",
        ),
        Method(
            "orpo",
            "preference tuning without a reference model (ORPO) of LoRA adapters on a "
            "preference dataset: the chosen answer's likelihood plus an odds-ratio term",
            "reference-free preference tuning",
            5e-5,
            data=PREFERENCE,
            loss=Loss.ORPO,
            sequences=2,
            no_packing="each preference pair is its own sequence",
            owns=("lr",),
            keys=("beta",),
            metrics=(*PREFERENCE_METRICS, "log_odds_ratio", "nll"),
            plan_note="orpo: each example is two sequences (chosen, rejected); no reference pass",
        ),
        Method(
            "kto",
            "preference tuning on unpaired answers labelled desirable or undesirable (KTO) of "
            "LoRA adapters; the reference is the base with the adapters switched off",
            "unpaired preference tuning",
            5e-5,
            data=UNPAIRED,
            loss=Loss.KTO,
            sequences=2,
            no_packing="each answer is its own sequence, scored against mismatched pairs",
            owns=("lr",),
            keys=("beta", "desirable_weight", "undesirable_weight"),
            metrics=(*PREFERENCE_METRICS, "kl"),
            plan_note="kto: each example is two sequences (its answer, and a mismatched answer "
            "for the reference point) and each step adds reference forward passes without "
            "gradients (compute, not memory)",
        ),
        Method(
            "grpo",
            "reinforcement learning from verifiable rewards (GRPO) of LoRA adapters on a prompt "
            "dataset: groups of sampled answers scored by built-in rewards; the KL reference is "
            "the base with the adapters switched off",
            "reinforcement learning",
            2e-5,
            **_GRPO,
            plan_note="grpo: each prompt is num_generations sequences of up to max_seq_len "
            "tokens (prompt and answer), generated with a KV cache that is held during generation "
            "only; each step adds a reference forward pass without gradients",
        ),
        Method(
            "grpo_full",
            "GRPO training every weight; the KL reference is a frozen copy of the base (none with "
            "beta=0)",
            "reinforcement learning, every weight",
            1e-6,
            adapters=False,
            **_GRPO,
            plan_note="grpo_full: as grpo, and the KL reference is a second, frozen copy of the "
            "weights (counted in weights; beta=0 needs none)",
        ),
    )
}
NAMES = tuple(METHODS)
DEFAULT = "lora"


def summary() -> str:
    """The methods in one phrase: "lora, qlora (NF4-quantized base), ... or dpo (...)"."""
    words = [f"{m.name} ({m.tag})" if m.tag else m.name for m in METHODS.values()]
    return ", ".join(words[:-1]) + " or " + words[-1]


def invalid_method_message(raw: object) -> str:
    return f"method={raw!r} is not valid: expected one of {', '.join(NAMES)}"


def get(name: str) -> Method:
    """The method called ``name``, or ``BadInputError`` naming the ones there are."""
    try:
        return METHODS[name]
    except (KeyError, TypeError):
        raise BadValueError(invalid_method_message(name)) from None


def takers(key: str) -> tuple[Method, ...]:
    """The methods that take trainer argument ``key`` (empty: every method takes it)."""
    return tuple(m for m in METHODS.values() if key in m.keys)


def key_groups() -> dict[tuple[str, ...], tuple[str, ...]]:
    """The method-only keys grouped by the methods that take them: {method names: keys}."""
    groups: dict[tuple[str, ...], list[str]] = {}
    for key in dict.fromkeys(k for m in METHODS.values() for k in m.keys):
        groups.setdefault(tuple(m.name for m in takers(key)), []).append(key)
    return {names: tuple(keys) for names, keys in groups.items()}


def either(names: tuple[str, ...]) -> str:
    """``dpo``, or ``dpo, orpo or grpo``: the methods of a key group, as messages name them
    (after ``method=``)."""
    return names[0] if len(names) == 1 else ", ".join(names[:-1]) + " or " + names[-1]


def learning_from(schema: str) -> tuple[Method, ...]:
    """The methods that learn from a dataset of ``schema``."""
    return tuple(m for m in METHODS.values() if schema in m.data.schemas)


def _a(word: str) -> str:
    return f"{'an' if word[0] in 'aeiou' else 'a'} {word}"


def wrong_data_message(method: Method, schema: str) -> str:
    """Why ``method`` cannot train on a dataset of ``schema``."""
    if len(method.data.schemas) == 1:
        return (
            f"method={method.name} needs {_a(method.data.name)} dataset ({method.data.rows}), "
            f"but the dataset's schema is {schema!r}"
        )
    data = next(d for d in DATA if schema in d.schemas)
    others = " or ".join(f"method={m.name}" for m in learning_from(schema))
    return (
        f"the dataset is {_a(data.name)} dataset ({data.holds}), which method={method.name} "
        f"cannot learn from: use {others}"
    )
