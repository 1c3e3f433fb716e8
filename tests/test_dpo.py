"""Preference tuning (method=dpo): the preference schema, the DPO loss, training, resume, FSDP2."""

from __future__ import annotations

import json

import pytest

from tests.test_dataset_schemas import jsonl, output, run_dataset
from tunepack.errors import EXIT_BAD_INPUT

PAIR = {"prompt": "2+2?", "chosen": "4", "rejected": "5"}
CHAT_PAIR = {
    "chosen": [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4"}],
    "rejected": [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "5"}],
}
NORMALIZED = CHAT_PAIR
PREFERENCE_HINT = (
    "each row must hold string fields 'prompt', 'chosen' and 'rejected', or 'chosen' and "
    "'rejected' as arrays of objects with 'role' (system, user or assistant) and string "
    "'content' that share every turn but their last, an assistant turn"
)


# ------------------------------------------------------------------ the preference schema


def test_prompt_chosen_rejected_rows_become_two_conversations(tmp_path):
    result = run_dataset(tmp_path, jsonl(tmp_path / "p.jsonl", [{**PAIR, "score": 3}]))
    assert result.returncode == 0, result.stderr
    rows, manifest = output(tmp_path)
    assert rows == [NORMALIZED]
    assert (manifest["schema"], manifest["source_schema"], manifest["rows"]) == (
        "preference",
        "preference",
        1,
    )


def test_chat_form_with_a_separate_prompt_and_a_system_turn(tmp_path):
    system = {"role": "system", "content": "Be brief."}
    row = {
        "prompt": [system, {"role": "user", "content": "2+2?"}],
        "chosen": [{"role": "assistant", "content": "4"}],
        "rejected": [{"role": "assistant", "content": "5"}],
    }
    result = run_dataset(tmp_path, jsonl(tmp_path / "p.jsonl", [CHAT_PAIR, row]))
    assert result.returncode == 0, result.stderr
    rows, _ = output(tmp_path)
    assert rows[0] == NORMALIZED
    assert rows[1] == {
        "chosen": [system, *NORMALIZED["chosen"]],
        "rejected": [system, *NORMALIZED["rejected"]],
    }


def test_csv_preference_rows_with_a_column_map(tmp_path):
    (tmp_path / "p.csv").write_text("question,good,bad\n2+2?,4,5\n")
    result = run_dataset(tmp_path, "p.csv", COLUMN_MAP="question:prompt,good:chosen,bad:rejected")
    assert result.returncode == 0, result.stderr
    assert output(tmp_path)[0] == [NORMALIZED]


def _turn(role, content):
    return {"role": role, "content": content}


PREFERENCE_CORPUS = [
    # (id, rows, message for row 2)
    ("missing-rejected", [PAIR, {"prompt": "x", "chosen": "y"}], "field 'rejected' is missing"),
    ("missing-prompt", [PAIR, {"chosen": "y", "rejected": "z"}], "field 'prompt' is missing"),
    (
        "prompt-not-string",
        [PAIR, {"prompt": 3, "chosen": "y", "rejected": "z"}],
        "field 'prompt' must be a string, got number",
    ),
    (
        "mixed-kinds",
        [PAIR, {"prompt": "x", "chosen": "y", "rejected": [_turn("assistant", "z")]}],
        "'chosen' and 'rejected' must both be strings or both arrays, got string and array",
    ),
    (
        "same-answer",
        [PAIR, {"prompt": "x", "chosen": "y", "rejected": "y"}],
        "'chosen' and 'rejected' are the same answer, so there is no preference",
    ),
    (
        "chat-ends-with-user",
        [PAIR, {"chosen": [_turn("user", "x")], "rejected": [_turn("assistant", "z")]}],
        "field 'chosen' must end with an assistant turn",
    ),
    (
        "chat-different-prompts",
        [
            PAIR,
            {
                "chosen": [_turn("user", "x"), _turn("assistant", "y")],
                "rejected": [_turn("user", "other"), _turn("assistant", "z")],
            },
        ],
        "'chosen' and 'rejected' must be the same conversation up to their last (assistant) turn",
    ),
    (
        "chat-bad-role",
        [PAIR, {"chosen": [_turn("bot", "y")], "rejected": [_turn("assistant", "z")]}],
        "chosen[0]: role 'bot' is not one of system, user, assistant",
    ),
    (
        "chat-no-user",
        [PAIR, {"chosen": [_turn("assistant", "y")], "rejected": [_turn("assistant", "z")]}],
        "the conversation has no user turn (or 'prompt') before the answers",
    ),
    (
        "chat-empty",
        [PAIR, {"prompt": "x", "chosen": [], "rejected": [_turn("assistant", "z")]}],
        "field 'chosen' is empty",
    ),
]


@pytest.mark.parametrize(
    ("rows", "problem"),
    [c[1:] for c in PREFERENCE_CORPUS],
    ids=[c[0] for c in PREFERENCE_CORPUS],
)
def test_bad_preference_rows_are_named_by_row_and_field(tmp_path, rows, problem):
    result = run_dataset(tmp_path, jsonl(tmp_path / "d.jsonl", rows))
    assert result.returncode == EXIT_BAD_INPUT, result.stderr
    assert result.stderr == (
        f"dataset-initializer: error: dataset 'd.jsonl' has 1 invalid row; {PREFERENCE_HINT}:\n"
        f"  d.jsonl row 2: {problem}\n"
    )
    assert not (tmp_path / "ws" / "dataset").exists()


def test_forced_preference_schema_on_instruction_rows(tmp_path):
    rows = [{"instruction": "x", "output": "y"}]
    result = run_dataset(tmp_path, jsonl(tmp_path / "d.jsonl", rows), DATASET_SCHEMA="preference")
    assert result.returncode == EXIT_BAD_INPUT
    assert result.stderr.endswith("  d.jsonl row 1: field 'chosen' is missing\n")


def test_tiny_preference_rows_prefer_the_right_answer():
    from tunepack.tiny.dataset import tiny_dataset_rows, tiny_preference_rows

    pairs = tiny_preference_rows(20)
    assert len(pairs) == 20 and all(p["chosen"] != p["rejected"] for p in pairs)
    rows = tiny_dataset_rows(20)
    assert [p["chosen"] for p in pairs] == [r["output"] for r in rows]
    assert json.dumps(pairs) == json.dumps(tiny_preference_rows(20))  # deterministic
