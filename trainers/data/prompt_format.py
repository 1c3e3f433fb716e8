"""The chat format a run trains in: each family's published Hugging Face chat template.

``FormattedTokenizer`` wraps the family's torchtune tokenizer (which still encodes the text) and
lays each conversation out as the template does, token for token; why, and which formats:
docs/trainer.md, "Chat format". Formats are Python here: no template text from a user or a model
repository is ever executed.

Loss: as torchtune's own tokenizers do, a turn is trained whole (its role markers, its content
and the marker that ends it, so the model learns to stop) when its message is not masked: the
assistant's turns, and with ``train_on_input`` every turn. What belongs to no turn (BOS, a
template's default system prompt) is never trained.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tunepack.core.errors import (
    BadDatasetError,
    BadInputError,
    BadValueError,
    UnknownRuntimeError,
    UnsupportedError,
)
from tunepack.runtimes.chat_templates import NO_SYSTEM, QWEN2_5_SYSTEM, check_chat_template
from tunepack.runtimes.families import FAMILIES

# Markers the tokenizer resolves to its own BOS / EOS ids.
BOS, EOS = "<bos>", "<eos>"
QWEN2_SYSTEM = "You are a helpful assistant."
LLAMA3_1_DATE = "26 Jul 2024"  # the published template's date when it is given none


@dataclass(frozen=True)
class Turn:
    role: str
    content: str
    trained: bool = False  # its content counts in the loss


@dataclass(frozen=True)
class Piece:
    """Text, or one special token (``special``), belonging to turn ``turn`` (None: framing)."""

    text: str
    turn: int | None = None
    kind: str = "head"  # head (role markers), body (content) or end (the turn's closing marker)
    special: bool = False


def _text(text: str, turn: int | None = None, kind: str = "head") -> Piece:
    return Piece(text, turn, kind)


def _tok(name: str, turn: int | None = None, kind: str = "head") -> Piece:
    return Piece(name, turn, kind, special=True)


def _split_system(turns: Sequence[Turn]) -> tuple[Turn | None, list[tuple[int, Turn]]]:
    indexed = list(enumerate(turns))
    if turns and turns[0].role == "system":
        return turns[0], indexed[1:]
    return None, indexed


def _alternating(fmt: str, turns: list[tuple[int, Turn]]) -> None:
    for position, (_, turn) in enumerate(turns):
        expected = "user" if position % 2 == 0 else "assistant"
        if turn.role != expected:
            roles = "/".join(t.role for _, t in turns)
            raise BadDatasetError(
                f"the {fmt} chat format needs turns alternating user/assistant after an optional "
                f"system message, but a conversation has {roles}"
            )


def _llama2(turns: Sequence[Turn], generation: bool) -> list[Piece]:
    system, rest = _split_system(turns)
    _alternating("llama2", rest)
    out: list[Piece] = []
    for position, (i, turn) in enumerate(rest):
        if turn.role == "user":
            out += [_tok(BOS), _text("[INST] ", i)]
            if position == 0 and system is not None:
                # The template strips "<<SYS>>\n{system}\n<</SYS>>\n\n{user}" as a whole: only
                # the user text's end, or the block's end when the user text is blank.
                user = turn.content.rstrip()
                out += [_text("<<SYS>>\n", 0), _text(system.content, 0, "body")]
                out += [_text("\n<</SYS>>" + ("\n\n" if user else ""), 0), _text(user, i, "body")]
            else:
                out.append(_text(turn.content.strip(), i, "body"))
            out.append(_text(" [/INST]", i))
        else:
            out += [_text(" ", i), _text(turn.content.strip(), i, "body"), _text(" ", i, "end")]
            out.append(_tok(EOS, i, "end"))
    return out


def _mistral(turns: Sequence[Turn], generation: bool) -> list[Piece]:
    system, rest = _split_system(turns)
    _alternating("mistral", rest)
    out = [_tok(BOS)]
    for position, (i, turn) in enumerate(rest):
        if turn.role == "user":
            content = turn.content
            if position == 0 and system is not None:
                content = f"{system.content}\n\n{content}"
            out += [_text(" [INST] ", i), _text(content, i, "body"), _text(" [/INST]", i)]
        else:
            out += [_text(" ", i), _text(turn.content, i, "body"), _tok(EOS, i, "end")]
    return out


def _llama3_turn(i: int | None, role: str, content: str) -> list[Piece]:
    return [
        _tok("<|start_header_id|>", i),
        _text(role, i),
        _tok("<|end_header_id|>", i),
        _text("\n\n", i),
        _text(content.strip(), i, "body"),
        _tok("<|eot_id|>", i, "end"),
    ]


def _llama3_generation() -> list[Piece]:
    return [
        _tok("<|start_header_id|>"),
        _text("assistant"),
        _tok("<|end_header_id|>"),
        _text("\n\n"),
    ]


def _llama3(turns: Sequence[Turn], generation: bool) -> list[Piece]:
    out = [_tok(BOS)]
    for i, turn in enumerate(turns):
        out += _llama3_turn(i, turn.role, turn.content)
    return out + (_llama3_generation() if generation else [])


def _llama3_1(turns: Sequence[Turn], generation: bool) -> list[Piece]:
    system, rest = _split_system(turns)
    header = f"Cutting Knowledge Date: December 2023\nToday Date: {LLAMA3_1_DATE}\n\n"
    # Always a system turn: the dated header, then the (trimmed) system text, if any.
    index = 0 if system else None
    system_turn = _llama3_turn(index, "system", "")
    text = system.content.strip() if system else ""
    system_turn[4:5] = [_text(header, index), _text(text, index, "body")]
    out = [_tok(BOS), *system_turn]
    for i, turn in rest:
        out += _llama3_turn(i, turn.role, turn.content)
    return out + (_llama3_generation() if generation else [])


# Where an image stands in a turn's content (image_chat rows): the token the vision model's
# template writes for an {"type": "image"} part.
IMAGE_TOKEN = "<|image|>"


def _body(i: int, content: str) -> list[Piece]:
    """A turn's content as text pieces with each ``<|image|>`` a special piece of its own."""
    out: list[Piece] = []
    for k, part in enumerate(content.split(IMAGE_TOKEN)):
        if k:
            out.append(_tok(IMAGE_TOKEN, i, "body"))
        if part:
            out.append(_text(part, i, "body"))
    return out


def _llama3_2_vision(turns: Sequence[Turn], generation: bool) -> list[Piece]:
    """Llama 3.2 Vision's template: content untrimmed, images in place; a conversation with an
    image has no system turn (the template refuses a system message with one), else Llama 3.1's
    dated system turn."""
    system, rest = _split_system(turns)
    has_images = any(IMAGE_TOKEN in turn.content for _, turn in rest)
    out = [_tok(BOS)]
    if has_images and system is not None and system.content.strip():
        raise BadDatasetError(
            "the llama3.2-vision chat format refuses a system message in a conversation with "
            "images (as the published template does): drop the system message or system_prompt"
        )
    if not has_images:
        index = 0 if system else None
        header = f"Cutting Knowledge Date: December 2023\nToday Date: {LLAMA3_1_DATE}\n\n"
        text = system.content.strip() if system else ""
        out += [_tok("<|start_header_id|>", index), _text("system", index),
                _tok("<|end_header_id|>", index), _text("\n\n", index),
                _text(header, index), _text(text, index, "body"),
                _tok("<|eot_id|>", index, "end")]  # fmt: skip
    for i, turn in rest:
        out += [_tok("<|start_header_id|>", i), _text(turn.role, i),
                _tok("<|end_header_id|>", i), _text("\n\n", i), *_body(i, turn.content),
                _tok("<|eot_id|>", i, "end")]  # fmt: skip
    return out + (_llama3_generation() if generation else [])


def _gemma(turns: Sequence[Turn], generation: bool) -> list[Piece]:
    system, rest = _split_system(turns)
    if system is not None:
        raise BadDatasetError(
            "the gemma chat format has no system role (Gemma's published template refuses it), "
            "but a conversation starts with a system message: drop it, or fold it into the first "
            "user message"
        )
    _alternating("gemma", rest)
    out = [_tok(BOS)]
    for i, turn in rest:
        role = "model" if turn.role == "assistant" else turn.role
        out += [_tok("<start_of_turn>", i), _text(f"{role}\n", i)]
        out += [_text(turn.content.strip(), i, "body"), _tok("<end_of_turn>", i, "end")]
        out.append(_text("\n", i, "tail"))
    if generation:
        out += [_tok("<start_of_turn>"), _text("model\n")]
    return out


def _gemma3(turns: Sequence[Turn], generation: bool) -> list[Piece]:
    system, rest = _split_system(turns)
    _alternating("gemma3", rest)
    out = [_tok(BOS)]
    for position, (i, turn) in enumerate(rest):
        role = "model" if turn.role == "assistant" else turn.role
        out += [_tok("<start_of_turn>", i), _text(f"{role}\n", i)]
        if position == 0 and system is not None:  # the system text, untrimmed, opens the turn
            out.append(_text(system.content + "\n\n", 0, "body"))
        out += [_text(turn.content.strip(), i, "body"), _tok("<end_of_turn>", i, "end")]
        out.append(_text("\n", i, "tail"))
    if generation:
        out += [_tok("<start_of_turn>"), _text("model\n")]
    return out


def _phi3(turns: Sequence[Turn], generation: bool) -> list[Piece]:
    out: list[Piece] = []
    for i, turn in enumerate(turns):
        if turn.role not in ("system", "user", "assistant"):
            continue  # the published template leaves other roles out
        out += [_tok(f"<|{turn.role}|>", i), _text("\n", i), _text(turn.content, i, "body")]
        out += [_tok("<|end|>", i, "end"), _text("\n", i, "tail")]
    if generation:
        return out + [_tok("<|assistant|>"), _text("\n")]
    return out + [_tok(EOS)]


def _phi4(turns: Sequence[Turn], generation: bool) -> list[Piece]:
    out: list[Piece] = []
    for i, turn in enumerate(turns):
        if turn.role not in ("system", "user", "assistant"):
            continue
        out += [_tok("<|im_start|>", i), _text(turn.role, i), _tok("<|im_sep|>", i)]
        out += [_text(turn.content, i, "body"), _tok("<|im_end|>", i, "end")]
    if generation:
        out += [_tok("<|im_start|>"), _text("assistant"), _tok("<|im_sep|>")]
    return out


def _chatml_turn(i: int | None, role: str, content: str, prefix: str = "") -> list[Piece]:
    return [
        _tok("<|im_start|>", i),
        _text(f"{role}\n{prefix}", i),
        _text(content, i, "body"),
        _tok("<|im_end|>", i, "end"),
        _text("\n", i, "tail"),
    ]


def _chatml(default_system: str | None):
    def render(turns: Sequence[Turn], generation: bool) -> list[Piece]:
        out: list[Piece] = []
        if default_system and turns and turns[0].role != "system":
            out += _chatml_turn(None, "system", default_system)
        for i, turn in enumerate(turns):
            out += _chatml_turn(i, turn.role, turn.content)
        if generation:
            out += [_tok("<|im_start|>"), _text("assistant\n")]
        return out

    return render


def _qwen3(turns: Sequence[Turn], generation: bool) -> list[Piece]:
    out: list[Piece] = []
    last_query = len(turns) - 1
    for i in range(len(turns) - 1, -1, -1):
        content = turns[i].content
        if turns[i].role == "user" and not (
            content.startswith("<tool_response>") and content.endswith("</tool_response>")
        ):
            last_query = i
            break
    for i, turn in enumerate(turns):
        if turn.role == "system" and i == 0:
            out += _chatml_turn(i, "system", turn.content)
        elif turn.role in ("user", "system"):
            out += _chatml_turn(i, turn.role, turn.content)
        elif turn.role == "assistant":
            content, reasoning = turn.content, ""
            if "</think>" in content:
                reasoning = content.split("</think>")[0].rstrip("\n").split("<think>")[-1]
                reasoning = reasoning.lstrip("\n")
                content = content.split("</think>")[-1].lstrip("\n")
            last = i == len(turns) - 1
            if i > last_query and (last or reasoning):
                think = f"<think>\n{reasoning.strip(chr(10))}\n</think>\n\n"
                content = content.lstrip("\n")
                if reasoning:  # the model's own reasoning is trained; an empty block is prompt
                    content, think = think + content, ""
                out += _chatml_turn(i, "assistant", content, prefix=think)
            else:
                out += _chatml_turn(i, "assistant", content)
    if generation:  # as the template with enable_thinking=false: an empty thinking block
        out += [_tok("<|im_start|>"), _text("assistant\n<think>\n\n</think>\n\n")]
    return out


FORMATS = {
    "llama2": _llama2,
    "mistral": _mistral,
    "llama3": _llama3,
    "llama3.1": _llama3_1,
    "llama3.2": _llama3_1,  # the fixed date: training does not depend on the day it ran
    "llama3.2-vision": _llama3_2_vision,
    "gemma": _gemma,
    "gemma3": _gemma3,
    "phi3": _phi3,
    "phi4": _phi4,
    "qwen2": _chatml(QWEN2_SYSTEM),
    "qwen2.5": _chatml(QWEN2_5_SYSTEM),
    "qwen3": _qwen3,
}


def render(fmt: str, turns: Sequence[Turn], *, generation: bool = False) -> list[Piece]:
    """``turns`` laid out in format ``fmt``; ``generation``: end with the assistant's opening."""
    return FORMATS[fmt](list(turns), generation)


class FormattedTokenizer:
    """A torchtune model tokenizer that lays conversations out in a chat format.

    Everything but the conversation layout (``encode``, ``decode``, ids, ``max_seq_len``) is the
    wrapped tokenizer's.
    """

    def __init__(self, base, chat_template: str, system_prompt: str | None = None):
        if chat_template not in FORMATS:
            raise BadValueError(
                f"chat_template={chat_template!r} is not valid: expected one of "
                f"{', '.join(FORMATS)}"
            )
        self._base = base
        self.chat_template = chat_template
        self.system_prompt = system_prompt or None
        self._special_ids: dict[str, int] = {}

    def __getattr__(self, name: str):
        if name.startswith("_"):
            raise AttributeError(name)
        return getattr(self._base, name)

    # --- special tokens -------------------------------------------------------------------------

    def special_id(self, name: str) -> int:
        if name not in self._special_ids:
            self._special_ids[name] = self._resolve(name)
        return self._special_ids[name]

    def _resolve(self, name: str) -> int:
        base = self._base
        if name == BOS:
            if base.bos_id is None:
                raise UnsupportedError(
                    f"the {self.chat_template} chat format starts with a BOS token, which this "
                    "model's tokenizer does not name (tokenizer_config.json bos_token or "
                    "config.json bos_token_id)"
                )
            return base.bos_id
        if name == EOS:
            return base.eos_id
        table = getattr(base, "special_tokens", None)
        if isinstance(table, Mapping) and name in table:
            return table[name]
        lookup = getattr(base, "special_token_id", None)  # a checkpoint's own tokenizer.json
        if lookup is not None and (found := lookup(name)) is not None:
            return found
        spm = getattr(getattr(base, "_spm_model", None), "spm_model", None)
        if spm is not None:
            piece = spm.piece_to_id(name)
            if piece != spm.unk_id() and spm.id_to_piece(piece) == name:
                return piece
        raise UnsupportedError(
            f"the {self.chat_template} chat format needs the token {name}, which this model's "
            "tokenizer does not have: pick the model's own chat_template"
        )

    def turn_end_ids(self) -> set[int]:
        """The special tokens that close an assistant's turn in this format (``<|eot_id|>``,
        ``<end_of_turn>``, ``</s>``...): where a sampled answer ends."""
        turns = [Turn("user", "q"), Turn("assistant", "a")]
        pieces = render(self.chat_template, turns)
        return {
            self.special_id(p.text) for p in pieces if p.special and p.turn == 1 and p.kind == "end"
        }

    # --- conversations --------------------------------------------------------------------------

    def turns(self, messages: Sequence[Any]) -> list[Turn]:
        """torchtune ``Message``s as turns, the default system prompt first where none is."""
        turns = [
            Turn(m.role, m.text_content, trained=not m.masked)
            for m in messages
            if m.role != "ipython"
        ]
        if self.system_prompt and (not turns or turns[0].role != "system"):
            turns.insert(0, Turn("system", self.system_prompt))
        return turns

    def encode_pieces(self, pieces: Sequence[Piece], trained) -> tuple[list[int], list[bool]]:
        """Token ids and loss mask (True: not trained) of ``pieces``.

        Consecutive text pieces are encoded as one text, as transformers encodes everything
        between two special tokens; a piece boundary inside that text is placed where the
        encoding of the text before it ends (a token across it goes to the later piece).
        """
        tokens: list[int] = []
        mask: list[bool] = []
        run: list[Piece] = []

        def flush() -> None:
            if not run:
                return
            text = "".join(p.text for p in run)
            ids = self._encode(text)
            flags = [not trained(p) for p in run]
            start, consumed = 0, ""
            for k, piece in enumerate(run):
                consumed += piece.text
                if k == len(run) - 1:
                    end = len(ids)
                else:
                    prefix = self._encode(consumed) if consumed else []
                    end = start
                    while end < min(len(prefix), len(ids)) and prefix[end] == ids[end]:
                        end += 1
                    end = max(end, start)
                tokens.extend(ids[start:end])
                mask.extend([flags[k]] * (end - start))
                start = end
            run.clear()

        for piece in pieces:
            if piece.special:
                flush()
                tokens.append(self.special_id(piece.text))
                mask.append(not trained(piece))
            elif piece.text:
                run.append(piece)
        flush()
        return tokens, mask

    def _encode(self, text: str) -> list[int]:
        return list(self._base.encode(text, add_bos=False, add_eos=False))

    def tokenize_messages(
        self, messages: Sequence[Any], *, add_end_tokens: bool = True
    ) -> tuple[list[int], list[bool]]:
        """Token ids and mask of a conversation (``add_end_tokens=False``: up to the opening of
        the assistant's turn, for generation; a trailing empty assistant message is dropped)."""
        turns = self.turns(messages)
        generation = not add_end_tokens
        if generation:
            while turns and turns[-1].role == "assistant" and not turns[-1].content:
                turns.pop()
        if self.chat_template in NO_SYSTEM and turns and turns[0].role == "system":
            render(self.chat_template, turns)  # raises the format's own message
        pieces = render(self.chat_template, turns, generation=generation)

        def trained(piece: Piece) -> bool:
            return piece.turn is not None and turns[piece.turn].trained

        tokens, mask = self.encode_pieces(pieces, trained)
        max_len = getattr(self._base, "max_seq_len", None)
        if max_len and len(tokens) > max_len:
            tokens, mask = tokens[:max_len], mask[:max_len]
        return tokens, mask

    @contextmanager
    def untruncated(self) -> Iterator[None]:
        """Within it, sequences keep their full length (to measure what ``max_seq_len`` cuts):
        this class's conversations and torchtune's text rows both read the limit from here."""
        limit = self._base.max_seq_len
        self._base.max_seq_len = None
        try:
            yield
        finally:
            self._base.max_seq_len = limit

    def __call__(self, sample: Mapping[str, Any], inference: bool = False) -> Mapping[str, Any]:
        messages = sample.pop("messages")
        tokens, mask = self.tokenize_messages(messages, add_end_tokens=not inference)
        sample["tokens"] = tokens
        sample["mask"] = mask
        return sample


def build_tokenizer(
    family: str,
    files: dict[str, str],
    max_seq_len: int | None = None,
    chat_template: str | None = None,
    system_prompt: str | None = None,
    checkpoint_tokenizer: bool = False,
) -> FormattedTokenizer:
    """The family's torchtune tokenizer (the catalog names it) in ``chat_template``'s layout
    (default: the family's published format); with ``checkpoint_tokenizer``, the checkpoint's
    own tokenizer.json (``files["path"]``: a bring-your-own runtime) in that layout."""
    from torchtune.config._utils import _get_component_from_path

    if family not in FAMILIES:
        raise UnknownRuntimeError(f"unknown model family {family!r}", runtime=family)
    fmt = check_chat_template(family, chat_template)
    if checkpoint_tokenizer:
        from tunepack.trainers.data.checkpoint_tokenizer import CheckpointTokenizer

        base = CheckpointTokenizer(files["path"], max_seq_len=max_seq_len)
    else:
        builder = _get_component_from_path(FAMILIES[family].tokenizer.component)
        base = builder(**files, max_seq_len=max_seq_len)
    return FormattedTokenizer(base, fmt, system_prompt)


# Formats whose published templates refuse some conversations (turns out of order; Gemma: a
# system message).
STRICT = ("llama2", "mistral", "gemma", "gemma3")


def check_conversations(path: Path, chat_template: str, system_prompt: str | None) -> None:
    """Refuse, naming the file and row, the first conversation of a chat dataset (``messages``
    rows, as the dataset initializer writes them) that ``chat_template`` cannot lay out: the
    trainer checks before it loads the model, not when it meets the row."""
    if chat_template not in STRICT:
        return
    with open(path, encoding="utf-8") as rows:
        for number, line in enumerate(rows, 1):
            if not line.strip():
                continue
            messages = json.loads(line).get("messages") or []
            turns = [
                Turn(str(m.get("role")), str(m.get("content") or ""))
                for m in messages
                if m.get("role") != "ipython"
            ]
            if system_prompt and (not turns or turns[0].role != "system"):
                turns.insert(0, Turn("system", system_prompt))
            try:
                render(chat_template, turns)
            except BadInputError as error:
                raise BadDatasetError(f"{path.name} row {number}: {error}") from None
