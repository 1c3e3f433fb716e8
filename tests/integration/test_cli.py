"""The `tunepack` command line as a new user meets it: quickstart path, render, bad input."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest
import torch
import yaml

from tests import REPO
from tunepack.runtimes.validate import validate_trainjob

# README's "What the quickstart does": the commands `make quickstart` runs, and their output.
QUICKSTART = (REPO / "README.md").read_text().split("## What the quickstart does", 1)[1]
QUICKSTART = QUICKSTART.split("\n## ", 1)[0]
# The trainer arguments of its `tunepack train` line (the key=value words after the flags).
QUICKSTART_ARGS = [
    word
    for word in re.search(r"^tunepack train (.*?)\n```", QUICKSTART, re.S | re.M).group(1).split()
    if "=" in word and not word.startswith("-")
]


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
        *QUICKSTART_ARGS,
    )  # fmt: skip
    return done, workspace


def test_quickstart_trains_and_summarises(quickstart):
    done, workspace = quickstart
    assert done.returncode == 0, done.stderr + done.stdout
    result = json.loads((workspace / "output" / "result.json").read_text())
    assert result["steps"] == 96
    assert result["final_loss"] < result["first_loss"] - 0.5
    for line in (
        "tunepack: training finished",
        "runtime     tunepack-tiny-llama3",
        "steps       96",
        f"result      {workspace / 'output' / 'adapter'}",
    ):
        assert line in done.stdout
    # Each step ran, in the runtime's order, with a log of its own.
    assert done.stdout.index("==> dataset-initializer") < done.stdout.index("==> node")
    for step in ("dataset-initializer", "model-initializer", "node"):
        assert (workspace / "logs" / f"{step}.log").stat().st_size > 0


def test_the_readme_quickstart_is_the_makefiles_and_its_output_is_this_runs(quickstart):
    """README's quickstart output (the run is deterministic on a CPU: the same losses with 1 or
    2 threads) is what the same command prints: steps, first and final loss, in each line."""
    makefile = (REPO / "Makefile").read_text().split("\nquickstart:", 1)[1].split("\n\n", 1)[0]
    assert QUICKSTART_ARGS and makefile.split()[-len(QUICKSTART_ARGS) :] == QUICKSTART_ARGS
    epochs = dict(word.split("=", 1) for word in QUICKSTART_ARGS)["epochs"]
    done, workspace = quickstart
    assert done.returncode == 0, done.stderr + done.stdout
    result = json.loads((workspace / "output" / "result.json").read_text())
    steps, first, final = (
        result["steps"],
        f"{result['first_loss']:.4f}",
        f"{result['final_loss']:.4f}",
    )
    said = re.search(r"trainer: done: (\d+) steps, loss (\S+) -> (\S+);", QUICKSTART)
    assert said.groups() == (str(steps), first, final), "README's quickstart output is stale"
    summary = re.search(r"^  loss +(\S+) \(first step\) -> (\S+) \(last step\)$", QUICKSTART, re.M)
    assert summary.groups() == (first, final)
    assert re.search(rf"^  steps +{steps}$", QUICKSTART, re.M)
    last_step = re.search(r"^\[node\] step (\d+)/(\d+) +epoch (\d+) +loss (\S+) ", QUICKSTART, re.M)
    assert last_step.groups() == (str(steps), str(steps), epochs, final)
    # and the run printed those lines
    printed = [line for line in done.stdout.splitlines() if line.startswith("[node] step ")]
    assert re.match(rf"\[node\] step {steps}/{steps} +epoch {epochs} +loss {final} ", printed[-1])
    assert f"trainer: done: {steps} steps, loss {first} -> {final};" in done.stdout
    assert f"{first} (first step) -> {final} (last step)" in done.stdout


def test_quickstart_adapter_loads_with_peft(quickstart):
    import peft
    import transformers

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
        "--dataset", data, "--model", model, *QUICKSTART_ARGS,
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
    # As `train` submits them: in the vocabulary's order.
    assert spec["trainer"]["args"] == ["epochs=3", "lora_rank=16"]


def test_render_trainjob_for_the_platform_namespaced_runtime_queue_and_processes():
    done = tunepack(
        "render", "trainjob", "--name", "big", "--runtime", "llama3.1-70b", "--namespace",
        "team-a", "--namespaced", "--queue", "team-a-queue",
        "--dataset", "/pvc/data/train.jsonl", "--model", "hf://meta-llama/Llama-3.1-70B",
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    trainjob = yaml.safe_load(done.stdout)
    validate_trainjob(trainjob)
    assert trainjob["metadata"] == {
        "name": "big",
        "namespace": "team-a",
        "labels": {"kueue.x-k8s.io/queue-name": "team-a-queue"},
    }
    spec = trainjob["spec"]
    assert spec["runtimeRef"] == {
        "name": "tunepack-llama3.1-70b",
        "apiGroup": "trainer.kubeflow.org",
        "kind": "TrainingRuntime",
    }
    # An absolute path is written as the API requires; processes = the runtime's 8 GPUs.
    assert spec["initializer"]["dataset"]["storageUri"] == "file:///pvc/data/train.jsonl"
    assert spec["trainer"]["numProcPerNode"] == 8

    done = tunepack(
        "render", "trainjob", "--name", "tiny", "--runtime", "tiny-llama3",
        "--dataset", "/d.jsonl", "--model", "/m", "--num-proc-per-node", "2",
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    trainjob = yaml.safe_load(done.stdout)
    assert trainjob["spec"]["runtimeRef"]["kind"] == "ClusterTrainingRuntime"
    assert trainjob["spec"]["trainer"]["numProcPerNode"] == 2
    assert "labels" not in trainjob["metadata"]


def test_render_trainjob_gets_the_memory_check_of_train(tmp_path):
    """Issue 27, 2: a YAML user meets the planner as `tunepack train` does, with the same
    --gpu / --memory-check, message and exit code."""
    job = ["--runtime", "llama3.1-8b", "--dataset", "hf://org/data", "--model", "hf://org/model"]
    job += ["--name", "big"]
    big = ["method=qlora", "batch_size=64", "max_seq_len=8192"]
    refused = tunepack("render", "trainjob", *job, *big)
    assert refused.returncode == 65
    assert refused.stdout == ""
    assert refused.stderr.startswith(
        "tunepack: error: this fine-tune is estimated not to fit in GPU memory:\n"
        "llama3.1-8b qlora, seq_len 8192, batch 64/device, 1 node(s) x 1 H100-80GB\n"
        "  step (chosen for the device): recompute 32 of 32 layers; loss: 65 rows of logits at a "
        "time\n"
    )
    assert "peak          261.69 GiB" in refused.stderr
    assert refused.stderr.endswith(  # the command's flags, not TrainingClient's arguments
        "\nLower max_seq_len or batch_size, add GPUs (--gpus-per-node / --num-nodes), choose "
        "method=qlora where available, or pass --memory-check warn to submit anyway (see "
        "docs/planner.md).\n"
    )
    # The very message `train` gives for the same run.
    train = tunepack(
        "train", "--local", "--workspace", str(tmp_path / "ws"), "--jobs-dir",
        str(tmp_path / "jobs"), *job, *big,
    )  # fmt: skip
    assert (train.returncode, train.stderr) == (65, refused.stderr)

    # --gpu names the GPU type planned for.
    small = tunepack("render", "trainjob", *job, "max_seq_len=8192", "--gpu", "l4")
    assert small.returncode == 65
    assert "1 node(s) x 1 L4-24GB" in small.stderr
    assert tunepack("render", "trainjob", *job, "max_seq_len=8192").returncode == 0  # H100

    # warn: the TrainJob is printed, the plan said on stderr; off: printed, nothing said.
    warned = tunepack("render", "trainjob", *job, *big, "--memory-check", "warn")
    assert warned.returncode == 0
    assert yaml.safe_load(warned.stdout)["spec"]["trainer"]["args"] == big
    assert warned.stderr.startswith(
        "tunepack: warning: this fine-tune is estimated not to fit in GPU memory:"
    )
    off = tunepack("render", "trainjob", *job, *big, "--memory-check", "off")
    assert (off.returncode, off.stderr) == (0, "")
    assert off.stdout == warned.stdout
    bad = tunepack("render", "trainjob", *job, "--memory-check", "never")
    assert bad.returncode == 65
    assert "argument --memory-check: invalid choice: 'never'" in bad.stderr


# Issue 49, 2: the exact case of the issue (an 8B full fine-tune on L4s).
EIGHT_B = ["--runtime", "tunepack-llama3.1-8b", "--dataset", "s3://bucket/d.jsonl"]
EIGHT_B += ["--model", "s3://bucket/m", "--name", "big"]


def test_processes_per_node_are_the_gpus_per_node(tmp_path):
    """Issue 49, 2: `--num-proc-per-node 4` on a one-GPU runtime rendered `numProcPerNode: 4`
    with no GPU limit, and the memory check planned for 4 GPUs (rc 0); the launcher refused it
    on the node, after the model download. Now it is refused here, and --gpus-per-node gives the
    GPUs (the pods' limit, the processes, the memory plan)."""
    refused = tunepack("render", "trainjob", *EIGHT_B, "--num-proc-per-node", "4", "method=full",
                       "--gpu", "l4")  # fmt: skip
    assert (refused.returncode, refused.stdout) == (65, "")
    assert refused.stderr == (
        "tunepack: error: --num-proc-per-node 4 asks for 4 processes a node, but a trainer node "
        "holds 1 GPU (runtime tunepack-llama3.1-8b's) and runs one process per GPU: give "
        "--gpus-per-node 4 for 4 GPUs a node, or leave --num-proc-per-node out\n"
    )
    # train on a cluster and --local: the same rule, the same line, nothing recorded.
    jobs = tmp_path / "jobs"
    train = tunepack("train", "--local", "--jobs-dir", str(jobs), *EIGHT_B,
                     "--num-proc-per-node", "4", "--gpus-per-node", "1", "method=full",
                     "--gpu", "l4", cwd=tmp_path)  # fmt: skip
    assert (train.returncode, train.stderr) == (65, refused.stderr.replace(
        "(runtime tunepack-llama3.1-8b's)", "(--gpus-per-node 1)"))  # fmt: skip
    assert not jobs.exists()

    fits = tunepack("render", "trainjob", *EIGHT_B, "--gpus-per-node", "4", "method=full",
                    "--gpu", "l4")  # fmt: skip
    assert (fits.returncode, fits.stderr) == (0, "")
    trainer = yaml.safe_load(fits.stdout)["spec"]["trainer"]
    assert trainer["numProcPerNode"] == 4
    assert trainer["resourcesPerNode"]["limits"] == {"nvidia.com/gpu": 4}
    same = tunepack("render", "trainjob", *EIGHT_B, "--gpus-per-node", "4",
                    "--num-proc-per-node", "4", "method=full", "--gpu", "l4")  # fmt: skip
    assert (same.returncode, same.stdout) == (0, fits.stdout)

    # The memory check plans with the GPUs the job gets: 2 L4s do not hold it.
    two = tunepack("render", "trainjob", *EIGHT_B, "--gpus-per-node", "2", "method=full",
                   "--gpu", "l4")  # fmt: skip
    assert two.returncode == 65
    assert "\nllama3.1-8b full, seq_len 2048, batch 2/device, 1 node(s) x 2 L4-24GB\n" in two.stderr

    # No GPU: the processes are free.
    cpu = tunepack("render", "trainjob", *EIGHT_B, "--gpus-per-node", "0",
                   "--num-proc-per-node", "3")  # fmt: skip
    assert cpu.returncode == 0, cpu.stderr
    trainer = yaml.safe_load(cpu.stdout)["spec"]["trainer"]
    assert trainer["numProcPerNode"] == 3
    assert trainer["resourcesPerNode"]["limits"] == {"nvidia.com/gpu": 0}
    negative = tunepack("render", "trainjob", *EIGHT_B, "--gpus-per-node", "-1")
    assert negative.returncode == 65
    assert negative.stderr == (
        "tunepack: error: --gpus-per-node -1 is not valid: expected an integer >= 0\n"
    )


def test_the_memory_check_plans_the_activation_checkpointing_the_trainer_does():
    """On a GPU the trainer recomputes as many layers as the job needs to fit
    (activation_checkpointing=auto): a run that fits only with it is accepted, and refused once
    the user turns it off."""
    job = ["--runtime", "llama3.1-8b", "--dataset", "hf://org/data", "--model", "hf://org/model"]
    job += ["--name", "long", "max_seq_len=8192", "batch_size=4"]
    fits = tunepack("render", "trainjob", *job)
    assert (fits.returncode, fits.stderr) == (0, "")
    off = tunepack("render", "trainjob", *job, "activation_checkpointing=false")
    assert off.returncode == 65
    assert "llama3.1-8b lora, seq_len 8192, batch 4/device, 1 node(s) x 1 H100-80GB\n" in off.stderr


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (
            ["--dataset", "data/train.jsonl", "--model", "/m"],
            "tunepack: error: dataset storage URI 'data/train.jsonl' is a relative path: a "
            "TrainJob's storage URI is read inside the dataset initializer container on the "
            "cluster, so a path must be absolute (/abs/path or file:///abs/path), or use a URI "
            "such as hf://org/name or s3://bucket/key\n",
        ),
        (
            ["--dataset", "/d", "--model", "/m", "--queue", "Q"],
            "tunepack: error: queue 'Q' (label kueue.x-k8s.io/queue-name) is not a valid Kueue "
            "LocalQueue name: use at most 63 lowercase letters, digits, '-' and '.', starting "
            "and ending with a letter or digit\n",
        ),
        (
            ["--dataset", "/d", "--model", "/m", "--num-proc-per-node", "0"],
            "tunepack: error: --num-proc-per-node 0 is not valid: expected an integer >= 1\n",
        ),
    ],
)
def test_render_refuses_what_the_platform_would(args, message):
    done = tunepack("render", "trainjob", "--runtime", "tiny-llama3", *args)
    assert done.returncode == 65
    assert done.stderr == message
    assert done.stdout == ""


def test_local_train_refuses_a_queue(tmp_path):
    done = tunepack(
        "train", "--local", "--runtime", "tiny-llama3", "--workspace", str(tmp_path / "ws"),
        "--dataset", "/d.jsonl", "--model", "/m", "--queue", "team-a-queue",
    )  # fmt: skip
    assert done.returncode == 65
    assert done.stderr == (
        "tunepack: error: --queue team-a-queue names a Kueue queue on a cluster; the local "
        "backend has none (leave out --queue, or --local)\n"
    )


def _write_kubeconfig(path, current_namespace: str | None):
    context = {"cluster": "c", "user": "u"}
    if current_namespace:
        context["namespace"] = current_namespace
    path.write_text(
        yaml.safe_dump(
            {
                "apiVersion": "v1",
                "kind": "Config",
                "current-context": "main",
                "clusters": [{"name": "c", "cluster": {"server": "https://127.0.0.1:1"}}],
                "users": [{"name": "u", "user": {"token": "t"}}],
                "contexts": [
                    {"name": "main", "context": context},
                    {"name": "other", "context": {"cluster": "c", "user": "u", "namespace": "b"}},
                ],
            }
        )
    )


def test_cli_prefers_the_kubeconfig_as_kubectl_does(tmp_path, monkeypatch):
    """The kubeconfig is used whenever there is one (the SDK alone would take the in-cluster
    config as soon as /var/run/secrets/kubernetes.io exists on the machine)."""
    from argparse import Namespace

    from tunepack.cli.cluster import backend_config as _backend_config

    kubeconfig = tmp_path / "config"
    _write_kubeconfig(kubeconfig, "team-a")
    monkeypatch.setenv("KUBECONFIG", str(kubeconfig))
    cfg = _backend_config(Namespace(namespace=None, context=None))
    assert (cfg.config_file, cfg.namespace, cfg.context) == (str(kubeconfig), "team-a", None)
    cfg = _backend_config(Namespace(namespace=None, context="other"))
    assert (cfg.namespace, cfg.context) == ("b", "other")
    assert _backend_config(Namespace(namespace="x", context=None)).namespace == "x"
    _write_kubeconfig(kubeconfig, None)
    assert _backend_config(Namespace(namespace=None, context=None)).namespace == "default"

    # No kubeconfig at all: left to the SDK (in-cluster config and namespace).
    monkeypatch.setenv("KUBECONFIG", str(tmp_path / "missing"))
    cfg = _backend_config(Namespace(namespace=None, context=None))
    assert (cfg.config_file, cfg.namespace) == (None, None)


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
        ("file:///no/such/data.jsonl", [], "dataset 'file:///no/such/data.jsonl' does not exist"),
        (None, ["lora_rnk=8"], "unknown trainer argument 'lora_rnk'; did you mean 'lora_rank'?"),
        (None, ["lora_rank=abc"], "lora_rank='abc' is not valid: expected an integer"),
        (None, ["epochs=1", "--runtime-typo"], "unrecognized arguments"),
        (
            None,
            ["--column-map", "a:text,b:text"],
            "tunepack: error: --column-map 'a:text,b:text' maps two columns to the same field\n",
        ),
        (
            None,
            ["--dataset-schema", "dpo"],
            "tunepack: error: --dataset-schema 'dpo' is not a dataset schema; use one of ",
        ),
        (
            None,
            ["learning_rate=1e-4"],
            "unknown trainer argument 'learning_rate'; did you mean 'lr'?\n",
        ),
        (
            None,
            ["--learning-rate", "1e-4"],
            "unrecognized arguments: --learning-rate (trainer arguments are key=value pairs: "
            "write lr=VALUE; see `tunepack args`)\n",
        ),
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


def test_a_failed_step_names_its_reason_and_its_log(tmp_path, tiny_model_dir):
    """A dataset that only its initializer can judge (rows that are not JSON): the step fails
    with 65, and the CLI shows the step's own reason and where its log is."""
    data = tmp_path / "rows.jsonl"
    data.write_text("this is not a JSON row\n")
    workspace = tmp_path / "ws"
    done = tunepack(
        "train", "--local", "--runtime", "tiny-llama3", "--workspace", str(workspace),
        "--dataset", f"file://{data}", "--model", f"file://{tiny_model_dir}",
    )  # fmt: skip
    assert done.returncode == 65
    assert "bad input: fix it and run again" in done.stderr
    assert "dataset-initializer: error:" in done.stderr  # the step's own reason, shown
    log = (workspace / "logs" / "dataset-initializer.log").read_text()
    assert "rows.jsonl" in log
    assert not (workspace / "logs" / "node.log").exists()


def _commands(parser, prefix=()):
    """(command words, parser) for the parser and every subcommand below it."""
    import argparse

    yield prefix, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from _commands(sub, (*prefix, name))


def test_every_option_and_argument_has_help():
    import argparse

    from tunepack.cli.parser import build_parser

    missing = [
        f"tunepack {' '.join(words)} {action.option_strings or action.dest}"
        for words, parser in _commands(build_parser())
        for action in parser._actions
        if not isinstance(action, argparse._HelpAction | argparse._SubParsersAction)
        and not action.help
    ]
    assert missing == []


def test_top_level_help_is_a_sentence_and_uris_are_listed():
    top = tunepack("--help")
    description = top.stdout.split("\n\n")[1].replace("\n", " ")
    assert description.startswith("Fine-tune LLMs") and description.endswith(".")
    assert "``" not in top.stdout
    train = " ".join(tunepack("train", "--help").stdout.split())
    for scheme in ("hf://", "s3://", "https://", "file://", "a local path"):
        dataset = train.split("--dataset DATASET dataset storage URI:")[1].split(" --model ")[0]
        assert scheme in dataset, dataset
