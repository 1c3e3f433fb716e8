"""Dataset schemas: detecting them, checking every row, and normalizing what the trainer reads.

The schemas, what a row holds and what it is written as: docs/initializers.md, "Datasets".
``DATASET_SCHEMA`` picks one, else the first row decides; ``COLUMN_MAP`` renames columns first."""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from dataclasses import dataclass, fields

from tunepack.core import workspace
from tunepack.core.durable import size_text
from tunepack.core.errors import BadDatasetError, BadValueError, ConflictError
from tunepack.initializers.data.formats import json_type
from tunepack.runtimes import catalog, methods

SCHEMA_ENV = "DATASET_SCHEMA"
COLUMN_MAP_ENV = "COLUMN_MAP"
# Who set them, so that messages name them as that caller wrote them: the ``tunepack`` command
# sets it to ``cli`` (its flags --dataset, --model, --column-map, --dataset-schema); unset, the
# variables themselves.
SPELLING_ENV = "TUNEPACK_SPELLING"
# With ``cli``: the variables among SPELLED that the step took from the environment of the
# command that ran it (a COLUMN_MAP exported in the shell), not from its flags, as a comma list.
# Messages name those as the variables they are: the user never passed the flag.
INHERITED_ENV = "TUNEPACK_INHERITED"
SPELLED = (workspace.STORAGE_URI_ENV, COLUMN_MAP_ENV, SCHEMA_ENV)


@dataclass(frozen=True)
class Spelling:
    """How a caller names the initializers' settings: container variables or CLI flags."""

    column_map: str
    schema: str
    dataset: str = workspace.STORAGE_URI_ENV  # the dataset initializer's source
    model: str = workspace.STORAGE_URI_ENV  # the model initializer's source

    def given(self, name: str, raw: str) -> str:
        """``COLUMN_MAP='x'`` (a variable) or ``--column-map 'x'`` (a flag)."""
        return f"{name} {raw!r}" if name.startswith("--") else f"{name}={raw!r}"


VARIABLES = Spelling(COLUMN_MAP_ENV, SCHEMA_ENV)
FLAGS = Spelling("--column-map", "--dataset-schema", "--dataset", "--model")


def spelling() -> Spelling:
    """The caller's names for the settings, from ``TUNEPACK_SPELLING``: the CLI's flags, but a
    variable the step inherited (``TUNEPACK_INHERITED``) by its own name."""
    if os.environ.get(SPELLING_ENV, "").strip() != "cli":
        return VARIABLES
    inherited = {name.strip() for name in os.environ.get(INHERITED_ENV, "").split(",")}
    names = {}
    for field in fields(Spelling):
        variable = getattr(VARIABLES, field.name)
        names[field.name] = variable if variable in inherited else getattr(FLAGS, field.name)
    return Spelling(**names)


ROLES = ("system", "user", "assistant")
SHAREGPT_ROLES = {
    "system": "system",
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "assistant": "assistant",
}

Normalized = tuple[dict | None, str | None]  # (the row to write, or the problem)
# The largest row (its normalized JSON line): 1 MiB, or 8 bytes per token of the model's context
# window where that is more. Tokens average about 4 bytes of text, so a larger row is longer
# than any max_seq_len the model takes, and the trainer would train on its beginning only.
MAX_ROW_BYTES = 1 << 20
ROW_BYTES_PER_TOKEN = 8


def max_row_bytes() -> int:
    """The row size limit for the model ``TUNEPACK_MODEL`` names (1 MiB when none is named)."""
    model = os.environ.get(workspace.MODEL_ENV, "").strip().removeprefix(catalog.RUNTIME_PREFIX)
    entry = catalog.CATALOG.get(model)  # an unknown model is the model initializer's to refuse
    return max(MAX_ROW_BYTES, ROW_BYTES_PER_TOKEN * (entry.shape.max_seq_len if entry else 0))


def row_size_problem(size: int, limit: int) -> str | None:
    """The problem with a row of ``size`` bytes (normalized), or None."""
    if size <= limit:
        return None
    return (
        f"the row is {size_text(size)}, more than the {size_text(limit)} a row may hold (the "
        "trainer reads at most max_seq_len tokens of it); split it into shorter rows or remove it"
    )


@dataclass(frozen=True)
class Schema:
    name: str
    output: str  # the schema the trainer reads (manifest "schema")
    marker: str  # the field whose presence identifies the schema
    hint: str
    normalize: Callable[[dict, bool], Normalized]


def _string_field(row: dict, field: str, required: bool = True) -> str | None:
    """The problem with ``row[field]`` as a string field, or None."""
    if field not in row or (not required and row[field] is None):
        return f"field {field!r} is missing" if required else None
    if not isinstance(row[field], str):
        return f"field {field!r} must be a string, got {json_type(row[field])}"
    return None


def _instruction(row: dict, text_cells: bool) -> Normalized:
    for field in ("instruction", "output"):
        if problem := _string_field(row, field):
            return None, problem
    if problem := _string_field(row, "input", required=False):
        return None, problem
    # One fixed shape for every row: extra fields dropped, a missing or null input becomes "".
    return {
        "instruction": row["instruction"],
        "input": row.get("input") or "",
        "output": row["output"],
    }, None


def _turns(row: dict, field: str, text_cells: bool) -> tuple[list | None, str | None]:
    if field not in row:
        return None, f"field {field!r} is missing"
    value = row[field]
    if text_cells and isinstance(value, str):
        # CSV cells are text; a conversation column holds its turns as JSON.
        try:
            value = json.loads(value)
        except json.JSONDecodeError as error:
            return None, f"field {field!r} is not a JSON array ({error.msg})"
    if not isinstance(value, list):
        return None, f"field {field!r} must be an array, got {json_type(value)}"
    if not value:
        return None, f"field {field!r} is empty"
    return value, None


def _messages(
    turns: list, field: str, role_key: str, text_key: str, roles: dict, learn: bool = True
) -> Normalized:
    messages = []
    for index, turn in enumerate(turns):
        where = f"{field}[{index}]"
        if not isinstance(turn, dict):
            return None, (
                f"{where}: expected an object with {role_key!r} and {text_key!r}, got "
                f"{json_type(turn)}"
            )
        role = turn.get(role_key)
        if role not in roles:
            allowed = ", ".join(roles)
            if role is None:
                return None, f"{where}: field {role_key!r} is missing (one of {allowed})"
            return None, f"{where}: {role_key} {role!r} is not one of {allowed}"
        content = turn.get(text_key)
        if not isinstance(content, str):
            return None, f"{where}: field {text_key!r} must be a string, got {json_type(content)}"
        messages.append({"role": roles[role], "content": content})
    if learn and not any(m["role"] == "assistant" for m in messages):
        return None, f"field {field!r} has no assistant turn, so there is nothing to learn"
    return {"messages": messages}, None


def _chat(row: dict, text_cells: bool) -> Normalized:
    turns, problem = _turns(row, "messages", text_cells)
    if problem:
        return None, problem
    return _messages(turns, "messages", "role", "content", {r: r for r in ROLES})


def _sharegpt(row: dict, text_cells: bool) -> Normalized:
    turns, problem = _turns(row, "conversations", text_cells)
    if problem:
        return None, problem
    return _messages(turns, "conversations", "from", "value", SHAREGPT_ROLES)


def _text(row: dict, text_cells: bool) -> Normalized:
    if problem := _string_field(row, "text"):
        return None, problem
    if not row["text"].strip():
        return None, "field 'text' is empty"
    return {"text": row["text"]}, None


def _preference(row: dict, text_cells: bool) -> Normalized:
    """Prompt/chosen/rejected strings, or chosen/rejected conversations (an optional prompt as
    a string or turns before them): both become conversations that differ only in the answer."""
    if "chosen" not in row or "rejected" not in row:
        missing = "chosen" if "chosen" not in row else "rejected"
        return None, f"field {missing!r} is missing"
    strings = [isinstance(row[side], str) for side in ("chosen", "rejected")]
    if strings == [True, False] or strings == [False, True]:
        kinds = " and ".join(json_type(row[side]) for side in ("chosen", "rejected"))
        return None, f"'chosen' and 'rejected' must both be strings or both arrays, got {kinds}"
    if all(strings):
        if problem := _string_field(row, "prompt"):
            return None, problem
        prompt = [{"role": "user", "content": row["prompt"]}]
        answers = {
            side: [{"role": "assistant", "content": row[side]}] for side in ("chosen", "rejected")
        }
    else:
        prompt = []
        if "prompt" in row and row["prompt"] is not None:
            if isinstance(row["prompt"], str):
                prompt = [{"role": "user", "content": row["prompt"]}]
            else:
                turns, problem = _turns(row, "prompt", text_cells)
                if problem:
                    return None, problem
                normalized, problem = _chat_turns(turns, "prompt")
                if problem:
                    return None, problem
                prompt = normalized["messages"]
        answers = {}
        for side in ("chosen", "rejected"):
            turns, problem = _turns(row, side, text_cells)
            if problem:
                return None, problem
            normalized, problem = _chat_turns(turns, side)
            if problem:
                return None, problem
            answers[side] = normalized["messages"]
            if answers[side][-1]["role"] != "assistant":
                return None, f"field {side!r} must end with an assistant turn"
        if prompt and any(m["role"] == "user" for m in answers["chosen"]):
            # Conversations that hold their prompt already (as in UltraFeedback binarized, next
            # to a 'prompt' column that repeats it): the prompt is not added a second time.
            if not _holds_prompt(answers["chosen"], prompt, isinstance(row["prompt"], str)):
                return None, (
                    "'chosen' and 'rejected' hold user turns of their own and 'prompt' is not "
                    "among them: leave out 'prompt', or give only the answers in them"
                )
            prompt = []
    chosen, rejected = prompt + answers["chosen"], prompt + answers["rejected"]
    if chosen[:-1] != rejected[:-1]:
        return None, (
            "'chosen' and 'rejected' must be the same conversation up to their last "
            "(assistant) turn"
        )
    if chosen[-1] == rejected[-1]:
        return None, "'chosen' and 'rejected' are the same answer, so there is no preference"
    if not any(m["role"] == "user" for m in chosen):
        return None, "the conversation has no user turn (or 'prompt') before the answers"
    return {"chosen": chosen, "rejected": rejected}, None


def _prompt(row: dict, text_cells: bool) -> Normalized:
    """A prompt to sample answers to (a string, or turns that end with the user's), and an
    optional reference answer (a string or a number) for the rewards that check it."""
    if "prompt" not in row:
        return None, "field 'prompt' is missing"
    if isinstance(row["prompt"], str):
        if not row["prompt"].strip():
            return None, "field 'prompt' is empty"
        messages = [{"role": "user", "content": row["prompt"]}]
    else:
        turns, problem = _turns(row, "prompt", text_cells)
        if problem:
            return None, problem
        normalized, problem = _chat_turns(turns, "prompt")
        if problem:
            return None, problem
        messages = normalized["messages"]
        if messages[-1]["role"] != "user":
            return None, "field 'prompt' must end with a user turn (the answer is sampled)"
    answer = row.get("answer")
    if isinstance(answer, bool) or not (answer is None or isinstance(answer, str | int | float)):
        return None, f"field 'answer' must be a string or a number, got {json_type(answer)}"
    if isinstance(answer, float) and answer != answer:
        return None, "field 'answer' is NaN"
    return {"messages": messages, "answer": None if answer is None else str(answer)}, None


_LABELS = {"true": True, "1": True, "yes": True, "false": False, "0": False, "no": False}


def _unpaired(row: dict, text_cells: bool) -> Normalized:
    """One answer to a prompt and whether it is desirable: a conversation ending with the
    answer, and its label."""
    for field in ("prompt", "completion"):
        if problem := _string_field(row, field):
            return None, problem
        if not row[field].strip():
            return None, f"field {field!r} is empty"
    if "label" not in row:
        return None, "field 'label' is missing"
    label = row["label"]
    if text_cells and isinstance(label, str) and label.strip().lower() in _LABELS:
        label = _LABELS[label.strip().lower()]  # a CSV cell
    if not isinstance(label, bool):
        return None, (
            f"field 'label' must be true (a desirable answer) or false, got {json_type(label)}"
        )
    messages = [
        {"role": "user", "content": row["prompt"]},
        {"role": "assistant", "content": row["completion"]},
    ]
    return {"messages": messages, "label": label}, None


def _holds_prompt(conversation: list, prompt: list, single: bool) -> bool:
    """Whether a conversation already holds ``prompt``: a prompt string as one of its user turns,
    prompt turns as its first turns."""
    if single:
        return any(m == prompt[0] for m in conversation[:-1])
    return conversation[: len(prompt)] == prompt


def _image_chat(row: dict, text_cells: bool) -> Normalized:
    """Chat turns whose contents are a string or parts ({"type": "text", "text": ...} or
    {"type": "image"}), and ``images``: one entry per image part, in order (resolved and checked
    by the dataset initializer, ``tunepack.initializers.data.images``)."""
    turns, problem = _turns(row, "messages", text_cells)
    if problem:
        return None, problem
    images = row.get("images")
    if images is None:
        return None, "field 'images' is missing"
    if isinstance(images, str | dict):
        images = [images]  # one image
    if not isinstance(images, list):
        return None, f"field 'images' must be an array, got {json_type(images)}"
    messages, placeholders = [], 0
    for index, turn in enumerate(turns):
        where = f"messages[{index}]"
        if not isinstance(turn, dict):
            return None, (
                f"{where}: expected an object with 'role' and 'content', got {json_type(turn)}"
            )
        role = turn.get("role")
        if role not in ROLES:
            return None, f"{where}: role {role!r} is not one of {', '.join(ROLES)}"
        content = turn.get("content")
        if isinstance(content, str):
            content = [{"type": "text", "text": content}]
        if not isinstance(content, list) or not content:
            return None, (
                f"{where}: field 'content' must be a string or an array of parts, got "
                f"{json_type(content)}"
            )
        parts = []
        for at, part in enumerate(content):
            kind = part.get("type") if isinstance(part, dict) else None
            if kind == "text" and isinstance(part.get("text"), str):
                parts.append({"type": "text", "text": part["text"]})
            elif kind == "image":
                if role != "user":
                    return None, f"{where}: a {role} turn holds an image; images go in user turns"
                parts.append({"type": "image"})
                placeholders += 1
            else:
                return None, (
                    f"{where}.content[{at}]: expected {{'type': 'text', 'text': <string>}} or "
                    "{'type': 'image'}"
                )
        messages.append({"role": role, "content": parts})
    if not any(m["role"] == "assistant" for m in messages):
        return None, "field 'messages' has no assistant turn, so there is nothing to learn"
    if placeholders != len(images):
        return None, (
            f"the messages hold {placeholders} image part(s) ({{'type': 'image'}}) but 'images' "
            f"has {len(images)}; give one image per part, in order"
        )
    return {"messages": messages, "images": images}, None


def _chat_turns(turns: list, field: str) -> Normalized:
    return _messages(turns, field, "role", "content", {r: r for r in ROLES}, learn=False)


SCHEMAS: dict[str, Schema] = {
    s.name: s
    for s in (
        Schema(
            "instruction",
            "instruction",
            "instruction",
            "each row must be a JSON object with string fields 'instruction' and 'output' and "
            "an optional string 'input'",
            _instruction,
        ),
        Schema(
            "chat",
            "chat",
            "messages",
            "each row must hold 'messages': an array of objects with 'role' (system, user or "
            "assistant) and string 'content', with at least one assistant turn",
            _chat,
        ),
        Schema(
            "sharegpt",
            "chat",
            "conversations",
            "each row must hold 'conversations': an array of objects with 'from' (system, "
            "human or gpt) and string 'value', with at least one gpt turn",
            _sharegpt,
        ),
        Schema("text", "text", "text", "each row must hold a non-empty string field 'text'", _text),
        Schema(
            "preference",
            "preference",
            "chosen",
            "each row must hold string fields 'prompt', 'chosen' and 'rejected', or 'chosen' and "
            "'rejected' as arrays of objects with 'role' (system, user or assistant) and string "
            "'content' that share every turn but their last, an assistant turn",
            _preference,
        ),
        Schema(
            "prompt",
            "prompt",
            "prompt",
            "each row must hold 'prompt', a string or an array of objects with 'role' (system, "
            "user or assistant) and string 'content' ending with a user turn, and optionally "
            "'answer', a string or a number",
            _prompt,
        ),
        Schema(
            "image_chat",
            "image_chat",
            "images",
            "each row must hold 'messages' (objects with 'role' and 'content', a string or an "
            "array of {'type': 'text', 'text': ...} and {'type': 'image'} parts, images in user "
            "turns, at least one assistant turn) and 'images', one path inside the dataset, "
            "URL or embedded image per image part",
            _image_chat,
        ),
        Schema(
            "unpaired",
            "unpaired",
            "label",
            "each row must hold string fields 'prompt' and 'completion' and a boolean 'label' "
            "(true: the completion is a desirable answer)",
            _unpaired,
        ),
    )
}
# Detection order: the most specific marker first ("text" is a common extra column; preference
# rows have a 'prompt' too; image-text rows have 'messages' too).
_DETECT = (
    "preference", "image_chat", "chat", "sharegpt", "instruction", "unpaired", "prompt", "text",
)  # fmt: skip


def requested() -> Schema | None:
    """The schema named by ``DATASET_SCHEMA``, or None to detect it."""
    return parse_schema(os.environ.get(SCHEMA_ENV, ""), spelling())


def parse_schema(raw: str, names: Spelling = VARIABLES) -> Schema | None:
    """A ``DATASET_SCHEMA`` value: the schema it names, or None (``auto``, empty) to detect it;
    ``names``: the caller's name for the setting, for the message."""
    key = raw.strip().lower()
    if key in ("", "auto"):
        return None
    if key == "alpaca":
        key = "instruction"
    if key not in SCHEMAS:
        raise BadValueError(
            f"{names.given(names.schema, raw.strip())} is not a dataset schema; use one of "
            f"{', '.join(SCHEMAS)} or auto"
        )
    return SCHEMAS[key]


def detect(row: object, source: str) -> Schema:
    """The schema of a dataset, from its first decodable row."""
    if isinstance(row, dict):
        for name in _DETECT:
            if SCHEMAS[name].marker in row:
                return SCHEMAS[name]
        fields = ", ".join(repr(k) for k in list(row)[:8]) or "no fields"
        problem = f"its first row has {fields}"
    else:
        problem = f"its first row is a JSON {json_type(row)}, not an object"
    raise BadDatasetError(
        f"cannot tell the schema of dataset {source!r}: {problem}. Rows need 'instruction' and "
        f"'output' (instruction), 'messages' (chat), 'messages' and 'images' (image_chat), "
        f"'conversations' (sharegpt), 'text', "
        f"'chosen' and 'rejected' (preference), 'prompt' and 'completion' and 'label' "
        f"(unpaired), or 'prompt' (prompt); "
        f"rename columns with {_example(spelling())} or set {spelling().schema}"
    )


def check_method(method: str | None, schema: str) -> None:
    """``ConflictError`` (exit 65) naming the method, the schema and what the method needs,
    unless ``method`` learns from rows of ``schema`` (a ``Schema.output``, the schema the trainer
    reads; None: the method is not known): the trainer's refusal, said where the schema is first
    known (at submission, in the dataset initializer) rather than after both initializers ran."""
    if method is None:
        return
    record = methods.get(method)
    if schema not in record.data.schemas:
        raise ConflictError(methods.wrong_data_message(record, schema))


def _example(names: Spelling) -> str:
    return names.given(names.column_map, "from:to,...").replace("'", "")


def column_map() -> dict[str, str]:
    """``COLUMN_MAP`` as {source column: schema field}."""
    return parse_column_map(os.environ.get(COLUMN_MAP_ENV, ""), spelling())


def parse_column_map(raw: str, names: Spelling = VARIABLES) -> dict[str, str]:
    """A ``COLUMN_MAP`` value as {source column: schema field}; ``names``: the caller's name for
    the setting, for the messages."""
    raw = raw.strip()
    if not raw:
        return {}
    given = names.given(names.column_map, raw)
    bad = BadValueError(
        f"{given} is not valid: write source:target pairs separated by "
        f"commas (question:instruction,answer:output) or a JSON object of strings"
    )
    if raw.startswith("{"):
        try:
            mapping = json.loads(raw)
        except json.JSONDecodeError:
            raise bad from None
        if not all(isinstance(k, str) and isinstance(v, str) for k, v in mapping.items()):
            raise bad
    else:
        mapping = {}
        for pair in raw.split(","):
            src, sep, dst = (part.strip() for part in pair.partition(":"))
            if not sep or not src or not dst:
                raise bad
            mapping[src] = dst
    targets = list(mapping.values())
    if len(set(targets)) != len(targets):
        raise BadValueError(f"{given} maps two columns to the same field")
    return mapping


MAX_COLUMNS_SHOWN = 20


def absent_columns_message(absent: list[str], columns: list[str], which: str) -> str:
    """The refusal of a column map that names columns (``absent``) the data does not have:
    ``which`` says of which rows (``no row of dataset 'd.jsonl' has``), ``columns`` what they
    have."""
    quoted = [repr(c) for c in absent]
    named = " and ".join([", ".join(quoted[:-1]), quoted[-1]] if len(quoted) > 1 else quoted)
    shown = ", ".join(repr(c) for c in columns[:MAX_COLUMNS_SHOWN])
    if len(columns) > MAX_COLUMNS_SHOWN:
        shown += f" and {len(columns) - MAX_COLUMNS_SHOWN} more"
    plural = "s" if len(absent) > 1 else ""
    return (
        f"{spelling().column_map} names column{plural} {named}, which {which}; its columns are "
        f"{shown or 'none'}"
    )


def rename(row: object, mapping: dict[str, str]) -> object:
    if not mapping or not isinstance(row, dict):
        return row
    renamed = {k: v for k, v in row.items() if k not in mapping}
    for src, dst in mapping.items():
        if src in row:
            renamed[dst] = row[src]
    return renamed
