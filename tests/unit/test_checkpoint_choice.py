"""Which checkpoint a run resumes from, and what it says of the others, on directories laid out
by hand (the trainer's own checkpoints, damaged in every way: tests/integration/
test_trainer_integrity.py)."""

from __future__ import annotations

import json
import logging

from tunepack.trainers.outputs import checkpoint

DIGEST = "d" * 64


def _checkpoint(root, step: int, *, manifest: bool = True):
    path = root / f"step-{step:08d}"
    path.mkdir(parents=True)
    (path / "trainer.pt").write_bytes(b"state")
    if manifest:
        files = checkpoint.file_sums(path)
        (path / checkpoint.MANIFEST).write_text(json.dumps({"digest": DIGEST, "files": files}))
    return path


def _lines(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "tunepack.trainer"]


def test_a_checkpoint_without_its_manifest_is_said_and_set_aside(tmp_path, caplog):
    """Issue 49, item 16: it was skipped with no word, a newer one than the run resumed from."""
    root = tmp_path / "checkpoints"
    older = _checkpoint(root, 2)
    cut = _checkpoint(root, 4, manifest=False)
    caplog.set_level(logging.INFO, logger="tunepack.trainer")
    assert checkpoint.find_or_clear(root, DIGEST, {}, resume=True) == older
    assert _lines(caplog) == [
        f"checkpoint {cut} is damaged (manifest.json is missing): set aside as "
        ".corrupt-step-00000004"
    ]
    assert sorted(p.name for p in root.iterdir()) == [".corrupt-step-00000004", "step-00000002"]
    caplog.clear()  # said once: the next start finds it set aside
    assert checkpoint.find_or_clear(root, DIGEST, {}, resume=True) == older
    assert _lines(caplog) == []


def test_a_fresh_run_removes_a_checkpoint_without_its_manifest_and_says_so(tmp_path, caplog):
    root = tmp_path / "checkpoints"
    _checkpoint(root, 4, manifest=False)
    caplog.set_level(logging.INFO, logger="tunepack.trainer")
    assert checkpoint.find_or_clear(root, DIGEST, {}, resume=False) is None
    assert _lines(caplog) == [
        f"resume=false: starting fresh, removing earlier checkpoints under {root}"
    ]
    assert list(root.iterdir()) == []
