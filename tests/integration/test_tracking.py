"""Experiment tracking for real: TensorBoard event files, an MLflow tracking server on loopback,
W&B in offline mode. The tracker packages are dev dependencies: a missing one fails, not skips."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from tests.helpers import copy_workspace, free_port, launch_trainer, trainer_env

TRAIN = ["max_steps=4", "warmup_steps=0", "batch_size=8", "lr=3e-3", "val_fraction=0.1"]
TRAIN.append("eval_every_steps=2")


def _train(workspace: Path, *args: str, env: dict | None = None):
    done = launch_trainer(trainer_env(workspace) | (env or {}), *TRAIN, *args)
    assert done.returncode == 0, done.stdout + done.stderr
    return done


def _metrics(workspace: Path) -> list[dict]:
    lines = (workspace / "output" / "metrics.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines]


def _expected(workspace: Path) -> tuple[dict[int, float], dict[int, float]]:
    records = _metrics(workspace)
    train = {r["step"]: r["loss"] for r in records if r.get("event") == "step"}
    val = {r["step"]: r["val_loss"] for r in records if r.get("event") == "eval"}
    return train, val


def test_tensorboard_event_files_read_back(initialized_workspace, tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from tensorboard.util.tensor_util import make_ndarray

    workspace = copy_workspace(initialized_workspace, tmp_path)
    _train(workspace, "tracker=tensorboard")
    log_dir = workspace / "output" / "tracker"
    events = EventAccumulator(str(log_dir))
    events.Reload()
    # torch's SummaryWriter writes scalars as (new-style) scalar tensors.
    tags = set(events.Tags()["tensors"])
    assert {"loss", "lr", "tokens_per_second", "val_loss", "val_perplexity"} <= tags

    def scalars(tag: str) -> dict[int, float]:
        return {e.step: float(make_ndarray(e.tensor_proto)) for e in events.Tensors(tag)}

    train, val = _expected(workspace)
    got_train, got_val = scalars("loss"), scalars("val_loss")
    assert got_train.keys() == train.keys() == {1, 2, 3, 4}
    assert got_val.keys() == val.keys() == {2, 4}
    for step, loss in train.items():
        assert got_train[step] == pytest.approx(loss, abs=1e-5)
    for step, loss in val.items():
        assert got_val[step] == pytest.approx(loss, abs=1e-5)
    # result.json says where the run is; the summary and Result point there.
    assert _pointer(workspace) == f"tensorboard --logdir {log_dir}"


def _pointer(workspace: Path) -> str | None:
    from tunepack.types import tracker_pointer

    return tracker_pointer(
        json.loads((workspace / "output" / "result.json").read_text())["tracker"]
    )


# mlflow server's job queue (huey) lives in a directory it makes with mkdtemp(dir="/dev/shm"),
# a name no flag sets, and never removes: the tests' server runs without job execution (it needs
# none: runs and metrics only), so it makes none.
HUEY_STORE_ENV = "_MLFLOW_HUEY_STORAGE_PATH"
SHM = Path("/dev/shm")


def _huey_stores_in_shm() -> set[Path]:
    """The directories in /dev/shm that hold an MLflow job queue (``*.mlflow-huey-store``)."""
    try:
        return {d for d in SHM.glob("tmp*") if d.is_dir() and any(d.glob("*.mlflow-huey-store"))}
    except OSError:
        return set()


def _huey_stores_of(pid: int) -> set[str]:
    """The job-queue directories the processes of the server ``pid`` (its group) were given."""
    import psutil

    stores = set()
    for proc in psutil.process_iter():
        try:
            if os.getpgid(proc.pid) == pid and HUEY_STORE_ENV in (env := proc.environ()):
                stores.add(env[HUEY_STORE_ENV])
        except (OSError, psutil.Error):
            continue
    return stores


@contextlib.contextmanager
def _running_mlflow_server(tmp_path: Path):
    """A real ``mlflow server`` on 127.0.0.1 with a sqlite store in tmp_path, stopped by PID;
    yields its URI and the set of job-queue directories its processes were given, filled when
    it stops (and each removed then: only this server was given it)."""
    stores: set[str] = set()
    port = free_port()
    mlflow_cli = Path(sys.executable).with_name("mlflow")
    assert mlflow_cli.exists(), "the mlflow package (a dev dependency) is not installed"
    log = (tmp_path / "mlflow-server.log").open("w")
    server = subprocess.Popen(
        [str(mlflow_cli), "server", "--host", "127.0.0.1", "--port", str(port)]
        + ["--backend-store-uri", f"sqlite:///{tmp_path / 'mlflow.db'}"]
        + ["--default-artifact-root", str(tmp_path / "artifacts"), "--workers", "1"],
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,  # its workers are in its process group, stopped with it
        cwd=tmp_path,
        env={**os.environ, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"},
    )
    uri = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                with urllib.request.urlopen(f"{uri}/health", timeout=2) as reply:
                    if reply.status == 200:
                        break
            except OSError:
                pass
            if server.poll() is not None or time.monotonic() > deadline:
                raise AssertionError(
                    "mlflow server did not start: " + (tmp_path / "mlflow-server.log").read_text()
                )
            time.sleep(0.5)
        yield uri, stores
    finally:
        stores.update(_huey_stores_of(server.pid))
        os.killpg(server.pid, signal.SIGTERM)
        try:
            server.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(server.pid, signal.SIGKILL)
            server.wait()
        log.close()
        for store in stores:  # mkdtemp's, made for this server alone
            shutil.rmtree(store, ignore_errors=True)


@pytest.fixture
def mlflow_server(tmp_path):
    with _running_mlflow_server(tmp_path) as (uri, _):
        yield uri


def test_the_mlflow_server_leaves_nothing_in_dev_shm(tmp_path):
    """`make test` used to leave a /dev/shm/tmp* directory of *.mlflow-huey-store files per
    MLflow server; the tests' server makes none, so nothing of it is left when it stops."""
    before = _huey_stores_in_shm()
    with _running_mlflow_server(tmp_path) as (_, given):
        pass
    assert given == set(), f"the mlflow server was given job-queue directories {sorted(given)}"
    left = sorted(str(d) for d in _huey_stores_in_shm() - before)
    assert left == [], f"the stopped mlflow server left {left} in /dev/shm"


def test_mlflow_server_receives_train_and_val_metrics(
    initialized_workspace, tmp_path, mlflow_server
):
    from mlflow.tracking import MlflowClient

    workspace = copy_workspace(initialized_workspace, tmp_path)
    _train(workspace, "tracker=mlflow", f"tracker_uri={mlflow_server}", "tracker_project=tiny-exp")
    client = MlflowClient(tracking_uri=mlflow_server)
    experiment = client.get_experiment_by_name("tiny-exp")
    assert experiment is not None
    runs = client.search_runs([experiment.experiment_id])
    assert len(runs) == 1
    run_id = runs[0].info.run_id
    train, val = _expected(workspace)
    history = {m.step: m.value for m in client.get_metric_history(run_id, "loss")}
    val_history = {m.step: m.value for m in client.get_metric_history(run_id, "val_loss")}
    assert history.keys() == train.keys() == {1, 2, 3, 4}
    assert val_history.keys() == val.keys() == {2, 4}
    for step, loss in val.items():
        assert val_history[step] == pytest.approx(loss, abs=1e-5)
    assert {m.key for m in client.get_metric_history(run_id, "val_perplexity")} == {
        "val_perplexity"
    }
    assert runs[0].info.status == "FINISHED"
    assert _pointer(workspace) == (
        f"MLflow run {mlflow_server}/#/experiments/{experiment.experiment_id}/runs/{run_id}"
    )


def test_mlflow_outage_is_one_warning_and_training_goes_on(initialized_workspace, tmp_path):
    workspace = copy_workspace(initialized_workspace, tmp_path)
    port = free_port()  # nothing listens there
    started = time.monotonic()
    done = _train(workspace, "tracker=mlflow", f"tracker_uri=http://127.0.0.1:{port}")
    warnings = [
        line for line in done.stderr.splitlines() if "tracker=mlflow is unavailable" in line
    ]
    assert len(warnings) == 1, done.stderr
    assert "training goes on without it" in warnings[0]
    assert "Traceback" not in done.stderr
    result = json.loads((workspace / "output" / "result.json").read_text())
    assert result["steps"] == 4 and result["val_loss"] is not None
    assert time.monotonic() - started < 120  # no minutes of retries


def _wandb_records(path: Path) -> list[bytes]:
    """The records of a W&B run file (``run-*.wandb``), read without wandb's own code.

    The file is a 7-byte header (``:W&B``, 0xBEE1, version 0) followed by LevelDB's log format:
    32 KiB blocks of chunks, each ``crc32 (4) | length (2, LE) | type (1)`` then the payload;
    type 1 is a whole record, 2/3/4 its first, middle and last pieces.
    """
    data = path.read_bytes()
    assert data[:4] == b":W&B", data[:7]
    records, pending, pos, block = [], b"", 7, 32768
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # too little room left in the block for a chunk header
            pos += block - pos % block
            continue
        length = int.from_bytes(data[pos + 4 : pos + 6], "little")
        kind = data[pos + 6]
        payload = data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind == 0 and length == 0:  # zero padding at a block's end
            pos += block - pos % block if pos % block else 0
            continue
        if kind == 1:
            records.append(payload)
        elif kind == 2:
            pending = payload
        elif kind == 3:
            pending += payload
        elif kind == 4:
            records.append(pending + payload)
    return records


def test_wandb_offline_files_read_back(initialized_workspace, tmp_path):
    from wandb.proto import wandb_internal_pb2

    workspace = copy_workspace(initialized_workspace, tmp_path)
    env = {"WANDB_MODE": "offline", "WANDB_SILENT": "true"}
    _train(workspace, "tracker=wandb", "tracker_project=tiny-wb", env=env)
    files = list((workspace / "output" / "tracker").glob("wandb/offline-run-*/run-*.wandb"))
    assert len(files) == 1, list((workspace / "output" / "tracker").rglob("*"))
    history: list[dict] = []
    project = None
    for data in _wandb_records(files[0]):
        record = wandb_internal_pb2.Record()
        record.ParseFromString(data)
        if record.WhichOneof("record_type") == "history":
            history.append(
                {
                    item.key or ".".join(item.nested_key): json.loads(item.value_json)
                    for item in record.history.item
                }
            )
        elif record.WhichOneof("record_type") == "run":
            project = record.run.project
    assert project == "tiny-wb"
    train, val = _expected(workspace)
    got_train = {row["global_step"]: row["loss"] for row in history if "loss" in row}
    got_val = {row["global_step"]: row["val_loss"] for row in history if "val_loss" in row}
    assert got_train.keys() == train.keys() == {1, 2, 3, 4}
    assert got_val.keys() == val.keys() == {2, 4}
    for step, loss in val.items():
        assert got_val[step] == pytest.approx(loss, abs=1e-5)
    # Offline, the run has no page yet: the pointer is the command that uploads it.
    assert _pointer(workspace) == f"W&B offline run: wandb sync {files[0].parent}"
