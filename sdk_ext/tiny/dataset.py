"""The tiny instruction dataset: deterministic alpaca-schema rows of simple, learnable tasks.

Its text is also what the tiny tokenizers learn their vocabularies from (``tiny_corpus``).
"""

from __future__ import annotations

import json
import random
from pathlib import Path

from tunepack.core import durable
from tunepack.core.errors import BadInputError

_WORDS = (
    "apple", "river", "stone", "cloud", "green", "house", "light", "music", "paper", "table",
    "water", "bread", "chair", "dream", "earth", "flame", "grape", "horse", "lemon", "mouse",
    "night", "ocean", "piano", "queen", "robot", "sugar", "tiger", "voice", "whale", "zebra",
    "cat", "dog", "sun", "moon", "star", "tree", "bird", "fish", "book", "rain",
)  # fmt: skip

_CAPITALS = (
    ("France", "Paris"), ("Germany", "Berlin"), ("Italy", "Rome"), ("Spain", "Madrid"),
    ("Japan", "Tokyo"), ("Canada", "Ottawa"), ("Egypt", "Cairo"), ("Kenya", "Nairobi"),
    ("Peru", "Lima"), ("Norway", "Oslo"), ("Brazil", "Brasília"), ("Colombia", "Bogotá"),
    ("Iceland", "Reykjavík"), ("Poland", "Warsaw"), ("Greece", "Athens"), ("India", "New Delhi"),
)  # fmt: skip

_ANTONYMS = (
    ("hot", "cold"), ("big", "small"), ("fast", "slow"), ("happy", "sad"), ("light", "dark"),
    ("open", "closed"), ("up", "down"), ("early", "late"), ("full", "empty"), ("hard", "soft"),
    ("old", "new"), ("strong", "weak"), ("high", "low"), ("rich", "poor"), ("wet", "dry"),
)  # fmt: skip

# Role names appear in every chat-formatted sample, so the tokenizer should learn them too.
_CHAT_ROLES = ("system", "user", "assistant", "ipython")


def _reverse(rng: random.Random) -> tuple[str, str, str]:
    word = rng.choice(_WORDS)
    return "Reverse the letters of this word.", word, word[::-1]


def _uppercase(rng: random.Random) -> tuple[str, str, str]:
    word = rng.choice(_WORDS)
    return "Write this word in capital letters.", word, word.upper()


def _add(rng: random.Random) -> tuple[str, str, str]:
    a, b = rng.randint(0, 20), rng.randint(0, 20)
    return f"What is {a} plus {b}?", "", str(a + b)


def _capital(rng: random.Random) -> tuple[str, str, str]:
    country, capital = rng.choice(_CAPITALS)
    return f"What is the capital of {country}?", "", capital


def _antonym(rng: random.Random) -> tuple[str, str, str]:
    pair = rng.choice(_ANTONYMS)
    # Both directions, so the task is symmetric and twice as varied.
    word, opposite = pair if rng.random() < 0.5 else pair[::-1]
    return "Give the opposite of this word.", word, opposite


_TASKS = (_reverse, _uppercase, _add, _capital, _antonym)


def check_int(name: str, value: object, minimum: int | None = None) -> int:
    # bool is an int subclass; True rows is almost certainly a mistake.
    if not isinstance(value, int) or isinstance(value, bool):
        raise BadInputError(f"{name} must be an integer, got {value!r}")
    if minimum is not None and value < minimum:
        raise BadInputError(f"{name} must be at least {minimum}, got {value}")
    return value


def tiny_dataset_rows(rows: int = 256, seed: int = 0) -> list[dict[str, str]]:
    """Return the tiny instruction dataset as alpaca rows (``instruction``, ``input``, ``output``).

    Tasks take turns so every task is equally represented whatever ``rows`` is.
    """
    check_int("rows", rows, minimum=1)
    rng = random.Random(check_int("seed", seed))
    records = []
    for index in range(rows):
        instruction, input_text, output = _TASKS[index % len(_TASKS)](rng)
        records.append({"instruction": instruction, "input": input_text, "output": output})
    return records


def tiny_preference_rows(rows: int = 64, seed: int = 0) -> list[dict[str, str]]:
    """The tiny dataset as preference rows (``prompt``, ``chosen``, ``rejected``): the right
    answer is chosen, another answer to the same kind of task (a wrong one) is rejected."""
    records = tiny_dataset_rows(max(check_int("rows", rows, minimum=1), 2 * len(_TASKS)), seed)
    pairs = []
    for index, row in enumerate(records[:rows]):
        prompt = row["instruction"] + (f"\n\n{row['input']}" if row["input"] else "")
        # The later rows of the same task, then the earlier ones, until one answers differently.
        task = len(_TASKS)
        others = records[index + task :: task] + records[index % task :: task]
        wrong = next(o["output"] for o in others if o["output"] != row["output"])
        pairs.append({"prompt": prompt, "chosen": row["output"], "rejected": wrong})
    return pairs


def tiny_corpus() -> str:
    """The text the tiny tokenizer learns its merges from: the default dataset and role names.

    It is fixed (default rows and seed) so the tokenizer does not change with dataset arguments.
    """
    lines = [field for row in tiny_dataset_rows() for field in row.values() if field]
    return "\n".join([*lines, *_CHAT_ROLES]) + "\n"


def write_tiny_dataset(path: Path, rows: int = 256, seed: int = 0) -> Path:
    """Write the tiny dataset as JSONL at ``path`` (atomically) and return the path."""
    path = Path(path)
    records = tiny_dataset_rows(rows, seed)
    text = "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records)
    _write_atomic(path, text.encode("utf-8"))
    return path


def write_tiny_preference_dataset(path: Path, rows: int = 64, seed: int = 0) -> Path:
    """Write ``tiny_preference_rows`` as JSONL at ``path`` (atomically) and return the path."""
    path = Path(path)
    records = tiny_preference_rows(rows, seed)
    text = "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records)
    _write_atomic(path, text.encode("utf-8"))
    return path


def _write_atomic(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    durable.write_bytes(path, data)  # world-readable: readers may run as another user
