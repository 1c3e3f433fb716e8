"""What the two side-by-side benchmarks (side_by_side.py: supervised LoRA; grpo_side_by_side.py:
GRPO) share: TRL's environment, a measured run, the command line around their systems, the
interleaved rounds, the medians over them and the report's cells. Each benchmark keeps its own
systems, figures and table."""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import os
import platform
import shutil
import signal
import statistics
import subprocess
import sys
import sysconfig
import tempfile
import time
from collections.abc import Iterator
from importlib import metadata
from pathlib import Path

from sbs_workload import CACHE
from trainer_bench import run_measured

HERE = Path(__file__).resolve().parent
TRL_VERSION = "1.16.0"


def log(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


# ----------------------------------------------------------------------------- TRL's venv
def trl_python(version: str, *, create: bool, log=print) -> tuple[Path | None, str]:
    """The interpreter of TRL's virtual environment, creating it if asked; else why not."""
    venv = CACHE / f"trl-{version}"
    python = venv / "bin" / "python"
    if (venv / "ready").is_file():
        return python, ""
    if not create:
        return None, f"TRL's environment {venv} is not created (run without --trl if-ready)"
    log(f"creating TRL {version}'s environment in {venv} ...")
    CACHE.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{venv.name}.", dir=CACHE))
    try:
        subprocess.run([sys.executable, "-m", "venv", str(tmp)], check=True)
        # The project's packages after TRL's own: torch is reused, not downloaded again, and
        # whatever TRL needs in another version is installed in (and imported from) its venv.
        site = Path(
            subprocess.check_output(
                [
                    tmp / "bin" / "python",
                    "-c",
                    "import sysconfig; print(sysconfig.get_paths()['purelib'])",
                ],
                text=True,
            ).strip()
        )
        (site / "zz_tunepack_project.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
        done = subprocess.run(
            [tmp / "bin" / "python", "-m", "pip", "install", "-q", f"trl[peft]=={version}"],
            capture_output=True,
            text=True,
            timeout=1800,
        )
        if done.returncode:
            tail = (done.stderr or done.stdout).strip().splitlines()[-3:]
            return None, f"pip could not install trl[peft]=={version}: {' / '.join(tail)}"
        (tmp / "ready").write_text(version + "\n")
        shutil.rmtree(venv, ignore_errors=True)
        os.rename(tmp, venv)
    except (OSError, subprocess.SubprocessError) as err:
        return None, f"could not create TRL's environment: {err}"
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return python, ""


# ----------------------------------------------------------------------------- runs
def measure(cmd: list, env: dict, log: Path) -> dict:
    """Run ``cmd`` to the end (it must succeed): its process tree's CPU seconds, wall seconds
    and peak resident memory."""
    start = time.perf_counter()
    code, rss, cpu = run_measured([str(c) for c in cmd], env, log)
    if code:
        raise RuntimeError(f"{cmd[1:4]} exited {code}:\n{log.read_text()[-3000:]}")
    return {"cpu_s": cpu, "wall_s": time.perf_counter() - start, "rss_gib": rss}


def read_records(path: Path) -> list[dict]:
    """The JSON lines a probe or a callback wrote (none if it never started)."""
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


class RunDirs:
    """A bench's numbered run directories under ``self.root``, in the order they ran."""

    root: Path
    runs: int = 0

    def _run_dir(self, name: str) -> Path:
        self.runs += 1
        path = self.root / f"{self.runs:02d}-{name}"
        path.mkdir()
        return path


def run_rounds(bench, systems: list[str], rounds: int, log) -> list[dict[str, dict]]:
    """``rounds`` rounds of every system, each round starting one system later than the last,
    so that no system always runs first (or on the machine's warmest caches)."""
    done = []
    for index in range(rounds):
        order = systems[index % len(systems) :] + systems[: index % len(systems)]
        results = {}
        for name in order:
            log(f"round {index + 1}/{rounds}: {name} ...")
            results[name] = bench.run(name)
        done.append(results)
    return done


@contextlib.contextmanager
def scratch(prefix: str, keep: Path | None) -> Iterator[Path]:
    """A temporary directory for the runs, copied to ``keep`` (if given) and removed after."""
    # SIGTERM unwinds like Ctrl-C: the running trainer is stopped, the temporary runs removed.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    root = Path(tempfile.mkdtemp(prefix=prefix))
    try:
        yield root
    finally:
        if keep:
            shutil.copytree(root, keep, symlinks=True, dirs_exist_ok=True)
        shutil.rmtree(root, ignore_errors=True)


# ----------------------------------------------------------------------------- report
def median(values):
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def median_row(name: str, runs: list[dict], keys, per_round: str) -> dict:
    """One system's row: the median over its rounds of each of ``keys``, ``per_round``'s value
    in each round, and the rounds' notes."""
    row = {"system": name, "rounds": len(runs)}
    for key in keys:
        row[key] = median([run.get(key) for run in runs])
    row[f"per_round_{per_round}"] = [run.get(per_round) for run in runs]
    row["notes"] = sorted({run["note"] for run in runs if run.get("note")})
    return row


def versions(trl_runs: list[dict], packages: tuple[str, ...], *, commit: bool = False) -> dict:
    """The versions of ``packages`` here, of TRL's environment where it ran, of Python; with
    ``commit``, the checkout's commit and how many of tunepack's files differ from it."""
    found = {}
    for package in packages:
        try:
            found[package] = metadata.version(package)
        except metadata.PackageNotFoundError:
            found[package] = None
    for run in trl_runs:
        found["trl_env"] = run["versions"]
        found["trl_env_paths"] = run["paths"]
        break
    found["python"] = platform.python_version()
    if commit:
        git = ["git", "-C", str(HERE.parent)]
        try:
            found["commit"] = subprocess.check_output(
                [*git, "rev-parse", "HEAD"], text=True
            ).strip()
            changed = subprocess.check_output(
                [*git, "status", "--porcelain", "--", "trainers", "runtimes", "sdk_ext"], text=True
            )
            found["uncommitted_tunepack_files"] = len(changed.splitlines())
        except (OSError, subprocess.CalledProcessError):
            found["commit"] = None
    return found


def cell(row: dict, key: str, fmt: str) -> str:
    """A table cell: ``row[key]`` in ``fmt``, or a dash as wide where there is no figure."""
    v = row.get(key)
    return format(v, fmt) if v is not None else "-".rjust(int(fmt.split(".")[0]))


def system_lines(report: dict, width: int, cells) -> list[str]:
    """The table's body: each system's name (``width`` wide) and ``cells(f)``, where ``f(key,
    fmt)`` is that row's cell; its notes under it; then each skipped system and why."""
    lines = []
    for row in report["systems"].values():
        lines.append(f"{row['system']:<{width}}" + cells(functools.partial(cell, row)))
        lines += [f"{'':<{width}}{note}" for note in row["notes"]]
    for name, why in report["skipped"].items():
        lines.append(f"{name:<{width}}skipped: {why}")
    return lines


# ----------------------------------------------------------------------------- command line
def add_run_arguments(parser: argparse.ArgumentParser, systems: tuple[str, ...]) -> None:
    """The options both benchmarks end with: which systems, TRL's environment, where to write."""
    parser.add_argument("--systems", default=",".join(systems), help="comma-separated subset")
    parser.add_argument(
        "--trl",
        choices=("create", "if-ready", "no"),
        default="create",
        help="TRL's environment: create it if missing (pip), use it only if already created, "
        "or leave TRL out",
    )
    parser.add_argument("--trl-version", default=TRL_VERSION)
    parser.add_argument("--json", type=Path, help="also write the report here as JSON")
    parser.add_argument("--keep", type=Path, help="keep the runs' directories here")


def chosen_systems(
    parser: argparse.ArgumentParser, args: argparse.Namespace, systems: tuple[str, ...]
) -> list[str]:
    chosen = [s for s in args.systems.split(",") if s]
    unknown = [s for s in chosen if s not in systems]
    if unknown or not chosen:
        parser.error(f"--systems: unknown {unknown}; choose from {', '.join(systems)}")
    return chosen


def trl_or_skipped(
    systems: list[str], args: argparse.Namespace, log
) -> tuple[Path | None, dict[str, str], list[str]]:
    """TRL's interpreter where a TRL system is asked for and its environment is (or is made)
    ready; else the TRL systems, skipped with the reason. Returns it, the skipped systems and
    the systems left to run."""
    skipped: dict[str, str] = {}
    trl = None
    wanted_trl = [s for s in systems if s.startswith("trl")]
    if wanted_trl:
        why = "left out (--trl no)"
        if args.trl != "no":
            trl, why = trl_python(args.trl_version, create=args.trl == "create", log=log)
        if trl is None:
            for name in wanted_trl:
                skipped[name] = why
            systems = [s for s in systems if s not in wanted_trl]
    return trl, skipped, systems


def emit(text: str, report: dict, json_path: Path | None) -> None:
    """The table on stdout; the report as JSON too where asked."""
    print(text)
    if json_path:
        json_path.write_text(json.dumps(report, indent=2) + "\n")
