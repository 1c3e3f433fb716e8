"""The rewards ``method=grpo`` scores its sampled answers with: the built-ins and the plugins
(docs/trainer.md, "Reinforcement learning from verifiable rewards").

The arguments that name them (``rewards=match,format:0.5``, ``reward_pattern``) are read by the
vocabulary with ``tunepack.runtimes.reward_names`` (the names, weights and the pattern's checks,
in the initializer images too); here, what each built-in computes, and each named reward resolved
to a built-in or an installed plugin (entry point group ``tunepack.rewards``), never a Python
object a trainer argument names.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from dataclasses import dataclass
from importlib import metadata

from tunepack.core.errors import BadInputError, BadValueError
from tunepack.runtimes.reward_names import Weighted

PLUGIN_GROUP = "tunepack.rewards"
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


# Each built-in's function, by the name the vocabulary accepts (runtimes/reward_names.py's
# BUILT_IN; a test keeps the two equal).
BUILT_IN: dict[str, Reward] = {
    "exact": exact,
    "match": match,
    "numeric": numeric,
    "format": format_,
    "length": length,
}
NEEDS_ANSWER = ("exact", "match", "numeric")


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
