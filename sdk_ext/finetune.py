"""``FineTune``: tunepack's trainer vocabulary as a typed dataclass for notebooks.

The fields are generated from ``tunepack.trainers.args.VOCABULARY`` (the one source of truth for
trainer arguments), so a key added there appears here without a second list to keep in sync.
Each value is checked with the vocabulary's own parser when the object is made, so a wrong value
fails in the notebook cell that wrote it, naming the field and the allowed range:

    >>> from tunepack import FineTune
    >>> FineTune(method="lora", lora_rank=16, epochs=3).to_args()
    ['method=lora', 'epochs=3', 'lora_rank=16']
    >>> FineTune(epochs=0)
    Traceback (most recent call last):
    ...
    tunepack.core.errors.BadInputError: FineTune.epochs: epochs='0' is not valid: expected an
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
import typing

from tunepack.core.errors import BadInputError
from tunepack.trainers.args import VOCABULARY, Arg, split_pairs

# Not trainer arguments: where and how the trainer runs (TrainJob.spec.trainer fields).
PLACEMENT_FIELDS = ("num_nodes", "num_proc_per_node", "resources_per_node", "env")
# Where the result goes after training (the exporter step; docs/export.md).
EXPORT_FIELDS = ("export", "export_secret")


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


def _check_value(arg: Arg, value: object) -> None:
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
            raise BadInputError(
                f"{arg.name}={value!r} is not valid: expected "
                f"{_KIND.get(expected, expected.__name__)} ({arg.help})"
            )
        arg.parse(arg.name, _raw(value))
    except BadInputError as err:
        raise BadInputError(f"FineTune.{arg.name}: {err}") from None


def _init(self, **values) -> None:
    """Keyword arguments only, each a field (``None``: the runtime's default); a name that is
    not a field is refused naming the closest fields (``lora_r``: ``lora_rank``?)."""
    names = [name for name, _, _ in _fields()]
    unknown = [key for key in values if key not in names]
    if unknown:
        import difflib

        close = difflib.get_close_matches(unknown[0], names, n=3, cutoff=0.6)
        hint = f"did you mean {', '.join(map(repr, close))}?" if close else "see help(FineTune)"
        raise BadInputError(
            f"FineTune has no field {unknown[0]!r}: its fields are the trainer arguments of "
            f"`tunepack args` and {', '.join(PLACEMENT_FIELDS + EXPORT_FIELDS)}; {hint}"
        )
    for name in names:
        object.__setattr__(self, name, values.get(name))
    self.__post_init__()


def _post_init(self) -> None:
    for arg in VOCABULARY:
        value = getattr(self, arg.name)
        if value is not None:
            _check_value(arg, value)
    if self.method == "full":
        lora = [f"{a.name}={getattr(self, a.name)!r}" for a in VOCABULARY if _is_lora(a.name, self)]
        if lora:
            raise BadInputError(
                f"FineTune: {', '.join(lora)} set{'s' if len(lora) == 1 else ''} LoRA adapters, "
                "but method='full' trains every weight and has none; leave "
                f"{'it' if len(lora) == 1 else 'them'} out, or use method='lora'"
            )
    nodes, procs = self.num_nodes, self.num_proc_per_node
    for name, value in (("num_nodes", nodes), ("num_proc_per_node", procs)):
        bad_type = not isinstance(value, int) or isinstance(value, bool)
        if value is not None and (bad_type or value < 1):
            raise BadInputError(f"FineTune.{name}={value!r} is not valid: expected an integer >= 1")
    if self.resources_per_node is not None and not isinstance(self.resources_per_node, dict):
        raise BadInputError(
            "FineTune.resources_per_node must be a dict such as {'gpu': 1, 'memory': '64Gi'}, "
            f"got {self.resources_per_node!r}"
        )
    if self.env is not None and not (
        isinstance(self.env, dict)
        and all(isinstance(k, str) and isinstance(v, str) for k, v in self.env.items())
    ):
        raise BadInputError(f"FineTune.env must map names to string values, got {self.env!r}")
    if self.export is not None:
        from tunepack.initializers.export import export_uri_problem

        problem = (
            export_uri_problem(self.export)
            if isinstance(self.export, str)
            else f"expected a string such as 's3://bucket/prefix', got {self.export!r}"
        )
        if problem:
            raise BadInputError(f"FineTune.export: {problem}")
    if self.export_secret is not None and self.export is None:
        raise BadInputError(
            "FineTune.export_secret names the exporter's credentials, but export is not set; "
            "give export='s3://bucket/prefix' (or hf://org/name) too"
        )


def _is_lora(name: str, obj) -> bool:
    """A LoRA setting given (``lora_rank``, ``lora_alpha``, ...)."""
    return name.startswith("lora_") and getattr(obj, name) is not None


def _to_args(self) -> list[str]:
    """The trainer's ``key=value`` arguments, in vocabulary order (unset fields omitted)."""
    return [
        f"{arg.name}={_raw(getattr(self, arg.name))}"
        for arg in VOCABULARY
        if getattr(self, arg.name) is not None
    ]


def _from_args(cls, args: list[str], **placement) -> FineTune:
    """A ``FineTune`` from tunepack's ``key=value`` trainer arguments (as the CLI takes them).

    Unknown, repeated or malformed keys and bad values raise ``BadInputError`` as the trainer
    would; ``placement`` takes the non-argument fields (``num_nodes=2``, ...).
    """
    if isinstance(args, str) or not all(isinstance(a, str) for a in args):
        raise BadInputError(
            f"trainer arguments must be a list of 'key=value' strings, got {args!r}"
        )
    by_name = {arg.name: arg for arg in VOCABULARY}
    values = {key: by_name[key].parse(key, raw) for key, raw in split_pairs(args).items()}
    return cls(**values, **placement)


def _doc() -> str:
    lines = [
        "tunepack trainer arguments (``None`` = the runtime's default).",
        "",
        "Args:",
    ]
    for arg in VOCABULARY:
        lines.append(f"    {arg.name} ({_value_type(arg).__name__}): {arg.help}")
    lines += [
        "    num_nodes (int): trainer nodes (TrainJob spec.trainer.numNodes)",
        "    num_proc_per_node (int): processes per node (default: the GPUs per node, or 1)",
        "    resources_per_node (dict): e.g. {'gpu': 4, 'memory': '200Gi'}",
        "    env (dict): extra environment variables for the trainer container",
        "    export (str): where the result goes: s3://bucket/prefix, hf://org/name or a path",
        "    export_secret (str): a cluster Secret with the exporter's credentials",
        "",
        "Example:",
        "    >>> FineTune(method='lora', lora_rank=16, epochs=3, num_nodes=2)",
    ]
    return "\n".join(lines)


def _fields() -> list[tuple]:
    out = []
    for arg in VOCABULARY:
        out.append((arg.name, _value_type(arg) | None, dataclasses.field(default=None)))
    out += [
        ("num_nodes", int | None, dataclasses.field(default=None)),
        ("num_proc_per_node", int | None, dataclasses.field(default=None)),
        ("resources_per_node", dict | None, dataclasses.field(default=None)),
        ("env", dict | None, dataclasses.field(default=None)),
        ("export", str | None, dataclasses.field(default=None)),
        ("export_secret", str | None, dataclasses.field(default=None)),
    ]
    return out


FineTune = dataclasses.make_dataclass(
    "FineTune",
    _fields(),
    namespace={
        "__init__": _init,
        "__post_init__": _post_init,
        "to_args": _to_args,
        "from_args": classmethod(_from_args),
        "__doc__": _doc(),
    },
    kw_only=True,
    frozen=True,
    init=False,  # _init: the same keyword arguments, an unknown one refused with the fields
)
FineTune.__module__ = __name__
