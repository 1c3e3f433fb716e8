"""``write_tiny_model``: a random tiny model of any catalog family, in its Hugging Face format.

Each family pairs a model format (``tunepack.tiny.hf``) with a tokenizer format
(``tunepack.tiny.bpe`` / ``tunepack.tiny.spm``) whose files are the ones the catalog names for
the family and that torchtune's tokenizer builder for the family loads.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

from tunepack.core import durable
from tunepack.core.errors import ConflictError, NotAvailableError, UnsupportedError
from tunepack.runtimes.catalog import FAMILIES, SAFETENSORS_INDEX, TINY_LLAMA3, Family, ModelEntry
from tunepack.tiny import hf, mllama
from tunepack.tiny.bpe import GptBpeFormat, TiktokenFormat, TokenizerFiles, dump_json
from tunepack.tiny.dataset import check_int
from tunepack.tiny.spm import SentencePieceFormat

TINY_MODEL = TINY_LLAMA3.name
# The tiny corpus supports a few hundred merges; real vocabularies are far beyond it.
MAX_TINY_VOCAB = 1024
WEIGHTS_FILE = "model.safetensors"
TOKENIZER_MODEL_FILE = "original/tokenizer.model"
# Everything write_tiny_model writes for tiny-llama3; see model_files() for any entry.
MODEL_FILES = (
    "config.json",
    "generation_config.json",
    WEIGHTS_FILE,
    TOKENIZER_MODEL_FILE,
    "tokenizer.json",
    "tokenizer_config.json",
    "README.md",
)

# The split of torchtune's GPT2BaseTokenizer (Phi-4), which keeps it inline in __init__; a test
# keeps the two equal. Qwen's is importable: torchtune.models.qwen2._tokenizer.PRETOKENIZE_REGEX.
GPT2_SPLIT_PATTERN = r"""'s|'t|'re|'ve|'m|'ll|'d| ?[\w]+| ?\d+| ?[^\s\w\d]+|\s+(?!\S)|\s+"""
_QWEN_SPLIT_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|"
    r"[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)

_LLAMA_SPM = {"unk_id": 0, "bos_id": 1, "eos_id": 2, "pad_id": -1}
_LLAMA_SPM_FORMAT = SentencePieceFormat(**_LLAMA_SPM, tokenizer_class="LlamaTokenizer")
# Gemma's turn markers are pieces of its SentencePiece model, as in the published tokenizer.
_GEMMA_SPM = SentencePieceFormat(
    pad_id=0, eos_id=1, bos_id=2, unk_id=3, tokenizer_class="GemmaTokenizer",
    user_symbols=("<start_of_turn>", "<end_of_turn>"), dummy_prefix=False,
)  # fmt: skip
_QWEN = {"pattern": _QWEN_SPLIT_PATTERN, "learned_tokens": 352, "bos": None}
_QWEN |= {"eos": "<|im_end|>", "pad": "<|endoftext|>", "normalizer": {"type": "NFC"}}


@dataclass(frozen=True)
class FamilyFormat:
    model: hf.HfFormat
    tokenizer: TiktokenFormat | GptBpeFormat | SentencePieceFormat


# The tiny variants' tokenizer formats, by the name a family's record gives
# (``Family.tiny_tokenizer``, runtimes/families.py).
TOKENIZERS: dict[str, TiktokenFormat | GptBpeFormat | SentencePieceFormat] = {
    "llama_spm": _LLAMA_SPM_FORMAT,
    "tiktoken": TiktokenFormat(),
    "gemma_spm": _GEMMA_SPM,
    # Like the real Phi-3 (32000 pieces, chat tokens from 32000, 32064 embeddings): 32 ids are
    # left for the special tokens and padding.
    "phi3_spm": SentencePieceFormat(
        **_LLAMA_SPM, tokenizer_class="LlamaTokenizer", reserved=32,
        special_tokens="torchtune.models.phi3._tokenizer:PHI3_SPECIAL_TOKENS",
        eos_token="<|endoftext|>"),
    "phi4_bpe": GptBpeFormat(
        canonical="torchtune.models.phi4._tokenizer:PHI4_SPECIAL_TOKENS",
        pattern=GPT2_SPLIT_PATTERN, learned_tokens=352, bos="<|endoftext|>", eos="<|im_end|>",
        pad="<|dummy_85|>"),
    "qwen2_bpe": GptBpeFormat(
        canonical="torchtune.models.qwen2._tokenizer:QWEN2_SPECIAL_TOKENS", **_QWEN),
    "qwen2_5_bpe": GptBpeFormat(
        canonical="torchtune.models.qwen2_5._tokenizer:QWEN2_5_SPECIAL_TOKENS", **_QWEN),
    # Qwen 3 (and Qwen3-MoE: Qwen/Qwen3-30B-A3B's tokenizer.json is the same) keeps Qwen 2.5's
    # vocabulary and special tokens and adds four (Qwen/Qwen3-8B's tokenizer.json, ids
    # 151665-151668), among them the <think> markers of its chat template.
    "qwen3_bpe": GptBpeFormat(
        canonical="torchtune.models.qwen2_5._tokenizer:QWEN2_5_SPECIAL_TOKENS", **_QWEN,
        added=("<tool_response>", "</tool_response>", "<think>", "</think>")),
}  # fmt: skip


def family_format(family: Family) -> FamilyFormat | None:
    """The tiny variant's model and tokenizer formats of ``family``, as its record names them
    (None where it names none)."""
    model = hf.FORMATS.get(family.hf_model_type)
    tokenizer = TOKENIZERS.get(family.tiny_tokenizer)
    return None if model is None or tokenizer is None else FamilyFormat(model, tokenizer)


# Each family's tiny formats, read from the records (tunepack.tiny's name for them).
FORMATS: dict[str, FamilyFormat] = {
    name: fmt for name, family in FAMILIES.items() if (fmt := family_format(family)) is not None
}


def model_files(entry: ModelEntry) -> tuple[str, ...]:
    """Every file write_tiny_model writes for ``entry``; a directory holding all is complete."""
    tokenizer = tuple(entry.tokenizer.files.values())
    index = (SAFETENSORS_INDEX,) if entry.checkpoint_files == (SAFETENSORS_INDEX,) else ()
    if entry.family.reads_images:  # transformers' own files (tunepack.tiny.mllama)
        return (
            "config.json",
            "generation_config.json",
            WEIGHTS_FILE,
            *index,
            *tokenizer,
            "tokenizer_config.json",
            mllama.PREPROCESSOR_FILE,
            "README.md",
        )
    return (
        "config.json",
        "generation_config.json",
        WEIGHTS_FILE,
        *index,
        *tokenizer,
        "tokenizer_config.json",
        "README.md",
    )


# One weights file, alone or with an index naming it for every tensor (as a sharded checkpoint's
# index does: the published runtimes of sharded sizes read their checkpoint through it).
_LAYOUTS = ((WEIGHTS_FILE,), (SAFETENSORS_INDEX,))


def _layout_problem(entry: ModelEntry) -> list[str]:
    if entry.checkpoint_files in _LAYOUTS:
        return []
    return [
        f"checkpoint files {entry.checkpoint_files} are not one {WEIGHTS_FILE} (or its "
        f"{SAFETENSORS_INDEX})"
    ]


def _check_entry(entry: ModelEntry) -> FamilyFormat | None:
    """The tiny writer's limits: single-file checkpoints and shapes the builders can take."""
    s, family = entry.shape, entry.family
    problems = []
    if family.reads_images:
        if family.name != "mllama":
            problems.append(f"family {family.name!r} has no tiny format")
        problems += _layout_problem(entry)
        if problems:
            raise UnsupportedError(
                f"cannot write a tiny model for {entry.name!r}: " + "; ".join(problems)
            )
        return None
    if (fmt := family_format(family)) is None:
        problems.append(f"family {family.name!r} has no tiny format")
    problems += _layout_problem(entry)
    if s.vocab_size > MAX_TINY_VOCAB:
        problems.append(
            f"vocab_size {s.vocab_size} is too large for the tiny tokenizer (at most "
            f"{MAX_TINY_VOCAB}); use a catalog.TINY entry"
        )
    if s.qkv_bias and family.hf_model_type != "qwen2":
        problems.append(f"{family.title} has no q/k/v bias")
    if s.head_dim % 2:
        problems.append(f"head_dim {s.head_dim} must be even (RoPE)")
    if s.num_heads % s.num_kv_heads:
        problems.append("num_heads must be a multiple of num_kv_heads")
    # Gemma always ties its embeddings; others tie only if their builder can.
    always_tied = not family.lora_output
    can_tie = always_tied or "tie_word_embeddings" in family.shape_keywords
    if s.tied_embeddings != always_tied and not (can_tie and not always_tied):
        problems.append(f"{family.title} cannot have tied_embeddings={s.tied_embeddings}")
    if problems:
        raise UnsupportedError(
            f"cannot write a tiny model for {entry.name!r}: " + "; ".join(problems)
        )
    return fmt


def _model_card(entry: ModelEntry, seed: int, tokenizer: TokenizerFiles) -> str:
    s = entry.shape
    return (
        f"# {entry.name}\n\n"
        f"A tiny {entry.family.title}-architecture model with **random weights**, generated "
        f"offline by `tunepack.tiny.write_tiny_model` (seed {seed}). It has not been trained and "
        "produces noise; it exists so the tunepack quickstart and tests run on a CPU without "
        "downloads.\n\n"
        f"- {entry.parameter_count:,} parameters: {s.num_layers} layers, {s.num_heads} heads "
        f"({s.num_kv_heads} key/value, dim {s.head_dim}), width {s.embed_dim}, "
        f"MLP {s.intermediate_dim}\n"
        f"- tokenizer: {s.vocab_size} token ids, {tokenizer.description}\n"
    )


def _write_model_files(
    target: Path, entry: ModelEntry, fmt: FamilyFormat | None, seed: int
) -> None:
    from safetensors.torch import save_file

    if fmt is None:  # a model that reads images: transformers writes it
        tokenizer = mllama.tokenizer_files(entry)
        mllama.write_files(target, entry, tokenizer, seed)
        files = {**tokenizer.files, "README.md": _model_card(entry, seed, tokenizer).encode()}
        for name, data in files.items():
            (target / name).parent.mkdir(parents=True, exist_ok=True)
            (target / name).write_bytes(data)
        _write_index(target, entry)
        for path in (target, *target.rglob("*")):
            os.chmod(path, 0o755 if path.is_dir() else 0o644)
        return

    tokenizer = fmt.tokenizer.write(entry)
    generation = {"bos_token_id": tokenizer.bos_id, "eos_token_id": list(tokenizer.stop_ids)}
    if tokenizer.pad_id is not None:
        generation["pad_token_id"] = tokenizer.pad_id
    files = {
        "config.json": dump_json(fmt.model.config(entry, tokenizer)),
        "generation_config.json": dump_json(generation),
        **tokenizer.files,
        "README.md": _model_card(entry, seed, tokenizer).encode("utf-8"),
    }
    for name, data in files.items():
        (target / name).parent.mkdir(parents=True, exist_ok=True)
        (target / name).write_bytes(data)
    # "format: pt" is the metadata transformers expects of a PyTorch safetensors file.
    save_file(fmt.model.weights(entry, seed), target / WEIGHTS_FILE, {"format": "pt"})
    _write_index(target, entry)
    # Temp files and dirs are private by default; the trainer may run as another user.
    for path in (target, *target.rglob("*")):
        os.chmod(path, 0o755 if path.is_dir() else 0o644)


def _write_index(target: Path, entry: ModelEntry) -> None:
    """For an indexed entry: the index of the one weights file, every tensor in it."""
    if entry.checkpoint_files != (SAFETENSORS_INDEX,):
        return
    from safetensors import safe_open

    with safe_open(target / WEIGHTS_FILE, "pt") as weights:
        weight_map = dict.fromkeys(sorted(weights.keys()), WEIGHTS_FILE)
    (target / SAFETENSORS_INDEX).write_bytes(dump_json({"metadata": {}, "weight_map": weight_map}))


def _needs(entry: ModelEntry) -> None:
    """A model transformers writes (tunepack.tiny.mllama) needs it installed: one line if not."""
    if not entry.family.reads_images:
        return
    try:
        import transformers  # noqa: F401
    except ImportError:
        raise NotAvailableError(
            f"writing {entry.name} needs transformers (its {entry.family.title} model is "
            "transformers' own class), which is not installed: pip install transformers "
            "'tunepack[vision]' (make dev has both)"
        ) from None


def is_complete_model_dir(path: Path, entry: ModelEntry | None = None) -> bool:
    files = model_files(entry or TINY_LLAMA3)
    return all((Path(path) / name).is_file() for name in files)


def write_tiny_model(out_dir: Path, entry: ModelEntry | None = None, seed: int = 0) -> Path:
    """Write a random tiny model of ``entry``'s family (default tiny-llama3) to ``out_dir``.

    The directory is built beside ``out_dir`` and renamed into place, so ``out_dir`` is either
    absent or complete; a complete one is left as it is.
    """
    out_dir = Path(out_dir)
    entry = TINY_LLAMA3 if entry is None else entry
    check_int("seed", seed)
    fmt = _check_entry(entry)
    if is_complete_model_dir(out_dir, entry):
        return out_dir
    _needs(entry)
    if out_dir.exists() and (not out_dir.is_dir() or any(out_dir.iterdir())):
        raise ConflictError(
            f"{out_dir} exists but is not a complete tiny model; remove it or pick another path"
        )
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.", suffix=".tmp", dir=out_dir.parent))
    try:
        _write_model_files(tmp, entry, fmt, seed)
        try:
            durable.rename_dir(tmp, out_dir)  # replaces an empty directory, not another
        except OSError:
            if not is_complete_model_dir(out_dir, entry):
                raise
            # Another writer finished first; its directory is as good as ours.
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out_dir
