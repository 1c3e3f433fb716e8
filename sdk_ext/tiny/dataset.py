"""The tiny instruction dataset: deterministic alpaca-schema rows of simple, learnable tasks.

Its text is also what the tiny tokenizers learn their vocabularies from (``tiny_corpus``).
"""

from __future__ import annotations

import json
import random
from pathlib import Path

from tunepack.core import durable
from tunepack.core.errors import BadValueError

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


# Each task gives (instruction, input, right answer, the question's own subject): a preference
# pair rejects an answer that only repeats the subject, the usual failure of an untrained model.
def _reverse(rng: random.Random) -> tuple[str, str, str, str]:
    word = rng.choice(_WORDS)
    return "Reverse the letters of this word.", word, word[::-1], word


def _uppercase(rng: random.Random) -> tuple[str, str, str, str]:
    word = rng.choice(_WORDS)
    return "Write this word in capital letters.", word, word.upper(), word


def _add(rng: random.Random) -> tuple[str, str, str, str]:
    a, b = rng.randint(0, 20), rng.randint(0, 20)
    return f"What is {a} plus {b}?", "", str(a + b), f"{a} plus {b}"


def _capital(rng: random.Random) -> tuple[str, str, str, str]:
    country, capital = rng.choice(_CAPITALS)
    return f"What is the capital of {country}?", "", capital, country


def _antonym(rng: random.Random) -> tuple[str, str, str, str]:
    pair = rng.choice(_ANTONYMS)
    # Both directions, so the task is symmetric and twice as varied.
    word, opposite = pair if rng.random() < 0.5 else pair[::-1]
    return "Give the opposite of this word.", word, opposite, word


_TASKS = (_reverse, _uppercase, _add, _capital, _antonym)


def check_int(name: str, value: object, minimum: int | None = None) -> int:
    # bool is an int subclass; True rows is almost certainly a mistake.
    if not isinstance(value, int) or isinstance(value, bool):
        raise BadValueError(f"{name} must be an integer, got {value!r}")
    if minimum is not None and value < minimum:
        raise BadValueError(f"{name} must be at least {minimum}, got {value}")
    return value


def tiny_dataset_rows(rows: int = 256, seed: int = 0) -> list[dict[str, str]]:
    """Return the tiny instruction dataset as alpaca rows (``instruction``, ``input``, ``output``).

    Tasks take turns so every task is equally represented whatever ``rows`` is.
    """
    return [{k: row[k] for k in ("instruction", "input", "output")} for row in _rows(rows, seed)]


def tiny_preference_rows(rows: int = 64, seed: int = 0) -> list[dict[str, str]]:
    """The tiny dataset as preference rows (``prompt``, ``chosen``, ``rejected``): the right
    answer is chosen; an answer that only repeats the question's subject (the word, the country,
    the sum) is rejected.

    A wrong answer of the same kind (another row's right answer) would make the pairs learnable
    only by tying each answer to its question, which a tiny random model does not learn in a
    quickstart-size run: DPO would stay at chance there. Parroting is learnable at DPO's own rate.
    """
    pairs = []
    for row in _rows(rows, seed):
        prompt = row["instruction"] + (f"\n\n{row['input']}" if row["input"] else "")
        pairs.append({"prompt": prompt, "chosen": row["output"], "rejected": row["subject"]})
    return pairs


def tiny_unpaired_rows(rows: int = 64, seed: int = 0) -> list[dict[str, object]]:
    """The tiny preference pairs as unpaired rows for method=kto (``prompt``, ``completion``,
    ``label``): the right answer (desirable) and the subject repeated (undesirable) take turns,
    each prompt appearing once."""
    out = []
    for i, pair in enumerate(tiny_preference_rows(rows, seed)):
        good = i % 2 == 0
        answer = pair["chosen"] if good else pair["rejected"]
        out.append({"prompt": pair["prompt"], "completion": answer, "label": good})
    return out


def tiny_prompt_rows(rows: int = 64, seed: int = 0) -> list[dict[str, str]]:
    """Prompts with verifiable answers for method=grpo (``prompt``, ``answer``): sums of two
    numbers from 0 to 20, asked to be answered with the number alone. ``rewards=numeric`` checks
    the sum; ``rewards=format`` with ``reward_pattern='^[0-9]'`` checks that an answer starts with
    a number, which a tiny random model does now and then, so GRPO has a signal from its first
    steps."""
    check_int("rows", rows, minimum=1)
    rng = random.Random(check_int("seed", seed))
    out = []
    for _ in range(rows):
        a, b = rng.randint(0, 20), rng.randint(0, 20)
        out.append(
            {"prompt": f"What is {a} plus {b}? Answer with the number.", "answer": str(a + b)}
        )
    return out


def _rows(rows: int, seed: int) -> list[dict[str, str]]:
    check_int("rows", rows, minimum=1)
    rng = random.Random(check_int("seed", seed))
    keys = ("instruction", "input", "output", "subject")
    return [dict(zip(keys, _TASKS[i % len(_TASKS)](rng), strict=True)) for i in range(rows)]


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
    return _write_rows(Path(path), tiny_preference_rows(rows, seed))


def write_tiny_prompt_dataset(path: Path, rows: int = 64, seed: int = 0) -> Path:
    """Write ``tiny_prompt_rows`` as JSONL at ``path`` (atomically) and return the path."""
    return _write_rows(Path(path), tiny_prompt_rows(rows, seed))


def write_tiny_unpaired_dataset(path: Path, rows: int = 64, seed: int = 0) -> Path:
    """Write ``tiny_unpaired_rows`` as JSONL at ``path`` (atomically) and return the path."""
    return _write_rows(Path(path), tiny_unpaired_rows(rows, seed))


def _write_rows(path: Path, records: list[dict]) -> Path:
    text = "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records)
    _write_atomic(path, text.encode("utf-8"))
    return path


def _write_atomic(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    durable.write_bytes(path, data)  # world-readable: readers may run as another user
