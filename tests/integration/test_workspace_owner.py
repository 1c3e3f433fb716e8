"""A workspace holds one job's work (issue 49, item 1): every program that writes in it refuses
one that holds another job's work, named by the platform (on a cluster JobSet's pod labels,
through the runtimes' downward API; locally the backend). The programs run as their own
processes, as in a Pod."""

from __future__ import annotations

import json

from tests.helpers import copy_workspace, launch_trainer, run_program, trainer_env
from tunepack.core.errors import EXIT_BAD_INPUT
from tunepack.core.workspace import JOB_FILE, JOB_NAME_ENV, JOB_UID_ENV
from tunepack.runtimes import catalog
from tunepack.runtimes.builder import build_runtime
from tunepack.runtimes.contract import container, replicated_jobs

MODEL = {"TUNEPACK_MODEL": "tiny-llama3"}


def _claimed_line(program: str, root, owner: str, job: str) -> str:
    return (
        f"{program}: error: workspace {root} holds the work of job {owner!r} (its dataset, "
        f"model, checkpoints and result); job {job!r} would replace it: give each job a "
        "workspace of its own (a runtime's volumeClaimPolicies make one per TrainJob; a claim "
        f"shared through runtimePatches does not), or delete {root}/{JOB_FILE} once {owner!r}'s "
        "result is no longer needed"
    )


def _owner(root) -> dict:
    return json.loads((root / JOB_FILE).read_text())


def test_every_program_refuses_a_workspace_that_holds_another_jobs_work(
    tmp_path, tiny_dataset_file, tiny_model_dir
):
    root = tmp_path / "ws"
    env = {"TUNEPACK_WORKSPACE": str(root), **MODEL, JOB_NAME_ENV: "first", JOB_UID_ENV: "u1"}
    for module, source in (
        ("tunepack.initializers.dataset", tiny_dataset_file),
        ("tunepack.initializers.model", tiny_model_dir),
    ):
        done = run_program(module, {**env, "STORAGE_URI": f"file://{source}"})
        assert done.returncode == 0, done.stderr
    assert _owner(root) == {"name": "first", "uid": "u1"}
    manifest = (root / "dataset" / "tunepack-manifest.json").read_bytes()

    other = {**env, JOB_NAME_ENV: "second", JOB_UID_ENV: "u2"}
    for module, program, source in (
        ("tunepack.initializers.dataset", "dataset-initializer", tiny_dataset_file),
        ("tunepack.initializers.model", "model-initializer", tiny_model_dir),
    ):
        done = run_program(module, {**other, "STORAGE_URI": f"file://{source}"})
        assert done.returncode == EXIT_BAD_INPUT, done.stderr
        assert done.stderr.splitlines() == [_claimed_line(program, root, "first", "second")]
    trained = launch_trainer({**trainer_env(root), **other}, "method=lora", "max_steps=1")
    assert trained.returncode == EXIT_BAD_INPUT, trained.stderr
    assert trained.stderr.splitlines()[-1] == _claimed_line("trainer", root, "first", "second")
    assert not (root / "output" / "result.json").exists()
    assert (root / "dataset" / "tunepack-manifest.json").read_bytes() == manifest
    assert _owner(root) == {"name": "first", "uid": "u1"}


def test_a_trainjob_of_the_same_name_takes_over_its_retained_workspace_and_says_so(
    tmp_path, initialized_workspace, tiny_dataset_file
):
    """A TrainJob deleted and created again binds its retained claim anew: the same name, a
    new uid. It is the job of that name now, so it works there, and the log says so."""
    root = copy_workspace(initialized_workspace, tmp_path)
    (root / JOB_FILE).write_text(json.dumps({"name": "job", "uid": "old"}))
    env = {"TUNEPACK_WORKSPACE": str(root), **MODEL, JOB_NAME_ENV: "job", JOB_UID_ENV: "new"}
    done = run_program(
        "tunepack.initializers.dataset", {**env, "STORAGE_URI": f"file://{tiny_dataset_file}"}
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines()[0] == (
        f"dataset-initializer: workspace {root} holds the work of an earlier job named 'job' "
        "(uid old); this one (uid new) takes it over"
    )
    assert _owner(root) == {"name": "job", "uid": "new"}


def test_a_workspace_holding_no_work_or_a_program_run_on_its_own_is_not_refused(
    tmp_path, initialized_workspace, tiny_dataset_file
):
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / JOB_FILE).write_text(json.dumps({"name": "first", "uid": ""}))
    uri = {"STORAGE_URI": f"file://{tiny_dataset_file}"}
    env = {"TUNEPACK_WORKSPACE": str(empty), **MODEL, **uri, JOB_NAME_ENV: "second"}
    done = run_program("tunepack.initializers.dataset", env)
    assert done.returncode == 0, done.stderr
    assert _owner(empty) == {"name": "second", "uid": ""}

    # No job named (a program started by hand): nothing to check, nothing recorded.
    root = copy_workspace(initialized_workspace, tmp_path)
    (root / JOB_FILE).write_text(json.dumps({"name": "first", "uid": ""}))
    done = run_program("tunepack.initializers.dataset", {"TUNEPACK_WORKSPACE": str(root), **uri})
    assert done.returncode == 0, done.stderr
    assert _owner(root) == {"name": "first", "uid": ""}


def test_each_step_of_a_runtime_is_told_its_trainjob_by_jobsets_pod_labels():
    runtime = build_runtime(catalog.get("tiny-llama3"))
    for job in replicated_jobs(runtime):
        env = {v["name"]: v.get("valueFrom") for v in container(job).get("env", [])}
        assert env[JOB_NAME_ENV] == {
            "fieldRef": {"fieldPath": "metadata.labels['jobset.sigs.k8s.io/jobset-name']"}
        }, job["name"]
        assert env[JOB_UID_ENV] == {
            "fieldRef": {"fieldPath": "metadata.labels['jobset.sigs.k8s.io/jobset-uid']"}
        }, job["name"]
