"""What a hyperparameter search is given, parsed once where it enters: the search space (the
Kubeflow SDK's ``Search.uniform/loguniform/choice`` over tunepack's trainer arguments), the
objectives (metrics the trainer reports) and the algorithm.

Each search key is a trainer argument, each bound and choice checked by that argument's own
parser, so a point the search could draw is one ``FineTune`` would accept; a metric is one the
method reports. Everything after this module works with the typed ``Parameter``, ``Goal`` and
``Algorithm`` below, never with the SDK's objects again.
"""

from __future__ import annotations

import difflib
import math
from dataclasses import dataclass, field

from kubeflow.optimizer.types.algorithm_types import BaseAlgorithm, GridSearch, RandomSearch
from kubeflow.optimizer.types.optimization_types import Direction, Objective

from tunepack.core.errors import BadValueError, ConflictError, UnknownKeyError, UnsupportedError
from tunepack.runtimes import methods
from tunepack.runtimes.args import VOCABULARY, foreign_name, invalid_value_message
from tunepack.spelling import CLI, SDK, Spelling

# The argument kinds a search can draw values of: numbers from a range, any of them from a list.
RANGE_KINDS = ("int", "float")
CHOICE_KINDS = ("int", "float", "choice", "bool", "auto_bool", "auto_int")
# What a search never draws: the run's plumbing, not its hyperparameters.
NOT_SEARCHED = frozenset(
    {
        "tracker",
        "tracker_uri",
        "tracker_project",
        "device",
        "resume",
        "log_every",
        "checkpoint_every_steps",
        "checkpoint_every_minutes",
        "keep_checkpoints",
        "deterministic",
        "merge",
        # How a step is computed, not what it learns (the memory plan's choices, compilation,
        # precision), and how trials are measured, which must be the same in every trial: the
        # objective's own rows, when and which step is evaluated.
        "activation_checkpointing",
        "loss_chunk",
        "compile",
        "dtype",
        "val_fraction",
        "eval_every_steps",
        "keep_best",
    }
)
_BY_NAME = {arg.name: arg for arg in VOCABULARY}
SEARCHABLE = tuple(
    arg.name for arg in VOCABULARY if arg.name not in NOT_SEARCHED and arg.rule.kind in CHOICE_KINDS
)

LOSS = methods.LOSS_METRIC
VAL_LOSS = methods.VAL_LOSS_METRIC
# Names other tools give the validation loss (Hugging Face's Trainer; Katib's, as the trainer
# prints it for its StdOut collector: methods.STDOUT_NAMES).
VAL_LOSS_NAMES = (methods.STDOUT_NAMES[VAL_LOSS], "validation_loss")


@dataclass(frozen=True)
class Parameter:
    """One searched trainer argument: ``low``..``high`` (``log``: on a log scale; ``integer``:
    whole numbers) or one of ``choices`` (each spelled as the argument takes it)."""

    name: str
    low: float | None = None
    high: float | None = None
    log: bool = False
    integer: bool = False
    choices: tuple[str, ...] = ()

    @property
    def is_range(self) -> bool:
        return not self.choices

    def describe(self) -> str:
        """The parameter as the CLI's ``--search`` spells it."""
        if self.choices:
            return f"{self.name}=choice:{','.join(self.choices)}"
        kind = "loguniform" if self.log else "uniform"
        return f"{self.name}={kind}:{number(self.low)}:{number(self.high)}"

    def largest(self) -> str:
        """The value that needs the most memory, for the memory plan (the top of a range, the
        largest number among choices, else the first choice)."""
        if self.choices:
            numbers = [c for c in self.choices if _is_number(c)]
            return max(numbers, key=float) if numbers else self.choices[0]
        return number(int(self.high) if self.integer else self.high)

    def to_dict(self) -> dict:
        return {k: v for k, v in self.__dict__.items() if v not in (None, False, ())}

    @classmethod
    def from_dict(cls, data: dict) -> Parameter:
        return cls(**{**data, "choices": tuple(data.get("choices", ()))})


@dataclass(frozen=True)
class Goal:
    """The metric a search optimises and its direction (``minimize`` or ``maximize``)."""

    metric: str
    direction: str = "minimize"

    @property
    def arrow(self) -> str:
        return "min" if self.direction == "minimize" else "max"


@dataclass(frozen=True)
class Algorithm:
    """How points are drawn: ``random``, ``grid`` or ``tpe``, with a seed (None: random)."""

    name: str = "random"
    seed: int | None = None


@dataclass
class TPESearch(BaseAlgorithm):
    """Tree-structured Parzen estimator: each point drawn where earlier trials did well (Optuna's
    TPE locally; Katib's ``tpe`` suggestion on a cluster).

    Args:
        random_state (`Optional[int]`): Random seed for reproducibility.
    """

    random_state: int | None = None

    @property
    def algorithm_name(self) -> str:
        return "tpe"

    def _to_katib_spec(self):
        from kubeflow.optimizer.types.algorithm_types import algorithm_to_katib_spec

        return algorithm_to_katib_spec(self)


@dataclass
class MedianStop:
    """Stop a trial whose objective, at an evaluation, is worse than the median of the earlier
    trials' at the same step (Optuna's median pruner locally; Katib's ``medianstop``).

    Args:
        min_trials_required: trials that must have finished before any is stopped.
        start_step: evaluations before this optimizer step never stop a trial.
    """

    min_trials_required: int = 3
    start_step: int = 0

    def __post_init__(self) -> None:
        for name in ("min_trials_required", "start_step"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise BadValueError(
                    f"MedianStop.{name}={value!r} is not valid: expected an integer >= 0"
                )


# --- the search space -------------------------------------------------------------------------


def parse_space(search_space: object, spelling: Spelling = SDK) -> tuple[Parameter, ...]:
    """The SDK's ``{name: Search.uniform(...) | Search.loguniform(...) | Search.choice([...])}``
    as ``Parameter``s, each key and value checked against the trainer's vocabulary."""
    if not isinstance(search_space, dict) or not search_space:
        raise BadValueError(
            "search_space must be a non-empty dict of trainer arguments to Search.uniform(), "
            f"Search.loguniform() or Search.choice(), e.g. {{'lr': Search.loguniform(1e-5, "
            f"1e-3)}}; got {search_space!r}"
        )
    params = []
    for name, spec in search_space.items():
        check_key(name, spelling)
        params.append(_from_spec(name, spec, spelling))
    return tuple(params)


def check_key(name: object, spelling: Spelling = SDK) -> str:
    """``name`` if it is a trainer argument a search may draw; else ``UnknownKeyError`` with the
    vocabulary's suggestion."""
    shown = spelling.key(name)
    if not isinstance(name, str) or name not in _BY_NAME:
        meant = foreign_name(name) if isinstance(name, str) else None
        if meant is not None:
            close = [meant[0]]
            hint = f"tunepack calls it {meant[0]!r}"
        else:
            close = difflib.get_close_matches(str(name), SEARCHABLE, n=3, cutoff=0.6)
            hint = (
                f"did you mean {', '.join(map(repr, close))}?"
                if close
                else "see `tunepack args` for the vocabulary"
            )
        raise UnknownKeyError(
            f"{shown}: {name!r} is not a trainer argument; {hint}", key=name, suggestions=close
        )
    if name not in SEARCHABLE:
        raise UnsupportedError(
            f"{shown}: {name} is not searched (it does not change what a trial learns, or every "
            f"trial must share it); set it in the trial template's FineTune; the searchable "
            f"arguments are {', '.join(SEARCHABLE)}"
        )
    return name


def _from_spec(name: str, spec: object, spelling: Spelling) -> Parameter:
    from kubeflow.optimizer.constants import constants

    shown = spelling.key(name)
    arg = _BY_NAME[name]
    space = getattr(spec, "feasible_space", None)
    kind = getattr(spec, "parameter_type", None)
    if space is None or kind not in (constants.DOUBLE_PARAMETER, constants.CATEGORICAL_PARAMETERS):
        raise BadValueError(
            f"{shown} must be Search.uniform(min, max), Search.loguniform(min, max) or "
            f"Search.choice([...]), got {spec!r}"
        )
    if kind == constants.CATEGORICAL_PARAMETERS:
        choices = tuple(str(v) for v in space.list or ())
        if not choices:
            raise BadValueError(f"{shown}: Search.choice() needs at least one value")
        for value in choices:
            _check_value(arg, value, shown)
        if len(set(choices)) != len(choices):
            raise BadValueError(f"{shown}: Search.choice({list(choices)!r}) repeats a value")
        return Parameter(name, choices=choices, integer=arg.rule.kind == "int")
    if arg.rule.kind not in RANGE_KINDS:
        raise BadValueError(
            f"{shown}: {name} takes {arg.rule.expected}, not a range; use Search.choice([...])"
        )
    low, high = (_check_value(arg, raw, shown) for raw in (space.min, space.max))
    log = space.distribution == "logUniform"
    if not low < high:
        raise BadValueError(
            f"{shown}: the range {number(low)}..{number(high)} is empty: min must be below max"
        )
    if log and low <= 0:
        raise BadValueError(
            f"{shown}: Search.loguniform needs min > 0, got {number(low)}; use Search.uniform"
        )
    integer = arg.rule.kind == "int"
    if integer and math.floor(high) < math.ceil(low):
        raise BadValueError(f"{shown}: no whole number lies in {low}..{high}")
    return Parameter(name, low=float(low), high=float(high), log=log, integer=integer)


def _check_value(arg, raw: object, shown: str):
    """The typed value of ``raw`` for ``arg``, by its own parser (its message, with the key)."""
    try:
        return arg.parse(arg.name, str(raw))
    except BadValueError as err:
        raise BadValueError(f"{shown}: {err}") from None


def parse_search_flag(flag: str) -> tuple[str, object]:
    """``--search lr=loguniform:1e-5:1e-3`` (or ``uniform:A:B``, ``choice:8,16,32``) as the
    SDK's ``(name, Search...)``."""
    from kubeflow.optimizer.types.search_types import Search

    name, eq, rest = flag.partition("=")
    kind, _, values = rest.partition(":")
    expected = (
        "NAME=loguniform:MIN:MAX, NAME=uniform:MIN:MAX or NAME=choice:A,B,... (e.g. "
        "lr=loguniform:1e-5:1e-3)"
    )
    name = name.strip()
    if not eq or not name or kind not in ("loguniform", "uniform", "choice") or not values:
        raise BadValueError(f"--search {flag!r} is not valid: expected {expected}")
    check_key(name, CLI)
    if kind == "choice":
        return name, Search.choice([v.strip() for v in values.split(",") if v.strip()])
    low, sep, high = values.partition(":")
    try:
        bounds = float(low), float(high)
    except ValueError:
        bounds = None
    if not sep or bounds is None:
        raise BadValueError(f"--search {flag!r} is not valid: expected {expected}")
    build = Search.loguniform if kind == "loguniform" else Search.uniform
    return name, build(low.strip(), high.strip())


def typed(name: str, raw: str) -> object:
    """A trainer argument's value as ``FineTune`` takes it (its parser's)."""
    return _BY_NAME[name].parse(name, raw)


# --- objectives -------------------------------------------------------------------------------


def metric_names(method: methods.Method, validates: bool, rewards: tuple[str, ...]) -> list[str]:
    """The metrics a run of ``method`` reports: the loss, the validation loss where it holds out
    rows (``validates``), the method's own, and for GRPO each reward's."""
    names = [LOSS]
    if validates:
        names.append(VAL_LOSS)
    names += list(method.metrics)
    if method.loss is methods.Loss.GRPO:
        names += [methods.GRPO_REWARD_METRIC.format(r) for r in rewards]
    return names


def parse_objectives(
    objectives: object,
    method: methods.Method,
    validates: bool,
    rewards: tuple[str, ...] = (),
    spelling: Spelling = SDK,
) -> tuple[Goal, ...]:
    """The SDK's ``[Objective(metric, direction)]`` as ``Goal``s, each a metric the trial's
    method reports. None: the validation loss where the run holds out rows, else the loss."""
    reported = metric_names(method, validates, rewards)
    if objectives is None:
        return (Goal(VAL_LOSS if validates else LOSS),)
    listed = objectives if isinstance(objectives, list | tuple) else [objectives]
    if not listed or not all(isinstance(o, Objective) for o in listed):
        raise BadValueError(
            f"objectives must be a list of Objective(metric=..., direction=...), got {objectives!r}"
        )
    goals = []
    for objective in listed:
        metric = VAL_LOSS if objective.metric in VAL_LOSS_NAMES else objective.metric
        shown = spelling.objective.format(objective.metric)
        if metric not in reported:
            if metric == VAL_LOSS:
                why = (
                    f"method={method.name} has no validation loss"
                    if not method.validates
                    else "the trial template holds out no rows: set val_fraction (e.g. "
                    "FineTune(val_fraction=0.1), or val_fraction=0.1)"
                )
            else:
                why = f"method={method.name} reports {', '.join(reported)}"
            raise UnsupportedError(f"{shown}: no trial would report {metric!r}: {why}")
        direction = objective.direction
        goals.append(
            Goal(metric, direction.value if isinstance(direction, Direction) else direction)
        )
    return tuple(goals)


def parse_objective_flag(flag: str) -> Objective:
    """``--objective val_loss:min`` (or ``:max``; the direction defaults to min)."""
    metric, _, arrow = flag.partition(":")
    directions = {"min": "minimize", "max": "maximize", "": "minimize"}
    if not metric.strip() or arrow not in directions:
        raise BadValueError(
            f"--objective {flag!r} is not valid: expected METRIC[:min|:max], e.g. val_loss:min"
        )
    return Objective(metric=metric.strip(), direction=directions[arrow])


# --- the algorithm ----------------------------------------------------------------------------

ALGORITHMS = ("random", "grid", "tpe")


def parse_algorithm(
    algorithm: object, params: tuple[Parameter, ...], spelling: Spelling = SDK
) -> Algorithm:
    """``RandomSearch()`` (default), ``GridSearch()`` or ``TPESearch()`` as an ``Algorithm``.
    A grid needs every parameter as a list of choices."""
    if algorithm is None:
        return Algorithm()
    if not isinstance(algorithm, RandomSearch | GridSearch | TPESearch):
        raise UnsupportedError(
            f"{spelling.algorithm}={algorithm!r} is not one tunepack runs: RandomSearch(), "
            "GridSearch() or tunepack.TPESearch()"
        )
    if isinstance(algorithm, GridSearch):
        ranges = [p for p in params if p.is_range]
        if ranges:
            shown = ", ".join(p.describe() for p in ranges)
            raise ConflictError(
                f"{spelling.algorithm}: a grid search needs every parameter as a list of "
                f"values (Search.choice, or choice:A,B,...), but {shown} is a range"
            )
        return Algorithm("grid")
    return Algorithm(algorithm.algorithm_name, getattr(algorithm, "random_state", None))


def algorithm_from_flag(name: str, seed: int | None):
    """``--algorithm random|grid|tpe`` (``--seed``) as the SDK's algorithm object."""
    if name == "grid":
        return GridSearch()
    if name == "tpe":
        return TPESearch(random_state=seed)
    return RandomSearch(random_state=seed)


def grid_size(params: tuple[Parameter, ...]) -> int:
    return math.prod(len(p.choices) for p in params)


# --- helpers ----------------------------------------------------------------------------------


def _is_number(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


def number(value: float | int | None) -> str:
    if value is None:
        return "?"
    if float(value).is_integer() and abs(value) < 1e15:
        return str(int(value))
    return f"{value:g}"


@dataclass
class Space:
    """A parsed search: parameters, goals, algorithm, early stopping, trial counts."""

    parameters: tuple[Parameter, ...]
    goals: tuple[Goal, ...]
    algorithm: Algorithm = field(default_factory=Algorithm)
    early_stopping: MedianStop | None = None
    num_trials: int = 10
    parallel_trials: int = 1
    max_failed_trials: int | None = None

    @property
    def goal(self) -> Goal:
        return self.goals[0]


def invalid_count_message(shown: str, value: object) -> str:
    return invalid_value_message(shown, str(value), "an integer >= 1")
