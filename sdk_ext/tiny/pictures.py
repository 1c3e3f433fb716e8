"""The tiny image dataset: pictures of coloured squares and circles, and questions about them.

``write_tiny_image_dataset`` writes an ``image_chat`` dataset (docs/initializers.md, "Image-text
datasets") for Llama 3.2 Vision: ``train.jsonl`` beside a ``pics/`` folder of PNG files, each row
a user turn (the picture, "What color is the square?") and the answer ("The square is red.").
Drawn with Pillow (``tunepack[vision]``), seeded, so the same arguments give the same bytes.
"""

from __future__ import annotations

import filecmp
import json
import random
import shutil
import tempfile
from pathlib import Path

from tunepack.core import durable
from tunepack.core.errors import ConflictError, NotAvailableError
from tunepack.tiny.dataset import check_int

COLORS = {"red": (220, 30, 30), "green": (30, 180, 60), "blue": (30, 60, 220)}
SHAPES = ("square", "circle")
# Sizes that fit 1, 2 or more tiles of the tiny model's 28 pixels, wide and tall, and need
# resizing: rows take them in turn, so any four consecutive rows hold every kind.
SIZES = ((40, 40), (60, 30), (30, 70), (50, 50))
PICTURES_DIR = "pics"
ROWS_FILE = "train.jsonl"
DEFAULT_ROWS = 24


def picture(shape: str, color: str, size: tuple[int, int]):
    """A ``shape`` ("square" or "circle") of ``color`` on a light background, as a PIL image."""
    from PIL import Image, ImageDraw

    image = Image.new("RGB", size, (245, 245, 245))
    draw = ImageDraw.Draw(image)
    w, h = size
    box = (w // 5, h // 5, w - w // 5, h - h // 5)
    (draw.rectangle if shape == "square" else draw.ellipse)(box, fill=COLORS[color])
    return image


def tiny_image_rows(rows: int = DEFAULT_ROWS, seed: int = 0) -> list[tuple[dict, tuple]]:
    """(row, (shape, color, size)) for each picture: every six rows hold each shape and colour
    once, in an order drawn from ``seed``; the sizes take turns (``SIZES``)."""
    check_int("rows", rows, minimum=1)
    rng = random.Random(check_int("seed", seed))
    kinds: list[tuple[str, str]] = []
    while len(kinds) < rows:
        block = [(shape, color) for color in COLORS for shape in SHAPES]
        rng.shuffle(block)
        kinds += block
    out = []
    for n, (shape, color) in enumerate(kinds[:rows]):
        question = [{"type": "image"}, {"type": "text", "text": f"What color is the {shape}?"}]
        row = {
            "messages": [
                {"role": "user", "content": question},
                {"role": "assistant", "content": f"The {shape} is {color}."},
            ],
            "images": [f"{PICTURES_DIR}/{n}.png"],
        }
        out.append((row, (shape, color, SIZES[n % len(SIZES)])))
    return out


def write_tiny_image_dataset(out_dir: Path, rows: int = DEFAULT_ROWS, seed: int = 0) -> Path:
    """Write ``rows`` pictures and their ``train.jsonl`` into ``out_dir`` and return it.

    The directory is built beside ``out_dir`` and renamed into place: ``out_dir`` must be absent
    or empty, or hold this very dataset already (then it is left as it is).
    """
    out_dir = Path(out_dir)
    drawn = tiny_image_rows(rows, seed)
    try:
        import PIL  # noqa: F401
    except ImportError:
        raise NotAvailableError(
            "the tiny image dataset is drawn with Pillow, which is not installed: pip install "
            "'tunepack[vision]' (make dev has it)"
        ) from None
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.", suffix=".tmp", dir=out_dir.parent))
    try:
        (tmp / PICTURES_DIR).mkdir()
        for row, (shape, color, size) in drawn:
            picture(shape, color, size).save(tmp / row["images"][0])
        text = "".join(json.dumps(row) + "\n" for row, _ in drawn)
        (tmp / ROWS_FILE).write_text(text, encoding="utf-8")
        for path in (tmp, *tmp.rglob("*")):  # readable by a trainer running as another user
            path.chmod(0o755 if path.is_dir() else 0o644)
        if out_dir.is_dir() and any(out_dir.iterdir()):
            if not _same_files(tmp, out_dir):
                raise ConflictError(
                    f"{out_dir} is not empty (nor the dataset these arguments write); give a new "
                    "or empty directory for the image dataset"
                )
            return out_dir
        if out_dir.exists() and not out_dir.is_dir():
            raise ConflictError(
                f"{out_dir} is a file; give a new or empty directory for the image dataset"
            )
        durable.rename_dir(tmp, out_dir)  # replaces an empty directory, not another
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out_dir


def _same_files(a: Path, b: Path) -> bool:
    """Whether ``a`` and ``b`` hold the same files with the same bytes, and nothing else."""
    names = sorted(p.relative_to(a) for p in a.rglob("*"))
    if names != sorted(p.relative_to(b) for p in b.rglob("*")):
        return False
    files = [str(n) for n in names if (a / n).is_file()]
    _, mismatch, errors = filecmp.cmpfiles(a, b, files, shallow=False)
    return not mismatch and not errors
