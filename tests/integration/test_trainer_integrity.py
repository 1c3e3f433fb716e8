"""The run's identity, damaged checkpoints and non-finite losses (issue 14), with real tiny runs."""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from tests.helpers import launch_trainer, result_of, setup_recipe, trainer_env
from tunepack.core.errors import EXIT_BAD_INPUT, EXIT_TRANSIENT, NonFiniteLossError
from tunepack.runtimes import catalog

TINY = catalog.get("tiny-llama3")

# 6 steps, a checkpoint every 2: a finished run keeps step-2 and step-4 (none at the end).
ARGS = [
    "max_steps=6",
    "batch_size=8",
    "warmup_steps=0",
    "lr=3e-3",
    "checkpoint_every_steps=2",
    "checkpoint_every_minutes=0",
]


def _launch(workspace: Path, *args: str):
    return launch_trainer(trainer_env(workspace), *args, timeout=300)


def _adapter_file(workspace: Path) -> Path:
    return workspace / "output" / "adapter" / "adapter_model.safetensors"


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _change_base_model(workspace: Path, edit) -> None:
    """What a model initializer run on another revision leaves: new weights, new manifest."""
    model = workspace / "model"
    manifest_path = model / "tunepack-manifest.json"
    manifest = json.loads(manifest_path.read_text())
    name = next(n for n in manifest["files"] if n.endswith(".safetensors"))
    weights = load_file(model / name)
    edit(weights)
    (model / name).unlink()  # never write through a hard link into the initializer's source
    save_file(weights, model / name, metadata={"format": "pt"})
    manifest["files"][name] = {
        "size": (model / name).stat().st_size,
        "sha256": _sha256(model / name),
    }
    manifest_path.write_text(json.dumps(manifest))


def _perturb(weights: dict[str, torch.Tensor]) -> None:
    key = next(k for k in sorted(weights) if k.endswith("q_proj.weight"))
    weights[key] = weights[key] * 1.01


@pytest.fixture(scope="module")
def finished(initialized_workspace, tmp_path_factory) -> Path:
    """A finished run of ARGS: adapter, result.json, and checkpoints of steps 2 and 4."""
    workspace = shutil.copytree(initialized_workspace, tmp_path_factory.mktemp("finished") / "ws")
    done = _launch(workspace, *ARGS)
    assert done.returncode == 0, done.stderr
    names = sorted(p.name for p in (workspace / "checkpoints").glob("step-*"))
    assert names == ["step-00000002", "step-00000004"]
    return workspace


# ------------------------------------------------------------------ identity


def test_bookkeeping_change_on_a_finished_run_does_nothing(finished, tmp_path):
    workspace = shutil.copytree(finished, tmp_path / "ws")
    adapter = _adapter_file(workspace)
    before = (_sha256(adapter), adapter.stat().st_mtime_ns)
    for changed in (
        ["log_every=3"],
        ["checkpoint_every_steps=3", "keep_checkpoints=5", "checkpoint_every_minutes=1"],
        ["compile=false", "resume=false"],
        ["deterministic=true"],  # the same computation, other GPU kernels
    ):
        args = [a for a in ARGS if a.split("=")[0] not in {c.split("=")[0] for c in changed}]
        again = _launch(workspace, *args, *changed)
        assert again.returncode == 0, again.stderr
        assert "nothing to do" in again.stdout, (changed, again.stdout)
        assert not [line for line in again.stdout.splitlines() if line.startswith("{")]
        assert (_sha256(adapter), adapter.stat().st_mtime_ns) == before


def test_changed_base_model_trains_again_from_scratch_and_says_why(finished, tmp_path):
    workspace = shutil.copytree(finished, tmp_path / "ws")
    before = _sha256(_adapter_file(workspace))
    _change_base_model(workspace, _perturb)  # same path, other content

    again = _launch(workspace, *ARGS)
    assert again.returncode == 0, again.stderr
    assert (
        "is from another run (the base model changed (model/tunepack-manifest.json differs "
        "from the result's)): training" in again.stdout
    )
    # The old run's checkpoints (steps 2 and 4) are not resumed on the new base.
    assert (
        "the base model changed (model/tunepack-manifest.json differs from the checkpoint's): "
        "starting fresh" in again.stderr
    )
    steps = [json.loads(x)["step"] for x in again.stdout.splitlines() if x.startswith('{"event"')]
    assert [s for s in steps if isinstance(s, int)][:1] == [1]
    result = result_of(workspace)
    assert result["resumed_from_step"] is None and result["steps"] == 6
    assert _sha256(_adapter_file(workspace)) != before

    # And now this base model's result is the finished one.
    third = _launch(workspace, *ARGS)
    assert third.returncode == 0 and "nothing to do" in third.stdout


def test_changed_dataset_or_training_argument_says_why(finished, tmp_path):
    workspace = shutil.copytree(finished, tmp_path / "ws")
    (workspace / "output" / "result.json").unlink()  # as if killed after step 4's checkpoint
    again = _launch(workspace, *[a for a in ARGS if a != "lr=3e-3"], "lr=1e-3")
    assert again.returncode == 0, again.stderr
    assert "the training configuration changed: starting fresh" in again.stderr
    assert result_of(workspace)["resumed_from_step"] is None


# ------------------------------------------------------------------ damaged checkpoints


def _truncate(path: Path) -> None:
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


def _flip_bit(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x10
    path.write_bytes(bytes(data))


def _largest_shard(step: Path) -> Path:
    return max(step.glob("*.distcp"), key=lambda p: p.stat().st_size)


DAMAGE = {
    "truncated shard": lambda step: _truncate(_largest_shard(step)),
    "deleted shard": lambda step: _largest_shard(step).unlink(),
    "flipped bit in a shard": lambda step: _flip_bit(_largest_shard(step)),
    "deleted .metadata": lambda step: (step / ".metadata").unlink(),
    "truncated trainer.pt": lambda step: _truncate(step / "trainer.pt"),
    "deleted trainer.pt": lambda step: (step / "trainer.pt").unlink(),
    "deleted random state": lambda step: (step / "rank-00000.pt").unlink(),
    "garbage manifest": lambda step: (step / "manifest.json").write_text("{not json"),
}


def _reason(kind: str, step: Path) -> str:
    """What the trainer says is wrong with ``step`` once ``kind`` has damaged it."""
    shard, trainer = _largest_shard(step), step / "trainer.pt"
    return {
        "truncated shard": f"{shard.name} has {shard.stat().st_size // 2} bytes, "
        f"{shard.stat().st_size} were written",
        "deleted shard": f"{shard.name} is missing",
        "flipped bit in a shard": f"{shard.name} does not match its checksum",
        "deleted .metadata": ".metadata is missing",
        "truncated trainer.pt": f"trainer.pt has {trainer.stat().st_size // 2} bytes, "
        f"{trainer.stat().st_size} were written",
        "deleted trainer.pt": "trainer.pt is missing",
        "deleted random state": "rank-00000.pt is missing",
        "garbage manifest": "manifest.json is unreadable (JSONDecodeError)",
    }[kind]


@pytest.mark.parametrize("kind", DAMAGE)
def test_each_damage_is_named_and_the_newest_sound_checkpoint_chosen(
    finished, tmp_path, kind, caplog
):
    """Rank 0's choice of checkpoint, as the trainer makes it at start (checkpoint.choose), for
    each damage: the newest is set aside (kept) with what is wrong with it, step 2 is chosen. The
    trainer acting on that choice (resuming, finishing) is the run below, for two of them."""
    from tunepack.trainers.outputs import checkpoint

    root = shutil.copytree(finished / "checkpoints", tmp_path / "checkpoints")
    newest, older = root / "step-00000004", root / "step-00000002"
    why = _reason(kind, newest)
    digest = json.loads((older / "manifest.json").read_text())["digest"]
    DAMAGE[kind](newest)

    with caplog.at_level("WARNING", logger=checkpoint.log.name):
        chosen, other = checkpoint.choose(root, digest)
    assert (chosen, other) == (older, None)
    assert (root / ".corrupt-step-00000004").is_dir() and not newest.exists()
    assert [r.getMessage() for r in caplog.records] == [
        f"checkpoint {newest} is damaged ({why}): set aside as .corrupt-step-00000004"
    ]


@pytest.mark.parametrize("kind", ["flipped bit in a shard", "garbage manifest"])
def test_damaged_newest_checkpoint_is_set_aside_and_the_older_one_resumed(finished, tmp_path, kind):
    workspace = shutil.copytree(finished, tmp_path / "ws")
    # As if killed after step 4's checkpoint: no result yet.
    shutil.rmtree(workspace / "output")
    newest = workspace / "checkpoints" / "step-00000004"
    DAMAGE[kind](newest)

    again = _launch(workspace, *ARGS)
    assert again.returncode == 0, again.stderr
    assert "checkpoint " + str(newest) + " is damaged (" in again.stderr
    assert "set aside as .corrupt-step-00000004" in again.stderr
    assert "resumed from" in again.stderr and "(step 2)" in again.stderr
    assert (workspace / "checkpoints" / ".corrupt-step-00000004").is_dir()  # kept, not deleted
    result = result_of(workspace)
    assert result["resumed_from_step"] == 2 and result["steps"] == 6
    assert result["final_loss"] < result["first_loss"]


def test_checkpoint_manifest_lists_every_file_with_its_checksum(finished):
    step = finished / "checkpoints" / "step-00000004"
    files = json.loads((step / "manifest.json").read_text())["files"]
    on_disk = {p.name for p in step.iterdir() if p.name != "manifest.json"}
    assert set(files) == on_disk and {".metadata", "trainer.pt", "rank-00000.pt"} <= on_disk
    for name, info in files.items():
        assert info == {"size": (step / name).stat().st_size, "sha256": _sha256(step / name)}


# ------------------------------------------------------------------ non-finite loss


def test_diverging_loss_stops_with_exit_75_and_publishes_nothing(initialized_workspace, tmp_path):
    # lr is bounded below 1 by the argument parser, so divergence is forced: the loss of the
    # third step comes out NaN, as an overflowing run's would.
    output = tmp_path / "output"
    recipe = setup_recipe(
        TINY,
        ["max_steps=5", "batch_size=8", "warmup_steps=0", "checkpoint_every_steps=1"],
        model_dir=initialized_workspace / "model",
        dataset_dir=initialized_workspace / "dataset",
        output=output,
    )
    recipe.cfg.checkpointing.dir = str(tmp_path / "checkpoints")
    real, calls = recipe._loss_and_tokens, []

    def diverging(batch):
        loss, tokens = real(batch)
        calls.append(1)
        return (loss * float("nan") if len(calls) == 3 else loss), tokens

    recipe._loss_and_tokens = diverging
    with pytest.raises(NonFiniteLossError) as err:
        recipe.train()
    assert err.value.exit_code == EXIT_TRANSIENT
    assert str(err.value).startswith("the loss became nan at step 3 (the step before: ")
    assert "training diverged; lower lr (now 0.003) or raise warmup_steps" in str(err.value)
    assert recipe.global_step == 2  # the NaN step was never applied
    assert all(torch.isfinite(p).all() for p in recipe.model.parameters())
    names = sorted(p.name for p in (tmp_path / "checkpoints").glob("step-*"))
    assert names == ["step-00000001", "step-00000002"]  # no checkpoint of a NaN state
    assert not (output / "result.json").exists() and not (output / "adapter").exists()


def test_non_finite_loss_at_the_first_step_is_bad_input(initialized_workspace, tmp_path):
    workspace = shutil.copytree(initialized_workspace, tmp_path / "ws")

    def poison(weights):
        key = next(k for k in sorted(weights) if k.endswith("embed_tokens.weight"))
        weights[key][:] = float("nan")

    _change_base_model(workspace, poison)
    done = _launch(workspace, "max_steps=2", "batch_size=8")
    assert done.returncode == EXIT_BAD_INPUT, done.stderr
    assert "trainer: error: the loss is nan at the first step, before any update" in done.stderr
    assert not (workspace / "output" / "result.json").exists()
    assert not (workspace / "output" / "adapter").exists()


def test_deterministic_selects_reproducible_gpu_kernels(monkeypatch):
    """deterministic=true on a GPU: the settings under which two H100 runs and a resumed one
    ended bit-identical (docs/gpu.md; off by default, tests/unit/test_args.py)."""
    import torch

    from tunepack.trainers import recipe

    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
    saved = (
        torch.are_deterministic_algorithms_enabled(),
        torch.is_deterministic_algorithms_warn_only_enabled(),
        torch.backends.cudnn.benchmark,
        torch.backends.cuda.flash_sdp_enabled(),
        torch.backends.cuda.mem_efficient_sdp_enabled(),
        torch.backends.cuda.cudnn_sdp_enabled(),
    )
    try:
        recipe._deterministic_kernels()
        assert torch.are_deterministic_algorithms_enabled()
        assert torch.is_deterministic_algorithms_warn_only_enabled()
        assert not torch.backends.cuda.flash_sdp_enabled()
        assert not torch.backends.cuda.mem_efficient_sdp_enabled()
        assert not torch.backends.cuda.cudnn_sdp_enabled()
        assert torch.backends.cuda.math_sdp_enabled()
        assert recipe.os.environ["CUBLAS_WORKSPACE_CONFIG"] == ":4096:8"
    finally:
        torch.use_deterministic_algorithms(saved[0], warn_only=saved[1])
        torch.backends.cudnn.benchmark = saved[2]
        torch.backends.cuda.enable_flash_sdp(saved[3])
        torch.backends.cuda.enable_mem_efficient_sdp(saved[4])
        torch.backends.cuda.enable_cudnn_sdp(saved[5])
