"""Choosing a dataset split's files by the Hugging Face Hub's naming conventions, and slicing it.

The rules (directory or file-name prefix, synonyms, unnamed files as ``train``, ``datasets``-style
slices): docs/initializers.md, "Datasets"."""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import PurePosixPath

from tunepack.core.errors import BadValueError, NotFoundError

SPLIT_ENV = "DATASET_SPLIT"
DEFAULT_SPLIT = "train"
_SYNONYMS = {
    "train": ("train", "training"),
    "validation": ("validation", "valid", "val", "dev"),
    "test": ("test", "testing", "eval", "evaluation"),
}
_SPLIT_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")


@dataclass(frozen=True)
class Split:
    """A split name and, when sliced, its bounds (``None``: open), as written in ``spec``."""

    name: str
    start: int | None = None
    stop: int | None = None
    percent: bool = False
    spec: str = DEFAULT_SPLIT

    @property
    def sliced(self) -> bool:
        return self.spec != self.name

    @property
    def needs_count(self) -> bool:
        """Whether the bounds depend on the split's row count (percentages, negative bounds)."""
        return self.percent or any(b is not None and b < 0 for b in (self.start, self.stop))

    def bounds(self, rows: int | None) -> tuple[int, int | None]:
        """The rows ``[start, stop)`` of a split of ``rows`` rows (``None`` when unknown: only
        for bounds that need no count; ``stop`` None is the end)."""
        if rows is None:
            if self.needs_count:
                raise AssertionError(f"split {self.spec!r} needs the row count")
            return self.start or 0, self.stop

        def absolute(bound: int | None, default: int) -> int:
            if bound is None:
                return default
            if self.percent:
                bound = round(bound * rows / 100)  # datasets' "closest" rounding
            if bound < 0:
                bound = max(rows + bound, 0)
            return min(bound, rows)

        return absolute(self.start, 0), absolute(self.stop, rows)


# name[from:to], each bound an optional integer, optionally a percentage: datasets' slice form.
_SLICE = re.compile(r"^(?P<name>[^\[\]]*)\[(?P<start>[^:\]]*):(?P<stop>[^\]]*)\]$")
_BOUND = re.compile(r"^(-?\d+)(%?)$")
_SLICE_FORMS = "e.g. train[:1000], train[10%:20%] or train[-100:]"


def parse(spec: str) -> Split:
    """A split spec (``train``, ``train[:1000]``, ``train[:10%]``); BadInputError when it is
    neither a split name nor a slice of one."""
    spec = spec.strip()
    if "[" not in spec and "]" not in spec:
        _check_name(spec, spec)
        return Split(spec, spec=spec)
    match = _SLICE.match(spec)
    if match is None:
        raise BadValueError(
            f"dataset split {spec!r} is not a split name or a slice of one; write "
            f"<name>[<from>:<to>], {_SLICE_FORMS} (one slice; no '+' or rounding suffix)"
        )
    name = match["name"].strip()
    _check_name(name, spec)
    bounds, units = [], set()
    for text in (match["start"].strip(), match["stop"].strip()):
        if not text:
            bounds.append(None)
            continue
        bound = _BOUND.match(text)
        if bound is None:
            raise BadValueError(
                f"dataset split {spec!r}: bound {text!r} is not a whole number of rows or a "
                f"percentage; {_SLICE_FORMS}"
            )
        value, percent = int(bound[1]), bool(bound[2])
        if percent and not -100 <= value <= 100:
            raise BadValueError(
                f"dataset split {spec!r}: {text} is not a percentage from -100% to 100%"
            )
        bounds.append(value)
        units.add(percent)
    if len(units) > 1:
        raise BadValueError(
            f"dataset split {spec!r} mixes a row count and a percentage; give both bounds in "
            f"rows or both in percent ({_SLICE_FORMS})"
        )
    return Split(name, bounds[0], bounds[1], percent=units == {True}, spec=spec)


def _check_name(name: str, spec: str) -> None:
    if not _SPLIT_NAME.match(name):
        raise BadValueError(
            f"dataset split {spec!r} is not a valid split name (letters, digits, '_', '-', '.')"
        )


def requested(uri_split: str | None) -> Split:
    """The split to read: the URI's ``?split=``, else ``DATASET_SPLIT``, else train."""
    return parse((uri_split or os.environ.get(SPLIT_ENV, "")).strip() or DEFAULT_SPLIT)


def _names(split: str) -> tuple[str, ...]:
    return _SYNONYMS.get(split, (split,))


def split_of(path: str) -> str | None:
    """The split a file's path names, or None."""
    pure = PurePosixPath(path)
    candidates = [*pure.parts[:-1], pure.name]
    for split, names in {**_SYNONYMS}.items():
        for name in names:
            for i, part in enumerate(candidates):
                part = part.lower()
                is_dir = i < len(candidates) - 1
                if (is_dir and part == name) or (
                    not is_dir and re.match(rf"^{re.escape(name)}([-_. 0-9]|$)", part)
                ):
                    return split
    return None


def select(paths: list[str], split: str, source: str) -> list[str]:
    """The paths of ``split``; BadInputError naming the splits present when it has none."""
    named = {p: split_of(p) for p in paths}
    if split not in _SYNONYMS:  # a custom split name: match it literally
        named = {p: split if _matches_custom(p, split) else named[p] for p in paths}
    chosen = [p for p in paths if named[p] == split]
    if chosen:
        return chosen
    if split == DEFAULT_SPLIT and all(s is None for s in named.values()):
        return paths
    present = sorted({s for s in named.values() if s is not None})
    if not present and paths:
        present = [DEFAULT_SPLIT]
    raise NotFoundError(
        f"dataset {source!r} has no {split!r} split; it has: {', '.join(present) or 'no data'}. "
        f"Set {SPLIT_ENV} or ?split= to one of them",
        what="split",
        name=split,
        available=present,
    )


def _matches_custom(path: str, split: str) -> bool:
    pure = PurePosixPath(path)
    return split in pure.parts[:-1] or bool(
        re.match(rf"^{re.escape(split)}([-_. 0-9]|$)", pure.name)
    )


def check_single_file(name: str, split: str, source: str) -> None:
    """A single data file holds one split: ``train``, or the split its name says
    (``test.jsonl``). Asked for another, it is refused rather than read whole as that split.
    ``split`` may be sliced (``train[:100]``): the slice picks rows, not files."""
    split = parse(split).name
    if split == DEFAULT_SPLIT or split_of(name) == split or _matches_custom(name, split):
        return
    raise NotFoundError(
        f"dataset {source!r} is a single file, which has no {split!r} split: a file is the "
        "train split unless its name says otherwise. Give the file of that split, or a "
        "directory with one file per split (train.jsonl, test.jsonl), and no split to train "
        "on the whole file",
        what="split",
        name=split,
        available=(DEFAULT_SPLIT,),
    )
