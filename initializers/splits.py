"""Choosing a dataset split's files by the Hugging Face Hub's naming conventions.

A file belongs to a split when a directory in its path is named after it (``train/x.parquet``) or
its file name starts with it followed by a separator (``train.jsonl``,
``data/train-00000-of-00002.parquet``, ``test_set.csv``). Common synonyms count (``valid``,
``dev`` for validation; ``eval`` for test). Files named after no split at all form the ``train``
split, as ``datasets.load_dataset`` treats them. Custom ``configs`` in a dataset card are not read:
give the subpath (``hf://datasets/org/name/<config dir>``) instead.
"""

from __future__ import annotations

import os
import re
from pathlib import PurePosixPath

from tunepack.core.errors import BadInputError

SPLIT_ENV = "DATASET_SPLIT"
DEFAULT_SPLIT = "train"
_SYNONYMS = {
    "train": ("train", "training"),
    "validation": ("validation", "valid", "val", "dev"),
    "test": ("test", "testing", "eval", "evaluation"),
}
_SPLIT_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")


def requested(uri_split: str | None) -> str:
    """The split to read: the URI's ``?split=``, else ``DATASET_SPLIT``, else train."""
    split = (uri_split or os.environ.get(SPLIT_ENV, "")).strip() or DEFAULT_SPLIT
    if not _SPLIT_NAME.match(split):
        raise BadInputError(
            f"dataset split {split!r} is not a valid split name (letters, digits, '_', '-', '.')"
        )
    return split


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
    raise BadInputError(
        f"dataset {source!r} has no {split!r} split; it has: {', '.join(present) or 'no data'}. "
        f"Set {SPLIT_ENV} or ?split= to one of them"
    )


def _matches_custom(path: str, split: str) -> bool:
    pure = PurePosixPath(path)
    return split in pure.parts[:-1] or bool(
        re.match(rf"^{re.escape(split)}([-_. 0-9]|$)", pure.name)
    )


def check_single_file(name: str, split: str, source: str) -> None:
    """A single data file holds one split: ``train``, or the split its name says
    (``test.jsonl``). Asked for another, it is refused rather than read whole as that split."""
    if split == DEFAULT_SPLIT or split_of(name) == split or _matches_custom(name, split):
        return
    raise BadInputError(
        f"dataset {source!r} is a single file, which has no {split!r} split: a file is the "
        "train split unless its name says otherwise. Give the file of that split, or a "
        "directory with one file per split (train.jsonl, test.jsonl), and no split to train "
        "on the whole file"
    )
