"""What the trainer leaves behind: readable results, one metrics line per step, and a full disk
that ends in one line for the trainer and the initializers alike (issue 14 items 7 and 8), with
real tiny runs."""

from __future__ import annotations

import errno
import json
import os
import shutil
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import trainer_env
from tunepack.core import durable
from tunepack.core.errors import EXIT_TRANSIENT, DiskFullError

LAUNCH = "tunepack.trainers.launch"
# 4 steps, a checkpoint at step 2 (the finished run keeps it; none is written at the end).
ARGS = [
    "max_steps=4",
    "batch_size=8",
    "warmup_steps=0",
    "lr=3e-3",
    "checkpoint_every_steps=2",
    "checkpoint_every_minutes=0",
]


def _launch(workspace: Path, *args: str, umask: int = 0o022, prefix: list[str] | None = None):
    return subprocess.run(
        [*(prefix or []), sys.executable, "-m", LAUNCH, *args],
        env=trainer_env(workspace),
        capture_output=True,
        text=True,
        timeout=300,
        umask=umask,
    )


def _steps(workspace: Path) -> list[int]:
    lines = (workspace / "output" / "metrics.jsonl").read_text().splitlines()
    return [json.loads(line)["step"] for line in lines]


@pytest.fixture(scope="module")
def finished(initialized_workspace, tmp_path_factory) -> Path:
    """A finished run of ARGS under umask 077 (what mkdtemp's 0700 used to leak into results)."""
    workspace = tmp_path_factory.mktemp("outputs") / "ws"
    shutil.copytree(initialized_workspace, workspace)
    done = _launch(workspace, *ARGS, umask=0o077)
    assert done.returncode == 0, done.stderr
    return workspace


def test_published_adapter_is_world_readable_whatever_the_umask(finished):
    adapter = finished / "output" / "adapter"
    assert stat.S_IMODE(adapter.stat().st_mode) == 0o755
    paths = list(adapter.rglob("*"))
    assert {p.name for p in paths} >= {"adapter_config.json", "adapter_model.safetensors"}
    for path in paths:
        want = 0o755 if path.is_dir() else 0o644
        assert stat.S_IMODE(path.stat().st_mode) == want, path
    result = finished / "output" / "result.json"
    assert stat.S_IMODE(result.stat().st_mode) == 0o644


def test_staging_left_by_a_run_killed_while_publishing_is_removed_at_start(
    initialized_workspace, tmp_path
):
    """A kill during publish leaves ``output/.adapter.partial-*`` (and possibly the old result
    set aside), one during the final save ``output/.result.json.tmp-<pid>``: the next run,
    holding the workspace lock, removes them and says so (issue 28; issue 49, item 13)."""
    workspace = tmp_path / "ws"
    shutil.copytree(initialized_workspace, workspace)
    left = [workspace / "output" / ".adapter.partial-3f9a1c", workspace / "output" / ".model.old-7"]
    for path in left:
        path.mkdir(parents=True)
    left.append(workspace / "output" / ".result.json.tmp-4242")
    left[-1].write_text('{"steps": ')
    done = _launch(workspace, *ARGS)
    assert done.returncode == 0, done.stderr
    for path in left:
        assert f"trainer: removed {path}, left by an interrupted run\n" in done.stdout
        assert not path.exists()
    names = [p.name for p in (workspace / "output").iterdir()]
    assert not [n for n in names if any(m in n for m in (".partial-", ".old-", ".tmp-"))], names


def test_resumed_run_records_each_step_once(finished, tmp_path):
    workspace = tmp_path / "ws"
    shutil.copytree(finished, workspace)
    assert _steps(workspace) == [1, 2, 3, 4]
    # As if killed after step 4 was logged, with the newest checkpoint at step 2 and a line
    # cut short by the kill.
    shutil.rmtree(workspace / "output" / "adapter")
    (workspace / "output" / "result.json").unlink()
    with (workspace / "output" / "metrics.jsonl").open("a") as f:
        f.write('{"event": "step", "step": 5, "lo')
    assert [p.name for p in (workspace / "checkpoints").glob("step-*")] == ["step-00000002"]

    again = _launch(workspace, *ARGS)
    assert again.returncode == 0, again.stderr
    assert "(step 2)" in again.stderr
    assert _steps(workspace) == [1, 2, 3, 4]  # not 1, 2, 3, 4, 3, 4
    assert json.loads((workspace / "output" / "result.json").read_text())["resumed_from_step"] == 2


# ------------------------------------------------------------------ a full disk


def _tmpfs_prefix(mountpoint: Path, size: str) -> list[str]:
    """Run the command in a mount namespace of its own with a tiny tmpfs at ``mountpoint``."""
    script = f'mount -t tmpfs -o size={size} tmpfs "{mountpoint}" && exec "$@"'
    return ["unshare", "--mount", "sh", "-c", script, "sh"]


def _can_mount_tmpfs(tmp_path: Path) -> bool:
    if os.geteuid() != 0 or not shutil.which("unshare"):
        return False
    probe = tmp_path / "probe"
    probe.mkdir()
    done = subprocess.run([*_tmpfs_prefix(probe, "64k"), "true"], capture_output=True)
    return done.returncode == 0


def _run_with_tiny_tmpfs(mountpoint: Path, size: str, python_args: str, env: dict[str, str]):
    """Run ``python <python_args>`` with a ``size`` tmpfs at ``mountpoint`` (in a mount namespace
    of its own); return the result and what was left on the tmpfs before it went away."""
    script = (
        f'mount -t tmpfs -o size={size} tmpfs "{mountpoint}" && '
        f'"{sys.executable}" {python_args}; code=$?; '
        f'echo LEFT:; ls -A "{mountpoint}"; exit $code'
    )
    done = subprocess.run(
        ["unshare", "--mount", "sh", "-c", script],
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        timeout=300,
    )
    left = done.stdout.split("LEFT:\n", 1)[1].split() if "LEFT:\n" in done.stdout else []
    return done, left


def _workspace_with_mount_point(initialized_workspace, tmp_path, sub: str):
    """A copy of the initialized workspace with an empty ``sub`` for a tiny tmpfs (or a skip)."""
    if not _can_mount_tmpfs(tmp_path):
        pytest.skip("needs root and unshare to mount a tiny tmpfs")
    workspace = tmp_path / "ws"
    shutil.copytree(initialized_workspace, workspace)
    (workspace / sub).mkdir()
    return workspace, workspace / sub


def test_full_disk_while_checkpointing_is_one_line_exit_75_nothing_partial(
    initialized_workspace, tmp_path
):
    workspace, checkpoints = _workspace_with_mount_point(
        initialized_workspace, tmp_path, "checkpoints"
    )
    # The checkpoint directory is a 64 KiB filesystem: a tiny-llama3 LoRA checkpoint (adapter and
    # AdamW state) is larger, the rest of the workspace is on the ordinary disk.
    done = _launch(workspace, *ARGS, prefix=_tmpfs_prefix(checkpoints, "64k"))
    assert done.returncode == EXIT_TRANSIENT, done.stderr
    assert "Traceback" not in done.stderr
    errors = [line for line in done.stderr.splitlines() if "error" in line.lower()]
    assert len(errors) == 1, done.stderr
    assert errors[0].startswith(
        f"trainer: error: no space left on the device (or quota) writing "
        f"{checkpoints / 'step-00000002'} ("
    )
    assert "needed, " in errors[0] and "free)" in errors[0]
    # The tmpfs went with its namespace; what the run saw there is gone. Outside it, nothing was
    # published and nothing partial is visible.
    assert not list(checkpoints.iterdir())
    assert not (workspace / "output" / "adapter").exists()
    assert not (workspace / "output" / "result.json").exists()


@pytest.mark.parametrize("nproc", [1, 2])
def test_full_disk_while_publishing_is_one_line_exit_75_nothing_partial(
    initialized_workspace, tmp_path, nproc
):
    """With two processes only the first writes the result: the other, waiting for it, stops
    with one line saying it followed, not with the traceback of its broken collective."""
    workspace, output = _workspace_with_mount_point(initialized_workspace, tmp_path, "output")
    # Room for config.yaml and metrics.jsonl, none for the adapter; the command lists what is
    # left on the tmpfs before the namespace (and the tmpfs) goes away.
    args = " ".join(a for a in ARGS if not a.startswith("checkpoint_every_steps"))
    done, left = _run_with_tiny_tmpfs(
        output,
        "16k",
        f"-m {LAUNCH} {args} checkpoint_every_steps=0",
        trainer_env(workspace, nproc_per_node=nproc),
    )
    assert done.returncode == EXIT_TRANSIENT, done.stderr
    assert "Traceback" not in done.stderr
    errors = [line for line in done.stderr.splitlines() if line.startswith("trainer: error:")]
    assert len(errors) == nproc, done.stderr
    assert errors[0].startswith(
        f"trainer: error: no space left on the device (or quota) writing {output / 'adapter'} ("
    )
    if nproc == 2:
        assert errors[1] == (
            "trainer: error: process 1 stopped because another process of the run failed first "
            "(that process's error is on a line of its own)"
        )
    left = set(left)
    assert {"config.yaml", "metrics.jsonl"} <= left, done.stdout
    assert not [name for name in left if "adapter" in name or ".tmp-" in name], left  # no partial
    assert "result.json" not in left


def test_full_disk_while_merging_says_the_merged_models_size(initialized_workspace, tmp_path):
    """Room for the adapter, none for the merged model: the line says what the merged model
    needs, about the base's weight files."""
    workspace, output = _workspace_with_mount_point(initialized_workspace, tmp_path, "output")
    args = " ".join(a for a in ARGS if not a.startswith("checkpoint_every_steps"))
    done, left = _run_with_tiny_tmpfs(
        output,
        "512k",
        f"-m {LAUNCH} {args} checkpoint_every_steps=0 merge=true",
        trainer_env(workspace),
    )
    assert done.returncode == EXIT_TRANSIENT, done.stderr
    assert "Traceback" not in done.stderr
    errors = [line for line in done.stderr.splitlines() if line.startswith("trainer: error:")]
    weights = sum(p.stat().st_size for p in (workspace / "model").glob("*.safetensors"))
    assert errors == [
        f"trainer: error: no space left on the device (or quota) writing {output / 'merged'} "
        f"({durable.size_text(weights)} needed, {errors[0].split(' needed, ')[1]}"
    ], done.stderr
    assert errors[0].endswith(
        " free): free space or enlarge the volume, then run again; nothing partial was kept"
    )
    assert "adapter" in left and not [name for name in left if "merged" in name], left


@pytest.mark.parametrize("program", ["model", "dataset"])
def test_full_disk_in_an_initializer_is_one_line_exit_75_nothing_partial(
    program, tmp_path, tiny_model_dir, tiny_dataset_file
):
    """The workspace is a 64 KiB filesystem: the tiny model (1.5 MB) does not fit, nor does the
    dataset (its copy plus the cache). One line naming the path, exit 75, nothing left behind."""
    if not _can_mount_tmpfs(tmp_path):
        pytest.skip("needs root and unshare to mount a tiny tmpfs")
    workspace = tmp_path / "ws"
    workspace.mkdir()
    source = tiny_model_dir if program == "model" else tiny_dataset_file
    size = "64k" if program == "model" else "8k"
    done, left = _run_with_tiny_tmpfs(
        workspace,
        size,
        f"-m tunepack.initializers.{program}",
        {
            "TUNEPACK_WORKSPACE": str(workspace),
            "TUNEPACK_MODEL": "tiny-llama3",
            "STORAGE_URI": f"file://{source}",
        },
    )
    assert done.returncode == EXIT_TRANSIENT, done.stdout + done.stderr
    assert "Traceback" not in done.stderr
    errors = done.stderr.strip().splitlines()
    assert len(errors) == 1, done.stderr
    # The space needed: the model's files (copied when they cannot be linked), the dataset's
    # source rows (what the normalized rows take, about).
    files = tiny_model_dir.rglob("*") if program == "model" else [tiny_dataset_file]
    needed = durable.size_text(sum(p.stat().st_size for p in files if p.is_file()))
    assert errors[0].startswith(
        f"{program}-initializer: error: no space left on the device (or quota) writing "
        f"{workspace}/{program} ({needed} needed, "
    )
    assert errors[0].endswith("then run again; nothing partial was kept")
    assert not [name for name in left if name.startswith(program)], left


# ------------------------------------------------------------------ the durable module


def _enospc(*_args, **_kwargs):
    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


def test_durable_write_text_cleans_up_and_names_the_path(tmp_path, monkeypatch):
    target = tmp_path / "result.json"
    target.write_text("old\n")
    monkeypatch.setattr(os, "fsync", _enospc)
    with pytest.raises(DiskFullError) as err:
        durable.write_text(target, "new\n")
    assert err.value.exit_code == EXIT_TRANSIENT
    assert f"writing {target} (4 bytes needed, " in str(err.value)
    assert [p.name for p in tmp_path.iterdir()] == ["result.json"]
    assert target.read_text() == "old\n"


def test_durable_publish_dir_cleans_up_on_an_opaque_write_failure(tmp_path, monkeypatch):
    # torch.save says only "iostream error": a full filesystem at that moment makes it disk-full.
    def write(staging: Path) -> None:
        (staging / "part").write_text("x")
        raise RuntimeError("basic_ios::clear: iostream error")

    monkeypatch.setattr(durable, "free_bytes", lambda _path: 0)
    with pytest.raises(DiskFullError, match=r"adapter \(1\.0 KiB needed, 0 bytes free\)"):
        durable.publish_dir(tmp_path / "adapter", write, needed=1024)
    assert not list(tmp_path.iterdir())

    monkeypatch.setattr(durable, "free_bytes", lambda _path: 10 << 30)
    with pytest.raises(RuntimeError, match="iostream"):  # with room left, it is not disk-full
        durable.publish_dir(tmp_path / "adapter", write, needed=1024)
    assert not list(tmp_path.iterdir())


def test_is_disk_full_sees_through_wrapped_errors():
    try:
        try:
            _enospc()
        except OSError as inner:
            raise RuntimeError("checkpoint failed") from inner
    except RuntimeError as outer:
        assert durable.is_disk_full(outer)
    assert durable.is_disk_full(RuntimeError("I/O error: No space left on device (os error 28)"))
    assert durable.is_disk_full(OSError(errno.EDQUOT, "Disk quota exceeded"))
    assert not durable.is_disk_full(OSError(errno.EACCES, "Permission denied"))
