"""The local backend: the platform's step order and environment, its console lines and summaries.
The steps run as processes: tests/integration/test_local.py."""

from __future__ import annotations

import json
import sys

import pytest

from tunepack.backends.local.steps import order_steps, resolve_steps
from tunepack.core.errors import BadValueError
from tunepack.jobs.trainjob import TrainJobSpec, build_trainjob
from tunepack.runtimes.store import load_runtime

DATASET_URI = "file:///data/instructions.jsonl"
MODEL_URI = "file:///models/tiny-llama3"


def _trainjob(**kwargs) -> dict:
    return build_trainjob(
        TrainJobSpec(
            name="local-test",
            runtime="tunepack-tiny-llama3",
            dataset_uri=DATASET_URI,
            model_uri=MODEL_URI,
            trainer_args=["lora_rank=4", "epochs=1"],
            **kwargs,
        )
    )


def _jobs(*spec: tuple[str, list[str]]) -> list[dict]:
    return [
        {"name": n, "dependsOn": [{"name": d, "status": "Complete"} for d in deps]}
        for n, deps in spec
    ]


def test_order_follows_depends_on_not_listing_order():
    jobs = _jobs(("node", ["b", "a"]), ("b", ["a"]), ("a", []))
    assert [j["name"] for j in order_steps(jobs)] == ["a", "b", "node"]


def test_order_refuses_cycles_and_unknown_jobs():
    with pytest.raises(BadValueError) as err:
        order_steps(_jobs(("a", ["b"]), ("b", ["a"])))
    assert str(err.value) == "runtime jobs depend on each other in a cycle: a -> b -> a"
    with pytest.raises(BadValueError) as err:
        order_steps(_jobs(("a", ["ghost"])))
    assert str(err.value) == "runtime job 'a' depends on unknown job 'ghost'"


def test_steps_get_the_environment_the_platform_injects(tmp_path):
    steps = resolve_steps(load_runtime("tunepack-tiny-llama3"), _trainjob(), tmp_path)
    by_name = {s.name: s for s in steps}
    assert [s.name for s in steps] == ["dataset-initializer", "model-initializer", "node"]
    assert by_name["dataset-initializer"].env["STORAGE_URI"] == DATASET_URI
    assert by_name["model-initializer"].env["STORAGE_URI"] == MODEL_URI
    node = by_name["node"]
    assert node.command == [
        sys.executable,
        "-m",
        "tunepack.trainers.launch",
        "lora_rank=4",
        "epochs=1",
    ]
    assert node.env["PET_NNODES"] == "1"
    assert node.env["PET_MASTER_ADDR"] == "127.0.0.1"
    assert int(node.env["PET_MASTER_PORT"]) > 0
    assert node.depends_on == ["dataset-initializer", "model-initializer"]
    for step in steps:  # /workspace is replaced by the local directory everywhere
        assert step.env["TUNEPACK_WORKSPACE"] == str(tmp_path)
        assert step.env["TUNEPACK_MODEL"] == "tiny-llama3"


def test_num_nodes_becomes_node_replicas(tmp_path):
    steps = resolve_steps(load_runtime("tunepack-tiny-llama3"), _trainjob(num_nodes=2), tmp_path)
    node = steps[-1]
    assert node.replicas == 2 and node.env["PET_NNODES"] == "2"


def test_the_console_shows_tunepack_lines_and_leaves_out_other_packages():
    from tunepack.backends.local.steps import progress_line

    own = [
        "trainer: done: 4 steps, loss 5.9 -> 5.1; result at /w/output/adapter",
        "model-initializer: delivered 7 files",
        "INFO tunepack.trainer: model tiny-llama3 (lora, fp32, 1 process)",
        "ERROR torch.distributed.elastic: failed (exitcode: 75)",
    ]
    noise = [
        "Skipping import of cpp extensions due to incompatible torch version",
        "/x/torch/distributed/tensor/_dispatch.py:342: UserWarning: DTensor random operators",
        "DEBUG torchtune.utils._logging: Setting manual seed to local seed 0.",
        '{"event": "checkpoint", "step": 3, "path": "/w/checkpoints/step-00000003"}',
    ]
    for line in own:
        assert progress_line(line + "\n", verbose=False) == line
    for line in noise:
        assert progress_line(line + "\n", verbose=False) is None
        assert progress_line(line + "\n", verbose=True) == line  # --verbose: everything


def test_step_and_eval_records_become_short_lines():
    from tunepack.backends.local.steps import progress_line

    def step(n: int) -> str:
        return json.dumps(
            {"event": "step", "step": n, "total_steps": 100, "epoch": 1, "loss": 2.5,
             "lr": 1e-3, "tokens_per_second": 812.4}
        )  # fmt: skip

    assert progress_line(step(1)) == "step 1/100  epoch 1  loss 2.5000  lr 1.00e-03  812 tok/s"
    assert progress_line(step(7)) is None  # about twenty step lines per run
    assert progress_line(step(10)).startswith("step 10/100 ")
    assert progress_line(step(100)).startswith("step 100/100 ")
    evaluation = {
        "event": "eval", "step": 20, "total_steps": 100, "val_loss": 2.25,
        "val_perplexity": 9.4877, "best_val_loss": 2.2, "best_step": 10,
    }  # fmt: skip
    assert progress_line(json.dumps(evaluation)) == (
        "eval at step 20/100  val_loss 2.2500  perplexity 9.49  best 2.2000 (step 10)"
    )


def test_each_run_keeps_its_logs(tmp_path):
    from tunepack.backends.local.steps import keep_previous_logs

    logs = tmp_path / "logs"
    assert keep_previous_logs(logs) is None  # nothing yet
    for run in ("first", "second"):
        logs.mkdir(exist_ok=True)
        (logs / "node.log").write_text(f"{run} run\n")
        (logs / "dataset-initializer.log").write_text(f"{run} run\n")
        keep_previous_logs(logs)
    assert (logs / "previous" / "1" / "node.log").read_text() == "first run\n"
    assert (logs / "previous" / "2" / "dataset-initializer.log").read_text() == "second run\n"
    assert not list(logs.glob("*.log"))


def test_the_summary_shows_the_validation_loss(tmp_path, capsys):
    from tunepack.cli.output import print_summary

    output = tmp_path / "output"
    output.mkdir()
    result = {
        "method": "lora", "steps": 29, "first_loss": 5.99, "final_loss": 4.77,
        "artifact": str(output / "adapter"), "val_loss": 4.76, "best_val_loss": 4.70,
        "best_step": 20, "keep_best": True,
    }  # fmt: skip
    (output / "result.json").write_text(json.dumps(result))
    print_summary("job", "tunepack-tiny-llama3", tmp_path, 19.2)
    out = capsys.readouterr().out
    assert "  val loss    4.7600 (last step); best 4.7000 at step 20, published\n" in out
    assert "  loss        5.9900 (first step) -> 4.7700 (last step)\n" in out


@pytest.mark.parametrize(
    ("method", "section"),
    [
        ("dpo", {"beta": 0.1, "loss": "sigmoid"}),
        ("orpo", {"beta": 0.1, "log_odds_ratio": 0.05, "nll": 1.2}),
        ("kto", {"beta": 0.1, "desirable_weight": 1.0, "undesirable_weight": 1.0, "kl": 0.0}),
    ],
)
def test_the_summary_shows_each_preference_method_s_rewards(tmp_path, capsys, method, section):
    """ORPO and KTO record their rewards under their own names, as DPO does (issue 41, 8):
    the summary says whether the run learned to prefer the right answers."""
    from tunepack.cli.output import print_summary

    output = tmp_path / "output"
    output.mkdir()
    rewards = {"reward_margin": 0.5097, "reward_accuracy": 0.6875}
    result = {
        "method": method, "steps": 96, "first_loss": 0.5, "final_loss": 0.4948,
        "artifact": str(output / "adapter"), method: {**section, **rewards},
    }  # fmt: skip
    (output / "result.json").write_text(json.dumps(result))
    print_summary("job", "tunepack-tiny-llama3", tmp_path, 19.2)
    out = capsys.readouterr().out
    assert "  rewards     margin 0.5097, accuracy 0.69 (last step)\n" in out


def test_local_progress_reads_the_last_step_and_the_last_evaluation(tmp_path):
    from tunepack.backends.local import read_progress

    metrics = tmp_path / "metrics.jsonl"
    records = [
        {"event": "step", "step": 9, "total_steps": 20, "loss": 3.0},
        {"event": "step", "step": 10, "total_steps": 20, "loss": 2.5},
        {"event": "eval", "step": 10, "total_steps": 20, "val_loss": 2.7, "val_perplexity": 14.88},
        {"event": "checkpoint", "step": 10, "path": "/w/checkpoints/step-00000010"},
    ]
    metrics.write_text("".join(json.dumps(r) + "\n" for r in records) + '{"event": "st')
    progress = read_progress(metrics)
    assert (progress.step, progress.total_steps, progress.percent) == (10, 20, 50)
    assert (progress.loss, progress.val_loss, progress.val_perplexity) == (2.5, 2.7, 14.88)
    assert read_progress(tmp_path / "none.jsonl") is None
