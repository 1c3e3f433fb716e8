"""The rewards ``method=grpo`` scores its sampled answers with: the built-ins and the plugins
(docs/trainer.md, "Reinforcement learning from verifiable rewards").

Standard library only: the argument vocabulary (``tunepack.trainers.args``) parses the names and
weights, in the initializer images too. A trainer argument only ever names a built-in or an
installed plugin (entry point group ``tunepack.rewards``), never a Python object.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from dataclasses import dataclass
from importlib import metadata

from tunepack.core.errors import BadInputError, BadValueError

PLUGIN_GROUP = "tunepack.rewards"
PATTERN_MAX = 500  # characters of reward_pattern
NAME_PATTERN = r"[a-z][a-z0-9_]{0,63}"
_NAME = re.compile(NAME_PATTERN)
# Numbers as answers write them: an optional sign, digits with optional thousands separators,
# an optional fraction.
_NUMBER = re.compile(r"[-+]?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?")


@dataclass(frozen=True)
class Sample:
    """One sampled answer and what its reward may read."""

    prompt: str  # the prompt as the row gave it (the last user turn)
    completion: str  # the answer as decoded, up to its end-of-turn token
    answer: str | None  # the row's reference answer, if it has one
    tokens: int  # the answer's length in tokens
    max_new_tokens: int
    pattern: str  # reward_pattern ("" when none is given)


Reward = Callable[[Sample], float]


def _normalised(text: str) -> str:
    return " ".join(text.casefold().split()).strip(".,;:!?\"'`()[]{} ")


def _last_number(text: str) -> float | None:
    found = _NUMBER.findall(text)
    if not found:
        return None
    try:
        return float(found[-1].replace(",", ""))
    except ValueError:
        return None


def exact(sample: Sample) -> float:
    return float(sample.answer is not None and sample.completion.strip() == sample.answer.strip())


def match(sample: Sample) -> float:
    return float(
        sample.answer is not None and _normalised(sample.completion) == _normalised(sample.answer)
    )


def numeric(sample: Sample) -> float:
    if sample.answer is None:
        return 0.0
    got, want = _last_number(sample.completion), _last_number(sample.answer)
    return float(got is not None and want is not None and math.isclose(got, want, abs_tol=1e-9))


def format_(sample: Sample) -> float:
    return float(re.search(sample.pattern, sample.completion, re.DOTALL) is not None)


def length(sample: Sample) -> float:
    return -min(sample.tokens / max(sample.max_new_tokens, 1), 1.0)


BUILT_IN: dict[str, Reward] = {
    "exact": exact,
    "match": match,
    "numeric": numeric,
    "format": format_,
    "length": length,
}
NEEDS_ANSWER = ("exact", "match", "numeric")
DEFAULT = "match"
EXPECTED = (
    f"comma-separated reward names with optional weights, name[:weight] (built-in: "
    f"{', '.join(BUILT_IN)}; others: plugins installed in the image)"
)


@dataclass(frozen=True)
class Weighted:
    name: str
    weight: float

    def __str__(self) -> str:  # as the argument spells it
        return self.name if self.weight == 1 else f"{self.name}:{self.weight:g}"


def parse(key: str, raw: str) -> tuple[Weighted, ...]:
    """``rewards=match,format:0.5`` as (name, weight) pairs; names are checked for shape here and
    resolved (built-in or installed plugin) when the trainer starts (``resolve``)."""
    bad = BadValueError(f"{key}={raw!r} is not valid: expected {EXPECTED}")
    parts = [part.strip() for part in raw.split(",")]
    if not raw.strip() or any(not part for part in parts):
        raise bad
    chosen: list[Weighted] = []
    for part in parts:
        name, sep, weight = (piece.strip() for piece in part.partition(":"))
        if not _NAME.fullmatch(name):
            raise bad
        try:
            value = float(weight) if sep else 1.0
        except ValueError:
            raise bad from None
        if not math.isfinite(value) or value == 0:
            raise BadValueError(
                f"{key}={raw!r} is not valid: the weight of {name!r} must be a non-zero number"
            )
        if any(w.name == name for w in chosen):
            raise BadValueError(f"{key}={raw!r} is not valid: {name!r} is named twice")
        chosen.append(Weighted(name, value))
    return tuple(chosen)


def spelled(rewards: tuple[Weighted, ...]) -> str:
    """The rewards as the argument spells them (``match,format:0.5``)."""
    return ",".join(map(str, rewards))


def parse_pattern(key: str, raw: str) -> str:
    if len(raw) > PATTERN_MAX:
        raise BadValueError(
            f"{key}={raw!r} is not valid: expected a regular expression of at most "
            f"{PATTERN_MAX} characters"
        )
    try:
        re.compile(raw)
    except re.error as err:
        raise BadValueError(
            f"{key}={raw!r} is not valid: expected a Python regular expression ({err})"
        ) from None
    return raw


def plugins() -> dict[str, metadata.EntryPoint]:
    """The reward plugins installed here, by name."""
    return {ep.name: ep for ep in metadata.entry_points(group=PLUGIN_GROUP)}


def resolve(rewards: tuple[Weighted, ...]) -> list[tuple[Weighted, Reward]]:
    """Each named reward's function: a built-in, else an installed plugin's; an unknown name is
    refused with the names there are."""
    installed = plugins()
    resolved = []
    for weighted in rewards:
        if weighted.name in BUILT_IN:
            resolved.append((weighted, BUILT_IN[weighted.name]))
            continue
        entry = installed.get(weighted.name)
        if entry is None:
            have = ", ".join([*BUILT_IN, *sorted(installed)])
            raise BadValueError(
                f"rewards: {weighted.name!r} is neither a built-in reward nor an installed "
                f"plugin (entry point group {PLUGIN_GROUP!r}): expected one of {have}"
            )
        function = entry.load()
        if not callable(function):
            raise BadInputError(
                f"rewards: the plugin {weighted.name!r} ({entry.value}) is not a function"
            )
        resolved.append((weighted, function))
    return resolved


def score(functions: list[tuple[Weighted, Reward]], sample: Sample) -> tuple[float, list[float]]:
    """The weighted sum of a sample's rewards, and each reward's own value."""
    values = []
    for weighted, function in functions:
        value = float(function(sample))
        if not math.isfinite(value):
            raise BadInputError(f"rewards: {weighted.name!r} returned {value} for an answer")
        values.append(value)
    total = sum(w.weight * v for (w, _), v in zip(functions, values, strict=True))
    return total, values
