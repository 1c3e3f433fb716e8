"""Where the test suite's CPU goes: CPU seconds per test and per test file, its own processes'
included, from one run of the suite as `make test` runs it.

`make test` on 2 cores is CPU-bound (its wall time is about its CPU seconds over the cores), so
what to make cheaper is what uses the most CPU, not what takes the longest: a test that waits
on a server costs little, one that starts six trainer processes a lot.

    .venv/bin/python benchmarks/suite_cpu.py [--out report.json] [--top 40] [pytest args...]

Each xdist worker records, per test, the CPU of its own process and of the processes it started
and reaped (``getrusage``'s RUSAGE_SELF and RUSAGE_CHILDREN: children count once they are waited
for, their own children with them), as a pytest plugin (``-p benchmarks.suite_cpu``) writing
JSON lines; a process never reaped (one left to init) is not counted, nor is the time a test
spends waiting, and a module fixture's cost is its first test's. Ratios, not seconds, compare
two runs: the machine's speed is in both.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
LOG_VARIABLE = "TUNEPACK_SUITE_CPU_LOG"


def _cpu(who: int) -> float:
    usage = resource.getrusage(who)
    return usage.ru_utime + usage.ru_stime


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    """Setup, call and teardown of one test, with what its fixtures started."""
    log = os.environ.get(LOG_VARIABLE)
    if not log:
        yield
        return
    own, children, wall = _cpu(resource.RUSAGE_SELF), _cpu(resource.RUSAGE_CHILDREN), time.time()
    yield
    record = {
        "test": item.nodeid,
        "own_cpu_s": round(_cpu(resource.RUSAGE_SELF) - own, 3),
        "children_cpu_s": round(_cpu(resource.RUSAGE_CHILDREN) - children, 3),
        "wall_s": round(time.time() - wall, 3),
    }
    with open(log, "a") as f:  # one short line per write: the workers' lines never interleave
        f.write(json.dumps(record) + "\n")


def summarize(records: list[dict]) -> dict:
    """Per file and in all; the files and tests in order of CPU, the most first."""
    files: dict[str, dict[str, float]] = defaultdict(lambda: defaultdict(float))
    for r in records:
        f = files[r["test"].split("::")[0]]
        f["cpu_s"] += r["own_cpu_s"] + r["children_cpu_s"]
        f["children_cpu_s"] += r["children_cpu_s"]
        f["wall_s"] += r["wall_s"]
        f["tests"] += 1
    total = sum(f["cpu_s"] for f in files.values())
    by_file = sorted(
        (
            {
                "file": name,
                **{k: round(v, 1) for k, v in f.items()},
                "tests": int(f["tests"]),
                "share": round(f["cpu_s"] / total, 4) if total else 0.0,
            }  # fmt: skip
            for name, f in files.items()
        ),
        key=lambda f: -f["cpu_s"],
    )
    tests = sorted(records, key=lambda r: -(r["own_cpu_s"] + r["children_cpu_s"]))
    return {"total_cpu_s": round(total, 1), "tests": len(records), "files": by_file,
            "tests_by_cpu": tests}  # fmt: skip


def table(summary: dict, top: int) -> str:
    lines = [f"{summary['tests']} tests, {summary['total_cpu_s']:.0f} CPU-s in all",
             f"{'CPU-s':>8} {'share':>6} {'of it, processes':>17} {'tests':>6}  file"]  # fmt: skip
    for f in summary["files"][:top]:
        lines.append(
            f"{f['cpu_s']:8.1f} {f['share']:6.1%} {f['children_cpu_s']:17.1f} {f['tests']:6d}  "
            f"{f['file']}"
        )
    lines.append("")
    lines.append(f"{'CPU-s':>8}  test")
    for t in summary["tests_by_cpu"][:top]:
        lines.append(f"{t['own_cpu_s'] + t['children_cpu_s']:8.1f}  {t['test']}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, help="write the summary as JSON here too")
    parser.add_argument("--top", type=int, default=40, help="rows of each table (default 40)")
    args, pytest_args = parser.parse_known_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        log = Path(tmp) / "cpu.jsonl"
        log.touch()
        command = [sys.executable, "-m", "pytest", "-q", "-n", "auto", "--dist", "loadfile",
                   "-p", "benchmarks.suite_cpu", *pytest_args]  # fmt: skip
        done = subprocess.run(command, cwd=ROOT, env={**os.environ, LOG_VARIABLE: str(log)})
        records = [json.loads(line) for line in log.read_text().splitlines()]
    if not records:
        print("suite_cpu: no test ran", file=sys.stderr)
        return done.returncode or 1
    summary = summarize(records)
    print(table(summary, args.top))
    if args.out:
        args.out.write_text(json.dumps(summary, indent=1) + "\n")
        print(f"report: {args.out}")
    return done.returncode


if __name__ == "__main__":
    raise SystemExit(main())
