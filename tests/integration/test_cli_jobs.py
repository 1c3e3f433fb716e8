"""One job path: `tunepack train --local` runs are jobs of the local backend, the same jobs
`TrainingClient(LocalBackendConfig(...))` creates; `jobs`, `status`, `logs`, `result` and
`delete` see them whichever created them."""

from __future__ import annotations

import contextlib
import io
import json
import re
import subprocess

import pytest

from tests.helpers import assert_local_status_complete, run_program
from tunepack import FineTune, Initializer, LocalBackendConfig, TrainingClient

RUNTIME = "tunepack-tiny-llama3"


@pytest.fixture(scope="module")
def home(tmp_path_factory):
    return tmp_path_factory.mktemp("home")  # $TUNEPACK_HOME: jobs under <home>/jobs


def tunepack(home, *args: str, cwd=None) -> subprocess.CompletedProcess:
    return run_program("tunepack.cli", {"TUNEPACK_HOME": str(home)}, *args, timeout=300, cwd=cwd)


def _train(home, tmp, model, data, *extra: str) -> subprocess.CompletedProcess:
    return tunepack(
        home, "train", "--local", "--runtime", RUNTIME, "--dataset", f"file://{data}",
        "--model", f"file://{model}", *extra, "method=lora", "max_steps=2", cwd=tmp,
    )  # fmt: skip


@pytest.fixture(scope="module")
def cli_job(home, tmp_path_factory, tiny_model_dir, tiny_dataset_file):
    """A `train --local` run with a generated name, in the default workspace."""
    cwd = tmp_path_factory.mktemp("cwd")
    done = _train(home, cwd, tiny_model_dir, tiny_dataset_file, "--quiet")
    assert done.returncode == 0, done.stderr + done.stdout
    first = done.stdout.splitlines()[0]
    match = re.fullmatch(
        r"tunepack: job (tiny-llama3-[0-9a-f]{10}): local run of \S+ in (\S+)", first
    )
    assert match, first
    name, workspace = match.groups()
    assert workspace == str(cwd / ".tunepack" / "runs" / name)
    assert done.stdout.splitlines()[1] == (
        "tunepack: a new job (named after this command: the same command resumes it)"
    )
    assert f"  job         {name}" in done.stdout.splitlines()
    return name, cwd / ".tunepack" / "runs" / name


@pytest.fixture(scope="module")
def python_job(home, tiny_model_dir, tiny_dataset_file):
    client = TrainingClient(LocalBackendConfig(root_dir=str(home / "jobs")))
    name = client.train(
        runtime=RUNTIME,
        initializer=Initializer(
            dataset=f"file://{tiny_dataset_file}", model=f"file://{tiny_model_dir}"
        ),
        trainer=FineTune(method="lora", max_steps=2),
    )
    client.wait_for_job_status(name, timeout=300, polling_interval=1)
    return client, name


def test_train_local_is_a_job_that_status_logs_and_result_see(home, cli_job):
    name, workspace = cli_job
    status = tunepack(home, "status", name, "--local")
    assert status.returncode == 0, status.stderr
    lines = assert_local_status_complete(status.stdout, name, RUNTIME)
    result = json.loads((workspace / "output" / "result.json").read_text())
    progress = next(line for line in lines if line.startswith("  progress "))
    assert re.fullmatch(
        rf"  progress 100%  loss {result['final_loss']:.4f}  \d+ tokens/s", progress
    ), progress

    logs = tunepack(home, "logs", name, "--local")
    assert logs.returncode == 0, logs.stderr
    assert logs.stdout == (workspace / "logs" / "node.log").read_text()
    # The console's `==> node:` and logs/node.log name the one-node trainer step `node`.
    node = tunepack(home, "logs", name, "--local", "--step", "node")
    assert (node.returncode, node.stderr, node.stdout) == (0, "", logs.stdout)
    init = tunepack(home, "logs", name, "--local", "--step", "dataset-initializer")
    assert init.stdout == (workspace / "logs" / "dataset-initializer.log").read_text()

    shown = tunepack(home, "result", name, "--local")
    assert shown.returncode == 0, shown.stderr
    assert shown.stdout.splitlines() == [
        f"{name}  {RUNTIME}",
        f"  result      {workspace / 'output' / 'adapter'}",
        f"  base model  {workspace / 'model'}",
        "  method      lora",
        f"  final loss  {result['final_loss']:.4f}",
    ]


def test_jobs_lists_cli_and_python_jobs_and_python_sees_the_cli_job(home, cli_job, python_job):
    name, workspace = cli_job
    client, py_name = python_job
    listed = tunepack(home, "jobs", "--local")
    assert listed.returncode == 0, listed.stderr
    header, *rows = [line.split() for line in listed.stdout.splitlines()]
    assert header == ["NAME", "RUNTIME", "STATUS", "CREATED", "PROGRESS", "WORKSPACE"]
    by_name = {row[0]: row for row in rows}
    assert by_name[name][1:3] == [RUNTIME, "Complete"] and by_name[name][-1] == str(workspace)
    assert by_name[name][-2] == by_name[py_name][-2] == "100%"
    assert by_name[py_name][1:3] == [RUNTIME, "Complete"]
    assert by_name[py_name][-1] == str(client.backend.workspace(py_name))
    assert re.fullmatch(r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d", " ".join(by_name[name][3:5]))

    # ...and Python sees the CLI's job: listed, its status, logs and result.
    assert {j.name for j in client.list_jobs()} >= {name, py_name}
    assert client.get_job(name).status == "Complete"
    assert list(client.get_job_logs(name)) == (
        (workspace / "logs" / "node.log").read_text().splitlines()
    )
    assert client.result(name).path == str(workspace / "output" / "adapter")
    assert tunepack(home, "status", py_name, "--local").stdout.startswith(f"{py_name}  Complete")


def test_the_same_command_again_resumes_its_job(
    home, tmp_path, cli_job, tiny_model_dir, tiny_dataset_file
):
    """No --name, no --workspace: the default job is named after the command, so running it
    again (from anywhere) is the same job, in the same workspace. The job had finished, so the
    re-run is a no-op that says so: no "resuming", no training summary, the training log still
    the one `tunepack logs` shows, and the job still created when it was first."""
    name, workspace = cli_job
    training_log = tunepack(home, "logs", name, "--local").stdout
    assert '"event": "step"' in training_log
    created = [
        line for line in tunepack(home, "jobs", "--local").stdout.splitlines() if name in line
    ]
    again = _train(home, tmp_path, tiny_model_dir, tiny_dataset_file)
    assert again.returncode == 0, again.stderr
    lines = again.stdout.splitlines()
    assert lines[0] == f"tunepack: job {name}: local run of {RUNTIME} in {workspace}"
    assert lines[1].startswith("==> dataset-initializer: python -m tunepack.initializers.dataset")
    assert (
        f"[node] trainer: {workspace / 'output' / 'result.json'} is complete for this "
        "configuration; nothing to do"
    ) in lines
    assert lines[-4:] == [
        "",
        f"tunepack: job {name} already finished; nothing to do",
        f"  result      {workspace / 'output' / 'adapter'}",
        f"  logs        tunepack logs {name} --local (of the run that trained)",
    ]
    assert "resuming" not in again.stdout and "training finished" not in again.stdout
    assert tunepack(home, "logs", name, "--local").stdout == training_log
    assert not (workspace / "logs" / "previous").exists()
    listed = tunepack(home, "jobs", "--local").stdout.splitlines()
    assert [line for line in listed if name in line] == created


def test_an_export_added_to_a_finished_job_is_reported_and_downloaded_from_its_path(
    tmp_path, tiny_model_dir, tiny_dataset_file
):
    """Issue 41, 7: a re-run whose trainer has nothing to do but whose exporter sent the result
    says so (not "nothing to do"), its exporter log is this run's, the training log still the
    run's that trained; `tunepack download PATH` takes the export's plain path."""
    home, cwd = tmp_path / "home", tmp_path / "cwd"
    cwd.mkdir()
    first = _train(home, cwd, tiny_model_dir, tiny_dataset_file, "--quiet")
    assert first.returncode == 0, first.stderr
    name = re.match(r"tunepack: job (\S+):", first.stdout).group(1)
    training_log = tunepack(home, "logs", name, "--local").stdout
    dest = tmp_path / "exports" / "run"
    exported = _train(home, cwd, tiny_model_dir, tiny_dataset_file, "--export", str(dest))
    assert exported.returncode == 0, exported.stderr
    assert exported.stdout.splitlines()[-4:] == [
        f"tunepack: job {name} had already trained; its result was exported",
        f"  result      {cwd / '.tunepack' / 'runs' / name / 'output' / 'adapter'}",
        f"  exported    {dest} (tunepack download {name} DIR)",
        f"  logs        tunepack logs {name} --local (of the run that trained; --step exporter: "
        "this export's)",
    ]
    assert tunepack(home, "logs", name, "--local").stdout == training_log
    exporter_log = tunepack(home, "logs", name, "--local", "--step", "exporter").stdout
    assert exporter_log.startswith(f"exporter: exported to file://{dest}: 5 files uploaded")
    again = _train(home, cwd, tiny_model_dir, tiny_dataset_file, "--export", str(dest))
    assert again.stdout.splitlines()[-4] == f"tunepack: job {name} already finished; nothing to do"

    for source, target in ((str(dest), "got-abs"), ("exports/run", "got-rel")):
        done = tunepack(home, "download", source, target, cwd=tmp_path)
        assert done.returncode == 0, done.stderr
        assert done.stdout.startswith("tunepack: downloaded 5 files ("), done.stdout
        assert (tmp_path / target / "adapter").is_dir()
    (tmp_path / "run").symlink_to(dest)
    done = tunepack(home, "download", "run", "got-bare", cwd=tmp_path)  # a directory, not a job
    assert done.returncode == 0, done.stderr


def test_the_default_name_follows_what_the_command_trains(tiny_model_dir, tiny_dataset_file):
    from tunepack.jobs.naming import stable_job_name

    data, model = str(tiny_dataset_file), f"file://{tiny_model_dir}"

    def name(args, dataset=data, runtime=RUNTIME, **placement):
        return stable_job_name(runtime, dataset, model, FineTune.from_args(args, **placement))

    same = name(["max_steps=2", "lr=1e-4"])
    assert re.fullmatch(r"tiny-llama3-[0-9a-f]{10}", same)
    # the same training, spelled differently: the same job
    assert name(["lr=0.0001", "max_steps=2"]) == same
    assert name(["max_steps=2", "lr=1e-4"], dataset=f"file://{data}") == same
    # anything that changes what is trained: another job
    others = {
        name(["max_steps=3", "lr=1e-4"]),
        name(["max_steps=2", "lr=2e-4"]),
        name(["max_steps=2"]),
        name(["max_steps=2", "lr=1e-4"], dataset=f"{data}.other"),
        name(["max_steps=2", "lr=1e-4"], num_proc_per_node=2),
        name(["max_steps=2", "lr=1e-4"], resources_per_node={"gpu": 2}),  # 2 processes too
        name(["max_steps=2", "lr=1e-4"], runtime="tunepack-qwen2.5-0.5b"),
        name(["max_steps=2", "lr=1e-4"], dataset=f"file://{data}?split=test"),
    }
    assert same not in others and len(others) == 8
    assert all(len(n) <= 33 for n in others)  # a valid TrainJob name (tunepack.jobs.trainjob)


def test_same_name_again_resumes_its_workspace(home, tmp_path, tiny_model_dir, tiny_dataset_file):
    first = _train(home, tmp_path, tiny_model_dir, tiny_dataset_file, "--name", "again")
    assert first.returncode == 0, first.stderr
    again = _train(home, tmp_path, tiny_model_dir, tiny_dataset_file, "--name", "again")
    assert again.returncode == 0, again.stderr
    workspace = tmp_path / ".tunepack" / "runs" / "again"
    assert again.stdout.splitlines()[0] == (
        f"tunepack: job again: local run of {RUNTIME} in {workspace}"
    )
    assert "nothing to do" in again.stdout
    listed = tunepack(home, "jobs", "--local").stdout.splitlines()
    assert sum(line.split()[0] == "again" for line in listed) == 1

    # delete keeps the workspace and says so; --workspace-too removes it
    deleted = tunepack(home, "delete", "again", "--local")
    assert deleted.returncode == 0, deleted.stderr
    assert deleted.stdout == (
        f"tunepack: deleted local TrainJob again; its workspace {workspace} is kept "
        "(--workspace-too removes it)\n"
    )
    assert (workspace / "output" / "result.json").exists()
    assert "again" not in tunepack(home, "jobs", "--local").stdout
    gone = tunepack(home, "status", "again", "--local")
    assert gone.returncode == 65

    # a re-run after delete is a new job in the same (kept) workspace, then deleted with it
    assert (
        _train(home, tmp_path, tiny_model_dir, tiny_dataset_file, "--name", "again").returncode == 0
    )
    deleted = tunepack(home, "delete", "again", "--local", "--workspace-too")
    assert deleted.stdout == "tunepack: deleted local TrainJob again and its workspace\n"
    assert not workspace.exists()


def test_delete_of_a_python_job_keeps_its_workspace(home, python_job):
    client, name = python_job
    workspace = client.backend.workspace(name)
    deleted = tunepack(home, "delete", name, "--local")
    assert deleted.returncode == 0, deleted.stderr
    assert f"its workspace {workspace} is kept" in deleted.stdout
    assert (workspace / "output" / "result.json").exists()
    assert name not in {j.name for j in client.list_jobs()}


@pytest.mark.parametrize("command", ["status", "logs", "result", "delete"])
def test_unknown_local_job_is_one_line_and_exit_65(home, command):
    done = tunepack(home, command, "nope", "--local")
    assert done.returncode == 65
    assert "Traceback" not in done.stderr
    assert done.stderr == (
        f"tunepack: error: no local TrainJob 'nope' under {home / 'jobs'}; `tunepack jobs "
        "--local` lists them\n"
    )
    assert done.stdout == ""


def test_jobs_with_no_jobs_says_so(tmp_path):
    done = tunepack(tmp_path, "jobs", "--local")
    assert (done.returncode, done.stdout) == (0, f"no local TrainJobs under {tmp_path / 'jobs'}\n")


def test_jobs_dir_that_cannot_be_written_is_one_line(tmp_path, tiny_model_dir, tiny_dataset_file):
    (tmp_path / "home").write_text("a file, not a directory")
    done = _train(tmp_path / "home", tmp_path, tiny_model_dir, tiny_dataset_file, "--name", "j")
    assert done.returncode == 65, done.stderr
    assert done.stderr == (
        f"tunepack: error: cannot record local TrainJob 'j' under {tmp_path / 'home' / 'jobs'}: "
        "not a directory; set TUNEPACK_HOME (or --jobs-dir) to a directory you can write to\n"
    )
    assert done.stdout == ""


def test_a_refused_run_touches_no_other_jobs_record_and_workspaces_are_jobs(
    home, tmp_path, tiny_model_dir, tiny_dataset_file
):
    """Issue 28, items 2 and 3. The same command in two workspaces is two jobs (the default
    name says where), so neither is refused as "still running" (65) nor greeted as resumed; a
    run refused because its workspace is busy (75) records nothing, and the job that trained
    in the other workspace keeps its record and result."""
    import os
    import signal
    import sys
    import time

    w1, w2 = tmp_path / "w1", tmp_path / "w2"
    first = _train(
        home, tmp_path, tiny_model_dir, tiny_dataset_file, "--workspace", str(w1), "lr=0.001"
    )
    assert first.returncode == 0, first.stderr
    name = first.stdout.split()[2].rstrip(":")
    assert first.stdout.splitlines()[1].startswith("tunepack: a new job")

    busy = subprocess.Popen(
        [
            sys.executable, "-m", "tunepack.cli", "train", "--local",
            "--runtime", RUNTIME, "--dataset", f"file://{tiny_dataset_file}",
            "--model", f"file://{tiny_model_dir}", "--workspace", str(w2),
            "method=lora", "max_steps=400", "epochs=100",
        ],
        cwd=tmp_path, env={**os.environ, "TUNEPACK_HOME": str(home)},
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 120
        while not (w2 / "logs" / "node.log").exists() and time.monotonic() < deadline:
            assert busy.poll() is None
            time.sleep(0.2)
        # (the deadline bounds a broken start only: without its trainer the refusal below would
        # be tested against a run that never held the workspace)
        assert (w2 / "logs" / "node.log").exists(), "the first run did not reach its trainer"
        refused = _train(
            home, tmp_path, tiny_model_dir, tiny_dataset_file, "--workspace", str(w2), "lr=0.001"
        )
    finally:
        os.killpg(busy.pid, signal.SIGTERM)
        busy.wait(timeout=120)
    assert refused.returncode == 75, refused.stderr
    assert refused.stdout == ""
    assert refused.stderr.startswith(f"tunepack: error: workspace {w2} is in use by local ")
    assert refused.stderr.count("\n") == 1

    listed = {
        row.split()[0]: row.split() for row in tunepack(home, "jobs", "--local").stdout.splitlines()
    }
    assert listed[name][2] == "Complete" and listed[name][-1] == str(w1)
    # The refused run recorded nothing: the only job at w2 is the one that held it.
    assert [row[0] for row in listed.values() if row[-1] == str(w2)] != [name]
    assert sum(row[-1] == str(w2) for row in listed.values()) == 1
    shown = tunepack(home, "result", name, "--local")
    assert shown.returncode == 0, shown.stderr
    assert f"  result      {w1 / 'output' / 'adapter'}" in shown.stdout

    # The same command in a fresh workspace: another job, new, not "still running", not resumed.
    w3 = tmp_path / "w3"
    fresh = _train(
        home, tmp_path, tiny_model_dir, tiny_dataset_file, "--workspace", str(w3), "lr=0.001"
    )
    assert fresh.returncode == 0, fresh.stderr
    other = fresh.stdout.split()[2].rstrip(":")
    assert other != name
    assert fresh.stdout.splitlines()[1].startswith("tunepack: a new job")
    assert "ran before" not in fresh.stdout


def test_a_named_job_in_a_fresh_workspace_is_not_resumed(
    home, tmp_path, tiny_model_dir, tiny_dataset_file
):
    """--name given twice, the second time with an empty workspace: a new run, not 'resuming'."""
    first = _train(home, tmp_path, tiny_model_dir, tiny_dataset_file, "--name", "moved")
    assert first.returncode == 0, first.stderr
    fresh = tmp_path / "fresh"
    again = _train(
        home, tmp_path, tiny_model_dir, tiny_dataset_file, "--name", "moved",
        "--workspace", str(fresh),
    )  # fmt: skip
    assert again.returncode == 0, again.stderr
    assert again.stdout.splitlines()[:2] == [
        f"tunepack: job moved: local run of {RUNTIME} in {fresh}",
        "tunepack: a new job",
    ]


def test_the_summary_points_at_the_tracker_and_results_carry_the_validation_loss(
    home, tmp_path, tiny_model_dir, tiny_dataset_file
):
    """A run with a validation split and tracker=tensorboard: the console's summary says how to
    open the run in TensorBoard; Python's Result has the validation losses of result.json, and
    the notebook's wait with a progress bar ends with the same pointer."""
    done = _train(
        home, tmp_path, tiny_model_dir, tiny_dataset_file, "--name", "tracked", "--quiet",
        "val_fraction=0.1", "eval_every_steps=1", "tracker=tensorboard",
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    workspace = tmp_path / ".tunepack" / "runs" / "tracked"
    pointer = f"tensorboard --logdir {workspace / 'output' / 'tracker'}"
    assert done.stdout.splitlines()[-1] == f"  tracker     {pointer}"

    client = TrainingClient(LocalBackendConfig(root_dir=str(home / "jobs")))
    result = client.result("tracked")
    recorded = json.loads((workspace / "output" / "result.json").read_text())
    assert result.val_loss == recorded["val_loss"] and result.val_loss is not None
    assert result.best_val_loss == recorded["best_val_loss"] <= result.val_loss
    assert result.tracker_line() == pointer

    printed = io.StringIO()
    with contextlib.redirect_stdout(printed), contextlib.redirect_stderr(io.StringIO()):
        client.wait_for_job_status("tracked", timeout=10, polling_interval=1, progress=True)
    assert printed.getvalue() == (
        f"tracked: final loss {recorded['final_loss']:.4f}; val loss {recorded['val_loss']:.4f} "
        f"(best {recorded['best_val_loss']:.4f}); tracker: {pointer}\n"
    )


def test_a_job_is_refused_the_workspace_another_job_ran_in(
    home, tmp_path, tiny_model_dir, tiny_dataset_file
):
    """Issue 49, item 1. The same command with another argument in the same --workspace is
    another job: it is refused in one line naming the job that owns the workspace and the ways
    out (exit 65), before anything is recorded or touched, and the first job's result, status
    and record stay its own. Once that job is deleted, the new one takes the workspace."""
    workspace = tmp_path / "shared"
    first = _train(
        home, tmp_path, tiny_model_dir, tiny_dataset_file, "--workspace", str(workspace), "--quiet"
    )
    assert first.returncode == 0, first.stderr
    owner = first.stdout.split()[2].rstrip(":")
    result = workspace / "output" / "result.json"
    before, loss = result.read_bytes(), json.loads(result.read_text())["final_loss"]

    refused = _train(
        home, tmp_path, tiny_model_dir, tiny_dataset_file, "--workspace", str(workspace),
        "lr=0.0005",
    )  # fmt: skip
    assert refused.returncode == 65, refused.stderr
    assert refused.stdout == ""
    other = re.search(r"these arguments make job '(tiny-llama3-[0-9a-f]{10})'", refused.stderr)
    assert other and other[1] != owner, refused.stderr
    assert refused.stderr == (
        f"tunepack: error: --workspace {workspace} holds local TrainJob {owner!r} (Complete); "
        f"these arguments make job {other[1]!r}, which would replace its dataset, model, "
        f"checkpoints and result: give this job another --workspace, run {owner!r} again with "
        f"--name {owner}, or delete it first (`tunepack delete {owner} --local` keeps the "
        "workspace)\n"
    )
    assert result.read_bytes() == before
    listed = [line.split()[0] for line in tunepack(home, "jobs", "--local").stdout.splitlines()]
    assert owner in listed and other[1] not in listed
    shown = tunepack(home, "result", owner, "--local")
    assert shown.returncode == 0, shown.stderr
    assert f"  final loss  {loss:.4f}" in shown.stdout.splitlines(), shown.stdout
    assert json.loads((workspace / "tunepack-job.json").read_text())["name"] == owner

    # The way out the line names: delete the owner (its workspace is kept), then train.
    assert tunepack(home, "delete", owner, "--local").returncode == 0
    taken = _train(
        home, tmp_path, tiny_model_dir, tiny_dataset_file, "--workspace", str(workspace),
        "--quiet", "lr=0.0005",
    )  # fmt: skip
    assert taken.returncode == 0, taken.stderr
    assert taken.stdout.split()[2].rstrip(":") == other[1]
    assert json.loads((workspace / "tunepack-job.json").read_text())["name"] == other[1]
    assert result.read_bytes() != before
