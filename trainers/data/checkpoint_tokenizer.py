"""The text encoder of a bring-your-own checkpoint: its own ``tokenizer.json``.

A custom runtime (runtimes/custom.py) cannot assume the family's torchtune tokenizer files: a
fine-tuned or re-trained checkpoint brings its own vocabulary, in the Hugging Face fast-tokenizer
format. ``CheckpointTokenizer`` encodes text with it (the ``tokenizers`` library, as torchtune
0.6.1's ``HuggingFaceBaseTokenizer`` does) and ``trainers/data/prompt_format.FormattedTokenizer``
lays conversations out in the family's chat format on top, naming the format's special tokens by
their text.

Unlike ``HuggingFaceBaseTokenizer``, whose ``encode(add_bos=False)`` still returns the BOS that a
Llama ``tokenizer.json``'s post-processor adds, the text is encoded without the tokenizer's own
special tokens and BOS/EOS are added only when asked: the chat format places them.
"""

from __future__ import annotations

from pathlib import Path

from tunepack.core.errors import BadModelError
from tunepack.runtimes import custom


class CheckpointTokenizer:
    def __init__(self, path: str, max_seq_len: int | None = None, vocab_size: int | None = None):
        from tokenizers import Tokenizer

        model_dir = Path(path).parent
        where = f"model at {str(model_dir)!r}"
        try:
            self.tokenizer = Tokenizer.from_file(str(path))
        except Exception as error:  # the library raises plain Exception on a bad file
            first = str(error).splitlines()[0] if str(error) else type(error).__name__
            raise BadModelError(
                f"{where}: {Path(path).name} cannot be loaded as a Hugging Face tokenizer "
                f"({first}); give the checkpoint's original tokenizer.json"
            ) from None
        size = vocab_size or self.tokenizer.get_vocab_size(with_added_tokens=True)
        ids = custom.special_token_ids(model_dir, size, where)
        self.bos_id = ids["bos"]
        self.eos_id = ids["eos"]
        # Padding is masked out of the loss; a tokenizer without a pad token pads with EOS.
        self.pad_id = ids["pad"] if ids["pad"] is not None else ids["eos"]
        self.max_seq_len = max_seq_len
        self.stop_tokens = [self.eos_id]

    def special_token_id(self, text: str) -> int | None:
        """The id of the token whose text is ``text`` (an added or vocabulary token), or None."""
        return self.tokenizer.token_to_id(text)

    def encode(self, text: str, add_bos: bool = True, add_eos: bool = True) -> list[int]:
        ids = self.tokenizer.encode(text, add_special_tokens=False).ids
        if add_bos:
            if self.bos_id is None:
                raise BadModelError(
                    "the checkpoint's tokenizer names no BOS token (tokenizer_config.json "
                    "bos_token or config.json bos_token_id), which this chat format needs"
                )
            ids.insert(0, self.bos_id)
        if add_eos:
            ids.append(self.eos_id)
        return ids

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        ids = [int(i) for i in token_ids]  # plain ints: a tensor's elements are not
        return self.tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)
