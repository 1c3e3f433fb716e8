"""tunepack's trainer argument vocabulary.

A TrainJob passes ``spec.trainer.args`` as ``key=value`` strings. This module is the one place
that says which keys exist, what values they take and what they default to; the launcher, the
CLI, the TrainJob renderer and the docs all read it. Unknown keys are refused: in particular no
argument can name a Python object (``_component_``) for torchtune to instantiate.

It lives in ``tunepack.runtimes``, beside the methods it resolves, because every step reads it:
the SDK and the admission policy, the initializers (which check a job's arguments before they
download anything) and the trainer. It imports the standard library, ``tunepack.core`` and the
runtimes only (the chat formats' and the rewards' checks: ``chat_templates``, ``reward_names``).
"""

from __future__ import annotations

import difflib
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field, fields

from tunepack.core.errors import (
    BadInputError,
    BadValueError,
    ConflictError,
    UnknownKeyError,
    UnsupportedError,
)
from tunepack.runtimes import methods, reward_names
from tunepack.runtimes.catalog import ModelEntry, expert_lora_obstacle
from tunepack.runtimes.chat_templates import check_chat_template, check_system_prompt
from tunepack.runtimes.reward_names import Weighted

LORA_ATTN_MODULES = ("q_proj", "k_proj", "v_proj", "output_proj")
DTYPES = ("auto", "fp32", "bf16")
DEVICES = ("auto", "cpu", "cuda")
DPO_LOSSES = ("sigmoid", "ipo", "hinge")
# Experiment trackers: a fixed allowlist, mapped in trainers/outputs/tracking.py to a logger class.
TRACKERS = ("none", "tensorboard", "mlflow", "wandb")
TRACKER_URI_SCHEMES = ("http", "https", "file")


@dataclass(frozen=True)
class Arg:
    name: str
    parse: Callable[[str, str], object]
    help: str
    default: object = None  # None: taken from the catalog entry or the method (see job_defaults)
    optional: bool = False  # None is a value of its own (max_steps: no limit), never filled in

    @property
    def rule(self) -> Rule:
        """What the parser accepts (``Rule``), for checks written elsewhere (admission)."""
        return self.parse.rule

    @property
    def annotation(self) -> str:
        """The type of a parsed value, as the parser's return annotation spells it."""
        return self.parse.__annotations__["return"]


@dataclass(frozen=True)
class Rule:
    """What a parser accepts, as data. The parser's message ends in ``expected``; the admission
    policy (``tunepack.tools.admission``) writes its CEL checks and messages from the rest."""

    # int, float, bool, auto_bool, choice, subset, uri, name, rewards (name[:weight],...),
    # pattern (a regular expression: its length) or model (checked in resolve_args)
    kind: str
    expected: str = ""  # "<key>=<value> is not valid: expected <this>"
    lo: float | None = None
    hi: float | None = None
    lo_open: bool = False  # lo itself is refused (floats)
    choices: tuple[str, ...] = ()  # choice, subset; the accepted spellings for bool, auto_bool


def _ruled(parse: Callable, rule: Rule) -> Callable:
    parse.rule = rule
    return parse


def invalid_value_message(key: str, raw: str, expected: str) -> str:
    return f"{key}={raw!r} is not valid: expected {expected}"


def invalid_value(key: str, raw: str, expected: str) -> BadValueError:
    """The refusal of ``key=raw``, its facts (``name``, ``value``, ``expected``) set."""
    return BadValueError(
        invalid_value_message(key, raw, expected), name=key, value=raw, expected=expected
    )


def _int(lo: int, hi: int | None = None) -> Callable[[str, str], int]:
    bound = f"from {lo} to {hi}" if hi is not None else f">= {lo}"
    rule = Rule("int", f"an integer {bound}", lo, hi)

    def parse(key: str, raw: str) -> int:
        try:
            value = int(raw)
        except ValueError:
            value = None
        if value is None or value < lo or (hi is not None and value > hi):
            raise invalid_value(key, raw, rule.expected)
        return value

    return _ruled(parse, rule)


def _float(lo: float, hi: float | None = None, *, lo_open: bool = False) -> Callable:
    low = f"> {lo}" if lo_open else f">= {lo}"
    bound = f"{low} and < {hi}" if hi is not None else low
    rule = Rule("float", f"a number {bound}", lo, hi, lo_open)

    def parse(key: str, raw: str) -> float:
        try:
            value = float(raw)
        except ValueError:
            value = None
        too_low = value is not None and (value <= lo if lo_open else value < lo)
        too_high = value is not None and hi is not None and value >= hi
        if value is None or value != value or too_low or too_high:
            raise invalid_value(key, raw, rule.expected)
        return value

    return _ruled(parse, rule)


_TRUE, _FALSE = ("true", "1", "yes"), ("false", "0", "no")  # any case


def _bool(key: str, raw: str) -> bool:
    lowered = raw.lower()
    if lowered in _TRUE:
        return True
    if lowered in _FALSE:
        return False
    raise invalid_value(key, raw, _bool.rule.expected)


_ruled(_bool, Rule("bool", "true or false", choices=_TRUE + _FALSE))


def _auto_bool(key: str, raw: str) -> str | bool:
    """``auto`` (decided per device or per run) or a boolean."""
    if raw.lower() == "auto":
        return "auto"
    try:
        return _bool(key, raw)
    except BadInputError:
        raise invalid_value(key, raw, _auto_bool.rule.expected) from None


_ruled(_auto_bool, Rule("auto_bool", "auto, true or false", choices=("auto", *_TRUE, *_FALSE)))


def _auto_int(lo: int) -> Callable[[str, str], str | int]:
    """``auto`` (decided per device) or an integer >= ``lo``."""
    rule = Rule("auto_int", f"auto or an integer >= {lo}", lo)
    number = _int(lo)

    def parse(key: str, raw: str) -> str | int:
        if raw.lower() == "auto":
            return "auto"
        try:
            return number(key, raw)
        except BadInputError:
            raise invalid_value(key, raw, rule.expected) from None

    return _ruled(parse, rule)


def _choice(choices: Iterable[str]) -> Callable[[str, str], str]:
    allowed = tuple(choices)
    rule = Rule("choice", f"one of {', '.join(allowed)}", choices=allowed)

    def parse(key: str, raw: str) -> str:
        if raw not in allowed:
            raise invalid_value(key, raw, rule.expected)
        return raw

    return _ruled(parse, rule)


def _modules(key: str, raw: str) -> tuple[str, ...]:
    names = tuple(part.strip() for part in raw.split(",") if part.strip())
    bad = [n for n in names if n not in LORA_ATTN_MODULES]
    if not names or bad:
        raise invalid_value(key, raw, _modules.rule.expected)
    return names


_ruled(
    _modules,
    Rule(
        "subset",
        f"a comma-separated subset of {','.join(LORA_ATTN_MODULES)}",
        choices=LORA_ATTN_MODULES,
    ),
)


def credentials_in_uri_message(key: str) -> str:
    return (
        f"{key} must not carry credentials in the URI: give them through the environment "
        "(MLFLOW_TRACKING_USERNAME / MLFLOW_TRACKING_PASSWORD or MLFLOW_TRACKING_TOKEN)"
    )


def _tracker_uri(key: str, raw: str) -> str:
    scheme, sep, rest = raw.partition("://")
    if (
        not sep
        or scheme.lower() not in TRACKER_URI_SCHEMES
        or not rest
        or any(c.isspace() for c in raw)
    ):
        raise invalid_value(key, raw, _tracker_uri.rule.expected)
    if "@" in rest.split("/", 1)[0]:
        raise UnsupportedError(credentials_in_uri_message(key))
    return raw


_ruled(
    _tracker_uri,
    Rule(
        "uri",
        f"a URI starting with {', '.join(s + '://' for s in TRACKER_URI_SCHEMES)}",
        choices=TRACKER_URI_SCHEMES,
    ),
)


def _as_given(key: str, raw: str) -> str:
    """Checked against the model in ``resolve_args`` (chat formats depend on it)."""
    return raw


_ruled(_as_given, Rule("model"))
NAME_MAX = 128


def _name(key: str, raw: str) -> str:
    if not raw or len(raw) > NAME_MAX or not all(c.isalnum() or c in "-_." for c in raw):
        raise invalid_value(key, raw, _name.rule.expected)
    return raw


_ruled(_name, Rule("name", f"1 to {NAME_MAX} letters, digits, '-', '_' or '.'", 1, NAME_MAX))


VOCABULARY: tuple[Arg, ...] = (
    Arg(
        "method",
        _choice(methods.NAMES),
        methods.summary(),
        methods.DEFAULT,
    ),
    Arg("epochs", _int(1, 1000), "passes over the dataset", 1),
    Arg(
        "max_steps",
        _int(1),
        "stop after this many optimizer steps (default: no limit)",
        optional=True,
    ),
    Arg("batch_size", _int(1, 4096), "examples per device per step (default: catalog)"),
    Arg("grad_accum", _int(1, 1024), "micro-batches accumulated per optimizer step", 1),
    Arg("lr", _float(0.0, 1.0, lo_open=True), "peak learning rate (default: by method)"),
    Arg("weight_decay", _float(0.0, 1.0), "AdamW weight decay", 0.01),
    Arg("warmup_steps", _int(0), "linear warmup steps before cosine decay", 10),
    Arg("max_seq_len", _int(8), "truncate examples to this many tokens (default: catalog)"),
    Arg("lora_rank", _int(1, 1024), "LoRA rank r (default: catalog)"),
    Arg("lora_alpha", _float(0.0, lo_open=True), "LoRA alpha (default: catalog)"),
    Arg("lora_dropout", _float(0.0, 1.0), "dropout on the LoRA path", 0.0),
    Arg("lora_attn_modules", _modules, "attention projections that get LoRA", LORA_ATTN_MODULES),
    Arg(
        "lora_mlp",
        _bool,
        "also apply LoRA to the MLP projections (a mixture of experts: every expert)",
        True,
    ),
    Arg(
        "lora_projector",
        _bool,
        "also apply LoRA to a vision model's image projector (multi_modal_projector)",
        False,
    ),
    Arg("train_on_input", _bool, "also compute the loss on the prompt tokens", False),
    Arg("seed", _int(0), "random seed (initialisation, shuffling)", 0),
    Arg("log_every", _int(1), "write a metrics line every N optimizer steps", 1),
    Arg("dtype", _choice(DTYPES), "training precision; auto = bf16 on GPU, fp32 on CPU", "auto"),
    Arg("device", _choice(DEVICES), "auto = cuda when a GPU is visible, else cpu", "auto"),
    Arg(
        "activation_checkpointing",
        _auto_bool,
        "recompute layer activations in backward to save memory; auto = on a GPU, as few layers "
        "as the memory plan needs to fit the device (none where everything fits), off for cpu",
        "auto",
    ),
    Arg(
        "loss_chunk",
        _auto_int(1),
        "rows of logits the loss computes at once; auto = on a GPU all of them where they fit "
        "the device, else as many as fit; on cpu chunks of 8M logits",
        "auto",
    ),
    Arg(
        "compile",
        _auto_bool,
        "torch.compile the model's layers (a minute or more of warm-up, then faster steps); "
        "auto = when the planned run is long enough to pay for it",
        "auto",
    ),
    Arg(
        "deterministic",
        _bool,
        "GPU kernels that give the same result every run (math attention, torch's deterministic "
        "algorithms): two runs, or a run and its resume, end bit-identical; slower, and attention "
        "holds batch x heads x max_seq_len^2 scores per layer (CPU runs are deterministic anyway)",
        False,
    ),
    Arg("packed", _bool, "pack several examples into each max_seq_len sequence", False),
    Arg(
        "group_by_length",
        _bool,
        "batch examples of similar length together, so batches hold less padding "
        "(unpacked data; packs are full already)",
        True,
    ),
    Arg(
        "checkpoint_every_steps",
        _int(0),
        "write a resumable checkpoint every N optimizer steps (0: only by time)",
        0,
    ),
    Arg(
        "checkpoint_every_minutes",
        _float(0.0),
        "write a resumable checkpoint every T minutes of training (0: only by steps)",
        10.0,
    ),
    Arg("keep_checkpoints", _int(1, 100), "how many of the newest checkpoints to keep", 2),
    Arg("resume", _bool, "resume from the newest complete checkpoint of the same run", True),
    Arg(
        "merge",
        _bool,
        "LoRA methods: also write a merged HF model (the adapter folded into a copy of the base)",
        False,
    ),
    Arg(
        "val_fraction",
        _float(0.0, 0.5),
        "hold out this fraction of the training rows for validation (the same rows on every run; "
        "0: none)",
        0.0,
    ),
    Arg(
        "eval_every_steps",
        _int(0),
        "compute the validation loss every N optimizer steps (0: only at the end)",
        0,
    ),
    Arg(
        "keep_best",
        _bool,
        "publish the weights of the step with the lowest validation loss, not the last step's",
        False,
    ),
    Arg(
        "tracker",
        _choice(TRACKERS),
        "experiment tracker: none, tensorboard, mlflow or wandb",
        "none",
    ),
    Arg("tracker_uri", _tracker_uri, "MLflow tracking URI (http, https or file)", ""),
    Arg(
        "tracker_project",
        _name,
        "MLflow experiment / W&B project name (default: tunepack)",
        "tunepack",
    ),
    Arg(
        "beta",
        _float(0.0, lo_open=True),
        "method=dpo, orpo, kto or grpo: the weight of the preference or KL term (grpo's "
        "default is 0.04)",
        0.1,
    ),
    Arg("dpo_loss", _choice(DPO_LOSSES), "method=dpo: the loss, sigmoid, ipo or hinge", "sigmoid"),
    Arg(
        "desirable_weight",
        _float(0.0, lo_open=True),
        "method=kto: the loss weight of desirable answers",
        1.0,
    ),
    Arg(
        "undesirable_weight",
        _float(0.0, lo_open=True),
        "method=kto: the loss weight of undesirable answers",
        1.0,
    ),
    Arg(
        "num_generations",
        _int(2, 64),
        "method=grpo: answers sampled per prompt (a group; advantages are relative to it)",
        4,
    ),
    Arg(
        "max_new_tokens",
        _int(1, 32768),
        "method=grpo: the longest answer sampled, in tokens (within max_seq_len)",
        64,
    ),
    Arg(
        "temperature",
        _float(0.0, 10.0, lo_open=True),
        "method=grpo: sampling temperature of the answers",
        1.0,
    ),
    Arg(
        "top_p",
        _float(0.0, 1.0001, lo_open=True),
        "method=grpo: nucleus sampling, the smallest set of tokens holding this probability "
        "(1: all)",
        1.0,
    ),
    Arg(
        "epsilon",
        _float(0.0, 1.0, lo_open=True),
        "method=grpo: the clip range of the policy ratio (1 - epsilon, 1 + epsilon)",
        0.2,
    ),
    Arg(
        "rewards",
        _ruled(reward_names.parse, Rule("rewards", reward_names.EXPECTED)),
        "method=grpo: the rewards an answer is scored by, name[:weight] summed: exact, match, "
        "numeric, format (reward_pattern), length, or an installed plugin's (docs/trainer.md)",
        (reward_names.Weighted(reward_names.DEFAULT, 1.0),),
    ),
    Arg(
        "reward_pattern",
        _ruled(
            reward_names.parse_pattern,
            Rule(
                "pattern",
                f"a regular expression of at most {reward_names.PATTERN_MAX} characters",
                hi=reward_names.PATTERN_MAX,
            ),
        ),
        "method=grpo: the regular expression the format reward searches the answer for",
        "",
    ),
    Arg(
        "chat_template",
        _as_given,
        "chat format of chat and instruction data: model (the base model's own Hugging Face "
        "template) or another format with the same special tokens (docs/trainer.md)",
        "model",
    ),
    Arg(
        "system_prompt",
        _as_given,
        "system message for conversations that have none (default: the template's own, if any)",
        "",
    ),
)
# Names users bring from Hugging Face Transformers/TRL/PEFT, Axolotl and LLaMA-Factory configs,
# and the tunepack argument each one is: close-match hints miss most of them (learning_rate is
# not close to lr), so an unknown key found here is answered with its tunepack key, and, where
# the name implies a value, that value too (use_dora: method=dora).
FOREIGN_NAMES: dict[str, tuple[str, str | None]] = {
    "learning_rate": ("lr", None),
    "num_train_epochs": ("epochs", None),
    "num_epochs": ("epochs", None),
    "per_device_train_batch_size": ("batch_size", None),
    "micro_batch_size": ("batch_size", None),
    "train_batch_size": ("batch_size", None),
    "gradient_accumulation_steps": ("grad_accum", None),
    "lora_r": ("lora_rank", None),
    "r": ("lora_rank", None),
    "max_length": ("max_seq_len", None),
    "max_seq_length": ("max_seq_len", None),
    "model_max_length": ("max_seq_len", None),
    "sequence_len": ("max_seq_len", None),
    "cutoff_len": ("max_seq_len", None),
    "target_modules": ("lora_attn_modules", None),
    "lora_target_modules": ("lora_attn_modules", None),
    "lora_target": ("lora_attn_modules", None),
    "logging_steps": ("log_every", None),
    "save_steps": ("checkpoint_every_steps", None),
    "save_total_limit": ("keep_checkpoints", None),
    "eval_steps": ("eval_every_steps", None),
    "val_set_size": ("val_fraction", None),
    "load_best_model_at_end": ("keep_best", None),
    "report_to": ("tracker", None),
    "gradient_checkpointing": ("activation_checkpointing", None),
    "torch_compile": ("compile", None),
    "packing": ("packed", None),
    "sample_packing": ("packed", None),
    "train_on_inputs": ("train_on_input", None),
    "resume_from_checkpoint": ("resume", None),
    "max_completion_length": ("max_new_tokens", None),
    "loss_type": ("dpo_loss", None),
    "adapter": ("method", None),
    "finetuning_type": ("method", None),
    "use_dora": ("method", "dora"),
    "load_in_4bit": ("method", "qlora"),
    "bf16": ("dtype", "bf16"),
}


def foreign_name(key: str) -> tuple[str, str | None] | None:
    """The tunepack argument (and the value it implies, if any) that another tool's name for a
    training setting means; ``--learning-rate``-style spellings and any case are read too."""
    return FOREIGN_NAMES.get(key.strip().lstrip("-").replace("-", "_").lower())


LORA_KEYS = tuple(arg.name for arg in VOCABULARY if arg.name.startswith("lora_"))  # not for full
_BY_NAME = {arg.name: arg for arg in VOCABULARY}
VOCABULARY_KEYS = frozenset(_BY_NAME)


@dataclass(frozen=True)
class TrainArgs:
    """The trainer's arguments, every one resolved (the user's, the catalog's or the default)."""

    # generated from VOCABULARY by `python -m tunepack.runtimes.args_docs --write`: begin
    method: str
    epochs: int
    max_steps: int | None
    batch_size: int
    grad_accum: int
    lr: float
    weight_decay: float
    warmup_steps: int
    max_seq_len: int
    lora_rank: int
    lora_alpha: float
    lora_dropout: float
    lora_attn_modules: tuple[str, ...]
    lora_mlp: bool
    lora_projector: bool
    train_on_input: bool
    seed: int
    log_every: int
    dtype: str
    device: str
    activation_checkpointing: str | bool
    loss_chunk: str | int
    compile: str | bool
    deterministic: bool
    packed: bool
    group_by_length: bool
    checkpoint_every_steps: int
    checkpoint_every_minutes: float
    keep_checkpoints: int
    resume: bool
    merge: bool
    val_fraction: float
    eval_every_steps: int
    keep_best: bool
    tracker: str
    tracker_uri: str
    tracker_project: str
    beta: float
    dpo_loss: str
    desirable_weight: float
    undesirable_weight: float
    num_generations: int
    max_new_tokens: int
    temperature: float
    top_p: float
    epsilon: float
    rewards: tuple[Weighted, ...]
    reward_pattern: str
    chat_template: str
    system_prompt: str
    # generated from VOCABULARY: end
    given: dict[str, str] = field(default_factory=dict)  # the raw key=value pairs, for records
    # The record of ``method`` (runtimes/methods.py), carried so that no reader looks the name up
    # again. Not an argument: equality, ``argv()`` and everything a run records or hashes (the
    # config, result.json, the run's identity) have the method's name.
    method_record: methods.Method = field(kw_only=True, compare=False, repr=False)

    def argv(self) -> list[str]:
        """The user's arguments as ``key=value`` strings again (a TrainJob's
        ``spec.trainer.args``): the given ones only, so the trainer fills in the same defaults."""
        return [f"{key}={raw}" for key, raw in self.given.items()]


def split_pairs(args: Iterable[str]) -> dict[str, str]:
    """Split ``key=value`` strings, refusing malformed and repeated keys and unknown keys."""
    pairs: dict[str, str] = {}
    for item in args:
        key, sep, raw = item.partition("=")
        key = key.strip()
        if not sep or not key:
            raise BadValueError(malformed_message(item), value=item, expected="key=value")
        if key not in _BY_NAME:
            raise _unknown_key(key)
        if key in pairs:
            raise UnknownKeyError(given_twice_message(key), key=key)
        pairs[key] = raw.strip()
    return pairs


# The messages below are functions of the values they name, so that the admission policy
# (tunepack.tools.admission) says the same words: it calls them with its CEL expressions' places.
def malformed_message(item: str) -> str:
    return f"trainer argument {item!r} is not of the form key=value"


def given_twice_message(key: str) -> str:
    return f"trainer argument {key!r} is given twice"


CONFIG_OVERRIDE_MARKERS = ("_component_", ".")  # in keys such as model._component_, optimizer.lr


def is_config_override(key: str) -> bool:
    """A torchtune config path or component, not a tunepack argument."""
    return any(marker in key for marker in CONFIG_OVERRIDE_MARKERS)


def config_override_message(key: str) -> str:
    return (
        f"trainer argument {key!r} is not part of tunepack's vocabulary: tunepack does not "
        f"take torchtune config overrides; use the documented keys ({', '.join(_BY_NAME)})"
    )


def unknown_key_message(key: str) -> str:
    """An unknown key with no likely meaning: the known ones, listed."""
    return f"unknown trainer argument {key!r}; the known arguments are {', '.join(_BY_NAME)}"


def meant_key_message(key: str, meant: str) -> str:
    """An unknown key that likely means ``meant`` (``key=value`` spelling)."""
    return f"unknown trainer argument {key!r}; did you mean {meant!r}?"


def likely_meant(key: str) -> tuple[str, str | None] | None:
    """The argument an unknown key likely means: another tool's name for it, else the closest
    spelling; with the value the key implies, if any."""
    if found := foreign_name(key):
        return found
    close = difflib.get_close_matches(key, _BY_NAME, n=1) or difflib.get_close_matches(
        key.lower(), _BY_NAME, n=1
    )
    return (close[0], None) if close else None


def _unknown_key_message(key: str) -> str:
    if is_config_override(key):
        return config_override_message(key)
    if meant := likely_meant(key):
        name, value = meant
        return meant_key_message(key, name if value is None else f"{name}={value}")
    return unknown_key_message(key)


def _unknown_key(key: str) -> UnknownKeyError:
    """The refusal of an unknown key, with the key the message proposes instead (if any)."""
    meant = None if is_config_override(key) else likely_meant(key)
    suggestions = () if meant is None else (meant[0] if meant[1] is None else "=".join(meant),)
    return UnknownKeyError(_unknown_key_message(key), key=key, suggestions=suggestions)


def unavailable_method_message(entry: ModelEntry, method: str) -> str:
    return entry.why_not(method) or (
        f"method={method!r} is not available for {entry.name}: "
        f"expected one of {', '.join(available_methods(entry))}"
    )


def lora_with_full_message(given: str, count: int, method: str = "full") -> str:
    """``given``: the ``lora_*=value`` pairs, ``count`` of them; ``method``: one that trains every
    weight."""
    return (
        f"{given} set{'s' if count == 1 else ''} LoRA adapters, but method={method} trains "
        f"every weight and has none; leave {'it' if count == 1 else 'them'} out, or use "
        "method=lora"
    )


def merge_with_full_message(given: str, method: str = "full") -> str:
    """``given``: the ``merge=value`` pair (a true value); ``method``: one that trains every
    weight."""
    return (
        f"{given} merges a LoRA adapter into the base, but method={method} trains every weight and "
        "has none (output/model/ is the whole model already); leave it out, or use method=lora"
    )


def context_window_message(value: object, model: str, tokens: object) -> str:
    return f"max_seq_len={value} is larger than {model}'s context window of {tokens} tokens"


def sliding_window_message(value: object, model: str, window: object, family: str) -> str:
    return (
        f"max_seq_len={value} is longer than {model}'s sliding attention window of {window} "
        f"tokens, which torchtune's {family} does not implement, so longer sequences would "
        f"train a different model than the checkpoint; use max_seq_len<={window}"
    )


def no_packing_message(model: str, reason: str) -> str:
    return f"packed=true is not available for {model}: {reason}; set packed=false"


def method_only_message(given: str, keys: str, owner: str, method: str) -> str:
    """``given``: the ``key=value`` pairs only method ``owner`` takes; ``keys``: their keys
    joined by ' and '."""
    return f"{given}: only method={owner} uses {keys}, but method={method}"


PACKED_WITH_GROUP_BY_LENGTH = (
    "group_by_length=true applies to unpacked data, and packed=true packs examples into "
    "full sequences already; set one of them"
)


def method_packing_message(method: str, reason: str) -> str:
    return f"packed=true is not available with method={method}: {reason}; set packed=false"


def no_projector_message(given: str, model: str) -> str:
    return (
        f"{given}: {model} takes no images, so it has no image projector to adapt; leave "
        "lora_projector unset"
    )


def unused_tracker_uri_message(tracker: str) -> str:
    return f"tracker_uri is only used by tracker=mlflow, but tracker={tracker!r}"


@dataclass(frozen=True)
class ParsedArgs:
    """Trainer arguments as given, parsed but not yet held against a model: each given key's
    typed value (``values``) and its ``key=value`` spelling (``spelled``), in the order given.

    ``parse_args`` makes it of words (the CLI's, a TrainJob's, the launcher's argv); ``FineTune``
    makes it of its fields (``FineTune.parsed_args``) without writing words first; either way
    ``resolve_args`` turns it into ``TrainArgs`` for a model.
    """

    values: dict[str, object]
    spelled: dict[str, str]


def parse_args(args: Iterable[str]) -> ParsedArgs:
    """Words to typed values: ``key=value`` strings split (malformed, repeated and unknown keys
    refused) and each value read by its vocabulary parser. Knows no model."""
    pairs = split_pairs(args)
    return ParsedArgs({name: _BY_NAME[name].parse(name, raw) for name, raw in pairs.items()}, pairs)


def parse_trainer_args(args: Iterable[str], entry: ModelEntry) -> TrainArgs:
    """Validate ``key=value`` trainer arguments for a catalog model and fill in the defaults: the
    parse (``parse_args``), then the resolve (``resolve_args``)."""
    return resolve_args(parse_args(args), entry)


def job_defaults(entry: ModelEntry, method: str) -> dict[str, object]:
    """Every argument's value in a job of ``entry`` with ``method`` that does not give it (None:
    optional, or not the method's): what ``resolve_args`` starts from, and what ``tunepack
    plan`` plans when a flag is left out."""
    owner = methods.get(method)
    # Precedence: the user's value (resolve_args), then the catalog entry's, then the method's,
    # then the key's; for a key the method owns (Method.owns), the method's before the entry's.
    resolved = {arg.name: arg.default for arg in VOCABULARY}
    resolved["lr"] = owner.lr
    resolved.update(owner.defaults)
    resolved.update(
        {k: v for k, v in entry.defaults.items() if k in resolved and k not in owner.owns}
    )
    return resolved


def resolve_args(parsed: ParsedArgs, entry: ModelEntry) -> TrainArgs:
    """Typed values to ``TrainArgs`` for a catalog model: defaults by precedence, the method's
    keys, the model's limits; every rule's message names the values as ``parsed`` spells them."""
    values, pairs = parsed.values, parsed.spelled
    method = methods.get(values.get("method", methods.DEFAULT))  # carried by the TrainArgs
    if method.name not in available_methods(entry):
        raise UnsupportedError(unavailable_method_message(entry, method.name))
    if not method.adapters and (lora := [k for k in values if k in LORA_KEYS]):
        given = ", ".join(f"{k}={pairs[k]}" for k in lora)
        raise ConflictError(lora_with_full_message(given, len(lora), method.name))
    if not method.adapters and values.get("merge"):
        raise ConflictError(merge_with_full_message(f"merge={pairs['merge']}", method.name))
    resolved = job_defaults(entry, method.name)
    resolved.update(values)
    if resolved["max_seq_len"] > entry.shape.max_seq_len:
        raise BadValueError(
            context_window_message(resolved["max_seq_len"], entry.name, entry.shape.max_seq_len)
        )
    if (window := entry.window_limit) and resolved["max_seq_len"] > window:
        raise BadValueError(
            sliding_window_message(resolved["max_seq_len"], entry.name, window, entry.family.title)
        )
    if resolved["packed"] and entry.family.no_packing:
        raise UnsupportedError(no_packing_message(entry.name, entry.family.no_packing))
    for owners, keys in methods.key_groups().items():
        if method.name not in owners and (only := [k for k in keys if k in values]):
            given = ", ".join(f"{k}={pairs[k]}" for k in only)
            raise ConflictError(
                method_only_message(given, " and ".join(only), methods.either(owners), method.name)
            )
    if resolved["packed"] and values.get("group_by_length"):
        raise ConflictError(PACKED_WITH_GROUP_BY_LENGTH)
    if method.no_packing and resolved["packed"]:
        raise ConflictError(method_packing_message(method.name, method.no_packing))
    resolved["chat_template"] = check_chat_template(entry.family.name, resolved["chat_template"])
    if "system_prompt" in pairs:
        check_system_prompt(resolved["system_prompt"], resolved["chat_template"])
    if method.sequences_key:
        _check_generation(resolved, entry)
    if method.loss is methods.Loss.KTO and resolved["batch_size"] < 2:
        raise ConflictError(
            f"batch_size={resolved['batch_size']} is too small for method=kto: its reference "
            "point comes from each batch's prompts paired with other rows' answers; use "
            "batch_size=2 or more"
        )
    if resolved["lora_projector"] and not entry.family.reads_images:
        raise UnsupportedError(
            no_projector_message(f"lora_projector={pairs['lora_projector']}", entry.name)
        )
    if method.adapters and resolved["lora_mlp"] and entry.shape.num_experts:
        given = f"lora_dropout={pairs['lora_dropout']}" if "lora_dropout" in pairs else None
        if obstacle := expert_lora_obstacle(resolved["lora_dropout"], method.dora, given):
            raise ConflictError(obstacle)
    if "tracker_uri" in values and resolved["tracker"] != "mlflow":
        raise ConflictError(unused_tracker_uri_message(resolved["tracker"]))
    names = {f.name for f in fields(TrainArgs)} - {"given", "method_record"}
    missing = sorted(n for n in names if resolved.get(n) is None and not _BY_NAME[n].optional)
    if missing:  # a catalog entry without a default for a required key is a tunepack bug
        raise RuntimeError(f"catalog entry {entry.name} has no default for {missing}")
    return TrainArgs(**{n: resolved[n] for n in names}, given=dict(pairs), method_record=method)


def _check_generation(resolved: dict, entry: ModelEntry) -> None:
    """A generating method's arguments against each other: the answers fit max_seq_len, and the
    format reward has its pattern."""
    if resolved["max_new_tokens"] >= resolved["max_seq_len"]:
        raise ConflictError(
            f"max_new_tokens={resolved['max_new_tokens']} leaves no room for the prompt in "
            f"max_seq_len={resolved['max_seq_len']} (a prompt and its answer share it): lower "
            "max_new_tokens or raise max_seq_len"
        )
    if resolved["compile"] is True:
        raise ConflictError(
            f"compile=true is not available with method={resolved['method']}: answers are "
            "generated one token at a time into a growing cache, a new shape for torch.compile "
            "at every token; leave compile out"
        )
    named = {w.name for w in resolved["rewards"]}
    if "format" in named and not resolved["reward_pattern"]:
        raise ConflictError(
            "rewards=format needs reward_pattern, the regular expression an answer must match "
            "(for example reward_pattern='^\\d+$')"
        )
    if resolved["reward_pattern"] and "format" not in named:
        raise ConflictError(
            f"reward_pattern is only read by the format reward, but rewards="
            f"{reward_names.spelled(resolved['rewards'])}: add format to rewards or drop "
            "reward_pattern"
        )


def available_methods(entry: ModelEntry) -> tuple[str, ...]:
    """The methods a catalog entry supports, in the registry's order."""
    return tuple(m for m in methods.NAMES if m in entry.methods)


def builder_for(entry: ModelEntry, method: methods.Method) -> str:
    """The torchtune builder for a method's record (the LoRA variants share the LoRA builder)."""
    return entry.builders[method.builder]
