"""The image_chat schema through the real dataset initializer: images from paths inside a local
dataset, from a loopback HTTP server, embedded in a Parquet image column; each one decoded,
stored once by content beside the rows, and every unusable image named with its row."""

from __future__ import annotations

import hashlib
import io
import json
from functools import partial
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer
from threading import Thread

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from PIL import Image

from tests.helpers import run_dataset_initializer
from tunepack.core.errors import EXIT_BAD_INPUT, UnsupportedError
from tunepack.core.workspace import MANIFEST_FILE
from tunepack.initializers.data import images


def _image(fmt: str, size=(24, 16), color=(200, 30, 30)) -> bytes:
    out = io.BytesIO()
    Image.new("RGB", size, color).save(out, format=fmt)
    return out.getvalue()


PNG, JPEG = _image("PNG"), _image("JPEG", color=(10, 120, 240))


def _row(*refs, question="What is in the picture?", answer="A red square."):
    parts = [{"type": "image"} for _ in refs] + [{"type": "text", "text": question}]
    return {
        "messages": [
            {"role": "user", "content": parts},
            {"role": "assistant", "content": answer},
        ],
        "images": list(refs),
    }


def _write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def _output(tmp_path):
    out = tmp_path / "ws" / "dataset"
    rows = [json.loads(x) for x in (out / "train.jsonl").read_text().splitlines()]
    return out, rows, json.loads((out / MANIFEST_FILE).read_text())


def _error(result) -> str:
    assert result.returncode == EXIT_BAD_INPUT, result.stderr
    return result.stderr


@pytest.fixture
def served(tmp_path):
    root = tmp_path / "served"
    root.mkdir()

    class Quiet(SimpleHTTPRequestHandler):
        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), partial(Quiet, directory=str(root)))
    Thread(target=server.serve_forever, daemon=True).start()
    yield root, f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


def test_local_paths_are_checked_and_stored_once_by_content(tmp_path):
    data = tmp_path / "data"
    (data / "pics").mkdir(parents=True)
    (data / "pics" / "red.png").write_bytes(PNG)
    (data / "pics" / "blue.jpg").write_bytes(JPEG)
    (data / "pics" / "red-again.png").write_bytes(PNG)  # the same bytes under another name
    _write_jsonl(
        data / "train.jsonl",
        [_row("pics/red.png"), _row("pics/blue.jpg", "pics/red-again.png"), _row("pics/red.png")],
    )
    result = run_dataset_initializer(tmp_path / "ws", str(data), cwd=tmp_path)
    assert result.returncode == 0, result.stderr

    out, rows, manifest = _output(tmp_path)
    red = f"images/{hashlib.sha256(PNG).hexdigest()}.png"
    blue = f"images/{hashlib.sha256(JPEG).hexdigest()}.jpg"
    assert [r["images"] for r in rows] == [[red], [blue, red], [red]]
    assert (out / red).read_bytes() == PNG and (out / blue).read_bytes() == JPEG
    assert sorted(p.name for p in (out / "images").iterdir()) == sorted(
        [red.split("/")[1], blue.split("/")[1]]
    )
    assert rows[1]["messages"][0]["content"] == [
        {"type": "image"},
        {"type": "image"},
        {"type": "text", "text": "What is in the picture?"},
    ]
    assert rows[0]["messages"][1]["content"] == [{"type": "text", "text": "A red square."}]
    assert (manifest["schema"], manifest["rows"]) == ("image_chat", 3)
    assert manifest["images"] == {"dir": "images", "count": 2, "bytes": len(PNG) + len(JPEG)}
    assert "checked and stored 2 images" in result.stderr + result.stdout


def test_urls_are_downloaded_and_no_url_is_kept(tmp_path, served):
    root, base = served
    (root / "cat.png").write_bytes(PNG)
    data = tmp_path / "rows.jsonl"
    _write_jsonl(data, [_row(f"{base}/cat.png"), _row(f"{base}/cat.png#size={len(PNG)}")])
    result = run_dataset_initializer(tmp_path / "ws", str(data), cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    out, rows, manifest = _output(tmp_path)
    stored = f"images/{hashlib.sha256(PNG).hexdigest()}.png"
    assert [r["images"] for r in rows] == [[stored], [stored]]
    assert base not in (out / "train.jsonl").read_text() + json.dumps(manifest)
    assert manifest["images"]["count"] == 1
    # The download cache is gone once the dataset is published.
    assert not list((tmp_path / "ws").glob(".tunepack-downloads/images-*"))


def test_a_parquet_image_column_is_read_as_embedded_bytes(tmp_path):
    """As datasets writes an Image feature: a struct of bytes and path, in a list column; the
    messages nested (a list of structs whose parts' missing keys are nulls)."""
    struct = pa.struct([("bytes", pa.binary()), ("path", pa.string())])
    messages = [
        {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What is it?"}]},
        {"role": "assistant", "content": [{"type": "text", "text": "A square."}]},
    ]
    table = pa.table(
        {
            "messages": [messages, messages],
            "images": pa.array(
                [[{"bytes": PNG, "path": "a.png"}], [{"bytes": JPEG, "path": None}]],
                type=pa.list_(struct),
            ),
        }
    )
    pq.write_table(table, tmp_path / "train.parquet")
    result = run_dataset_initializer(tmp_path / "ws", "train.parquet", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    out, written, manifest = _output(tmp_path)
    assert [r["images"][0].rsplit(".", 1)[1] for r in written] == ["png", "jpg"]
    assert (out / written[1]["images"][0]).read_bytes() == JPEG
    assert manifest["images"]["count"] == 2


@pytest.mark.parametrize(
    ("files", "refs", "problem"),
    [
        ({"x.png": b"not an image at all"}, ["x.png"],
         "images[0]: 'x.png' is not a readable image (JPEG, PNG, WebP, GIF or BMP)"),
        ({"cut.png": PNG[: len(PNG) // 2]}, ["cut.png"],
         "images[0]: 'cut.png' is not a readable image"),
        ({}, ["missing.png"], "images[0]: 'missing.png' is not a file in the dataset directory"),
        ({}, ["../outside.png"],
         "images[0]: '../outside.png' is not a path inside the dataset directory"),
        ({}, ["/etc/hostname"],
         "images[0]: '/etc/hostname' is not a path inside the dataset directory"),
        ({}, ["ftp://host/a.png"],
         "images[0]: 'ftp://host/a.png' is a ftp:// URL; images come from paths inside the "
         "dataset or https://, s3:// or hf:// URLs"),
        ({}, [5],
         "images[0]: must be a path, a URL or an embedded image ({'bytes': ...}), got int"),
        ({"tiff.tif": _image("TIFF")}, ["tiff.tif"],
         "images[0]: 'tiff.tif' is TIFF; use JPEG, PNG, WebP, GIF or BMP"),
    ],
)  # fmt: skip
def test_an_unusable_image_is_named_with_its_row_and_nothing_is_published(
    tmp_path, files, refs, problem
):
    data = tmp_path / "data"
    data.mkdir()
    (data / "ok.png").write_bytes(PNG)
    for name, content in files.items():
        (data / name).write_bytes(content)
    _write_jsonl(data / "train.jsonl", [_row("ok.png"), _row(*refs)])
    message = _error(run_dataset_initializer(tmp_path / "ws", str(data), cwd=tmp_path))
    assert f"train.jsonl row 2: {problem}" in message
    assert "Traceback" not in message
    assert not (tmp_path / "ws" / "dataset").exists()


def test_row_shape_errors(tmp_path):
    bad = [
        {**_row("a.png"), "images": ["a.png", "b.png"]},
        {"messages": [{"role": "assistant", "content": [{"type": "image"}]}], "images": ["a.png"]},
        {"messages": [{"role": "user", "content": [{"type": "audio"}]}], "images": []},
        {"messages": [{"role": "user", "content": [{"type": "image"}]}], "images": ["a.png"]},
    ]
    (tmp_path / "a.png").write_bytes(PNG)
    _write_jsonl(tmp_path / "rows.jsonl", bad)
    message = _error(run_dataset_initializer(tmp_path / "ws", "rows.jsonl", cwd=tmp_path))
    assert "has 4 invalid rows" in message
    assert (
        "rows.jsonl row 1: the messages hold 1 image part(s) ({'type': 'image'}) but 'images' "
        "has 2; give one image per part, in order"
    ) in message
    assert "row 2: messages[0]: a assistant turn holds an image; images go in user turns" in message
    assert (
        "row 3: messages[0].content[0]: expected {'type': 'text', 'text': <string>} or "
        "{'type': 'image'}"
    ) in message
    assert "row 4: field 'messages' has no assistant turn, so there is nothing to learn" in message


def test_oversized_and_bomb_images_are_refused(tmp_path, monkeypatch):
    """The limits, lowered for the test: a file over MAX_IMAGE_BYTES, an image over
    MAX_IMAGE_PIXELS (what a decompression bomb is), both named."""
    big = _image("PNG", size=(300, 300))
    with pytest.raises(images._Refused, match=r"is 300x300 pixels, more than the 10,000"):
        monkeypatch.setattr(images, "MAX_IMAGE_PIXELS", 100 * 100)
        images.check_image(big)
    monkeypatch.setattr(images, "MAX_IMAGE_BYTES", 100)
    store = images.ImageStore(tmp_path / "dest", tmp_path, tmp_path / "cache", print)
    (tmp_path / "big.png").write_bytes(big)
    path, problem = store.add("big.png")
    assert path is None and problem.startswith("'big.png' is ")
    assert problem.endswith("more than the 100 bytes an image may be")
    path, problem = store.add({"bytes": big, "path": None})
    assert problem.startswith("the embedded image is ")


def test_a_text_model_refuses_an_image_dataset_in_one_line(tmp_path, tiny_model_dir):
    from tunepack.runtimes import catalog
    from tunepack.runtimes.args import parse_trainer_args
    from tunepack.trainers.config import build_config

    data = tmp_path / "data"
    data.mkdir()
    (data / "a.png").write_bytes(PNG)
    _write_jsonl(data / "train.jsonl", [_row("a.png")])
    result = run_dataset_initializer(tmp_path / "ws", str(data), cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    entry = catalog.get("tiny-llama3")
    with pytest.raises(UnsupportedError) as refused:
        build_config(
            entry,
            parse_trainer_args([], entry),
            model_dir=tiny_model_dir,
            dataset_dir=tmp_path / "ws" / "dataset",
            output_dir=tmp_path / "out",
            cache_dir=tmp_path / "cache",
        )
    assert str(refused.value) == (
        "the dataset holds images (schema image_chat), but tiny-llama3 (Llama 3) reads text "
        "only; an image-text dataset needs a model that takes images"
    )
