"""Byte-level BPE tokenizers learned from the tiny corpus, as Llama 3 (tiktoken) and GPT-2 style
families (Qwen 2, Qwen 2.5, Phi-4) ship them.

Merges are learned within the family's own pre-tokenizer pieces, so the tokenizer applies them
exactly as learned; each writes a complete ``tokenizer.json``, so transformers and vLLM load the
same tokenizer."""

from __future__ import annotations

import base64
import json
from collections import Counter
from dataclasses import dataclass

from tunepack.core.errors import BadValueError
from tunepack.runtimes.catalog import ModelEntry
from tunepack.runtimes.chat_templates import TEMPLATES
from tunepack.tiny.dataset import check_int, tiny_corpus

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


def chat_template(entry: ModelEntry) -> str:
    """The Jinja chat template of the family's published model, for ``tokenizer_config.json``."""
    return TEMPLATES[entry.family.chat_format]


def train_bpe(
    text: str, num_merges: int, pattern: str = SPLIT_PATTERN
) -> list[tuple[bytes, bytes]]:
    """Learn up to ``num_merges`` byte-pair merges from ``text``, in order.

    ``text`` is first split with the regular expression ``pattern``; merges never cross pieces.
    Each merge joins the most frequent adjacent pair (ties: smallest bytes, for determinism)
    into a token that does not exist yet. Fewer come back when the text runs out of pairs.
    """
    import regex  # tiktoken's own dependency; the stdlib re lacks \\p{L}

    pieces = Counter(regex.findall(pattern, text))
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


def _learn(base_size: int, pattern: str) -> list[tuple[bytes, bytes]]:
    """Exactly ``base_size - 256`` merges, or an error saying how large the corpus allows."""
    wanted = base_size - 256
    merges = train_bpe(tiny_corpus(), wanted, pattern)
    if len(merges) < wanted:
        raise BadValueError(
            f"a vocabulary of {base_size} learned tokens is too large for the tiny tokenizer: "
            f"its corpus supports at most {256 + len(merges)}"
        )
    return merges


def _ranks(merges: list[tuple[bytes, bytes]]) -> dict[bytes, int]:
    """Token -> id: the 256 bytes, then each merge's result in the order learned."""
    ranks = {bytes([b]): b for b in range(256)}
    for left, right in merges:
        ranks[left + right] = len(ranks)
    return ranks


def tiny_tokenizer_ranks(vocab_size: int) -> dict[bytes, int]:
    """tiktoken ranks: the 256 bytes, then merges, leaving room for ``SPECIAL_TOKENS``."""
    check_int("vocab_size", vocab_size, minimum=256 + len(SPECIAL_TOKENS))
    return _ranks(_learn(vocab_size - len(SPECIAL_TOKENS), SPLIT_PATTERN))


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


def _render(token: bytes) -> str:
    to_unicode = _byte_to_unicode()
    return "".join(to_unicode[b] for b in token)


def _all_splits(ranks: dict[bytes, int]) -> list[tuple[bytes, bytes]]:
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


def _added_tokens(specials: dict[str, int]) -> list[dict]:
    return [
        {"id": i, "content": t, "single_word": False, "lstrip": False, "rstrip": False}
        | {"normalized": False, "special": True}
        for t, i in specials.items()
    ]


def _hf_tokenizer_json(
    ranks: dict[bytes, int],
    merges: list[tuple[bytes, bytes]],
    specials: dict[str, int],
    pattern: str,
    *,
    bos: str | None = None,
    normalizer: dict | None = None,
    ignore_merges: bool = False,
) -> dict:
    """A ``tokenizers`` file: torchtune reads ``added_tokens``; transformers and vLLM read all."""
    byte_level = {"add_prefix_space": False, "trim_offsets": True, "use_regex": False}
    data: dict = {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": _added_tokens(specials),
        "normalizer": normalizer,
        "pre_tokenizer": {
            "type": "Sequence",
            "pretokenizers": [
                {
                    "type": "Split",
                    "pattern": {"Regex": pattern},
                    "behavior": "Isolated",
                    "invert": False,
                },
                {"type": "ByteLevel", **byte_level},
            ],
        },
        "post_processor": None,
        "decoder": {"type": "ByteLevel", **byte_level},
        "model": {
            "type": "BPE",
            "dropout": None,
            "unk_token": None,
            "continuing_subword_prefix": None,
            "end_of_word_suffix": None,
            "fuse_unk": False,
            "byte_fallback": False,
            "ignore_merges": ignore_merges,
            "vocab": {_render(t): i for t, i in ranks.items()},
            "merges": [[_render(a), _render(b)] for a, b in merges],
        },
    }
    if bos is not None:  # Like Llama 3: encoding a text starts it with the BOS token.
        bos_token = {"SpecialToken": {"id": bos, "type_id": 0}}
        data["post_processor"] = {
            "type": "TemplateProcessing",
            "single": [bos_token, {"Sequence": {"id": "A", "type_id": 0}}],
            "pair": [
                bos_token,
                {"Sequence": {"id": "A", "type_id": 0}},
                {"SpecialToken": {"id": bos, "type_id": 1}},
                {"Sequence": {"id": "B", "type_id": 1}},
            ],
            "special_tokens": {bos: {"id": bos, "ids": [specials[bos]], "tokens": [bos]}},
        }
    return data


def dump_json(data: dict) -> bytes:
    return (json.dumps(data, indent=2, ensure_ascii=False) + "\n").encode("utf-8")


@dataclass(frozen=True)
class TokenizerFiles:
    """What a tokenizer format writes, and the ids config.json must name."""

    files: dict[str, bytes]  # path relative to the model directory -> content
    bos_id: int | None
    eos_id: int
    pad_id: int | None
    stop_ids: tuple[int, ...]  # generation_config.json eos_token_id
    description: str


@dataclass(frozen=True)
class TiktokenFormat:
    """Llama 3.x: tiktoken ranks + Llama 3 special tokens at the end of the vocabulary.

    ``merges``: merges learned elsewhere, exactly ``vocab_size - 256 - len(SPECIAL_TOKENS)`` of
    them (a realistic vocabulary from a larger corpus); by default they are learned from the tiny
    corpus.
    """

    merges: tuple[tuple[bytes, bytes], ...] | None = None

    def write(self, entry: ModelEntry) -> TokenizerFiles:
        vocab_size = entry.shape.vocab_size
        specials = special_token_ids(vocab_size)
        source = "the tiny dataset" if self.merges is None else "a generated corpus"
        if self.merges is None:
            ranks = tiny_tokenizer_ranks(vocab_size)
        else:
            ranks = _ranks(list(self.merges))
            if len(ranks) + len(specials) != vocab_size:
                raise BadValueError(
                    f"{len(self.merges)} merges do not fill vocab_size {vocab_size}: it needs "
                    f"{vocab_size - 256 - len(specials)}"
                )
        tokenizer_json = _hf_tokenizer_json(
            ranks,
            _all_splits(ranks),
            specials,
            SPLIT_PATTERN,
            bos="<|begin_of_text|>",
            # tiktoken returns a whole piece that is a token as is; so does ignore_merges.
            ignore_merges=True,
        )
        files = entry.tokenizer.files
        return TokenizerFiles(
            files={
                files["path"]: _tiktoken_file(ranks),
                files["special_tokens_path"]: dump_json(tokenizer_json),
                "tokenizer_config.json": dump_json(
                    {
                        "tokenizer_class": "PreTrainedTokenizerFast",
                        "bos_token": "<|begin_of_text|>",
                        "eos_token": "<|end_of_text|>",
                        "pad_token": "<|finetune_right_pad_id|>",
                        "model_max_length": entry.shape.max_seq_len,
                        "clean_up_tokenization_spaces": False,
                        # The published model's template (runtimes/chat_templates.py).
                        "chat_template": chat_template(entry),
                    }
                ),
            },
            bos_id=specials["<|begin_of_text|>"],
            eos_id=specials["<|end_of_text|>"],
            pad_id=specials["<|finetune_right_pad_id|>"],
            # Generation stops where torchtune's tokenizer stops: end of text, turn or message.
            stop_ids=tuple(specials[t] for t in ("<|end_of_text|>", "<|eom_id|>", "<|eot_id|>")),
            description=f"byte-level BPE learned from {source}, Llama 3 special tokens",
        )


@dataclass(frozen=True)
class GptBpeFormat:
    """Qwen 2 / 2.5 and Phi-4: GPT-2-style vocab.json + merges.txt, special tokens after them.

    ``canonical`` is the torchtune tokenizer's own table of special tokens; the tiny tokenizer
    keeps their names and order and renumbers them to follow its learned tokens. The model's
    vocabulary may be larger than the tokenizer's, as real Qwen models pad theirs.
    """

    canonical: str  # "module:NAME" of torchtune's special token table
    pattern: str  # the pre-tokenizer split of the torchtune tokenizer
    learned_tokens: int  # bytes + merges
    bos: str | None
    eos: str
    pad: str
    normalizer: dict | None = None
    # Tokens the model's tokenizer.json adds after torchtune's table (Qwen 3's thinking and tool
    # response markers).
    added: tuple[str, ...] = ()

    def special_names(self) -> list[str]:
        import importlib

        module, name = self.canonical.split(":")
        table = getattr(importlib.import_module(module), name)
        return sorted(table, key=table.get) + list(self.added)

    def write(self, entry: ModelEntry) -> TokenizerFiles:
        merges = _learn(self.learned_tokens, self.pattern)
        ranks = _ranks(merges)
        specials = {name: len(ranks) + i for i, name in enumerate(self.special_names())}
        if len(ranks) + len(specials) > entry.shape.vocab_size:
            raise BadValueError(
                f"{entry.name}: {len(ranks)} learned and {len(specials)} special tokens do not "
                f"fit its vocab_size {entry.shape.vocab_size}"
            )
        vocab = {_render(token): i for token, i in ranks.items()}
        merges_txt = "#version: 0.2\n" + "".join(f"{_render(a)} {_render(b)}\n" for a, b in merges)
        tokenizer_json = _hf_tokenizer_json(
            ranks, merges, specials, self.pattern, normalizer=self.normalizer
        )
        files = list(entry.tokenizer.files.values())  # vocab, merges, tokenizer.json
        return TokenizerFiles(
            files={
                files[0]: dump_json(vocab),
                files[1]: merges_txt.encode("utf-8"),
                files[2]: dump_json(tokenizer_json),
                "tokenizer_config.json": dump_json(
                    {
                        "tokenizer_class": "PreTrainedTokenizerFast",
                        "bos_token": self.bos,
                        "eos_token": self.eos,
                        "pad_token": self.pad,
                        "model_max_length": entry.shape.max_seq_len,
                        "clean_up_tokenization_spaces": False,
                        "chat_template": chat_template(entry),
                    }
                ),
            },
            bos_id=specials[self.bos] if self.bos else None,
            eos_id=specials[self.eos],
            pad_id=specials[self.pad],
            stop_ids=(specials[self.eos],),
            description=f"byte-level BPE learned from the tiny dataset, {len(specials)} special "
            "tokens named as the real model's",
        )
