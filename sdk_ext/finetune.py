"""``FineTune``: tunepack's trainer vocabulary as a typed dataclass for notebooks.

The field declarations (and the docstring that lists them) are generated from
``tunepack.runtimes.args.VOCABULARY`` (the one source of truth for trainer arguments) into this
file by ``python -m tunepack.finetune --write``, so IDEs and type checkers see every field; a
test fails while they are stale.

Each value is checked with the vocabulary's own parser when the object is made, so a wrong value
fails in the notebook cell that wrote it, naming the field and the allowed range:

    >>> from tunepack import FineTune
    >>> FineTune(method="lora", lora_rank=16, epochs=3).to_args()
    ['method=lora', 'epochs=3', 'lora_rank=16']
    >>> FineTune(epochs=0)
    Traceback (most recent call last):
    ...
    tunepack.core.errors.BadValueError: FineTune.epochs: epochs='0' is not valid: expected an
    integer from 1 to 1000

Besides the trainer arguments, ``FineTune`` carries the trainer's placement, which is not part of
the argument vocabulary but of the TrainJob: ``num_nodes``, ``num_proc_per_node``,
``resources_per_node`` (the upstream SDK's dict, e.g. ``{"gpu": 4, "memory": "200Gi"}``) and
``env`` (extra environment variables for the trainer container); and where the result goes
when training ends: ``export`` (``s3://bucket/prefix``, ``hf://org/name`` or a path; see
docs/export.md) with ``export_secret`` (a cluster Secret holding the exporter's credentials).

``FineTune.from_args(["epochs=2", "lora_rank=8"])`` reads the ``key=value`` spelling the CLI and
TrainJob YAML use.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import sys
import textwrap
import types
import typing
from pathlib import Path

from tunepack.core.errors import BadInputError, BadValueError, ConflictError, UnknownKeyError
from tunepack.runtimes import methods
from tunepack.runtimes.args import (
    LORA_KEYS,
    VOCABULARY,
    Arg,
    ParsedArgs,
    foreign_name,
    lora_with_full_message,
    merge_with_full_message,
    parse_args,
)
from tunepack.runtimes.args_docs import replace_block, write_block
from tunepack.spelling import SDK, Spelling

# Not trainer arguments: where and how the trainer runs (TrainJob.spec.trainer fields), then where
# the result goes after training (the exporter step; docs/export.md). (name, type, meaning)
PLACEMENT = (
    ("num_nodes", "int", "trainer nodes (TrainJob spec.trainer.numNodes)"),
    ("num_proc_per_node", "int", "processes per node (default: the GPUs per node, or 1)"),
    ("resources_per_node", "dict", "e.g. {'gpu': 4, 'memory': '200Gi'}"),
    ("env", "dict", "extra environment variables for the trainer container"),
)
EXPORT = (
    ("export", "str", "where the result goes: s3://bucket/prefix, hf://org/name or a path"),
    ("export_secret", "str", "a cluster Secret with the exporter's credentials"),
)
PLACEMENT_FIELDS = tuple(name for name, _, _ in PLACEMENT)
EXPORT_FIELDS = tuple(name for name, _, _ in EXPORT)
# What FineTune takes for a parsed type, where it takes more than the parser returns.
_ACCEPTED = {
    "tuple[str, ...]": "tuple[str, ...] | list[str] | str",
    "tuple[Weighted, ...]": "tuple[str, ...] | list[str] | str",  # rewards: names[:weight]
}
COMMAND = "tunepack.finetune"


@dataclasses.dataclass(frozen=True, kw_only=True)
class FineTune:
    # generated from VOCABULARY by `python -m tunepack.finetune --write`: begin
    """tunepack trainer arguments (``None`` = the runtime's default).

    Args:
        method (str): lora, qlora (NF4-quantized base), dora, full, dpo (preference tuning), orpo
            (reference-free preference tuning), kto (unpaired preference tuning), grpo
            (reinforcement learning) or grpo_full (reinforcement learning, every weight)
        epochs (int): passes over the dataset
        max_steps (int): stop after this many optimizer steps (default: no limit)
        batch_size (int): examples per device per step (default: catalog)
        grad_accum (int): micro-batches accumulated per optimizer step
        lr (float): peak learning rate (default: by method)
        weight_decay (float): AdamW weight decay
        warmup_steps (int): linear warmup steps before cosine decay
        max_seq_len (int): truncate examples to this many tokens (default: catalog)
        lora_rank (int): LoRA rank r (default: catalog)
        lora_alpha (float): LoRA alpha (default: catalog)
        lora_dropout (float): dropout on the LoRA path
        lora_attn_modules (tuple): attention projections that get LoRA
        lora_mlp (bool): also apply LoRA to the MLP projections (a mixture of experts: every expert)
        lora_projector (bool): also apply LoRA to a vision model's image projector
            (multi_modal_projector)
        train_on_input (bool): also compute the loss on the prompt tokens
        seed (int): random seed (initialisation, shuffling)
        log_every (int): write a metrics line every N optimizer steps
        dtype (str): training precision; auto = bf16 on GPU, fp32 on CPU
        device (str): auto = cuda when a GPU is visible, else cpu
        activation_checkpointing (str | bool): recompute layer activations in backward to save
            memory; auto = on a GPU, as few layers as the memory plan needs to fit the device (none
            where everything fits), off for cpu
        loss_chunk (str | int): rows of logits the loss computes at once; auto = on a GPU all of
            them where they fit the device, else as many as fit; on cpu chunks of 8M logits
        compile (str | bool): torch.compile the model's layers (a minute or more of warm-up, then
            faster steps); auto = when the planned run is long enough to pay for it
        deterministic (bool): GPU kernels that give the same result every run (math attention,
            torch's deterministic algorithms): two runs, or a run and its resume, end bit-identical;
            slower, and attention holds batch x heads x max_seq_len^2 scores per layer (CPU runs are
            deterministic anyway)
        packed (bool): pack several examples into each max_seq_len sequence
        group_by_length (bool): batch examples of similar length together, so batches hold less
            padding (unpacked data; packs are full already)
        checkpoint_every_steps (int): write a resumable checkpoint every N optimizer steps (0: only
            by time)
        checkpoint_every_minutes (float): write a resumable checkpoint every T minutes of training
            (0: only by steps)
        keep_checkpoints (int): how many of the newest checkpoints to keep
        resume (bool): resume from the newest complete checkpoint of the same run
        merge (bool): LoRA methods: also write a merged HF model (the adapter folded into a copy of
            the base)
        val_fraction (float): hold out this fraction of the training rows for validation (the same
            rows on every run; 0: none)
        eval_every_steps (int): compute the validation loss every N optimizer steps (0: only at the
            end)
        keep_best (bool): publish the weights of the step with the lowest validation loss, not the
            last step's
        tracker (str): experiment tracker: none, tensorboard, mlflow or wandb
        tracker_uri (str): MLflow tracking URI (http, https or file)
        tracker_project (str): MLflow experiment / W&B project name (default: tunepack)
        beta (float): method=dpo, orpo, kto or grpo: the weight of the preference or KL term (grpo's
            default is 0.04)
        dpo_loss (str): method=dpo: the loss, sigmoid, ipo or hinge
        desirable_weight (float): method=kto: the loss weight of desirable answers
        undesirable_weight (float): method=kto: the loss weight of undesirable answers
        num_generations (int): method=grpo: answers sampled per prompt (a group; advantages are
            relative to it)
        max_new_tokens (int): method=grpo: the longest answer sampled, in tokens (within
            max_seq_len)
        temperature (float): method=grpo: sampling temperature of the answers
        top_p (float): method=grpo: nucleus sampling, the smallest set of tokens holding this
            probability (1: all)
        epsilon (float): method=grpo: the clip range of the policy ratio (1 - epsilon, 1 + epsilon)
        rewards (tuple): method=grpo: the rewards an answer is scored by, name[:weight] summed:
            exact, match, numeric, format (reward_pattern), length, or an installed plugin's
            (docs/trainer.md)
        reward_pattern (str): method=grpo: the regular expression the format reward searches the
            answer for
        chat_template (str): chat format of chat and instruction data: model (the base model's own
            Hugging Face template) or another format with the same special tokens (docs/trainer.md)
        system_prompt (str): system message for conversations that have none (default: the
            template's own, if any)
        num_nodes (int): trainer nodes (TrainJob spec.trainer.numNodes)
        num_proc_per_node (int): processes per node (default: the GPUs per node, or 1)
        resources_per_node (dict): e.g. {'gpu': 4, 'memory': '200Gi'}
        env (dict): extra environment variables for the trainer container
        export (str): where the result goes: s3://bucket/prefix, hf://org/name or a path
        export_secret (str): a cluster Secret with the exporter's credentials

    Example:
        >>> FineTune(method='lora', lora_rank=16, epochs=3, num_nodes=2)
    """

    method: str | None = None
    epochs: int | None = None
    max_steps: int | None = None
    batch_size: int | None = None
    grad_accum: int | None = None
    lr: float | None = None
    weight_decay: float | None = None
    warmup_steps: int | None = None
    max_seq_len: int | None = None
    lora_rank: int | None = None
    lora_alpha: float | None = None
    lora_dropout: float | None = None
    lora_attn_modules: tuple[str, ...] | list[str] | str | None = None
    lora_mlp: bool | None = None
    lora_projector: bool | None = None
    train_on_input: bool | None = None
    seed: int | None = None
    log_every: int | None = None
    dtype: str | None = None
    device: str | None = None
    activation_checkpointing: str | bool | None = None
    loss_chunk: str | int | None = None
    compile: str | bool | None = None
    deterministic: bool | None = None
    packed: bool | None = None
    group_by_length: bool | None = None
    checkpoint_every_steps: int | None = None
    checkpoint_every_minutes: float | None = None
    keep_checkpoints: int | None = None
    resume: bool | None = None
    merge: bool | None = None
    val_fraction: float | None = None
    eval_every_steps: int | None = None
    keep_best: bool | None = None
    tracker: str | None = None
    tracker_uri: str | None = None
    tracker_project: str | None = None
    beta: float | None = None
    dpo_loss: str | None = None
    desirable_weight: float | None = None
    undesirable_weight: float | None = None
    num_generations: int | None = None
    max_new_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    epsilon: float | None = None
    rewards: tuple[str, ...] | list[str] | str | None = None
    reward_pattern: str | None = None
    chat_template: str | None = None
    system_prompt: str | None = None
    num_nodes: int | None = None
    num_proc_per_node: int | None = None
    resources_per_node: dict | None = None
    env: dict | None = None
    export: str | None = None
    export_secret: str | None = None
    # generated from VOCABULARY: end

    def __post_init__(self) -> None:
        # Each set field checked with the vocabulary's parser, and the value it reads kept with
        # the field's key=value spelling: parsed_args() hands both to the job builder.
        checked: dict[str, tuple[str, object]] = {}
        for arg in VOCABULARY:
            value = getattr(self, arg.name)
            if value is not None:
                raw = _raw(value)
                checked[arg.name] = (raw, _check_value(arg, value, raw))
        object.__setattr__(self, "_checked", checked)  # not a field: repr and == leave it out
        check_fields(self, SDK)

    @property
    def func_args(self):
        """What the Kubeflow SDK's ``OptimizerClient`` reads of a ``CustomTrainer``: a
        ``FineTune`` trial is tunepack's to run, so the SDK's client is told which one to use
        instead of failing on a missing attribute."""
        from tunepack.core.errors import UnsupportedError

        raise UnsupportedError(
            "kubeflow.optimizer.OptimizerClient runs CustomTrainer trials only; for a FineTune "
            "trial template use tunepack.OptimizerClient, with the same arguments "
            "(docs/optimize.md)"
        )

    def to_args(self) -> list[str]:
        """The trainer's ``key=value`` arguments, in vocabulary order (unset fields omitted)."""
        return [
            f"{arg.name}={_raw(getattr(self, arg.name))}"
            for arg in VOCABULARY
            if getattr(self, arg.name) is not None
        ]

    def parsed_args(self) -> ParsedArgs:
        """The trainer arguments as checked when this object was made: each set field's typed
        value and its spelling in ``to_args()`` (what the TrainJob's ``spec.trainer.args`` says),
        in vocabulary order. The job builder resolves these against the model
        (``tunepack.runtimes.args.resolve_args``); no words are written and read back."""
        values: dict[str, object] = {}
        spelled: dict[str, str] = {}
        for name, (raw, value) in self._checked.items():
            # As a key=value word is read (split_pairs strips the value): the same spelling, and
            # for a value with spaces at its ends, the same typed value and message.
            spelled[name] = raw.strip()
            values[name] = (
                value if raw == spelled[name] else _BY_NAME[name].parse(name, raw.strip())
            )
        return ParsedArgs(values, spelled)

    @classmethod
    def from_args(
        cls, args: list[str], *, spelling: Spelling = SDK, **placement: typing.Any
    ) -> FineTune:
        """A ``FineTune`` from tunepack's ``key=value`` trainer arguments (as the CLI takes them).

        Unknown, repeated or malformed keys and bad values raise ``BadInputError`` as the trainer
        would; ``placement`` takes the non-argument fields (``num_nodes=2``, ...); a message
        names them as ``spelling`` says (``tunepack.spelling.CLI``: the command's flags).
        """
        if isinstance(args, str) or not all(isinstance(a, str) for a in args):
            raise BadValueError(
                f"trainer arguments must be a list of 'key=value' strings, got {args!r}"
            )
        parsed = parse_args(args)
        values = {**parsed.values, **placement}
        fields = dict.fromkeys(f.name for f in dataclasses.fields(cls))
        check_fields(types.SimpleNamespace(**{**fields, **values}), spelling, parsed.spelled)
        return cls(**values)


def check_fields(
    finetune: typing.Any, spelling: Spelling = SDK, spelled: dict[str, str] | None = None
) -> None:
    """The checks of a FineTune's fields together (``finetune``: the object, or any with its
    attributes): LoRA settings with a method that has no adapters, the placement and the export;
    ``BadInputError`` naming them as ``spelling`` says (``spelled``: the trainer arguments as
    the caller wrote them, ``key=value``)."""

    def given(key: str) -> str:
        value = getattr(finetune, key)
        return spelling.given_arg(key, value, (spelled or {}).get(key, _raw(value)))

    if finetune.method is not None and not methods.get(finetune.method).adapters:
        lora = [given(k) for k in LORA_KEYS if getattr(finetune, k) is not None]
        if lora:
            message = lora_with_full_message(", ".join(lora), len(lora), finetune.method)
            raise ConflictError(f"{spelling.finetune}{message}")
        if finetune.merge:
            message = merge_with_full_message(given("merge"), finetune.method)
            raise ConflictError(f"{spelling.finetune}{message}")
    for name in ("num_nodes", "num_proc_per_node"):
        value = getattr(finetune, name)
        bad_type = not isinstance(value, int) or isinstance(value, bool)
        if value is not None and (bad_type or value < 1):
            raise BadValueError(
                f"{spelling.given(name, value)} is not valid: expected an integer >= 1",
                name=name,
                value=value,
                expected="an integer >= 1",
            )
    resources = finetune.resources_per_node
    if resources is not None and not isinstance(resources, dict):
        raise BadValueError(
            f"{spelling.named('resources_per_node')} must be a dict such as {{'gpu': 1, "
            f"'memory': '64Gi'}}, got {resources!r}",
            name="resources_per_node",
            value=resources,
            expected="a dict",
        )
    env = finetune.env
    if env is not None and not (
        isinstance(env, dict)
        and all(isinstance(k, str) and isinstance(v, str) for k, v in env.items())
    ):
        raise BadValueError(f"{spelling.named('env')} must map names to string values, got {env!r}")
    export = finetune.export
    if export is not None:
        from tunepack.initializers.export import export_uri_problem

        problem = (
            export_uri_problem(export)
            if isinstance(export, str)
            else f"expected a string such as 's3://bucket/prefix', got {export!r}"
        )
        if problem:
            raise BadValueError(f"{spelling.named('export')}: {problem}")
    if finetune.export_secret is not None and export is None:
        example = spelling.given_other("export", "s3://bucket/prefix")
        raise ConflictError(
            f"{spelling.named('export_secret')} names the exporter's credentials, but "
            f"{spelling.named_other('export')} is not set; give {example} (or hf://org/name) too"
        )


def _refuse_unknown_names(init: typing.Callable[..., None]) -> typing.Callable[..., None]:
    """The dataclass's ``__init__`` (keyword arguments only, each a field, ``None``: the
    runtime's default), refusing a name that is not a field with a ``BadInputError`` naming the
    closest fields (``lora_r``: ``lora_rank``?) instead of Python's ``TypeError``."""

    @functools.wraps(init)  # inspect.signature (help(), notebooks) still shows the fields
    def __init__(self, *args: typing.Any, **values: typing.Any) -> None:
        names = [f.name for f in dataclasses.fields(self)]
        unknown = [key for key in values if key not in names]
        if unknown:
            raise UnknownKeyError(
                _no_field_message(unknown[0], names),
                key=unknown[0],
                suggestions=_meant_fields(unknown[0], names),
            )
        init(self, *args, **values)

    return __init__


def _meant_fields(name: str, fields: list[str]) -> tuple[str, ...]:
    """The fields ``name`` likely means: another tool's name for a trainer argument (with the
    value it implies: ``method='qlora'``), else up to three close spellings."""
    if meant := foreign_name(name):
        key, value = meant
        return (key if value is None else f"{key}={value!r}",)
    return tuple(difflib.get_close_matches(name, fields, n=3, cutoff=0.6))


def _no_field_message(name: str, fields: list[str]) -> str:
    """``name`` is not a field: the field it likely means (another tool's name for a trainer
    argument, as ``learning_rate``, or a close spelling), in FineTune's own spelling."""
    if meant := foreign_name(name):
        key, value = meant
        spelled = repr(key) if value is None else f"{key}={value!r}"
        return f"FineTune has no field {name!r}; did you mean {spelled}?"
    close = _meant_fields(name, fields)
    hint = f"did you mean {', '.join(map(repr, close))}?" if close else "see help(FineTune)"
    return (
        f"FineTune has no field {name!r}: its fields are the trainer arguments of "
        f"`tunepack args` and {', '.join(PLACEMENT_FIELDS + EXPORT_FIELDS)}; {hint}"
    )


FineTune.__init__ = _refuse_unknown_names(FineTune.__init__)  # type: ignore[method-assign]


def _value_type(arg: Arg) -> type:
    """The Python type a vocabulary parser returns (read from its return annotation)."""
    hint = typing.get_type_hints(arg.parse).get("return", str)
    return typing.get_origin(hint) or hint


def _raw(value: object) -> str:
    """The ``key=value`` spelling of a Python value, as the trainer receives it."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, list | tuple):
        return ",".join(str(v) for v in value)
    return str(value)


_KIND = {
    bool: "True or False",
    int: "an integer",
    float: "a number",
    str: "a string",
    tuple: "a list of names",
}


_BY_NAME = {arg.name: arg for arg in VOCABULARY}


def _check_value(arg: Arg, value: object, raw: str) -> object:
    """``value`` (spelled ``raw``) checked against ``arg``'s type and parser; returns what the
    parser reads of it (a tuple for a list of names, ``Weighted`` pairs for rewards, ...)."""
    expected = _value_type(arg)
    # The parser checks the range; the type check keeps True from passing as 1, 2.5 as "2.5"...
    ok = {
        bool: lambda v: isinstance(v, bool),
        int: lambda v: isinstance(v, int) and not isinstance(v, bool),
        float: lambda v: isinstance(v, int | float) and not isinstance(v, bool),
        str: lambda v: isinstance(v, str),
        tuple: lambda v: isinstance(v, list | tuple | str),
    }.get(expected, lambda v: True)
    try:
        if not ok(value):
            kind = _KIND.get(expected, expected.__name__)
            raise BadValueError(
                f"{arg.name}={value!r} is not valid: expected {kind} ({arg.help})",
                name=arg.name,
                value=value,
                expected=kind,
            )
        return arg.parse(arg.name, raw)
    except BadInputError as err:  # the same narrow type and facts, the field named first
        facts = err.facts()
        if facts.get("name") == arg.name:
            facts["value"] = value  # the caller's value, not the key=value spelling of it
        raise type(err)(f"FineTune.{arg.name}: {err}", **facts) from None


# ---------------------------------------------------------------- the generated block
def _doc_type(arg: Arg) -> str:
    """A field's type as the docstring names it: ``int``, ``tuple``, ``str | bool``."""
    return arg.annotation if "|" in arg.annotation else _value_type(arg).__name__


def generated_lines() -> list[str]:
    """FineTune's docstring and field declarations, from VOCABULARY and the placement fields."""
    entries = [(arg.name, _doc_type(arg), arg.help) for arg in VOCABULARY]
    doc = [
        "tunepack trainer arguments (``None`` = the runtime's default).",
        "",
        "Args:",
        *(
            line
            for name, kind, text in entries + list(PLACEMENT + EXPORT)
            # The class body's 4 spaces come on top: lines within 100 characters.
            for line in textwrap.wrap(
                f"{name} ({kind}): {text}",
                width=96,
                initial_indent=" " * 4,
                subsequent_indent=" " * 8,
                break_on_hyphens=False,
            )
        ),
        "",
        "Example:",
        "    >>> FineTune(method='lora', lora_rank=16, epochs=3, num_nodes=2)",
    ]
    lines = ['"""' + doc[0], *doc[1:], '"""', ""]
    lines += [
        f"{arg.name}: {_ACCEPTED.get(arg.annotation, arg.annotation)} | None = None"
        for arg in VOCABULARY
    ]
    lines += [f"{name}: {kind} | None = None" for name, kind, _ in PLACEMENT + EXPORT]
    return lines


def main(argv: list[str], path: str = __file__) -> int:
    """``--write``: rewrite FineTune's generated block in ``path`` (this file); ``--check``: exit 1
    while it is stale. ``make generate`` runs ``--write`` with the repository's other generators."""
    if argv not in (["--write"], ["--check"]):
        print(
            f"usage: python -m {COMMAND} --write|--check  (rewrites FineTune's fields, or exits 1 "
            "while they are stale)",
            file=sys.stderr,
        )
        return 64  # EX_USAGE
    if argv == ["--check"]:
        source = Path(path).read_text(encoding="utf-8")
        if replace_block(source, COMMAND, generated_lines()) != source:
            print(f"{path}: FineTune's fields are stale: run `make generate`", file=sys.stderr)
            return 1
        print(f"{path}: up to date")
        return 0
    changed = write_block(path, COMMAND, generated_lines())
    print(f"{path}: {'rewritten' if changed else 'up to date'}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
