"""benchmarks/suite_cpu.py on a suite of its own: the CPU of the processes a test starts is that
test's, as make test runs the suite (xdist workers)."""

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

# A child that uses a given amount of CPU, however fast the machine: it spins until its own
# process time says so.
SUITE = """
import subprocess, sys

BURN = "import time\\nwhile time.process_time() < 0.5: pass"

def test_starts_a_busy_process():
    subprocess.run([sys.executable, "-c", BURN], check=True)

def test_starts_nothing():
    assert sum(range(10)) == 45
"""


def test_the_cpu_of_a_tests_processes_is_counted_as_that_tests(tmp_path):
    (tmp_path / "test_small.py").write_text(SUITE)
    out = tmp_path / "report.json"
    done = subprocess.run(
        [
            sys.executable,
            str(REPO / "benchmarks" / "suite_cpu.py"),
            "--out",
            str(out),
            str(tmp_path / "test_small.py"),
        ],  # fmt: skip
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    report = json.loads(out.read_text())
    assert report["tests"] == 2
    tests = {t["test"].rsplit("::", 1)[1]: t for t in report["tests_by_cpu"]}
    busy, idle = tests["test_starts_a_busy_process"], tests["test_starts_nothing"]
    assert busy["children_cpu_s"] >= 0.5
    assert idle["children_cpu_s"] == 0.0
    assert report["tests_by_cpu"][0]["test"].endswith("::test_starts_a_busy_process")
    [small] = report["files"]
    assert small["tests"] == 2 and small["share"] == 1.0
    assert small["cpu_s"] == round(
        sum(t["own_cpu_s"] + t["children_cpu_s"] for t in tests.values()), 1
    )
    assert f"2 tests, {report['total_cpu_s']:.0f} CPU-s in all" in done.stdout
    assert f"report: {out}" in done.stdout
