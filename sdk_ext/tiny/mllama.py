"""A tiny random Llama 3.2 Vision (``MllamaForConditionalGeneration``), written by transformers.

Unlike the text families (``tunepack.tiny.hf``, weights key by key), this is transformers' own
class saved with ``save_pretrained``, so the checkpoint is the Hub's layout exactly; transformers
is imported only here. Its cross-attention and tile gates are drawn away from transformers'
initial 0, which would keep the images out of the text."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from tunepack.runtimes.catalog import ModelEntry
from tunepack.tiny.bpe import TiktokenFormat, TokenizerFiles

TEXT_LAYERS = 4
CROSS_ATTENTION_LAYERS = [1]
TILE_SIZE, PATCH_SIZE, MAX_TILES = 28, 7, 4
VISION = {
    "hidden_size": 32,
    "attention_heads": 4,
    "intermediate_size": 64,
    "num_hidden_layers": 3,
    "num_global_layers": 1,
    "intermediate_layers_indices": [0, 2],
    "image_size": TILE_SIZE,
    "patch_size": PATCH_SIZE,
    "max_num_tiles": MAX_TILES,
    "supported_aspect_ratios": [[1, 1], [1, 2], [1, 3], [1, 4], [2, 1], [2, 2], [3, 1], [4, 1]],
    "vision_output_dim": 96,  # hidden_size x (1 + the two intermediate layers)
}
PREPROCESSOR_FILE = "preprocessor_config.json"
# Llama 3.1's RoPE scaling (the published Llama 3.2 Vision's), over torchtune's defaults.
ROPE = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 256,  # below the tiny context, so it acts
}


def tokenizer_files(entry: ModelEntry) -> TokenizerFiles:
    """The tiny Llama 3 tokenizer with ``<|image|>`` at id ``vocab_size``: the special tokens end
    one id past the text vocabulary (``<|image|>`` is the last of them)."""
    shape = dataclasses.replace(entry.shape, vocab_size=entry.shape.vocab_size + 1)
    files = TiktokenFormat().write(dataclasses.replace(entry, shape=shape))
    specials = json.loads(files.files[entry.tokenizer.files["special_tokens_path"]])
    image = next(t["id"] for t in specials["added_tokens"] if t["content"] == "<|image|>")
    assert image == entry.shape.vocab_size, (image, entry.shape.vocab_size)
    return files


def write_files(target: Path, entry: ModelEntry, tokenizer: TokenizerFiles, seed: int) -> None:
    """Write config.json, generation_config.json, the weights and preprocessor_config.json into
    ``target`` (the caller writes the tokenizer files and the model card)."""
    import torch
    from transformers import MllamaConfig, MllamaForConditionalGeneration
    from transformers.models.mllama.image_processing_mllama import MllamaImageProcessor
    from transformers.utils import logging

    s = entry.shape
    text = {
        "vocab_size": s.vocab_size,
        "hidden_size": s.embed_dim,
        "intermediate_size": s.intermediate_dim,
        "num_hidden_layers": TEXT_LAYERS,
        "num_attention_heads": s.num_heads,
        "num_key_value_heads": s.num_kv_heads,
        "cross_attention_layers": CROSS_ATTENTION_LAYERS,
        "max_position_embeddings": s.max_seq_len,
        "rms_norm_eps": entry.family.options["norm_eps"],
        "rope_parameters": {"rope_theta": entry.family.options["rope_base"], **ROPE},
        "bos_token_id": tokenizer.bos_id,
        "eos_token_id": list(tokenizer.stop_ids),
        "pad_token_id": tokenizer.pad_id,
        "tie_word_embeddings": False,
    }
    config = MllamaConfig(text_config=text, vision_config=VISION, image_token_index=s.vocab_size)
    torch.manual_seed(seed)
    model = MllamaForConditionalGeneration(config).eval()
    with torch.no_grad():
        generator = torch.Generator().manual_seed(seed)
        for name, param in model.named_parameters():
            if "gate" in name:
                sign = torch.where(torch.rand(param.shape, generator=generator) < 0.5, -1.0, 1.0)
                param.copy_(sign * (0.5 + torch.rand(param.shape, generator=generator)))
    shown = logging.is_progress_bar_enabled()
    logging.disable_progress_bar()  # one tiny file: no "Writing model shards" bar on the console
    try:
        model.save_pretrained(target, safe_serialization=True)
    finally:
        if shown:
            logging.enable_progress_bar()
    processor = MllamaImageProcessor(
        size={"height": TILE_SIZE, "width": TILE_SIZE}, max_image_tiles=MAX_TILES
    )
    processor.save_pretrained(target)
