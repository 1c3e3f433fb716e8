"""The planner as programs: `tunepack plan`'s exit code and the planner benchmark's dry mode.
Its arithmetic: tests/unit/test_planner.py."""

from __future__ import annotations

import json
import subprocess
import sys

from tests.helpers import run_benchmark


def test_cli_plan_exit_code_says_whether_it_fits():
    run = [sys.executable, "-m", "tunepack.cli", "plan", "--model", "llama3.1-8b"]
    fits = subprocess.run([*run, "--method", "lora", "--batch-size", "2"], capture_output=True,
                          text=True)  # fmt: skip
    assert fits.returncode == 0 and "fits in 77.2 GiB" in fits.stdout
    too_big = subprocess.run([*run, "--method", "full", "--batch-size", "32"], capture_output=True,
                             text=True)  # fmt: skip
    assert too_big.returncode == 1 and "does NOT fit" in too_big.stdout


def test_benchmark_dry_mode_exercises_the_measurement_path(tmp_path):
    out = tmp_path / "report.json"
    run_benchmark("planner_accuracy.py", "--dry", "--json", str(out), timeout=300)
    report = json.loads(out.read_text())
    assert report["mode"] == "dry" and report["rows"]
    row = report["rows"][0]
    assert row["estimate_bytes"] > 0 and row["measured_bytes"] is None
    assert row["steps_run"] == 2 and row["fused_loss"] and row["loss"] > 0
