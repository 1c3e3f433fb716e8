"""The tiny model, tokenizer and dataset load where tunepack needs them, and agree."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tunepack import tiny
from tunepack.core.errors import BadValueError, ConflictError, UnsupportedError
from tunepack.runtimes.catalog import CATALOG

ENTRY = CATALOG["tiny-llama3"]
VOCAB = ENTRY.shape.vocab_size
SAMPLES = (
    "What is the capital of Iceland?",
    "Reykjavík, Bogotá and Brasília: naïve café, 日本語 and 🙂 too!",
    "  spaces\tand\nnew lines\r\n",
    "it's 1234567 o'clock",
)


pytestmark = pytest.mark.usefixtures("no_tiktoken_cache")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return tiny.write_tiny_model(tmp_path_factory.mktemp("tiny") / "model")


@pytest.fixture
def tt_tokenizer(model_dir):
    from torchtune.models.llama3 import llama3_tokenizer

    files = ENTRY.tokenizer.files
    return llama3_tokenizer(
        path=str(model_dir / files["path"]),
        special_tokens_path=str(model_dir / files["special_tokens_path"]),
    )


def test_split_pattern_is_torchtunes():
    from torchtune.models.llama3._tokenizer import CL100K_PATTERN

    assert tiny.SPLIT_PATTERN == CL100K_PATTERN


def test_model_dir_has_catalog_files(model_dir):
    for name in ENTRY.required_files():
        assert (model_dir / name).is_file(), name
    assert not [p for p in model_dir.parent.iterdir() if p.name.startswith(".")], "temp dir left"


def test_torchtune_tokenizer_round_trips(tt_tokenizer):
    assert tt_tokenizer.vocab_size == VOCAB
    assert tt_tokenizer.base_vocab_size == VOCAB - len(tiny.SPECIAL_TOKENS)
    for text in (*SAMPLES, tiny.tiny_corpus()):
        ids = tt_tokenizer.encode(text, add_bos=True, add_eos=True)
        assert ids[0] == tt_tokenizer.bos_id and ids[-1] == tt_tokenizer.eos_id
        assert all(0 <= i < VOCAB for i in ids)
        assert tt_tokenizer.decode(ids) == text
    # The learned merges compress the text they were learned from.
    corpus = tiny.tiny_corpus()
    assert len(tt_tokenizer.encode(corpus)) < len(corpus.encode()) / 2


def test_special_tokens_take_the_last_ids(model_dir, tt_tokenizer):
    added = json.loads((model_dir / "tokenizer.json").read_text())["added_tokens"]
    ids = {token["content"]: token["id"] for token in added}
    assert ids == tiny.special_token_ids(VOCAB)
    assert sorted(ids.values()) == list(range(VOCAB - len(ids), VOCAB))
    assert tt_tokenizer.bos_id == ids["<|begin_of_text|>"]
    assert tt_tokenizer.eos_id == ids["<|end_of_text|>"]
    assert tt_tokenizer.pad_id == ids["<|finetune_right_pad_id|>"]
    config = json.loads((model_dir / "config.json").read_text())
    assert (config["bos_token_id"], config["eos_token_id"]) == (
        tt_tokenizer.bos_id,
        ids["<|end_of_text|>"],
    )


def test_tokenize_messages(tt_tokenizer):
    from torchtune.data import Message

    messages = [
        Message(role="user", content="What is 2 plus 3?", masked=True),
        Message(role="assistant", content="5", masked=False),
    ]
    tokens, mask = tt_tokenizer.tokenize_messages(messages)
    assert len(tokens) == len(mask)
    assert tokens[0] == tt_tokenizer.bos_id and tokens[-1] == tt_tokenizer.eos_id
    assert all(0 <= i < VOCAB for i in tokens)
    assert tt_tokenizer.eot_id in tokens and not all(mask)
    text = tt_tokenizer.decode(tokens, skip_special_tokens=False)
    assert "<|start_header_id|>assistant<|end_header_id|>\n\n5<|eot_id|>" in text


def test_hf_tokenizer_matches_torchtune(model_dir, tt_tokenizer):
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(model_dir)
    for text in (*SAMPLES, *tiny.tiny_corpus().splitlines()):
        ids = tt_tokenizer.encode(text, add_bos=True, add_eos=False)
        assert hf(text)["input_ids"] == ids, text
        assert hf.decode(ids, skip_special_tokens=True) == text

    chat = [{"role": "user", "content": "What is 2 plus 3?"}, {"role": "assistant", "content": "5"}]
    from torchtune.data import Message

    tt_ids, _ = tt_tokenizer.tokenize_messages([Message.from_dict(m) for m in chat])
    hf_ids = hf.apply_chat_template(chat, tokenize=True, return_dict=True)["input_ids"]
    assert hf_ids + [tt_tokenizer.eos_id] == tt_ids


def _load_torchtune_model(model_dir: Path, output_dir: Path):
    from torchtune.models.llama3 import llama3
    from torchtune.training import MODEL_KEY, FullModelHFCheckpointer

    checkpointer = FullModelHFCheckpointer(
        checkpoint_dir=str(model_dir),
        checkpoint_files=list(ENTRY.checkpoint_files),
        model_type=ENTRY.checkpoint_model_type,
        output_dir=str(output_dir),
    )
    model = llama3(**ENTRY.builder_kwargs())
    model.load_state_dict(checkpointer.load_checkpoint()[MODEL_KEY], strict=True)
    return model.eval()


def test_transformers_and_torchtune_give_the_same_logits(model_dir, tt_tokenizer, tmp_path):
    from transformers import LlamaForCausalLM

    hf_model = LlamaForCausalLM.from_pretrained(model_dir).eval()
    tt_model = _load_torchtune_model(model_dir, tmp_path / "out")
    assert hf_model.dtype == torch.float32
    assert hf_model.num_parameters() == ENTRY.parameter_count
    assert sum(p.numel() for p in tt_model.parameters()) == ENTRY.parameter_count

    # Long enough sequences that a wrong q/k layout (RoPE) shows clearly in the logits.
    length = 96
    ids = tt_tokenizer.encode(tiny.tiny_corpus(), add_eos=False)
    tokens = torch.tensor([ids[:length], ids[length : 2 * length]])
    with torch.no_grad():
        hf_logits = hf_model(tokens).logits
        tt_logits = tt_model(tokens)
    assert hf_logits.shape == tt_logits.shape == (2, length, VOCAB)
    # Random weights give logits well away from zero, so a small difference means a match.
    assert hf_logits.abs().max() > 1e-2
    assert (hf_logits - tt_logits).abs().max() < 1e-4


def test_complete_dir_is_left_alone(model_dir):
    before = {p: p.stat().st_mtime_ns for p in (model_dir, *model_dir.rglob("*"))}
    assert tiny.write_tiny_model(model_dir) == model_dir
    after = {p: p.stat().st_mtime_ns for p in (model_dir, *model_dir.rglob("*"))}
    assert after == before


def test_same_seed_same_bytes(model_dir, tmp_path):
    again = tiny.write_tiny_model(tmp_path / "again")
    other = tiny.write_tiny_model(tmp_path / "other", seed=1)
    for name in tiny.MODEL_FILES:
        assert (again / name).read_bytes() == (model_dir / name).read_bytes(), name
    # The seed draws the weights; the tokenizer is the same for every seed.
    weights = "model.safetensors"
    assert (other / weights).read_bytes() != (model_dir / weights).read_bytes()
    tokenizer = "tokenizer.json"
    assert (other / tokenizer).read_bytes() == (model_dir / tokenizer).read_bytes()


def test_empty_dir_is_filled_and_foreign_dir_refused(tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    assert tiny.is_complete_model_dir(tiny.write_tiny_model(empty))

    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("mine")
    with pytest.raises(ConflictError) as err:
        tiny.write_tiny_model(foreign)
    assert str(err.value) == (
        f"{foreign} exists but is not a complete tiny model; remove it or pick another path"
    )
    assert [p.name for p in foreign.iterdir()] == ["notes.txt"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["empty", "foreign"]


@pytest.mark.parametrize(
    ("name", "why"),
    [
        ("qwen2.5-1.5b", "vocab_size 151936 is too large for the tiny tokenizer (at most 1024)"),
        (
            "llama3.1-8b",
            "checkpoint files ('model-00001-of-00004.safetensors', "
            "'model-00002-of-00004.safetensors', 'model-00003-of-00004.safetensors', "
            "'model-00004-of-00004.safetensors') are not one model.safetensors (or its "
            "model.safetensors.index.json); vocab_size 128256 is too large for the tiny "
            "tokenizer (at most 1024)",
        ),
        ("llama3.2-1b", "vocab_size 128256 is too large for the tiny tokenizer (at most 1024)"),
    ],
)
def test_unsuitable_entries_are_refused(tmp_path, name, why):
    with pytest.raises(UnsupportedError) as err:
        tiny.write_tiny_model(tmp_path / "model", entry=CATALOG[name])
    assert str(err.value) == (
        f"cannot write a tiny model for {name!r}: {why}; use a catalog.TINY entry"
    )
    assert list(tmp_path.iterdir()) == []


def _check_answer(row: dict[str, str]) -> str:
    """Check the row's answer where it can be computed; return the row's task."""
    instruction, given, answer = row["instruction"], row["input"], row["output"]
    if instruction.startswith("Reverse"):
        assert answer == given[::-1]
        return "reverse"
    if instruction.startswith("Write this word in capital"):
        assert answer == given.upper()
        return "uppercase"
    if " plus " in instruction:
        a, b = instruction.removeprefix("What is ").removesuffix("?").split(" plus ")
        assert int(answer) == int(a) + int(b)
        return "add"
    if instruction.startswith("What is the capital of"):
        return "capital"
    assert instruction.startswith("Give the opposite") and answer != given
    return "antonym"


def test_dataset_rows_are_correct_and_balanced(tmp_path):
    path = tiny.write_tiny_dataset(tmp_path / "data" / "train.jsonl", rows=50)
    rows = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]
    assert len(rows) == 50
    assert all(list(row) == ["instruction", "input", "output"] for row in rows)
    assert all(isinstance(v, str) and v == v.strip() for row in rows for v in row.values())
    tasks = [_check_answer(row) for row in rows]
    assert {tasks.count(task) for task in set(tasks)} == {10}, "five tasks, ten rows each"
    assert [p.name for p in path.parent.iterdir()] == ["train.jsonl"], "temp file left"


def test_dataset_is_deterministic(tmp_path):
    first = tiny.write_tiny_dataset(tmp_path / "a.jsonl", seed=3).read_bytes()
    second = tiny.write_tiny_dataset(tmp_path / "b.jsonl", seed=3).read_bytes()
    other = tiny.write_tiny_dataset(tmp_path / "c.jsonl", seed=4).read_bytes()
    assert first == second != other
    assert len(first.splitlines()) == 256


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [({"rows": 0}, "rows must be at least 1, got 0"),
     ({"rows": True}, "rows must be an integer, got True"),
     ({"seed": "x"}, "seed must be an integer, got 'x'")],
)  # fmt: skip
def test_dataset_bad_arguments(tmp_path, kwargs, message):
    with pytest.raises(BadValueError) as err:
        tiny.write_tiny_dataset(tmp_path / "d.jsonl", **kwargs)
    assert str(err.value) == message
    assert list(tmp_path.iterdir()) == []


# --- the tiny models the CLI writes, and the picture dataset -----------------------------------


def test_tiny_model_help_lists_each_model_and_its_runtime(capsys, monkeypatch):
    from tunepack.cli import main

    monkeypatch.setenv("COLUMNS", "400")  # no line breaks inside a runtime's name
    with pytest.raises(SystemExit) as done:
        main(["tiny-model", "--help"])
    assert done.value.code == 0
    text = " ".join(capsys.readouterr().out.split())
    assert "--model {tiny-llama3,tiny-llama3.2-vision}" in text
    assert "tiny-llama3: for --runtime tunepack-tiny-llama3," in text
    assert (
        "tiny-llama3.2-vision: for --runtime tunepack-llama3.2-vision-11b, "
        "method=full, lora, qlora, dora"
    ) in text


def test_tiny_model_says_which_runtime_and_methods_it_is_for(model_dir, capsys):
    """The quickstart's model (already written: the directory is left as it is)."""
    from tunepack.cli import main

    assert main(["tiny-model", str(model_dir)]) == 0
    (line,) = capsys.readouterr().out.splitlines()
    prefix = f"tiny model ready at {model_dir} (for --runtime tunepack-tiny-llama3; method="
    assert line.startswith(prefix) and line.endswith(")"), line
    listed = line.removeprefix(prefix).removesuffix(")").split(", ")
    assert {"lora", "dora", "full", "dpo"} <= set(listed) and "qlora" not in listed, listed


def test_the_cli_vision_model_is_indexed_and_nf4_can_quantize_it():
    from tunepack.runtimes import catalog
    from tunepack.tiny import model_files

    tiny = catalog.TINY_MODELS["tiny-llama3.2-vision"]
    assert tiny.entry is catalog.TINY_VISION_NF4 and tiny.entry.shape.nf4_obstacle() is None
    assert catalog.TINY_VISION["mllama"].shape.nf4_obstacle() is not None  # why it exists
    assert tiny.methods == catalog.get(tiny.runtime).methods == ("full", "lora", "qlora", "dora")
    files = tiny.entry.required_files()
    assert "model.safetensors.index.json" in files and set(files) <= set(model_files(tiny.entry))


def test_image_dataset_rows_match_their_pictures(tmp_path):
    from PIL import Image

    from tunepack.tiny.pictures import COLORS, SIZES, write_tiny_image_dataset

    path = write_tiny_image_dataset(tmp_path / "pics-data", rows=13, seed=1)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["pics-data"], "temp dir left"
    rows = [json.loads(line) for line in (path / "train.jsonl").read_text().splitlines()]
    assert len(rows) == 13 and len(list((path / "pics").iterdir())) == 13
    kinds = []
    for n, row in enumerate(rows):
        user, answer = row["messages"]
        shape = user["content"][1]["text"].removeprefix("What color is the ").removesuffix("?")
        color = answer["content"].removeprefix(f"The {shape} is ").removesuffix(".")
        image = Image.open(path / row["images"][0])
        assert user["content"][0] == {"type": "image"} and image.size == SIZES[n % len(SIZES)]
        w, h = image.size
        assert image.getpixel((w // 2, h // 2)) == COLORS[color]  # the answer is the picture's
        corner = image.getpixel((w // 5 + 1, h // 5 + 1))  # inside a square, outside a circle
        assert (corner == COLORS[color]) == (shape == "square"), (n, shape, corner)
        kinds.append((shape, color))
    assert len(set(kinds[:6])) == len(set(kinds[6:12])) == 6, "each six rows hold every kind"


def test_image_dataset_is_deterministic_and_refuses_another_directory(tmp_path):
    from tunepack.tiny.pictures import write_tiny_image_dataset

    def files(path):
        return {p.relative_to(path): p.read_bytes() for p in path.rglob("*") if p.is_file()}

    first = files(write_tiny_image_dataset(tmp_path / "a", rows=12))
    assert files(write_tiny_image_dataset(tmp_path / "b", rows=12)) == first
    assert files(write_tiny_image_dataset(tmp_path / "c", rows=12, seed=1)) != first
    write_tiny_image_dataset(tmp_path / "a", rows=12)  # the same dataset again: left as it is
    with pytest.raises(ConflictError) as err:
        write_tiny_image_dataset(tmp_path / "a", rows=6)
    assert str(err.value) == (
        f"{tmp_path / 'a'} is not empty (nor the dataset these arguments write); give a new or "
        "empty directory for the image dataset"
    )
    assert files(tmp_path / "a") == first
    with pytest.raises(BadValueError) as err:
        write_tiny_image_dataset(tmp_path / "d", rows=0)
    assert str(err.value) == "rows must be at least 1, got 0"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a", "b", "c"]


def test_image_dataset_without_pillow_is_one_line(tmp_path, monkeypatch, capsys):
    import sys

    from tunepack.cli import main

    monkeypatch.setitem(sys.modules, "PIL", None)  # import PIL raises ImportError
    assert main(["tiny-dataset", "--images", str(tmp_path / "d")]) == 65
    (line,) = capsys.readouterr().err.splitlines()
    assert line == (
        "tunepack: error: the tiny image dataset is drawn with Pillow, which is not installed: "
        "pip install 'tunepack[vision]' (make dev has it)"
    )
    assert list(tmp_path.iterdir()) == []


def test_vision_model_without_transformers_is_one_line(tmp_path, monkeypatch, capsys):
    import sys

    from tunepack.cli import main

    monkeypatch.setitem(sys.modules, "transformers", None)
    argv = ["tiny-model", str(tmp_path / "m"), "--model", "tiny-llama3.2-vision"]
    assert main(argv) == 65
    (line,) = capsys.readouterr().err.splitlines()
    assert line == (
        "tunepack: error: writing tiny-llama3.2-vision needs transformers (its Llama 3.2 Vision "
        "model is transformers' own class), which is not installed: pip install transformers "
        "'tunepack[vision]' (make dev has both)"
    )
    assert list(tmp_path.iterdir()) == []
