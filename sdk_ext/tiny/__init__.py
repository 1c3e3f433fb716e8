"""Offline generators of tiny random models, their tokenizers and a small instruction dataset.

The quickstart and the tests need models and a dataset without a GPU or the internet. This
package writes them from nothing:

- ``write_tiny_dataset``: a deterministic alpaca-schema JSONL file of simple, learnable tasks
  (``dataset``);
- ``write_tiny_model``: a model directory in the Hugging Face format of any catalog family, with
  random weights (shape from the catalog's tiny variant, ``catalog.TINY``) and a tokenizer of the
  family's kind learned from the dataset text (``model``, ``hf``, ``bpe``, ``spm``). Without an
  entry it writes ``tiny-llama3``, the quickstart's model.

Everything is seeded: the same arguments give the same bytes.
"""

from tunepack.tiny.bpe import (
    SPECIAL_TOKENS,
    SPLIT_PATTERN,
    special_token_ids,
    tiny_tokenizer_ranks,
    train_bpe,
)
from tunepack.tiny.dataset import tiny_corpus, tiny_dataset_rows, write_tiny_dataset
from tunepack.tiny.model import (
    FORMATS,
    GPT2_SPLIT_PATTERN,
    MODEL_FILES,
    TINY_MODEL,
    is_complete_model_dir,
    model_files,
    write_tiny_model,
)

__all__ = [
    "FORMATS",
    "GPT2_SPLIT_PATTERN",
    "MODEL_FILES",
    "SPECIAL_TOKENS",
    "SPLIT_PATTERN",
    "TINY_MODEL",
    "is_complete_model_dir",
    "model_files",
    "special_token_ids",
    "tiny_corpus",
    "tiny_dataset_rows",
    "tiny_tokenizer_ranks",
    "train_bpe",
    "write_tiny_dataset",
    "write_tiny_model",
]
