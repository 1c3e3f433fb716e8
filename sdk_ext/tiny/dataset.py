"""Offline generators of a tiny Llama-3 model, its tokenizer and a small instruction dataset.

The quickstart and the tests need a model and a dataset without a GPU or the internet. This module
writes both from nothing:

- ``write_tiny_dataset``: a deterministic alpaca-schema JSONL file of simple, learnable tasks;
- ``write_tiny_model``: an HF-format Llama-3 model directory with random weights (shape from the
  catalog) and a Llama-3-style tiktoken tokenizer whose merges are learned from the dataset text,
  so the vocabulary is small (``shape.vocab_size`` ids, special tokens included).

Everything is seeded: the same arguments give the same bytes.
"""

from __future__ import annotations

import base64
import json
import os
import random
import shutil
import tempfile
from collections import Counter
from pathlib import Path

from tunepack.errors import BadInputError
from tunepack.runtimes.catalog import CATALOG, ModelEntry

TINY_MODEL = "tiny-llama3"

# ---------------------------------------------------------------------------------------------
# Dataset
# ---------------------------------------------------------------------------------------------

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


def _check_int(name: str, value: object, minimum: int | None = None) -> int:
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
    _check_int("rows", rows, minimum=1)
    rng = random.Random(_check_int("seed", seed))
    records = []
    for index in range(rows):
        instruction, input_text, output = _TASKS[index % len(_TASKS)](rng)
        records.append({"instruction": instruction, "input": input_text, "output": output})
    return records


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


def _write_atomic(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.chmod(tmp, 0o644)  # mkstemp creates 0600; readers may run as another user
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


# ---------------------------------------------------------------------------------------------
# Tokenizer
# ---------------------------------------------------------------------------------------------

# The special tokens torchtune's Llama3Tokenizer looks up, and nothing more: the 256 reserved
# tokens of real Llama 3 would not fit a 384-token vocabulary. They take the ids right after
# the BPE ranks, in this order.
SPECIAL_TOKENS = (
    "<|begin_of_text|>",
    "<|end_of_text|>",
    "<|finetune_right_pad_id|>",
    "<|step_id|>",
    "<|start_header_id|>",
    "<|end_header_id|>",
    "<|eom_id|>",
    "<|eot_id|>",
    "<|python_tag|>",
    "<|image|>",
)

# Llama 3's pre-tokenizer split (torchtune's CL100K_PATTERN; a test keeps the two equal).
# Merges are learned within these pieces, exactly as tiktoken applies them.
SPLIT_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)

_CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{{ '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n'"
    " + message['content'] | trim + '<|eot_id|>' }}{% endfor %}"
    "{% if add_generation_prompt %}"
    "{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{% endif %}"
)


def train_bpe(text: str, num_merges: int) -> list[tuple[bytes, bytes]]:
    """Learn up to ``num_merges`` byte-pair merges from ``text``, in order.

    Each merge joins the most frequent adjacent pair (ties: smallest bytes, for determinism)
    into a token that does not exist yet. Fewer come back when the text runs out of pairs.
    """
    import regex  # tiktoken's own dependency; the stdlib re lacks \\p{L}

    pieces = Counter(regex.findall(SPLIT_PATTERN, text))
    words = {tuple(bytes([b]) for b in p.encode("utf-8")): n for p, n in pieces.items()}
    known = {bytes([b]) for b in range(256)}
    merges: list[tuple[bytes, bytes]] = []
    while len(merges) < num_merges:
        pairs: Counter[tuple[bytes, bytes]] = Counter()
        for word, count in words.items():
            for pair in zip(word, word[1:], strict=False):
                if pair[0] + pair[1] not in known:
                    pairs[pair] += count
        if not pairs:
            break
        best = min(pairs, key=lambda pair: (-pairs[pair], pair))
        merges.append(best)
        known.add(best[0] + best[1])
        words = {_apply_merge(word, best): count for word, count in words.items()}
    return merges


def _apply_merge(word: tuple[bytes, ...], pair: tuple[bytes, bytes]) -> tuple[bytes, ...]:
    out: list[bytes] = []
    i = 0
    while i < len(word):
        if i + 1 < len(word) and (word[i], word[i + 1]) == pair:
            out.append(word[i] + word[i + 1])
            i += 2
        else:
            out.append(word[i])
            i += 1
    return tuple(out)


def tiny_tokenizer_ranks(vocab_size: int) -> dict[bytes, int]:
    """tiktoken ranks: the 256 bytes, then merges, leaving room for ``SPECIAL_TOKENS``."""
    _check_int("vocab_size", vocab_size, minimum=256 + len(SPECIAL_TOKENS))
    wanted = vocab_size - 256 - len(SPECIAL_TOKENS)
    merges = train_bpe(tiny_corpus(), wanted)
    if len(merges) < wanted:
        largest = 256 + len(merges) + len(SPECIAL_TOKENS)
        raise BadInputError(
            f"vocab_size {vocab_size} is too large for the tiny tokenizer: its corpus supports "
            f"at most {largest} tokens"
        )
    ranks = {bytes([b]): b for b in range(256)}
    for left, right in merges:
        ranks[left + right] = len(ranks)
    return ranks


def special_token_ids(vocab_size: int) -> dict[str, int]:
    base = vocab_size - len(SPECIAL_TOKENS)
    return {token: base + i for i, token in enumerate(SPECIAL_TOKENS)}


def _tiktoken_file(ranks: dict[bytes, int]) -> bytes:
    lines = (base64.b64encode(token) + b" %d\n" % rank for token, rank in ranks.items())
    return b"".join(lines)


def _byte_to_unicode() -> dict[int, str]:
    """The byte-level alphabet of HF (GPT-2) BPE: printable bytes stay, others shift past 255."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAC + 1), *range(0xAE, 0xFF + 1)]
    mapping = {b: chr(b) for b in printable}
    shifted = [b for b in range(256) if b not in mapping]
    for offset, b in enumerate(shifted):
        mapping[b] = chr(256 + offset)
    return mapping


def _hf_merges(ranks: dict[bytes, int]) -> list[tuple[bytes, bytes]]:
    """Every split of every token into two known tokens, by the token's rank.

    tiktoken merges any adjacent pair whose concatenation is a token, lowest rank first; listing
    all splits in that order makes HF's merge-list BPE make the same choices.
    """
    merges = []
    for token, rank in ranks.items():
        splits = [(token[:i], token[i:]) for i in range(1, len(token))]
        splits = [(a, b) for a, b in splits if a in ranks and b in ranks]
        merges += [(rank, ranks[a], ranks[b], a, b) for a, b in splits]
    return [(a, b) for *_, a, b in sorted(merges)]


def _hf_tokenizer_json(ranks: dict[bytes, int], specials: dict[str, int]) -> dict:
    """A ``tokenizers`` file: torchtune reads ``added_tokens``; transformers and vLLM read all."""
    to_unicode = _byte_to_unicode()

    def render(token: bytes) -> str:
        return "".join(to_unicode[b] for b in token)

    bos = "<|begin_of_text|>"
    added = [
        {"id": i, "content": t, "single_word": False, "lstrip": False, "rstrip": False}
        | {"normalized": False, "special": True}
        for t, i in specials.items()
    ]
    byte_level = {"add_prefix_space": False, "trim_offsets": True, "use_regex": False}
    return {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": added,
        "normalizer": None,
        "pre_tokenizer": {
            "type": "Sequence",
            "pretokenizers": [
                {
                    "type": "Split",
                    "pattern": {"Regex": SPLIT_PATTERN},
                    "behavior": "Isolated",
                    "invert": False,
                },
                {"type": "ByteLevel", **byte_level},
            ],
        },
        # Like Llama 3: encoding a text starts it with <|begin_of_text|>.
        "post_processor": {
            "type": "TemplateProcessing",
            "single": [
                {"SpecialToken": {"id": bos, "type_id": 0}},
                {"Sequence": {"id": "A", "type_id": 0}},
            ],
            "pair": [
                {"SpecialToken": {"id": bos, "type_id": 0}},
                {"Sequence": {"id": "A", "type_id": 0}},
                {"SpecialToken": {"id": bos, "type_id": 1}},
                {"Sequence": {"id": "B", "type_id": 1}},
            ],
            "special_tokens": {bos: {"id": bos, "ids": [specials[bos]], "tokens": [bos]}},
        },
        "decoder": {"type": "ByteLevel", **byte_level},
        "model": {
            "type": "BPE",
            "dropout": None,
            "unk_token": None,
            "continuing_subword_prefix": None,
            "end_of_word_suffix": None,
            "fuse_unk": False,
            "byte_fallback": False,
            # tiktoken returns a whole piece that is a token as is; so does ignore_merges.
            "ignore_merges": True,
            "vocab": {render(t): i for t, i in ranks.items()},
            "merges": [[render(a), render(b)] for a, b in _hf_merges(ranks)],
        },
    }


def _tokenizer_config(max_seq_len: int) -> dict:
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<|begin_of_text|>",
        "eos_token": "<|end_of_text|>",
        "pad_token": "<|finetune_right_pad_id|>",
        "model_max_length": max_seq_len,
        "clean_up_tokenization_spaces": False,
        # The same layout as torchtune's Llama3Tokenizer.tokenize_messages, for serving.
        "chat_template": _CHAT_TEMPLATE,
    }


# ---------------------------------------------------------------------------------------------
# Model
# ---------------------------------------------------------------------------------------------

TOKENIZER_MODEL_FILE = "original/tokenizer.model"
# Everything write_tiny_model writes; a directory holding all of them is complete.
MODEL_FILES = (
    "config.json",
    "generation_config.json",
    "model.safetensors",
    TOKENIZER_MODEL_FILE,
    "tokenizer.json",
    "tokenizer_config.json",
    "README.md",
)
_INIT_STD = 0.02


def _check_entry(entry: ModelEntry) -> None:
    """The writer produces a single-file HF Llama checkpoint with a tiktoken tokenizer."""
    problems = []
    if entry.tokenizer.files.get("path") != TOKENIZER_MODEL_FILE:
        problems.append(f"tokenizer files {entry.tokenizer.files} are not Llama 3's")
    if entry.checkpoint_files != ("model.safetensors",):
        problems.append(f"checkpoint files {entry.checkpoint_files} are not one model.safetensors")
    if entry.shape.qkv_bias:
        problems.append("Llama has no q/k/v bias")
    if entry.shape.embed_dim % entry.shape.num_heads or entry.shape.head_dim % 2:
        problems.append("embed_dim must split into num_heads heads of even size (RoPE)")
    if entry.shape.num_heads % entry.shape.num_kv_heads:
        problems.append("num_heads must be a multiple of num_kv_heads")
    if problems:
        raise BadInputError(f"cannot write a tiny model for {entry.name!r}: " + "; ".join(problems))


def _hf_config(entry: ModelEntry, specials: dict[str, int]) -> dict:
    s = entry.shape
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": s.vocab_size,
        "hidden_size": s.embed_dim,
        "intermediate_size": s.intermediate_dim,
        "num_hidden_layers": s.num_layers,
        "num_attention_heads": s.num_heads,
        "num_key_value_heads": s.num_kv_heads,
        "head_dim": s.head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": s.max_seq_len,
        "initializer_range": _INIT_STD,
        # torchtune's llama3 builder defaults; the two must agree for the same logits.
        "rms_norm_eps": 1e-5,
        "rope_theta": 500000.0,
        "rope_scaling": None,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "mlp_bias": False,
        "tie_word_embeddings": s.tied_embeddings,
        "bos_token_id": specials["<|begin_of_text|>"],
        "eos_token_id": specials["<|end_of_text|>"],
        "torch_dtype": "float32",
        "use_cache": True,
    }


def _generation_config(specials: dict[str, int]) -> dict:
    # Generation stops where torchtune's tokenizer stops: end of text, turn or message.
    stops = ["<|end_of_text|>", "<|eom_id|>", "<|eot_id|>"]
    return {
        "bos_token_id": specials["<|begin_of_text|>"],
        "eos_token_id": [specials[t] for t in stops],
        "pad_token_id": specials["<|finetune_right_pad_id|>"],
    }


def _random_weights(entry: ModelEntry, seed: int) -> dict:
    """HF Llama weights: normal(0, 0.02) matrices and unit norms, like a fresh HF model."""
    import torch

    s = entry.shape
    generator = torch.Generator().manual_seed(seed)

    def normal(rows: int, cols: int) -> torch.Tensor:
        return torch.randn(rows, cols, generator=generator) * _INIT_STD

    d, q_out, kv_out = s.embed_dim, s.num_heads * s.head_dim, s.num_kv_heads * s.head_dim
    weights = {"model.embed_tokens.weight": normal(s.vocab_size, d)}
    for n in range(s.num_layers):
        layer = f"model.layers.{n}"
        weights |= {
            f"{layer}.self_attn.q_proj.weight": normal(q_out, d),
            f"{layer}.self_attn.k_proj.weight": normal(kv_out, d),
            f"{layer}.self_attn.v_proj.weight": normal(kv_out, d),
            f"{layer}.self_attn.o_proj.weight": normal(d, q_out),
            f"{layer}.mlp.gate_proj.weight": normal(s.intermediate_dim, d),
            f"{layer}.mlp.up_proj.weight": normal(s.intermediate_dim, d),
            f"{layer}.mlp.down_proj.weight": normal(d, s.intermediate_dim),
            f"{layer}.input_layernorm.weight": torch.ones(d),
            f"{layer}.post_attention_layernorm.weight": torch.ones(d),
        }
    weights["model.norm.weight"] = torch.ones(d)
    if not s.tied_embeddings:
        weights["lm_head.weight"] = normal(s.vocab_size, d)
    return weights


def _model_card(entry: ModelEntry, seed: int) -> str:
    s = entry.shape
    return (
        f"# {entry.name}\n\n"
        "A tiny Llama-3-architecture model with **random weights**, generated offline by "
        f"`tunepack.tiny.write_tiny_model` (seed {seed}). It has not been trained and produces "
        "noise; it exists so the tunepack quickstart and tests run on a CPU without downloads.\n\n"
        f"- {entry.parameter_count:,} parameters: {s.num_layers} layers, {s.num_heads} heads "
        f"({s.num_kv_heads} key/value), dim {s.embed_dim}, MLP {s.intermediate_dim}\n"
        f"- tokenizer: {s.vocab_size} tokens, byte-level BPE learned from the tiny dataset, "
        "Llama 3 special tokens\n"
    )


def _dump_json(data: dict) -> bytes:
    return (json.dumps(data, indent=2, ensure_ascii=False) + "\n").encode("utf-8")


def _write_model_files(target: Path, entry: ModelEntry, seed: int) -> None:
    from safetensors.torch import save_file

    vocab_size = entry.shape.vocab_size
    specials = special_token_ids(vocab_size)
    ranks = tiny_tokenizer_ranks(vocab_size)
    files = {
        "config.json": _dump_json(_hf_config(entry, specials)),
        "generation_config.json": _dump_json(_generation_config(specials)),
        TOKENIZER_MODEL_FILE: _tiktoken_file(ranks),
        "tokenizer.json": _dump_json(_hf_tokenizer_json(ranks, specials)),
        "tokenizer_config.json": _dump_json(_tokenizer_config(entry.shape.max_seq_len)),
        "README.md": _model_card(entry, seed).encode("utf-8"),
    }
    for name, data in files.items():
        (target / name).parent.mkdir(parents=True, exist_ok=True)
        (target / name).write_bytes(data)
    # "format: pt" is the metadata transformers expects of a PyTorch safetensors file.
    save_file(_random_weights(entry, seed), target / "model.safetensors", {"format": "pt"})
    # Temp files and dirs are private by default; the trainer may run as another user.
    for path in (target, *target.rglob("*")):
        os.chmod(path, 0o755 if path.is_dir() else 0o644)


def is_complete_model_dir(path: Path) -> bool:
    return all((Path(path) / name).is_file() for name in MODEL_FILES)


def write_tiny_model(out_dir: Path, entry: ModelEntry | None = None, seed: int = 0) -> Path:
    """Write a random tiny Llama-3 model in HF format to ``out_dir`` and return it.

    The directory is built beside ``out_dir`` and renamed into place, so ``out_dir`` is either
    absent or complete; a complete one is left as it is.
    """
    out_dir = Path(out_dir)
    entry = CATALOG[TINY_MODEL] if entry is None else entry
    _check_int("seed", seed)
    _check_entry(entry)
    if is_complete_model_dir(out_dir):
        return out_dir
    if out_dir.exists() and (not out_dir.is_dir() or any(out_dir.iterdir())):
        raise BadInputError(
            f"{out_dir} exists but is not a complete tiny model; remove it or pick another path"
        )
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.", suffix=".tmp", dir=out_dir.parent))
    try:
        _write_model_files(tmp, entry, seed)
        try:
            os.rename(tmp, out_dir)  # replaces an empty directory, fails on a non-empty one
        except OSError:
            if not is_complete_model_dir(out_dir):
                raise
            # Another writer finished first; its directory is as good as ours.
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out_dir
