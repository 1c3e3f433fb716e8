"""Offline generators of tiny random models, their tokenizers and a small instruction dataset.

The quickstart and the tests need a model and data without a GPU or the internet:
``write_tiny_dataset`` and ``write_tiny_model`` (any catalog family; ``tiny-llama3`` by default)
write them from nothing, seeded, so the same arguments give the same bytes;
``write_tiny_image_dataset`` draws pictures with questions for Llama 3.2 Vision."""

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
from tunepack.tiny.pictures import write_tiny_image_dataset

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
    "write_tiny_image_dataset",
    "write_tiny_model",
]
