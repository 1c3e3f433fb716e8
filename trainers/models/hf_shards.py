"""Reading and writing a Hugging Face checkpoint's safetensors shards, for the checkpointers that
convert a family torchtune 0.6.1 cannot (trainers/models/, a module per family):
their own key conversion between these two steps, torchtune's file names and index around them."""

from __future__ import annotations

import json
from pathlib import Path

import torch


def load_shards(paths) -> tuple[dict[str, torch.Tensor], dict[str, int]]:
    """Every tensor of the shards at ``paths``, and the shard (numbered from 1) each came from."""
    from safetensors.torch import load_file

    merged: dict[str, torch.Tensor] = {}
    shard_of: dict[str, int] = {}
    for index, path in enumerate(paths, start=1):
        shard = load_file(path)
        shard_of.update(dict.fromkeys(shard, index))
        merged.update(shard)
    return merged, shard_of


def save_shards(
    state: dict[str, torch.Tensor],
    shard_of: dict[str, int],
    directory: Path,
    *,
    source_dir: Path,
    config: dict,
) -> None:
    """Write ``state`` as safetensors shards (a key's shard from ``shard_of``, else the first),
    their index and ``config``, plus the source's other files (tokenizer, generation config), in
    torchtune's names: a directory transformers' ``from_pretrained`` loads."""
    from safetensors.torch import save_file
    from torchtune.training.checkpointing._utils import (
        SAFETENSOR_INDEX_FNAME,
        SHARD_FNAME,
        SUFFIXES_TO_NOT_COPY,
        copy_files,
    )

    count = max(shard_of.values(), default=1)
    shards: dict[int, dict[str, torch.Tensor]] = {}
    for key, value in state.items():
        shards.setdefault(shard_of.get(key, 1), {})[key] = value.contiguous()
    directory.mkdir(parents=True, exist_ok=True)
    weight_map, total = {}, 0
    for index, tensors in sorted(shards.items()):
        name = SHARD_FNAME.format(cpt_idx=f"{index:05d}", num_shards=f"{count:05d}")
        save_file(tensors, directory / f"{name}.safetensors", metadata={"format": "pt"})
        for key, value in tensors.items():
            weight_map[key] = f"{name}.safetensors"
            total += value.numel() * value.element_size()
    copy_files(source_dir, directory, ignore_suffixes=SUFFIXES_TO_NOT_COPY)
    # After the copy: the source's own index and config.json (of other shards, or of another
    # model class) are replaced by the saved model's.
    index_data = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (directory / SAFETENSOR_INDEX_FNAME).write_text(json.dumps(index_data, indent=2))
    (directory / "config.json").write_text(json.dumps(config, indent=2) + "\n")
