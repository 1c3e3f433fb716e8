"""The three images run their programs as users run them (``make images-local`` builds them).

Each container: the image's own user (uid 1000), a read-only root file system, no network, the
workspace a mounted volume (podman with runc, as this machine's engine). The dataset and model
initializers fetch the tiny dataset and model, the trainer fine-tunes LoRA on them, and the
exporter copies the result to a directory; a user's mistake exits 65 and a failure that may pass
exits 75, seen from outside the container. The versions inside are those the tests run.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from importlib import metadata
from pathlib import Path

import pytest

from tunepack import __version__

pytestmark = [
    pytest.mark.controlplane,
    pytest.mark.skipif(
        os.environ.get("TUNEPACK_TIER_IMAGES") != "1",
        reason="the images are built by `make test-cluster` (make images-local; needs root)",
    ),
]

ROOT = Path(__file__).resolve().parents[2]
PYTHON = f"{sys.version_info[0]}.{sys.version_info[1]}"
REGISTRY = "ghcr.io/tunepack"
DATASET, MODEL, TRAINER = (
    f"{REGISTRY}/{name}:{__version__}"
    for name in ("dataset-initializer", "model-initializer", "trainer")
)
# This host's limits: podman's default rlimits are above what it allows (docs/cluster.md).
RUN = [
    "podman", "run", "--rm", "--runtime", "runc", "--network", "none", "--read-only",
    "--ulimit", "nofile=4096:4096", "--ulimit", "nproc=4096:4096",
]  # fmt: skip


@pytest.fixture(scope="module")
def sources():
    from tunepack.tiny import write_tiny_dataset, write_tiny_model

    root = Path(tempfile.mkdtemp(prefix="tunepack-image-sources-"))
    write_tiny_model(root / "tiny-llama3")
    write_tiny_dataset(root / "data" / "instructions.jsonl")
    for path in [root, *root.rglob("*")]:
        path.chmod(0o755 if path.is_dir() else 0o644)
    yield root
    shutil.rmtree(root, ignore_errors=True)


@pytest.fixture(scope="module")
def workspace():
    """One workspace through the steps, owned by the images' user, as fsGroup makes it."""
    ws = Path(tempfile.mkdtemp(prefix="tunepack-image-ws-"))
    os.chown(ws, 1000, 1000)
    yield ws
    shutil.rmtree(ws, ignore_errors=True)


def run(
    image, *args, env=None, volumes=(), timeout=900, entrypoint=None
) -> subprocess.CompletedProcess:
    cmd = [*RUN, *(["--entrypoint", entrypoint] if entrypoint else [])]
    for key, value in (env or {}).items():
        cmd += ["-e", f"{key}={value}"]
    for volume in volumes:
        cmd += ["-v", volume]
    return subprocess.run(
        [*cmd, image, *args], capture_output=True, text=True, timeout=timeout, check=False
    )


def python_in(image, *args, **kw) -> subprocess.CompletedProcess:
    """The image's python with other arguments than its ENTRYPOINT's program."""
    return run(image, *args, entrypoint="python", timeout=kw.pop("timeout", 300), **kw)


def steps_env(**extra) -> dict:
    return {"TUNEPACK_MODEL": "tiny-llama3", "TUNEPACK_WORKSPACE": "/workspace", **extra}


def test_versions_inside_the_images_are_those_the_tests_ran():
    probe = (
        "import json, sys; from importlib import metadata as m; "
        "print(json.dumps({'python': '%d.%d' % sys.version_info[:2], "
        "**{p: m.version(p) for p in sys.argv[1:]}}))"
    )
    trainer_pkgs = ["torch", "torchtune", "torchao", "peft", "tunepack"]
    done = python_in(TRAINER, "-c", probe, *trainer_pkgs)
    assert done.returncode == 0, done.stderr
    inside = json.loads(done.stdout.strip().splitlines()[-1])
    here = {
        "python": PYTHON,
        **{p: metadata.version(p) for p in trainer_pkgs},
    }
    assert inside == here

    init_pkgs = ["huggingface_hub", "boto3", "pyarrow", "tunepack"]
    done = python_in(DATASET, "-c", probe, *init_pkgs)
    assert done.returncode == 0, done.stderr
    inside = json.loads(done.stdout.strip().splitlines()[-1])
    pinned = dict(
        line.split("==")
        for line in (ROOT / "initializers" / "requirements.txt").read_text().splitlines()
        if "==" in line and not line.startswith("#")
    )
    assert inside == {
        "python": PYTHON,
        "huggingface_hub": pinned["huggingface_hub"],
        "boto3": pinned["boto3"],
        "pyarrow": pinned["pyarrow"],
        "tunepack": __version__,
    }
    # The initializers never load a model: no torch in their images.
    assert "torch" not in python_in(DATASET, "-m", "pip", "list").stdout


def test_initializers_trainer_and_exporter_run_in_their_images(sources, workspace, tmp_path):
    ws = f"{workspace}:/workspace"
    src = f"{sources}:/sources:ro"

    done = run(
        DATASET,
        env=steps_env(STORAGE_URI="file:///sources/data/instructions.jsonl"),
        volumes=[ws, src],
    )
    assert done.returncode == 0, done.stdout + done.stderr
    done = run(MODEL, env=steps_env(STORAGE_URI="file:///sources/tiny-llama3"), volumes=[ws, src])
    assert done.returncode == 0, done.stdout + done.stderr
    # Written by the image's user, not root.
    assert {p.stat().st_uid for p in workspace.rglob("*")} == {1000}

    done = run(
        TRAINER,
        "method=lora",
        "epochs=2",
        env=steps_env(),
        volumes=[ws, "/dev/shm:/dev/shm"],
        timeout=1200,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    result = json.loads((workspace / "output" / "result.json").read_text())
    assert result["method"] == "lora"
    assert result["final_loss"] < result["first_loss"]

    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(workspace / "model")
    PeftModel.from_pretrained(base, workspace / "output" / "adapter")

    out = tmp_path / "exported"
    out.mkdir()
    os.chown(out, 1000, 1000)
    done = python_in(
        MODEL,
        "-m",
        "tunepack.initializers.export",
        env=steps_env(EXPORT_URI="file:///export/run"),
        volumes=[ws, f"{out}:/export"],
    )
    assert done.returncode == 0, done.stdout + done.stderr
    out /= "run"
    manifest = json.loads((out / "tunepack-manifest.json").read_text())
    assert "adapter/adapter_model.safetensors" in manifest["files"]
    assert (out / "result.json").read_text() == (workspace / "output" / "result.json").read_text()


def test_exit_codes_are_seen_from_outside_the_container(tmp_path):
    ws = tmp_path / "ws"
    ws.mkdir()
    os.chown(ws, 1000, 1000)
    # A user's mistake: no dataset named at all.
    done = run(DATASET, env=steps_env(), volumes=[f"{ws}:/workspace"])
    assert done.returncode == 65, done.stdout + done.stderr
    lines = [line for line in (done.stdout + done.stderr).splitlines() if "error" in line]
    assert lines and "STORAGE_URI" in lines[-1], done.stdout + done.stderr
    assert "Traceback" not in done.stdout + done.stderr
    # What may pass: the source's server cannot be reached (no network in this container).
    done = run(
        MODEL,
        env=steps_env(
            STORAGE_URI="https://127.0.0.1:9/models/tiny",
            TUNEPACK_RETRIES="1",
            TUNEPACK_RETRY_BACKOFF_SECONDS="0",
        ),
        volumes=[f"{ws}:/workspace"],
    )
    assert done.returncode == 75, done.stdout + done.stderr
    assert "Traceback" not in done.stdout + done.stderr
    # Bad trainer arguments are refused by the trainer image too, before any training.
    done = run(TRAINER, "lora_rank=-1", env=steps_env(), volumes=[f"{ws}:/workspace"])
    assert done.returncode == 65, done.stdout + done.stderr
    assert "lora_rank" in done.stdout + done.stderr
