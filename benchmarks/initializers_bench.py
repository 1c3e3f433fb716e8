"""Download throughput of the model initializer vs ``huggingface_hub.snapshot_download``.

Both fetch the same repository from the loopback fake hub (tests/fakehub.py) in the same run,
each as a fresh process (import costs included, as in a Pod); then each runs again on its
complete output. The initializer also verifies every byte (sha256 of LFS files, git blob ids)
and hard-links the result into place; snapshot_download verifies nothing.

    .venv/bin/python benchmarks/initializers_bench.py [--mib 384] [--files 3]
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # the fake hub lives in the test suite

from tests.fakehub import FakeHub, Repo  # noqa: E402
from tunepack.tiny import write_tiny_model  # noqa: E402

REPO = "bench/tiny-llama3"


def timed(command: list[str], env: dict[str, str]) -> float:
    start = time.perf_counter()
    done = subprocess.run(command, env=env, capture_output=True, text=True)
    elapsed = time.perf_counter() - start
    if done.returncode != 0:
        raise SystemExit(f"{command[:3]} failed:\n{done.stdout}\n{done.stderr}")
    return elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mib", type=int, default=384, help="total size of the weight files")
    parser.add_argument("--files", type=int, default=3, help="number of weight files")
    args = parser.parse_args()

    with tempfile.TemporaryDirectory(prefix="tunepack-bench-") as tmp:
        tmp = Path(tmp)
        model = write_tiny_model(tmp / "tiny")
        files = {
            p.relative_to(model).as_posix(): p.read_bytes() for p in model.rglob("*") if p.is_file()
        }
        each = args.mib * (1 << 20) // args.files
        # Random bytes: the initializer never parses weights, and random data defeats any
        # compression on the way.
        files["model.safetensors"] = os.urandom(each)
        for i in range(1, args.files):
            files[f"extra-{i:05d}.safetensors"] = os.urandom(each)
        total = sum(len(v) for v in files.values())

        hub = FakeHub().start()
        hub.add(Repo(REPO, files))
        base = {
            **os.environ,
            "HF_ENDPOINT": hub.url,
            "HF_HOME": str(tmp / "hf-home"),
            "HF_HUB_DISABLE_PROGRESS_BARS": "1",
        }
        ours_env = {
            **base,
            "TUNEPACK_WORKSPACE": str(tmp / "ws"),
            "TUNEPACK_MODEL": "tiny-llama3",
            "STORAGE_URI": f"hf://{REPO}",
        }
        ours = [sys.executable, "-m", "tunepack.initializers.model"]
        snapshot = [
            sys.executable,
            "-c",
            "import sys; from huggingface_hub import snapshot_download; "
            f"snapshot_download({REPO!r}, local_dir=sys.argv[1], "
            "allow_patterns=['*.safetensors', '*.json', '*.model'])",
            str(tmp / "snapshot"),
        ]
        try:
            t_ours = timed(ours, ours_env)
            t_snap = timed(snapshot, base)
            r_ours = timed(ours, ours_env)
            r_snap = timed(snapshot, base)
        finally:
            hub.stop()

    mib = total / (1 << 20)
    print(f"repository: {len(files)} files, {mib:.1f} MiB, loopback fake hub")
    print(f"{'':28}{'first run':>12}{'MiB/s':>9}{'re-run':>10}")
    print(f"{'tunepack model-initializer':28}{t_ours:>10.2f} s{mib / t_ours:>9.1f}{r_ours:>8.2f} s")
    print(f"{'snapshot_download':28}{t_snap:>10.2f} s{mib / t_snap:>9.1f}{r_snap:>8.2f} s")
    print(f"throughput ratio (tunepack / snapshot_download): {t_snap / t_ours:.2f}")
    print(f"re-run ratio (tunepack / snapshot_download): {r_ours / r_snap:.2f}")


if __name__ == "__main__":
    main()
