"""metrics.jsonl (trainers/outputs/metrics_file.py): each step once across a resume, and never a
line cut short."""

from __future__ import annotations

import json

from tunepack.trainers.outputs import metrics_file


def _line(**record) -> str:
    return json.dumps(record) + "\n"


def test_a_fresh_run_starts_an_empty_file(tmp_path):
    path = tmp_path / "output" / "metrics.jsonl"
    path.parent.mkdir()
    path.write_text(_line(event="step", step=1))
    with metrics_file.open_for(path, None) as file:
        metrics_file.append_line(file, path, _line(event="step", step=1))
    assert path.read_text() == _line(event="step", step=1)


def test_a_resumed_run_keeps_the_lines_up_to_its_checkpoint_and_drops_a_cut_one(tmp_path):
    path = tmp_path / "metrics.jsonl"
    kept = _line(event="step", step=1) + _line(event="eval", step=2) + _line(event="x")
    # Steps 3 and 4 were trained after the checkpoint of step 2; the kill cut step 5's line.
    path.write_text(kept + _line(event="step", step=3) + _line(event="step", step=4) + '{"ev')
    with metrics_file.open_for(path, 2) as file:
        metrics_file.append_line(file, path, _line(event="step", step=3))
    assert path.read_text() == kept + _line(event="step", step=3)
