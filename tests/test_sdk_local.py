"""The local backend through TrainingClient: train, wait, logs, result, and a failure."""

from __future__ import annotations

import pytest

from tunepack import FineTune, Initializer, LocalBackendConfig, TrainingClient
from tunepack.types import RuntimeList, TunepackRuntime

RUNTIME = "tunepack-tiny-llama3"


@pytest.fixture(scope="module")
def client(tmp_path_factory):
    return TrainingClient(LocalBackendConfig(root_dir=str(tmp_path_factory.mktemp("jobs"))))


@pytest.fixture(scope="module")
def finished(client, tiny_model_dir, tiny_dataset_file):
    name = client.train(
        runtime=RUNTIME,
        initializer=Initializer(
            dataset=f"file://{tiny_dataset_file}", model=f"file://{tiny_model_dir}"
        ),
        trainer=FineTune(method="lora", epochs=1, max_steps=6),
    )
    job = client.wait_for_job_status(name, timeout=300, polling_interval=1)
    return name, job


def test_list_runtimes_is_a_table_of_tunepack_runtimes(client):
    runtimes = client.list_runtimes()
    assert isinstance(runtimes, RuntimeList)
    tiny = next(r for r in runtimes if r.name == RUNTIME)
    assert isinstance(tiny, TunepackRuntime)
    assert (tiny.model, tiny.methods, tiny.default_gpus) == (
        "tiny-llama3",
        ("full", "lora", "dora"),
        0,
    )
    html = runtimes._repr_html_()
    assert "<td>tunepack-llama3.1-8b</td>" in html and "<th>default_gpus</th>" in html
    assert client.get_runtime(RUNTIME).trainer.image.startswith("ghcr.io/tunepack/trainer:")


def test_train_wait_logs_and_result(client, finished):
    name, job = finished
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
