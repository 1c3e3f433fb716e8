"""The `tunepack` command line as a new user meets it: quickstart path, render, bad input."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
import yaml

from tunepack.runtimes.validate import validate_trainjob


def tunepack(*args: str, cwd=None, timeout: int = 600) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "tunepack.cli", *args],
        capture_output=True,
        text=True,
        cwd=cwd,
        timeout=timeout,
    )


@pytest.fixture(scope="module")
def quickstart(tmp_path_factory):
    """The quickstart's three commands, run as a user runs them."""
    root = tmp_path_factory.mktemp("quickstart")
    model, data, workspace = root / "tiny-llama3", root / "data.jsonl", root / "workspace"
    assert tunepack("tiny-model", str(model)).returncode == 0
    assert tunepack("tiny-dataset", str(data)).returncode == 0
    done = tunepack(
        "train", "--local", "--runtime", "tunepack-tiny-llama3",
        "--workspace", str(workspace),
        "--dataset", f"file://{data}", "--model", f"file://{model}",
        "method=lora", "epochs=2",
    )  # fmt: skip
    return done, workspace


def test_quickstart_trains_and_summarises(quickstart):
    done, workspace = quickstart
    assert done.returncode == 0, done.stderr + done.stdout
    result = json.loads((workspace / "output" / "result.json").read_text())
    assert result["steps"] == 64
    assert result["final_loss"] < result["first_loss"] - 0.5
    for line in (
        "tunepack: training finished",
        "runtime     tunepack-tiny-llama3",
        "steps       64",
        f"result      {workspace / 'output' / 'adapter'}",
    ):
        assert line in done.stdout
    # Each step ran, in the runtime's order, with a log of its own.
    assert done.stdout.index("==> dataset-initializer") < done.stdout.index("==> node")
    for step in ("dataset-initializer", "model-initializer", "node"):
        assert (workspace / "logs" / f"{step}.log").stat().st_size > 0


def test_quickstart_adapter_loads_with_peft(quickstart):
    peft = pytest.importorskip("peft")
    transformers = pytest.importorskip("transformers")
    _, workspace = quickstart
    base = transformers.AutoModelForCausalLM.from_pretrained(workspace / "model")
    tokens = torch.arange(1, 33).reshape(1, 32)
    with torch.no_grad():
        before = base(tokens).logits
        tuned = peft.PeftModel.from_pretrained(base, workspace / "output" / "adapter")
        after = tuned(tokens).logits
    assert (after - before).abs().max() > 1e-2


def test_rerun_on_complete_workspace_does_no_work(quickstart, tmp_path):
    _, workspace = quickstart
    adapter = workspace / "output" / "adapter" / "adapter_model.safetensors"
    mtime = adapter.stat().st_mtime_ns
    model = json.loads((workspace / "model" / "tunepack-manifest.json").read_text())["source"]
    data = json.loads((workspace / "dataset" / "tunepack-manifest.json").read_text())["source"]
    again = tunepack(
        "train", "--local", "--runtime", "tunepack-tiny-llama3", "--workspace", str(workspace),
        "--dataset", data, "--model", model, "method=lora", "epochs=2",
    )  # fmt: skip
    assert again.returncode == 0, again.stderr
    assert "nothing to do" in again.stdout
    assert adapter.stat().st_mtime_ns == mtime


def test_render_trainjob_is_valid_and_carries_the_run():
    done = tunepack(
        "render", "trainjob", "--name", "llama-lora", "--runtime", "tunepack-llama3.2-1b",
        "--dataset", "file:///data/train.jsonl", "--model", "file:///models/llama",
        "lora_rank=16", "epochs=3",
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    trainjob = yaml.safe_load(done.stdout)
    validate_trainjob(trainjob)
    spec = trainjob["spec"]
    assert spec["runtimeRef"]["name"] == "tunepack-llama3.2-1b"
    assert spec["initializer"]["dataset"]["storageUri"] == "file:///data/train.jsonl"
    assert spec["trainer"]["args"] == ["lora_rank=16", "epochs=3"]


def test_runtimes_lists_the_catalog():
    done = tunepack("runtimes")
    assert done.returncode == 0
    for name in ("tunepack-tiny-llama3", "tunepack-llama3.2-1b", "tunepack-qwen2.5-7b"):
        assert name in done.stdout


@pytest.mark.parametrize(
    ("dataset", "args", "message"),
    [
        (
            "ftp://example.org/data.jsonl",
            [],
            "unsupported storage URI 'ftp://example.org/data.jsonl'",
        ),
        ("file:///no/such/data.jsonl", [], "step 'dataset-initializer' failed with exit code 65"),
        (None, ["lora_rnk=8"], "unknown trainer argument 'lora_rnk'; did you mean 'lora_rank'?"),
        (None, ["lora_rank=abc"], "lora_rank='abc' is not valid: expected an integer"),
        (None, ["epochs=1", "--runtime-typo"], "unrecognized arguments"),
    ],
)
def test_bad_input_gives_a_clear_message_and_exit_code(
    tmp_path, tiny_model_dir, tiny_dataset_file, dataset, args, message
):
    workspace = tmp_path / "ws"
    done = tunepack(
        "train", "--local", "--runtime", "tunepack-tiny-llama3", "--workspace", str(workspace),
        "--dataset", dataset or f"file://{tiny_dataset_file}",
        "--model", f"file://{tiny_model_dir}", *args,
    )  # fmt: skip
    assert done.returncode in (2, 65)  # 2: argparse usage errors
    assert message in done.stderr
    assert not (workspace / "output").exists()


def test_missing_dataset_names_the_file_in_the_step_log(tmp_path, tiny_model_dir):
    workspace = tmp_path / "ws"
    done = tunepack(
        "train", "--local", "--runtime", "tiny-llama3", "--workspace", str(workspace),
        "--dataset", "file:///no/such/data.jsonl", "--model", f"file://{tiny_model_dir}",
    )  # fmt: skip
    assert done.returncode == 65
    assert "bad input: fix it and run again" in done.stderr
    assert "dataset-initializer: error:" in done.stderr  # the step's own reason, shown
    log = (workspace / "logs" / "dataset-initializer.log").read_text()
    assert "/no/such/data.jsonl" in log
    assert not (workspace / "logs" / "node.log").exists()
