"""Hyperparameter search on the local backend (issue 48): `tunepack optimize --local` and
`tunepack.OptimizerClient(LocalBackendConfig())` run real trials of tiny-llama3 (each a local
TrainJob, real torchtune training on CPU) on an Optuna study."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading

import pytest

from tests.helpers import run_program
from tunepack import LocalBackendConfig, OptimizerClient

RUNTIME = "tunepack-tiny-llama3"


def tunepack(home, *args: str, timeout: int = 600) -> subprocess.CompletedProcess:
    return run_program("tunepack.cli", {"TUNEPACK_HOME": str(home)}, *args, timeout=timeout)


def _search_args(data, model, *extra: str) -> list[str]:
    return [
        "optimize", "--local", "--runtime", RUNTIME, "--dataset", f"file://{data}",
        "--model", f"file://{model}", *extra,
    ]  # fmt: skip


def _client(home) -> OptimizerClient:
    return OptimizerClient(LocalBackendConfig(root_dir=str(home / "jobs")))


def _name(stdout: str) -> str:
    first = stdout.splitlines()[0]
    assert first.startswith("tunepack: optimization hpo-"), stdout
    return first.split()[2].rstrip(":")


def _result_json(home, trial: str) -> dict:
    return json.loads((home / "jobs" / trial / "workspace/output/result.json").read_text())


@pytest.fixture(scope="module")
def search(tmp_path_factory, tiny_model_dir, tiny_dataset_file):
    """A 4-trial random search over lr (log-uniform) and lora_rank (a choice)."""
    home = tmp_path_factory.mktemp("home")
    done = tunepack(
        home,
        *_search_args(
            tiny_dataset_file, tiny_model_dir,
            "--search", "lr=loguniform:1e-4:1e-2", "--search", "lora_rank=choice:4,8",
            "--trials", "4", "--parallel", "2", "--seed", "7", "--quiet",
            "method=lora", "max_steps=4", "val_fraction=0.2", "warmup_steps=0",
        ),
    )  # fmt: skip
    assert done.returncode == 0, done.stderr + done.stdout
    return home, _name(done.stdout), done.stdout


def test_the_best_trial_is_the_one_whose_own_result_has_the_lowest_val_loss(search):
    home, name, stdout = search
    client = _client(home)
    job = client.get_job(name)
    assert job.status == "Complete" and len(job.trials) == 4
    assert all(t.state == "Complete" for t in job.trials)
    own = {t.name: _result_json(home, t.name) for t in job.trials}
    lowest = min(own, key=lambda n: own[n]["val_loss"])
    best = client.get_best_results(name)
    assert best.trial == lowest == job.best_trial
    # Its parameters are the ones that trial trained with, and its figures its run's own.
    trained = own[lowest]["trainer_args"]
    assert best.parameters == {"lr": trained["lr"], "lora_rank": trained["lora_rank"]}
    metrics = {m.name: m for m in best.metrics}
    assert float(metrics["val_loss"].latest) == pytest.approx(own[lowest]["val_loss"], abs=1e-6)
    assert float(metrics["loss"].latest) == pytest.approx(own[lowest]["final_loss"], abs=1e-6)
    for trial in job.trials:
        assert trial.objective == own[trial.name]["val_loss"]
        assert 1e-4 <= float(trial.parameters["lr"]) <= 1e-2
        assert trial.parameters["lora_rank"] in ("4", "8")
    # On a machine without a GPU the trials ran one after another, and it said why.
    assert (
        "tunepack: parallel_trials=2: this machine has no GPU, so the trials run one at a time "
        "(on one CPU they would only slow each other down)"
    ) in stdout.splitlines()
    assert stdout.splitlines()[-1] == (
        f"tunepack: best trial {lowest}: lr={trained['lr']} lora_rank={trained['lora_rank']}: "
        f"val_loss {own[lowest]['val_loss']:.4f}; its result: tunepack result {lowest} --local"
    )


def test_the_dataset_and_model_are_initialized_once_for_every_trial(search):
    home, name, _ = search
    shared = home / "jobs" / ".optimizations" / name / "shared" / "logs"
    assert "dataset-initializer: " in (shared / "dataset-initializer.log").read_text()
    for trial in _client(home).get_job(name).trials:
        logs = home / "jobs" / trial.name / "workspace" / "logs"
        for step, what in (("dataset-initializer", "rows"), ("model-initializer", "tiny-llama3")):
            text = (logs / f"{step}.log").read_text()
            assert " already complete (" in text and what in text, text
        # Hard links to the one copy: no byte of the model was copied per trial.
        weights = home / "jobs" / trial.name / "workspace" / "model" / "model.safetensors"
        assert os.stat(weights).st_nlink >= 5  # the shared copy and each of the 4 trials'


def test_the_best_trials_result_logs_status_and_delete(search):
    home, name, _ = search
    client = _client(home)
    best = client.get_best_results(name).trial
    result = client.result(name)
    assert result.job == best
    adapter = json.loads(
        (home / "jobs" / best / "workspace/output/adapter/adapter_config.json").read_text()
    )
    assert str(adapter["r"]) == client.get_best_results(name).parameters["lora_rank"]
    assert result.path == str(home / "jobs" / best / "workspace/output/adapter")

    logs = list(client.get_job_logs(name))
    assert logs == (home / "jobs" / best / "workspace/logs/node.log").read_text().splitlines()

    status = tunepack(home, "optimize", "status", name, "--local")
    assert status.returncode == 0, status.stderr
    lines = status.stdout.splitlines()
    assert lines[0] == f"{name}  Complete  (4 of 4 trials)"
    assert lines[1].split() == ["trial", "state", "lr", "lora_rank", "val_loss"]
    assert sum(line.startswith(f"{best} *") for line in lines) == 1
    listed = tunepack(home, "optimize", "jobs", "--local")
    assert listed.stdout.splitlines()[1].split()[:3] == [name, "Complete", "4/4"]
    assert json.loads((home / "jobs" / best / "workspace/output/result.json").read_text())


def test_a_stopped_search_resumes_without_running_a_finished_trial_again(
    tmp_path, tiny_model_dir, tiny_dataset_file
):
    """Ctrl-C while the second trial trains: the first (finished) is never run again; the
    second resumes from the checkpoint its trainer wrote when stopped."""
    home = tmp_path / "home"
    args = _search_args(
        tiny_dataset_file, tiny_model_dir,
        "--search", "lr=loguniform:1e-4:1e-3", "--trials", "2", "--seed", "3", "--quiet",
        "method=lora", "max_steps=40", "epochs=20",
    )  # fmt: skip
    env = {**os.environ, "TUNEPACK_HOME": str(home)}
    cli = subprocess.Popen(
        [sys.executable, "-m", "tunepack.cli", *args],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    first = []
    started = threading.Event()

    def read() -> None:
        for line in cli.stdout:
            first.append(line.rstrip("\n"))
            if " trial 1 (" in line:
                started.set()

    reader = threading.Thread(target=read)
    reader.start()
    assert started.wait(300), first
    name = _name("\n".join(first))
    metrics = home / "jobs" / f"{name}-1" / "workspace" / "output" / "metrics.jsonl"
    _wait_for_a_step(metrics, cli)
    cli.send_signal(signal.SIGINT)
    assert cli.wait(timeout=300) == 130
    reader.join()
    stderr = cli.stderr.read()
    assert stderr.splitlines()[-1] == (
        f"tunepack: optimization {name} stopped; run the same command again to resume it (no "
        "finished trial runs again)"
    ), stderr
    assert _client(home).get_job(name).status == "Stopped"

    again = tunepack(home, *args)
    assert again.returncode == 0, again.stderr + again.stdout
    lines = again.stdout.splitlines()
    assert "tunepack: trial 1 was stopped; it runs again from its checkpoint" in lines
    assert not any(" trial 0 (" in line for line in lines)  # the finished one: not run again
    done = [line for line in first + lines if " done: val_loss " in line or " done: loss " in line]
    assert len(done) == 2, first + lines  # each trial ran to its end once
    job = _client(home).get_job(name)
    assert job.status == "Complete"
    assert [(t.name, t.state) for t in job.trials] == [
        (f"{name}-0", "Complete"),
        (f"{name}-1", "Complete"),  # its stopped attempt, then this one
    ]
    resumed = _result_json(home, f"{name}-1")
    assert resumed["resumed_from_step"] is not None and resumed["steps"] == 40


def _wait_for_a_step(metrics, proc) -> None:
    """Until the trial's metrics.jsonl holds a step record (its trainer is training)."""
    stop = threading.Event()
    while not (metrics.exists() and '"event": "step"' in metrics.read_text()):
        assert proc.poll() is None, "the search ended before its second trial trained"
        stop.wait(0.05)


def test_a_hopeless_trial_is_stopped_early_by_the_median_rule(
    tmp_path, tiny_model_dir, tiny_dataset_file
):
    """A grid in order: two learning rates that learn, then one that cannot (1e-9): at its
    first evaluation its validation loss is worse than both earlier trials' there, so it is
    stopped and counted as stopped early; the search completes."""
    home = tmp_path / "home"
    done = tunepack(
        home,
        *_search_args(
            tiny_dataset_file, tiny_model_dir,
            "--search", "lr=choice:0.01,0.009,0.000000001", "--algorithm", "grid",
            "--trials", "3", "--early-stop", "2:0", "--quiet",
            "method=lora", "max_steps=16", "val_fraction=0.2", "eval_every_steps=2",
            "warmup_steps=0",
        ),
    )  # fmt: skip
    assert done.returncode == 0, done.stderr + done.stdout
    name = _name(done.stdout)
    job = _client(home).get_job(name)
    assert [(t.parameters["lr"], t.state) for t in job.trials] == [
        ("0.01", "Complete"),
        ("0.009", "Complete"),
        ("0.000000001", "EarlyStopped"),
    ]
    stopped = [line for line in done.stdout.splitlines() if " stopped early at step " in line]
    assert len(stopped) == 1 and stopped[0].startswith("tunepack: trial 2 stopped early at step ")
    assert stopped[0].endswith(
        ": its val_loss was worse than the median of the earlier trials there"
    )
    steps = [
        json.loads(line)
        for line in (home / "jobs" / f"{name}-2" / "workspace/output/metrics.jsonl")
        .read_text()
        .splitlines()
    ]
    assert max(r["step"] for r in steps) < 16  # it did not train to its end
    assert not (home / "jobs" / f"{name}-2" / "workspace/output/result.json").exists()
    assert job.best_trial in (f"{name}-0", f"{name}-1")


def test_every_method_declares_the_metrics_its_objective_reports():
    """Method.metrics is what a search may optimise: it must be what the objectives compute."""
    from tunepack.runtimes import methods
    from tunepack.trainers.objectives.dpo import DPO

    assert tuple(DPO.metrics([0.0, 1.0, 0.5, 1.0], 2.0)) == methods.get("dpo").metrics


def test_a_search_refused_before_anything_is_created(tmp_path, tiny_model_dir, tiny_dataset_file):
    """The memory plan of the largest point, on a GPU runtime: refused in one line block (65),
    and no job, record or study is left."""
    home = tmp_path / "home"
    refused = tunepack(
        home,
        "optimize", "--local", "--runtime", "tunepack-llama3-8b", "--gpu", "l4",
        "--dataset", f"file://{tiny_dataset_file}", "--model", "hf://meta-llama/Llama-3.1-8B",
        "--search", "batch_size=choice:1,16", "--search", "max_seq_len=choice:512,8192",
        "method=lora",
    )  # fmt: skip
    assert refused.returncode == 65, refused.stderr
    assert refused.stderr.startswith(
        "tunepack: error: this fine-tune is estimated not to fit in GPU memory:\n"
        "llama3-8b lora, seq_len 8192, batch 16/device, 1 node(s) x 1 L4-24GB\n"
    ), refused.stderr
    assert refused.stdout == "" and not home.exists()
