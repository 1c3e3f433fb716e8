"""Kill-and-resume soak: SIGKILL the trainer at random moments, resume until done, compare.

One reference run trains without interruption. The soaked run trains the same thing with a
checkpoint every step, and is killed ``--kills`` times (SIGKILL to every process of it at once:
the launcher, torchrun and its workers, so none gets to checkpoint): each time at a random step
and a random fraction of a second after it was logged, so kills land in the middle of steps, of
checkpoint writes and of start-up. After each kill the same command runs again and resumes from
the newest complete checkpoint. At the end the adapters must be equal bit for bit, and every step
must appear once in ``metrics.jsonl``. ``restarts_recorded`` is the number of resumes in the
final checkpoint's lineage (a kill before the next checkpoint leaves no trace there).

    .venv/bin/python benchmarks/kill_resume_soak.py [--kills 10] [--seed 0] [--nproc 1]
        [--max-steps 24] [--json report.json]

Exit status 0 when the soaked run ends identical to the reference, 1 otherwise.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil
import torch
from safetensors.torch import load_file

from tunepack.tiny import write_tiny_dataset, write_tiny_model

MODEL = "tiny-llama3"
ARGS = ["batch_size=8", "grad_accum=2", "lora_dropout=0.1", "warmup_steps=2", "lr=3e-3"]


def _env(workspace: Path, nproc: int, port: int) -> dict[str, str]:
    return {
        **os.environ,
        "TUNEPACK_WORKSPACE": str(workspace),
        "TUNEPACK_MODEL": MODEL,
        "PET_NPROC_PER_NODE": str(nproc),
        "PET_MASTER_PORT": str(port),
        "OMP_NUM_THREADS": "1",
    }


def _initialize(workspace: Path, scratch: Path) -> None:
    model = write_tiny_model(scratch / "model")
    data = write_tiny_dataset(scratch / "data.jsonl")
    for program, uri in (("dataset", data), ("model", model)):
        done = subprocess.run(
            [sys.executable, "-m", f"tunepack.initializers.{program}"],
            env={**_env(workspace, 1, 0), "STORAGE_URI": f"file://{uri}"},
            capture_output=True,
            text=True,
        )
        if done.returncode != 0:
            raise SystemExit(f"{program} initializer failed:\n{done.stderr}")


def _trainer(workspace: Path, args: list[str], nproc: int, port: int, log: Path):
    with log.open("ab") as out:
        return subprocess.Popen(
            [sys.executable, "-m", "tunepack.trainers.launch", *args],
            env=_env(workspace, nproc, port),
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )


def _kill_tree(proc: subprocess.Popen) -> None:
    """SIGKILL the launcher and all its descendants at once (torchrun runs in a session of its
    own, so a process-group kill would miss it, and it would stop its workers gracefully)."""
    try:
        tree = [psutil.Process(proc.pid), *psutil.Process(proc.pid).children(recursive=True)]
    except psutil.Error:
        tree = []
    for member in tree:
        try:
            member.send_signal(signal.SIGKILL)
        except psutil.Error:
            pass
    proc.wait()
    psutil.wait_procs(tree, timeout=30)


def _steps_logged(workspace: Path) -> int:
    metrics = workspace / "output" / "metrics.jsonl"
    if not metrics.exists():
        return 0
    return sum('"event": "step"' in line for line in metrics.read_text().splitlines())


def _adapter(workspace: Path) -> dict[str, torch.Tensor]:
    return load_file(workspace / "output" / "adapter" / "adapter_model.safetensors")


def soak(kills: int, seed: int, nproc: int, max_steps: int, scratch: Path) -> dict:
    rng = random.Random(seed)
    base = scratch / "initialized"
    _initialize(base, scratch)
    # Enough epochs that max_steps, not the data, ends the run whatever the number of processes.
    args = [*ARGS, "epochs=100", f"max_steps={max_steps}", "checkpoint_every_minutes=0"]

    reference = scratch / "reference"
    subprocess.run(["cp", "-a", str(base), str(reference)], check=True)
    started = time.perf_counter()
    ref = _trainer(reference, args, nproc, 29611, scratch / "reference.log")
    if ref.wait() != 0:
        raise SystemExit(f"reference run failed: see {scratch / 'reference.log'}")
    reference_s = time.perf_counter() - started

    soaked = scratch / "soaked"
    subprocess.run(["cp", "-a", str(base), str(soaked)], check=True)
    soak_args = [*args, "checkpoint_every_steps=1"]
    log = scratch / "soaked.log"
    kill_points, attempts = [], 0
    started = time.perf_counter()
    while True:
        attempts += 1
        proc = _trainer(soaked, soak_args, nproc, 29621 + attempts, log)
        if len(kill_points) < kills:
            target = rng.randint(_steps_logged(soaked), max_steps - 1)
            delay = rng.uniform(0.0, 0.4)
            while proc.poll() is None and _steps_logged(soaked) < target:
                time.sleep(0.02)
            time.sleep(delay)
            if proc.poll() is None:
                _kill_tree(proc)
                kill_points.append({"after_step": target, "delay_s": round(delay, 3)})
                continue
        if proc.wait() == 0:
            break
        tail = "\n".join(log.read_text(errors="replace").splitlines()[-40:])
        raise SystemExit(f"the soaked run failed (attempt {attempts}); its log ends:\n{tail}")
    soak_s = time.perf_counter() - started

    result = json.loads((soaked / "output" / "result.json").read_text())
    expected, got = _adapter(reference), _adapter(soaked)
    identical = expected.keys() == got.keys() and all(
        torch.equal(expected[k], got[k]) for k in expected
    )
    metrics = [
        json.loads(line)
        for line in (soaked / "output" / "metrics.jsonl").read_text().splitlines()
        if '"event": "step"' in line
    ]
    steps_once = [m["step"] for m in metrics] == list(range(1, result["steps"] + 1))
    return {
        "kills": len(kill_points),
        "kill_points": kill_points,
        "attempts": attempts,
        "restarts_recorded": result.get("restarts"),
        "steps": result["steps"],
        "max_steps": max_steps,
        "processes": nproc,
        "adapter_identical": identical,
        "each_step_once_in_metrics": steps_once,
        "final_loss": result["final_loss"],
        "reference_s": round(reference_s, 1),
        "soak_s": round(soak_s, 1),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kills", type=int, default=10)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--nproc", type=int, default=1, help="trainer processes (torchrun if > 1)")
    parser.add_argument("--max-steps", type=int, default=24)
    parser.add_argument("--json", type=Path, help="also write the report here")
    ns = parser.parse_args(argv)
    if ns.max_steps < 2:
        parser.error("--max-steps must be at least 2")
    with tempfile.TemporaryDirectory(prefix="tunepack-soak-") as scratch:
        report = soak(ns.kills, ns.seed, ns.nproc, ns.max_steps, Path(scratch))
    print(json.dumps(report, indent=2))
    if ns.json:
        ns.json.write_text(json.dumps(report, indent=2) + "\n")
    complete = report["steps"] == report["max_steps"]
    return (
        0 if complete and report["adapter_identical"] and report["each_step_once_in_metrics"] else 1
    )


if __name__ == "__main__":
    sys.exit(main())
