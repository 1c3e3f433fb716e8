"""Image-text chat rows (the initializer's ``image_chat`` schema) for Llama 3.2 Vision.

A row is ``{"messages": [{"role", "content": [{"type": "text", "text"} | {"type": "image"}]}],
"images": ["images/<sha256>.png", ...]}``, its images stored in the dataset directory beside the
row files. For each row:

- the turns are laid out in the model's chat format (``trainers/data/prompt_format.py``,
  ``llama3.2-vision``: ``<|image|>`` where each image part is, as the published template places
  it), prompt tokens masked from the loss unless ``train_on_input``;
- each image is opened with Pillow and cut into tiles by torchtune's ``CLIPImageTransform`` with
  the checkpoint's ``preprocessor_config.json`` (mean, std, tile size, most tiles): fitted into
  the best canvas of whole tiles without distortion, padded, normalised, tiled, as transformers'
  ``MllamaImageProcessor`` does (tests/integration/test_vision.py compares the two);
- torchtune's ``VisionCrossAttentionMask`` says which text positions see which image: from its
  ``<|image|>`` up to the next image's (consecutive images share), as transformers' processor.

``collate`` pads a batch with torchtune's ``padded_collate_tiled_images_and_mask`` and marks the
padding images as such (aspect ratio (0, 0), transformers' id 0), which torchtune's collate marks
as one-tile images instead.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
from torch.utils.data import Dataset
from torchtune.data import CROSS_ENTROPY_IGNORE_IDX

from tunepack.core.errors import BadDatasetError, BadModelError, ConflictError
from tunepack.trainers.data.prompt_format import IMAGE_TOKEN, Turn, render

PREPROCESSOR_FILE = "preprocessor_config.json"
# transformers' MllamaImageProcessor defaults (OpenAI CLIP's statistics), where a checkpoint's
# preprocessor_config.json leaves them out.
CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
CLIP_STD = (0.26862954, 0.26130258, 0.27577711)
_RESAMPLE = {2: "bilinear", 3: "bicubic"}  # PIL's codes, as preprocessor_config.json writes them


@dataclass(frozen=True)
class ImageSettings:
    """How the checkpoint's processor turns an image into tiles, and the mask's token counts."""

    tile_size: int
    patch_size: int
    max_num_tiles: int
    image_mean: tuple[float, ...]
    image_std: tuple[float, ...]
    resample: str = "bilinear"

    def as_dict(self) -> dict:
        return {
            "tile_size": self.tile_size,
            "patch_size": self.patch_size,
            "max_num_tiles": self.max_num_tiles,
            "image_mean": list(self.image_mean),
            "image_std": list(self.image_std),
            "resample": self.resample,
        }


def image_settings(model_dir: Path, config: dict) -> ImageSettings:
    """The checkpoint's image processing: preprocessor_config.json where it has one, the vision
    config's tile size and tile count otherwise."""
    vision = config["vision_config"]
    tile, tiles = int(vision["image_size"]), int(vision["max_num_tiles"])
    pre: dict = {}
    path = Path(model_dir) / PREPROCESSOR_FILE
    if path.is_file():
        try:
            pre = json.loads(path.read_text(encoding="utf-8"))
        except ValueError as error:
            raise BadModelError(f"{path} is not valid JSON ({error})") from None
    size = pre.get("size") or {}
    if size and (size.get("height") != tile or size.get("width") != tile):
        raise BadModelError(
            f"{path}: size {size} differs from vision_config.image_size {tile} of config.json; "
            "the tiles the model reads are image_size pixels square"
        )
    if pre.get("max_image_tiles", tiles) != tiles:
        raise BadModelError(
            f"{path}: max_image_tiles {pre['max_image_tiles']} differs from "
            f"vision_config.max_num_tiles {tiles} of config.json"
        )
    resample = pre.get("resample", 2)
    if resample not in _RESAMPLE:
        raise BadModelError(
            f"{path}: resample {resample!r} is not one tunepack reproduces (2: bilinear, "
            "3: bicubic)"
        )
    for flag in ("do_resize", "do_rescale", "do_normalize", "do_pad"):
        if pre.get(flag, True) is not True:
            raise BadModelError(
                f"{path}: {flag}={pre[flag]!r}; tunepack processes images with it on"
            )
    return ImageSettings(
        tile_size=tile,
        patch_size=int(vision["patch_size"]),
        max_num_tiles=tiles,
        image_mean=tuple(float(v) for v in pre.get("image_mean", CLIP_MEAN)),
        image_std=tuple(float(v) for v in pre.get("image_std", CLIP_STD)),
        resample=_RESAMPLE[resample],
    )


def image_transform(settings: dict):
    """torchtune's CLIP transform with the checkpoint's settings (float32 tiles)."""
    from torchtune.models.clip._transform import CLIPImageTransform

    return CLIPImageTransform(
        image_mean=list(settings["image_mean"]),
        image_std=list(settings["image_std"]),
        tile_size=settings["tile_size"],
        max_num_tiles=settings["max_num_tiles"],
        dtype=torch.float32,
        resample=settings["resample"],
        resize_to_max_canvas=False,
    )


def load_image(path: Path):
    from PIL import Image

    with Image.open(path) as image:
        image.load()
        return image.convert("RGB")


class ImageChatDataset(Dataset):
    """``image_chat`` rows as token ids, labels, tiles, aspect ratios and cross-attention masks
    (one row at a time: images are read when a row is)."""

    def __init__(self, tokenizer, data_files: list[str], image: dict, train_on_input: bool):
        from torchtune.modules.transforms import VisionCrossAttentionMask

        self.tokenizer = tokenizer
        self.train_on_input = train_on_input
        self.rows: list[tuple[Path, int, dict]] = []
        for name in data_files:
            path = Path(name)
            with path.open(encoding="utf-8") as lines:
                for number, line in enumerate(lines, start=1):
                    if line.strip():
                        self.rows.append((path.parent, number, json.loads(line)))
        self.transform = image_transform(image)
        self.image_id = tokenizer.special_id(IMAGE_TOKEN)
        self.mask = VisionCrossAttentionMask(
            tile_size=image["tile_size"],
            patch_size=image["patch_size"],
            image_token_id=self.image_id,
        )

    def __len__(self) -> int:
        return len(self.rows)

    def turns(self, row: dict) -> list[Turn]:
        out = []
        for message in row["messages"]:
            content = message["content"]
            if not isinstance(content, str):
                content = "".join(
                    IMAGE_TOKEN if part["type"] == "image" else part["text"] for part in content
                )
            role = message["role"]
            out.append(Turn(role, content, trained=role == "assistant" or self.train_on_input))
        if self.tokenizer.system_prompt and (not out or out[0].role != "system"):
            out.insert(0, Turn("system", self.tokenizer.system_prompt))
        return out

    def tokens(self, row: dict) -> tuple[list[int], list[bool]]:
        turns = self.turns(row)
        pieces = render(self.tokenizer.chat_template, turns)

        def trained(piece) -> bool:
            return piece.turn is not None and turns[piece.turn].trained

        tokens, mask = self.tokenizer.encode_pieces(pieces, trained)
        limit = self.tokenizer.max_seq_len
        if limit and len(tokens) > limit:
            tokens, mask = tokens[:limit], mask[:limit]
        return tokens, mask

    def token_lengths(self) -> list[int]:
        """Each row's length in tokens (under the tokenizer's current limit), images unread."""
        return [len(self.tokens(row)[0]) for _, _, row in self.rows]

    def __getitem__(self, index: int) -> dict:
        root, number, row = self.rows[index]
        tokens, mask = self.tokens(row)
        labels = [CROSS_ENTROPY_IGNORE_IDX if m else t for t, m in zip(tokens, mask, strict=True)]
        # Images whose <|image|> max_seq_len cut off are not read.
        kept = sum(1 for t in tokens if t == self.image_id)
        images, ratios = [], []
        for name in row.get("images", [])[:kept]:
            try:
                picture = load_image(root / name)
            except (OSError, ValueError) as error:
                raise BadDatasetError(
                    f"row {number} of {root}: cannot read its image {name} ({error})"
                ) from None
            tiles = self.transform({"image": picture})
            images.append(tiles["image"])
            ratios.append(tiles["aspect_ratio"])
        if len(images) != kept:
            raise BadDatasetError(
                f"row {number} of {root}: {kept} image places in its messages, "
                f"{len(row.get('images', []))} images"
            )
        sample = {
            "tokens": tokens,
            "labels": labels,
            "encoder_input": {"images": images, "aspect_ratio": ratios},
        }
        return self.mask(sample)


def image_chat_dataset(
    tokenizer,
    *,
    data_files: list[str],
    image: dict,
    train_on_input: bool = False,
    packed: bool = False,
    **_ignored,
) -> ImageChatDataset:
    """The recipe's dataset builder for ``image_chat`` (``packed`` is refused earlier)."""
    if packed:
        raise ConflictError("packed=true cannot join rows that carry images; leave it out")
    return ImageChatDataset(tokenizer, list(data_files), dict(image), train_on_input)


def collate(batch: list[dict], padding_idx: int, ignore_idx: int = CROSS_ENTROPY_IGNORE_IDX):
    """A batch of rows: torchtune's padding of text, tiles, images and masks, the padding
    images' aspect ratios (0, 0); a batch without any image has no encoder input."""
    from torchtune.data import padded_collate_sft, padded_collate_tiled_images_and_mask

    counts = [len(row["encoder_input"]["images"]) for row in batch]
    if not any(counts):
        out = padded_collate_sft(
            [{"tokens": r["tokens"], "labels": r["labels"]} for r in batch],
            padding_idx=padding_idx,
            ignore_idx=ignore_idx,
        )
        return out
    out = padded_collate_tiled_images_and_mask(
        batch, padding_idx=padding_idx, ignore_idx=ignore_idx
    )
    ratio = out["encoder_input"]["aspect_ratio"]
    for sample, count in enumerate(counts):
        ratio[sample, count:] = 0
    return out
