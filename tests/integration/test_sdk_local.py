"""The local backend through TrainingClient: train, wait, logs, result, and a failure; the
progress bar, plot_loss, and `tunepack status`/`tunepack logs` on the same job."""

from __future__ import annotations

import contextlib
import importlib.util
import io
import json
from pathlib import Path

import pytest

from tests.helpers import assert_local_status_complete, run_program
from tunepack import FineTune, Initializer, LocalBackendConfig, TrainingClient
from tunepack.types import RuntimeList, TunepackRuntime

RUNTIME = "tunepack-tiny-llama3"


@pytest.fixture(scope="module")
def client(tmp_path_factory):
    # <home>/jobs: the layout TUNEPACK_HOME names, so the CLI can find these jobs both ways.
    root = tmp_path_factory.mktemp("home") / "jobs"
    return TrainingClient(LocalBackendConfig(root_dir=str(root)))


@pytest.fixture(scope="module")
def finished(client, tiny_model_dir, tiny_dataset_file):
    name = client.train(
        runtime=RUNTIME,
        initializer=Initializer(
            dataset=f"file://{tiny_dataset_file}", model=f"file://{tiny_model_dir}"
        ),
        trainer=FineTune(method="lora", epochs=1, max_steps=6),
    )
    bar = io.StringIO()  # tqdm (not in a notebook) writes the bar to sys.stderr
    with contextlib.redirect_stderr(bar):
        job = client.wait_for_job_status(name, timeout=300, polling_interval=1, progress=True)
    return name, job, bar.getvalue()


def test_list_runtimes_is_a_table_of_tunepack_runtimes(client):
    runtimes = client.list_runtimes()
    assert isinstance(runtimes, RuntimeList)
    tiny = next(r for r in runtimes if r.name == RUNTIME)
    assert isinstance(tiny, TunepackRuntime)
    assert (tiny.model, tiny.methods, tiny.default_gpus) == (
        "tiny-llama3",
        ("full", "grpo_full", "lora", "dora", "dpo", "orpo", "kto", "grpo"),
        0,
    )
    html = runtimes._repr_html_()
    assert "<td>tunepack-llama3.1-8b</td>" in html and "<th>default_gpus</th>" in html
    trainer = client.get_runtime(RUNTIME).trainer
    assert trainer.image.startswith("ghcr.io/tunepack/trainer:")
    # Driven by a BuiltinTrainer (FineTune), as the SDK reports its torchtune runtimes.
    assert (trainer.trainer_type.name, trainer.framework) == ("BUILTIN_TRAINER", "torchtune")
    assert trainer.command == ("python", "-m", "tunepack.trainers.launch")


def test_runtime_names_are_resolved_visibly(client, caplog):
    """The local backend has tunepack's runtimes only: a short name resolves, and says so;
    get_runtime takes exact names, as the SDK's; a typo lists the close matches."""
    caplog.set_level("INFO", logger="tunepack")
    assert client.backend.resolve_runtime("tiny-llama3").name == RUNTIME
    assert caplog.messages == [
        f"runtime 'tiny-llama3': no runtime of that name on the local backend; using {RUNTIME!r}"
    ]
    assert client.backend.resolve_runtime(RUNTIME).name == RUNTIME
    assert len(caplog.messages) == 1
    with pytest.raises(ValueError, match=r"only; did you mean 'tunepack-tiny-llama3'\?$"):
        client.get_runtime("tiny-llama3")
    with pytest.raises(
        ValueError, match=r"no model of that name; did you mean 'tunepack-tiny-llama3'\?$"
    ):
        client.train(runtime="tunepack-tiny-lama3", trainer=FineTune())
    with pytest.raises(ValueError, match="only; tunepack runtimes are: tunepack-tiny-llama3, "):
        client.get_runtime("torch-distributed")


def test_train_wait_logs_and_result(client, finished):
    name, job, _ = finished
    assert job.status == "Complete", job.message
    assert [s.name for s in job.steps] == ["dataset-initializer", "model-initializer", "node-0"]
    assert all(s.status == "Succeeded" for s in job.steps)
    assert job.progress.step == job.progress.total_steps == 6 and job.progress.percent == 100
    logs = list(client.get_job_logs(name))
    assert any('"event": "step"' in line for line in logs)
    init_logs = list(client.get_job_logs(name, step="dataset-initializer"))
    assert init_logs, "the dataset initializer's log is empty"
    events = [(e.involved_object_name, e.reason) for e in client.get_job_events(name)]
    assert events[0] == ("dataset-initializer", "Started")
    assert events[-1] == ("node-0", "Completed")
    assert events.index(("model-initializer", "Completed")) < events.index(("node-0", "Started"))
    assert name in [j.name for j in client.list_jobs()]
    result = client.result(name)
    assert result.method == "lora" and result.path.endswith("output/adapter")
    model, _ = result.load()
    assert type(model).__name__ == "PeftModelForCausalLM"
    text = result.generate("Write", max_new_tokens=4)
    assert isinstance(text, str)


def test_generate_asks_in_the_format_the_model_was_trained_on(client, finished):
    """The prompt's tokens are exactly what preceded the answer in training: the trainer's own
    dataset pipeline (output/config.yaml) tokenizes a row to the prompt's tokens, then the
    answer's."""
    from omegaconf import OmegaConf
    from torchtune import config as tt_config

    result = client.result(finished[0])
    workspace = Path(result.base_model).parent
    cfg = OmegaConf.load(workspace / "output" / "config.yaml")
    tokenizer = tt_config.instantiate(cfg.tokenizer)
    dataset = tt_config.instantiate(cfg.dataset, tokenizer)
    row = json.loads((workspace / "dataset" / "train.jsonl").read_text().splitlines()[0])
    trained = dataset[0]["tokens"]
    asked = result.prompt_ids(row["instruction"], input=row["input"])
    assert trained[: len(asked)] == asked
    answer = tokenizer.decode(trained[len(asked) :], skip_special_tokens=True)
    assert answer.strip() == row["output"]
    # Without the template the model would be asked something it never saw.
    assert result.prompt_ids(row["instruction"], input="") != asked
    assert len(result.generate(row["instruction"], 4, input=row["input"])) > 0


def test_generate_loads_once_and_quietly(client, finished, capfd, monkeypatch):
    """A Result loads the model once, however often it generates, and other packages' loading
    bars and warnings stay out of the notebook (TUNEPACK_VERBOSE=1 shows them)."""
    monkeypatch.delenv("TUNEPACK_VERBOSE", raising=False)
    result = client.result(finished[0])
    capfd.readouterr()
    first = result.generate("Write", max_new_tokens=4)
    model, tokenizer = result.load()
    assert result.generate("Write", max_new_tokens=4) == first
    assert result.load()[0] is model and result.load()[1] is tokenizer
    out, err = capfd.readouterr()
    assert (out, err) == ("", "")

    monkeypatch.setenv("TUNEPACK_VERBOSE", "1")
    client.result(finished[0]).load()
    assert "Loading weights" in capfd.readouterr().err


def test_a_bad_dataset_is_a_failed_job_with_the_steps_message(client, tiny_model_dir, tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"instruction": "hi"}\n')  # no "output"
    name = client.train(
        runtime=RUNTIME,
        initializer=Initializer(dataset=f"file://{bad}", model=f"file://{tiny_model_dir}"),
        trainer=FineTune(epochs=1),
    )
    with pytest.raises(
        RuntimeError, match=f"TrainJob {name} is Failed: step 'dataset-initializer'"
    ):
        client.wait_for_job_status(name, timeout=120, polling_interval=1)
    job = client.get_job(name)
    assert job.status == "Failed"
    assert "exit code 65 (bad input" in job.message and "output" in job.message
    assert {s.name: s.status for s in job.steps}["node-0"] == "Pending"
    client.delete_job(name)
    assert name not in [j.name for j in client.list_jobs()]


def test_wrong_values_fail_in_the_notebook_before_anything_runs(client):
    with pytest.raises(ValueError, match="FineTune.lora_rank"):
        FineTune(lora_rank=0)
    with pytest.raises(ValueError, match="unknown runtime or model"):
        client.train(runtime="tunepack-nope", initializer=Initializer("a", "b"), trainer=FineTune())


def test_runtime_packages_are_this_environments(client, capsys):
    client.get_runtime_packages(client.get_runtime(RUNTIME))
    printed = capsys.readouterr().out
    assert printed.startswith("Python: 3.11")
    assert "torchtune==0.6.1" in printed.splitlines()


def test_wait_with_progress_shows_a_bar_of_steps(finished):
    name, job, bar = finished
    # The bar counts the optimizer steps; its last frame carries the final loss and the status.
    last = bar.rstrip().split("\r")[-1]
    assert last.startswith(f"{name}: 100%"), bar
    assert "| 6/6 [" in last and ("step/s" in last or "s/step" in last), last
    assert "%/s" not in bar and "s/%" not in bar
    assert "status=Running" in bar  # it followed the job while it ran, not only at the end
    assert f"loss={job.progress.loss:.4f}" in last and "status=Complete" in last


def _losses(client, name) -> list[float]:
    metrics = client.backend.workspace(name) / "output" / "metrics.jsonl"
    rows = [json.loads(line) for line in metrics.read_text().splitlines()]
    return [r["loss"] for r in rows if "loss" in r and "step" in r]


def test_plot_loss_plots_the_jobs_metrics_or_says_matplotlib_is_missing(client, finished):
    name, _, _ = finished
    losses = _losses(client, name)
    assert len(losses) == 6
    if importlib.util.find_spec("matplotlib") is None:
        with pytest.raises(ImportError) as err:
            client.plot_loss(name)
        assert str(err.value) == (
            "plot_loss needs matplotlib: pip install matplotlib (the metrics are available "
            "without it from the job's output/metrics.jsonl)"
        )
    else:
        fig = client.plot_loss(name)
        (line,) = fig.axes[0].get_lines()
        assert list(line.get_ydata()) == losses


def test_cli_status_and_logs_find_the_local_job(client, finished):
    name, job, _ = finished
    root = client.backend.root
    # status via $TUNEPACK_HOME (<home>/jobs), logs via --jobs-dir
    status = run_program(
        "tunepack.cli", {"TUNEPACK_HOME": str(root.parent)}, "status", name, "--local"
    )
    assert status.returncode == 0, status.stderr
    lines = assert_local_status_complete(status.stdout, name, RUNTIME)
    p = job.progress
    assert f"  progress 100%  loss {p.loss:.4f}  {p.tokens_per_second:.0f} tokens/s" in lines

    logs = run_program("tunepack.cli", {}, "logs", name, "--local", "--jobs-dir", str(root))
    assert logs.returncode == 0, logs.stderr
    assert logs.stdout.splitlines() == list(client.get_job_logs(name))
    assert any('"event": "step"' in line for line in logs.stdout.splitlines())

    for cmd in ("status", "logs"):
        unknown = run_program("tunepack.cli", {}, cmd, "nope", "--local", "--jobs-dir", str(root))
        assert unknown.returncode == 65
        assert unknown.stderr == (
            f"tunepack: error: no local TrainJob 'nope' under {root}; `tunepack jobs --local` "
            "lists them\n"
        )
