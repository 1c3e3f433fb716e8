"""SentencePiece tokenizers learned offline from the tiny corpus (Llama 2, Mistral, Gemma, Phi-3).

The real models' ``tokenizer.model`` files are SentencePiece BPE models with byte fallback; the
tiny ones are trained the same way with the ``sentencepiece`` package, with the control-token ids
of the family (Llama: unk 0, bos 1, eos 2; Gemma: pad 0, eos 1, bos 2, unk 3).
"""

from __future__ import annotations

import importlib
import io
from dataclasses import dataclass

from tunepack.core.errors import BadValueError
from tunepack.runtimes.catalog import ModelEntry
from tunepack.tiny.bpe import TokenizerFiles, _added_tokens, chat_template, dump_json
from tunepack.tiny.dataset import tiny_corpus


@dataclass(frozen=True)
class SentencePieceFormat:
    unk_id: int
    bos_id: int
    eos_id: int
    pad_id: int  # -1: none (Llama, whose torchtune tokenizer pads with id 0)
    tokenizer_class: str  # tokenizer_config.json, for transformers
    # Phi-3 adds chat tokens after the SentencePiece vocabulary, listed in tokenizer.json:
    # torchtune's table ("module:NAME") gives their names and order.
    special_tokens: str | None = None
    eos_token: str | None = None  # a special token that ends text instead of </s> (Phi-3)
    # Ids the SentencePiece model leaves to special tokens and padding (Phi-3: 32064 - 32000).
    reserved: int = 0
    # Pieces the model keeps whole, as Gemma's turn markers (its chat template's tokens).
    user_symbols: tuple[str, ...] = ()
    # Whether a text gets a leading "▁" (Llama's models do; Gemma's do not, nor after its
    # special tokens).
    dummy_prefix: bool = True

    def _train(self, vocab_size: int) -> bytes:
        import sentencepiece

        model = io.BytesIO()
        try:
            sentencepiece.SentencePieceTrainer.train(
                sentence_iterator=iter(tiny_corpus().splitlines()),
                model_writer=model,
                model_type="bpe",
                vocab_size=vocab_size,
                byte_fallback=True,  # like the real models: no unknown text, only bytes
                character_coverage=1.0,
                split_digits=True,
                normalization_rule_name="identity",
                remove_extra_whitespaces=False,
                unk_id=self.unk_id,
                bos_id=self.bos_id,
                eos_id=self.eos_id,
                pad_id=self.pad_id,
                user_defined_symbols=list(self.user_symbols),
                add_dummy_prefix=self.dummy_prefix,
                num_threads=1,  # one thread: the same model on every run
                minloglevel=2,
            )
        except RuntimeError as error:
            raise BadValueError(
                f"cannot train a {vocab_size}-piece SentencePiece model on the tiny corpus: {error}"
            ) from None
        return model.getvalue()

    def write(self, entry: ModelEntry) -> TokenizerFiles:
        pieces = entry.shape.vocab_size - self.reserved
        model = self._train(pieces)
        files = {entry.tokenizer.files["path"]: model}
        specials: dict[str, int] = {}
        if self.special_tokens:
            module, name = self.special_tokens.split(":")
            table = getattr(importlib.import_module(module), name)
            specials = {token: pieces + i for i, token in enumerate(sorted(table, key=table.get))}
            added = {"version": "1.0", "added_tokens": _added_tokens(specials)}
            files[entry.tokenizer.files["special_tokens_path"]] = dump_json(added)
        eos = specials[self.eos_token] if self.eos_token else self.eos_id
        import sentencepiece

        processor = sentencepiece.SentencePieceProcessor(model_proto=model)
        files["tokenizer_config.json"] = dump_json(
            {
                "tokenizer_class": self.tokenizer_class,
                "bos_token": processor.id_to_piece(self.bos_id),
                "eos_token": self.eos_token or processor.id_to_piece(self.eos_id),
                "model_max_length": entry.shape.max_seq_len,
                "clean_up_tokenization_spaces": False,
                # Llama's published tokenizer.json starts every text between special tokens
                # with "▁" (its normalizer prepends it), as SentencePiece and torchtune do;
                # transformers builds that from the .model file only with legacy=true.
                **({"legacy": True} if self.dummy_prefix else {}),
                # The published model's template (runtimes/chat_templates.py).
                "chat_template": chat_template(entry),
            }
        )
        return TokenizerFiles(
            files=files,
            bos_id=self.bos_id,
            eos_id=eos,
            pad_id=self.pad_id if self.pad_id >= 0 else None,
            stop_ids=(eos,),
            description=f"SentencePiece BPE ({pieces} pieces, byte fallback) learned from the "
            f"tiny dataset{f', {len(specials)} special tokens' if specials else ''}",
        )
