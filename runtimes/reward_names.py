"""The names of the rewards ``method=grpo`` scores its answers with, as the argument vocabulary
reads them: ``rewards=match,format:0.5`` (names and weights) and ``reward_pattern``.

Standard library and ``tunepack.core`` only: the vocabulary (``tunepack.runtimes.args``) checks
these arguments wherever it runs, the SDK, the admission policy and the initializer images
included. What each built-in computes, and how a name is resolved to a built-in or to an
installed plugin when the trainer starts, is the trainer's: ``trainers/objectives/rewards.py``
(docs/trainer.md, "Reinforcement learning from verifiable rewards"). A trainer argument only ever
names a reward, never a Python object.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

from tunepack.core.errors import BadValueError

PATTERN_MAX = 500  # characters of reward_pattern
NAME_PATTERN = r"[a-z][a-z0-9_]{0,63}"
_NAME = re.compile(NAME_PATTERN)
# The built-in rewards, in the order the docs list them (their functions: the trainer's
# rewards.BUILT_IN, a test keeps the two equal).
BUILT_IN = ("exact", "match", "numeric", "format", "length")
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
    resolved (built-in or installed plugin) when the trainer starts (the trainer's
    ``rewards.resolve``)."""
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
