"""The images of an image-text dataset: found, checked and stored beside its rows.

Each image (a path inside the dataset, a URL, or embedded bytes) is decoded before it is kept,
then stored once by content as ``images/<sha256>.<ext>``, so the trainer reads only what was
checked here and no URL, nor any credential in one, is kept (docs/initializers.md, "Image-text
datasets")."""

from __future__ import annotations

import hashlib
import io
import os
import tempfile
import warnings
from collections.abc import Callable
from pathlib import Path, PurePosixPath

from tunepack.core.durable import size_text
from tunepack.core.errors import BadInputError
from tunepack.initializers.transport import download, uri
from tunepack.initializers.transport.retry import retrying

IMAGES_DIR = "images"
MAX_IMAGE_BYTES = 20 << 20  # a 4K photo is a few MiB; larger files are scans or mistakes
MAX_IMAGE_PIXELS = 8192 * 8192  # past this a file is a decompression bomb, not a photo
FORMATS = {"JPEG": "jpg", "PNG": "png", "WEBP": "webp", "GIF": "gif", "BMP": "bmp"}
_URL_SCHEMES = ("https", "http", "s3", "hf")
_FORMATS_TEXT = "JPEG, PNG, WebP, GIF or BMP"


class ImageStore:
    """Resolves, checks and stores the images of one dataset's rows under ``dest/images``.

    ``root`` is the directory relative paths are read from (None when the source has none: an
    hf:// or s3:// dataset, or a single downloaded file), ``cache`` where URLs are downloaded.
    """

    def __init__(self, dest: Path, root: Path | None, cache: Path, log: Callable[[str], None]):
        self.dest = dest
        self.root = root.resolve() if root is not None else None
        self.cache = cache
        self.log = log
        self.stored: dict[str, str] = {}  # sha256 -> the relative path written
        self.by_ref: dict[str, str] = {}  # a path or URL already resolved -> its relative path
        self.bytes_written = 0

    def add(self, ref: object) -> tuple[str | None, str | None]:
        """(the stored image's path relative to the dataset, or None; the problem, or None)."""
        label = "the embedded image"
        try:
            if isinstance(ref, dict):
                data = ref.get("bytes")
                if isinstance(data, bytes | bytearray) and data:
                    return self._store(bytes(data)), None
                ref = ref.get("path")  # an Image cell without bytes points at a file
            if not isinstance(ref, str) or not ref.strip():
                return None, (
                    "must be a path, a URL or an embedded image ({'bytes': ...}), got "
                    f"{_kind(ref)}"
                )
            label = repr(uri.redact(ref))
            if ref in self.by_ref:
                return self.by_ref[ref], None
            scheme = ref.split("://", 1)[0].lower() if "://" in ref else None
            if scheme is not None and scheme not in _URL_SCHEMES:
                raise _Refused(
                    f"is a {scheme}:// URL; images come from paths inside the dataset or "
                    "https://, s3:// or hf:// URLs"
                )
            data = self._download(ref) if scheme else self._read_local(ref)
            stored = self._store(data)
            self.by_ref[ref] = stored
            return stored, None
        except _Refused as refused:
            return None, f"{label} {refused}"

    # ------------------------------------------------------------------ sources
    def _read_local(self, ref: str) -> bytes:
        if self.root is None:
            raise _Refused(
                "is a path, but this dataset's source has no directory to read it from; embed "
                "the images (a Parquet image column) or give https://, s3:// or hf:// URLs"
            )
        pure = PurePosixPath(ref)
        if pure.is_absolute() or ".." in pure.parts or "\\" in ref or "\0" in ref:
            raise _Refused("is not a path inside the dataset directory")
        path = (self.root / pure).resolve()
        if not path.is_relative_to(self.root):  # a symbolic link out of the dataset
            raise _Refused("leads outside the dataset directory")
        if not path.is_file():
            raise _Refused("is not a file in the dataset directory")
        size = path.stat().st_size
        if size > MAX_IMAGE_BYTES:
            raise _Refused(_too_large(size))
        return path.read_bytes()

    def _download(self, ref: str) -> bytes:
        shown = uri.redact(ref)
        try:
            parsed = uri.parse(ref)
            source = uri.remote_source(parsed, "dataset")
            listing = retrying(f"listing {shown!r}", source.list, self.log)
        except BadInputError as error:
            raise _Refused(f"could not be fetched: {error}") from None
        if len(listing.files) != 1:
            raise _Refused("is not one file")
        (file,) = listing.files
        if file.size is not None and file.size > MAX_IMAGE_BYTES:
            raise _Refused(_too_large(file.size))
        self.cache.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=self.cache) as tmp:
            try:
                fetched = download.fetch(source, [file], Path(tmp), lambda _line: None)
            except BadInputError as error:
                raise _Refused(f"could not be fetched: {error}") from None
            path = fetched[file.path].path
            size = path.stat().st_size
            if size > MAX_IMAGE_BYTES:
                raise _Refused(_too_large(size))
            return path.read_bytes()

    # ------------------------------------------------------------------ checked, then kept
    def _store(self, data: bytes) -> str:
        if len(data) > MAX_IMAGE_BYTES:
            raise _Refused(_too_large(len(data)))
        ext = check_image(data)
        digest = hashlib.sha256(data).hexdigest()
        if digest in self.stored:
            return self.stored[digest]
        rel = f"{IMAGES_DIR}/{digest}.{ext}"
        target = self.dest / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        with open(target, "xb") as out:
            out.write(data)
            out.flush()
            os.fsync(out.fileno())
        self.stored[digest] = rel
        self.bytes_written += len(data)
        return rel

    def record(self) -> dict:
        """The manifest's ``images``: where they are, how many, how large."""
        return {"dir": IMAGES_DIR, "count": len(self.stored), "bytes": self.bytes_written}

    def summary(self) -> str:
        return f"{len(self.stored)} images ({size_text(self.bytes_written)}) in {IMAGES_DIR}/"


class _Refused(Exception):
    """An image that cannot be used: the row's problem."""


def check_image(data: bytes) -> str:
    """The file extension of a decodable image in ``data``; ``_Refused`` says why not."""
    from PIL import Image, UnidentifiedImageError

    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            with Image.open(io.BytesIO(data)) as image:
                kind, (width, height) = image.format, image.size
                if width * height > MAX_IMAGE_PIXELS:
                    raise _Refused(
                        f"is {width}x{height} pixels, more than the {MAX_IMAGE_PIXELS:,} an "
                        "image may have; resize it"
                    )
                if kind not in FORMATS:
                    raise _Refused(f"is {kind or 'of an unknown format'}; use {_FORMATS_TEXT}")
                image.load()  # decode every pixel: a truncated file fails here, not in training
    except _Refused:
        raise
    except (UnidentifiedImageError, Image.DecompressionBombError, Image.DecompressionBombWarning):
        raise _Refused(f"is not a readable image ({_FORMATS_TEXT})") from None
    except (OSError, SyntaxError, ValueError) as error:
        raise _Refused(f"is not a readable image ({error})") from None
    return FORMATS[kind]


def _too_large(size: int) -> str:
    return f"is {size_text(size)}, more than the {size_text(MAX_IMAGE_BYTES)} an image may be"


def _kind(value: object) -> str:
    if value is None:
        return "null"
    if isinstance(value, str):
        return "an empty string"
    return type(value).__name__
