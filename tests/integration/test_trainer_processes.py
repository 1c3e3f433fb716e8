"""The trainer as the platform runs it: launcher processes, torchrun, FSDP2, kills and restarts."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests.helpers import (
    LAUNCH,
    adapter_of,
    assert_same_tensors,
    copy_workspace,
    free_port,
    launch_trainer,
    losses_of,
    result_of,
    run_program,
    start_and_wait_for_step,
    still_running,
    straight_and_resumed,
    trainer_config,
    trainer_env,
    two_processes_env,
)
from tunepack.core.errors import EXIT_BAD_INPUT, EXIT_TRANSIENT
from tunepack.trainers.data.batching import ShuffledSampler
from tunepack.trainers.launch import _exit_code, layout_from_env

# 8 steps of 2 accumulated micro-batches; dropout makes the result depend on the restored random
# state too. (Crossing an epoch boundary would double the runtime: the sampler test covers it.)
RESUME_ARGS = ["max_steps=8", "batch_size=8", "grad_accum=2", "lora_dropout=0.1", "warmup_steps=2"]
# Every batching mode (trainers/data/batching.py) resumes bit for bit; packs hold several examples,
# so fewer of them make a step.
BATCHING = {
    "length-grouped": RESUME_ARGS,
    "shuffled": [*RESUME_ARGS, "group_by_length=false"],
    "packed": ["max_steps=8", "batch_size=2", "grad_accum=2", "lora_dropout=0.1", "packed=true"],
}


def _run_nodes(commands: list[tuple[list[str], dict]], tmp_path: Path, timeout: float = 300):
    """Start one process per node, each writing to a file of its own (a node blocked on a full
    pipe that nobody reads would hold the other nodes in their collectives), and wait for all;
    nodes still running after ``timeout`` seconds are killed. The exit codes and outputs."""
    logs = [tmp_path / f"node-{rank}.log" for rank in range(len(commands))]
    nodes = []
    for (argv, env), log in zip(commands, logs, strict=True):
        with log.open("wb") as out:
            nodes.append(subprocess.Popen(argv, env=env, stdout=out, stderr=subprocess.STDOUT))
    deadline = time.monotonic() + timeout
    for node in nodes:
        try:
            node.wait(timeout=max(deadline - time.monotonic(), 0.1))
        except subprocess.TimeoutExpired:
            for other in nodes:
                if other.poll() is None:
                    other.kill()
                    other.wait()
            break
    outputs = [log.read_text(errors="replace") for log in logs]
    return [node.returncode for node in nodes], outputs


def _descendants(pid: int) -> set[int]:
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError):
                continue
            children.setdefault(ppid, []).append(int(entry.name))
    found, todo = set(), [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.add(child)
            todo.append(child)
    return found


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


# ------------------------------------------------------------------ fast unit checks


def test_sampler_started_mid_epoch_continues_the_same_order():
    full = ShuffledSampler(50, rank=1, world_size=2, seed=7)
    full.set_epoch(3)
    resumed = ShuffledSampler(50, rank=1, world_size=2, seed=7)
    resumed.set_epoch(3, start=2 * 4 * 2)  # 2 batches of 4 on each of 2 ranks consumed
    assert list(resumed) == list(full)[8:]
    other = ShuffledSampler(50, rank=0, world_size=2, seed=7)
    other.set_epoch(3)
    assert sorted([*full, *other]) == sorted({*full, *other})  # disjoint shares (no padding)


def test_exit_code_prefers_bad_input_then_transient():
    assert _exit_code(1, [EXIT_BAD_INPUT, 1], signalled=False) == EXIT_BAD_INPUT
    assert _exit_code(1, [EXIT_TRANSIENT], signalled=False) == EXIT_TRANSIENT
    assert _exit_code(1, [], signalled=True) == EXIT_TRANSIENT
    assert _exit_code(1, [1], signalled=False) == 1
    assert _exit_code(0, [0, 0], signalled=False) == 0


def test_exit_code_of_a_worker_killed_by_a_signal_is_128_plus_n():
    """As a one-process run killed so: whatever the other workers did once torchrun stopped
    them (a follower's 1, a checkpointing worker's 75); bad input and a stop request still win."""
    kill = int(signal.SIGKILL)
    assert _exit_code(1, [1], signalled=False, killed=[kill]) == 128 + kill
    assert _exit_code(1, [EXIT_TRANSIENT], signalled=False, killed=[kill]) == 128 + kill
    assert _exit_code(1, [EXIT_BAD_INPUT], signalled=False, killed=[kill]) == EXIT_BAD_INPUT
    assert _exit_code(1, [], signalled=True, killed=[kill]) == EXIT_TRANSIENT


def test_layout_from_pet_variables(monkeypatch):
    for key, value in {"NNODES": "2", "NPROC_PER_NODE": "auto", "NODE_RANK": "1"}.items():
        monkeypatch.setenv(f"PET_{key}", value)
    monkeypatch.setenv("PET_MASTER_ADDR", "job-node-0-0.job")
    monkeypatch.setenv("PET_MASTER_PORT", "29500")
    layout = layout_from_env("cpu")
    assert (layout.nnodes, layout.nproc_per_node, layout.node_rank) == (2, 1, 1)  # auto on CPU
    assert layout.world_size == 2 and layout.master_addr == "job-node-0-0.job"
    monkeypatch.setenv("PET_NODE_RANK", "2")
    with pytest.raises(Exception, match="PET_NODE_RANK='2' is not valid: expected 0 to 1"):
        layout_from_env("cpu")


# ------------------------------------------------------------------ single process


@pytest.mark.parametrize("batching", BATCHING)
def test_kill_9_then_restart_resumes_and_ends_bit_identical(
    initialized_workspace, tmp_path, batching
):
    # SIGKILL: no handler runs, whatever was being written stays half-written.
    args = [*BATCHING[batching], "checkpoint_every_minutes=0"]
    reference, interrupted, newest = straight_and_resumed(
        initialized_workspace, tmp_path, args, at_step=5, every=3
    )
    assert not (reference / "checkpoints").exists()  # checkpointing is off there
    assert newest in (3, 6) and result_of(interrupted)["steps"] == 8
    assert_same_tensors(adapter_of(reference), adapter_of(interrupted))
    # keep_checkpoints=2: only the newest two remain
    assert len(list((interrupted / "checkpoints").glob("step-*"))) <= 2


# ------------------------------------------------------------------ torchrun, FSDP2


def test_two_processes_full_fine_tune_with_fsdp(initialized_workspace, tmp_path):
    import transformers

    ws = copy_workspace(initialized_workspace, tmp_path)
    env = two_processes_env(ws)
    done = launch_trainer(env, "method=full", "max_steps=3", "warmup_steps=0", "lr=1e-3")
    assert done.returncode == 0, done.stdout + done.stderr
    result = result_of(ws)
    assert (result["world_size"], result["method"], result["steps"]) == (2, "full", 3)
    trained = transformers.AutoModelForCausalLM.from_pretrained(ws / "output" / "model")
    base = transformers.AutoModelForCausalLM.from_pretrained(ws / "model")
    delta = trained.model.layers[0].mlp.up_proj.weight - base.model.layers[0].mlp.up_proj.weight
    assert delta.abs().max() > 0


# Loaded by each Python process of a run (PYTHONPATH): counts the cyclic collections that ran
# while torch was being imported or after, before program.imports_done froze the imports' objects.
_COLLECTION_PROBE = """
import atexit, gc, os, sys
early = []
def count(phase, info):
    if phase == "start" and "torch" in sys.modules and gc.get_freeze_count() == 0:
        early.append(info["generation"])
gc.callbacks.append(count)
def write():
    with open(os.path.join(os.path.dirname(__file__), f"{os.getpid()}.probe"), "w") as out:
        out.write(f"{sys.argv[0]}\t{len(early)}\t{gc.get_freeze_count()}")
atexit.register(write)
"""


def test_sharded_load_and_gather_give_back_the_base_weights(initialized_workspace, tmp_path):
    """Rank 0 alone reads the checkpoint and streams each weight into both ranks' shards; the
    saved model is gathered from the shards. A step too small to move any weight must save the
    base back bit for bit: a shard left unloaded or misplaced would show.

    Each of the run's programs that imports torch (the launcher, torchrun, both workers) runs no
    cyclic collection until its imports are done, then freezes what they made
    (program.defer_collection: a line moved or lost would only cost CPU, so it is counted here)."""
    ws = copy_workspace(initialized_workspace, tmp_path)
    probe = tmp_path / "probe"
    probe.mkdir()
    (probe / "sitecustomize.py").write_text(_COLLECTION_PROBE)
    env = {**two_processes_env(ws), "PYTHONPATH": str(probe)}
    done = launch_trainer(env, "method=full", "max_steps=1", "lr=1e-30", "weight_decay=0")
    assert done.returncode == 0, done.stdout + done.stderr
    programs = sorted(
        (Path(argv0).name, int(early), int(frozen) > 0)
        for argv0, early, frozen in (p.read_text().split("\t") for p in probe.glob("*.probe"))
    )
    assert programs == [
        ("launch.py", 0, True), ("torchrun.py", 0, True), ("worker.py", 0, True),
        ("worker.py", 0, True),
    ], programs  # fmt: skip
    base = load_file(ws / "model" / "model.safetensors")
    saved = {}
    for shard in sorted((ws / "output" / "model").glob("*.safetensors")):
        saved.update(load_file(shard))
    assert saved.keys() == base.keys()
    assert all(torch.equal(saved[key], base[key]) for key in base)


def test_sigterm_checkpoints_stops_every_worker_and_resumes(initialized_workspace, tmp_path):
    ws = copy_workspace(initialized_workspace, tmp_path)
    env = two_processes_env(ws)
    args = ["max_steps=12", "warmup_steps=0", "checkpoint_every_minutes=0"]
    proc = start_and_wait_for_step(env, args, step=2)
    workers = _descendants(proc.pid)
    assert len(workers) >= 3  # torchrun's agent and two workers
    proc.send_signal(signal.SIGTERM)  # what the kubelet does on eviction
    output = proc.communicate(timeout=120)[0].decode()
    assert proc.returncode == EXIT_TRANSIENT, output
    stopped = [p.name for p in (ws / "checkpoints").glob("step-*")]
    assert len(stopped) == 1 and "asked to stop (SIGTERM)" in output
    assert not [pid for pid in workers if _alive(pid)], "processes outlived the launcher"

    env["PET_MASTER_PORT"] = str(free_port())
    done = launch_trainer(env, *args)
    assert done.returncode == 0, done.stdout + done.stderr
    result = result_of(ws)
    assert result["steps"] == 12 and result["resumed_from_step"] == int(stopped[0][5:])


def test_kill_9_of_the_launcher_alone_ends_torchrun_and_its_workers(
    initialized_workspace, tmp_path
):
    """The launcher killed outright, not its group (torchrun and its workers are in the
    launcher's process group): torchrun dies with it and each worker with torchrun (parent-death
    signals, ``tunepack.core.lifetime``), and nothing is written after the kill."""
    import psutil

    ws = copy_workspace(initialized_workspace, tmp_path)
    args = ["max_steps=30", "warmup_steps=0", "checkpoint_every_minutes=0"]
    proc = start_and_wait_for_step(two_processes_env(ws), args, step=1)
    run = [psutil.Process(pid) for pid in _descendants(proc.pid)]
    assert len(run) >= 3, run  # torchrun's agent and two workers
    proc.kill()
    proc.wait()
    # A guard against a hang, not a speed: each dies as soon as the kernel has ended its parent.
    deadline = time.monotonic() + 90
    while any(still_running(p) for p in run) and time.monotonic() < deadline:
        time.sleep(0.1)
    left = [p for p in run if still_running(p)]
    for still in left:
        still.kill()  # psutil: only the process it saw, were the pid reused
    assert left == [], "processes outlived the killed launcher"
    assert not (ws / "checkpoints").exists() and not (ws / "output" / "result.json").exists()


def test_two_nodes_of_one_process_train_lora_from_pet_variables(initialized_workspace, tmp_path):
    ws = copy_workspace(initialized_workspace, tmp_path)
    port = free_port()
    codes, outputs = _run_nodes(
        [
            (
                [*LAUNCH, "max_steps=4", "warmup_steps=0"],
                trainer_env(
                    ws,
                    nnodes=2,
                    nproc_per_node=1,
                    node_rank=rank,
                    master_addr="127.0.0.1",
                    master_port=port,
                ),
            )
            for rank in (0, 1)
        ],
        tmp_path,
    )
    assert codes == [0, 0], outputs
    result = result_of(ws)
    assert (result["world_size"], result["method"], result["steps"]) == (2, "lora", 4)
    assert (ws / "output" / "adapter" / "adapter_config.json").is_file()
    assert "trainer: done" in outputs[0]  # rank 0's node reports the result


# A node of the launcher for a model outside the catalog: run_torchrun over a given config.
_NODE = (
    "import sys; from pathlib import Path; from tunepack.trainers import launch; "
    "config, nnodes, nproc, rank, port = sys.argv[1:]; "
    "layout = launch.Layout(int(nnodes), int(nproc), int(rank), '127.0.0.1', int(port)); "
    "sys.exit(launch.run_torchrun(layout, Path(config).read_text(), 'digest'))"
)


def _written_config(entry, given, *, model_dir, dataset_dir, output, tmp_path):
    """(the config the trainer builds for ``entry`` and ``given`` arguments, its YAML file)."""
    from omegaconf import OmegaConf

    cfg = trainer_config(
        entry, given, model_dir=model_dir, dataset_dir=dataset_dir, output=output,
        cache_dir=tmp_path / "cache",
    )  # fmt: skip
    config = tmp_path / f"config-{output.name}.yaml"
    config.write_text(OmegaConf.to_yaml(cfg))
    return cfg, config


def _run_one_node(config: Path, nproc: int, tmp_path: Path) -> None:
    """One node of ``nproc`` processes of the launcher's torchrun over ``config``."""
    argv = [sys.executable, "-c", _NODE, str(config), "1", str(nproc), "0", str(free_port())]
    codes, logs = _run_nodes([(argv, {**os.environ, "OMP_NUM_THREADS": "1"})], tmp_path)
    assert codes == [0], logs


def train_on_processes(entry, given, *, model_dir, dataset_dir, output, nproc, tmp_path) -> None:
    """One node of ``nproc`` processes of the launcher's torchrun, over the config the trainer
    builds for ``entry`` (a model outside the published runtimes) and ``given`` arguments."""
    _, config = _written_config(
        entry, given, model_dir=model_dir, dataset_dir=dataset_dir, output=output,
        tmp_path=tmp_path,
    )  # fmt: skip
    _run_one_node(config, nproc, tmp_path)


@pytest.mark.parametrize(
    ("method", "dtype", "nnodes", "nproc"),
    [("qlora", "fp32", 2, 1), ("dora", "bf16", 1, 2)],
    ids=["qlora-2-nodes", "dora-bf16-2-processes"],
)
def test_lora_variants_train_sharded(initialized_workspace, tmp_path, method, dtype, nnodes, nproc):
    """QLoRA's NF4 base and DoRA's magnitudes under FSDP2, the pieces torchtune's distributed
    recipes treat specially; QLoRA across two "nodes" (upstream Kubeflow refuses multi-node
    QLoRA). The model is not a catalog entry, so each node runs the launcher's torchrun over a
    config built here, as the launcher would."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from tests.helpers import NF4_TINY
    from tunepack.tiny import write_tiny_model

    model_dir = write_tiny_model(tmp_path / "model", NF4_TINY)
    given = [f"method={method}", f"dtype={dtype}", "max_steps=4", "warmup_steps=0", "lr=1e-2"]
    _, config = _written_config(
        NF4_TINY, given, model_dir=model_dir, dataset_dir=initialized_workspace / "dataset",
        output=tmp_path / "output", tmp_path=tmp_path,
    )  # fmt: skip
    port = str(free_port())
    codes, outputs = _run_nodes(
        [
            (
                [
                    sys.executable,
                    "-c",
                    _NODE,
                    str(config),
                    str(nnodes),
                    str(nproc),
                    str(rank),
                    port,
                ],
                {**os.environ, "OMP_NUM_THREADS": "1"},
            )
            for rank in range(nnodes)
        ],
        tmp_path,
    )
    assert codes == [0] * nnodes, outputs

    result = json.loads((tmp_path / "output" / "result.json").read_text())
    assert (result["world_size"], result["method"], result["dtype"]) == (2, method, dtype)
    assert result["final_loss"] < result["first_loss"]
    adapter = tmp_path / "output" / "adapter"
    assert json.loads((adapter / "adapter_config.json").read_text())["use_dora"] is (
        method == "dora"
    )
    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    tokens = torch.randint(0, NF4_TINY.shape.vocab_size, (2, 20))
    with torch.no_grad():
        before = base(tokens).logits
        after = PeftModel.from_pretrained(base, adapter).eval()(tokens).logits
    assert (after - before).abs().max() > 1e-3


def test_sharded_load_benchmark_runs():
    """The benchmark (by hand, not CI) keeps working: both ways shard alike and it reports."""
    done = subprocess.run(
        [sys.executable, "benchmarks/sharded_load_bench.py", "--layers", "1"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "tunepack / baseline, summed peak RSS:" in done.stdout
    assert done.stdout.count("rank 1") == 2


def test_qwen3_moe_loads_trains_and_gathers_its_experts_sharded(initialized_workspace, tmp_path):
    """Qwen3-MoE under FSDP2 on two processes: each layer is one unit and the stacked expert
    weights are sharded along the experts (four: two whole experts a rank), the router's
    load-balancing loss goes through the backward, and a step too small to move any weight saves
    the base back bit for bit (every expert's weight loaded into its shard and gathered back)."""
    from tunepack.runtimes import catalog
    from tunepack.tiny import write_tiny_model

    entry = catalog.TINY["qwen3_moe"]
    assert entry.shape.num_experts % 2 == 0
    model_dir = write_tiny_model(tmp_path / "model", entry)
    given = ["method=full", "max_steps=2", "warmup_steps=0", "lr=1e-30", "weight_decay=0"]
    cfg, config = _written_config(
        entry, given, model_dir=model_dir, dataset_dir=initialized_workspace / "dataset",
        output=tmp_path / "output", tmp_path=tmp_path,
    )  # fmt: skip
    assert cfg.model.router_aux_loss_coef > 0
    _run_one_node(config, 2, tmp_path)
    result = json.loads((tmp_path / "output" / "result.json").read_text())
    assert (result["world_size"], result["steps"]) == (2, 2)
    base = load_file(model_dir / "model.safetensors")
    saved = {}
    for shard in sorted((tmp_path / "output" / "model").glob("*.safetensors")):
        saved.update(load_file(shard))
    assert "model.layers.1.mlp.experts.3.down_proj.weight" in saved
    assert saved.keys() == base.keys()
    assert all(torch.equal(saved[key], base[key]) for key in base)


def test_qwen3_moe_lora_on_the_experts_trains_sharded_as_on_one_process(
    initialized_workspace, tmp_path
):
    """LoRA on every expert (``lora_mlp=true``) under FSDP2: the experts' stacked adapters are
    sharded along the experts as their weights are, drawn whole (trainers/models/adapter_init.py),
    so two processes train what one does; peft applies the exported adapter to transformers' model
    as trained, and ``merge=true``'s model is that model too."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from tunepack.runtimes import catalog
    from tunepack.tiny import write_tiny_model

    entry = catalog.TINY["qwen3_moe"]
    assert entry.defaults["lora_mlp"] is False  # every layer sparse: the experts are opt-in
    model_dir = write_tiny_model(tmp_path / "model", entry)
    given = ["lora_mlp=true", "max_steps=4", "warmup_steps=0", "lr=1e-2", "merge=true"]
    outputs = {}
    for nproc in (1, 2):
        outputs[nproc] = tmp_path / f"output-{nproc}"
        batch = f"batch_size={4 // nproc}"  # the same global batches
        train_on_processes(
            entry, [*given, batch], model_dir=model_dir,
            dataset_dir=initialized_workspace / "dataset", output=outputs[nproc], nproc=nproc,
            tmp_path=tmp_path,
        )  # fmt: skip

    results = {n: json.loads((outputs[n] / "result.json").read_text()) for n in outputs}
    assert results[2]["world_size"] == 2
    assert results[2]["final_loss"] < results[2]["first_loss"]
    losses = {n: losses_of(outputs[n]) for n in outputs}
    assert max(abs(a - b) for a, b in zip(losses[1], losses[2], strict=True)) < 1e-4, losses
    adapters = {n: load_file(outputs[n] / "adapter" / "adapter_model.safetensors") for n in outputs}
    assert adapters[1].keys() == adapters[2].keys()
    for key in adapters[1]:
        # Up to the reductions' order (1e-4 relative measured, the experts' included).
        assert (adapters[1][key] - adapters[2][key]).norm() <= 1e-3 * adapters[1][key].norm(), key
    # PEFT's A on the fused gate/up is tunepack's B (zero when built): training moved it.
    gate_up = "base_model.model.model.layers.0.mlp.experts.base_layer.lora_A.weight"
    assert adapters[2][gate_up].abs().max() > 0

    tokens = torch.randint(
        0, entry.shape.vocab_size, (2, 24), generator=torch.Generator().manual_seed(0)
    )
    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    merged = AutoModelForCausalLM.from_pretrained(outputs[2] / "merged", dtype=torch.float32)
    with torch.no_grad():
        before = base(tokens).logits
        merged_logits = merged.eval()(tokens).logits
        peft_logits = PeftModel.from_pretrained(base, outputs[2] / "adapter").eval()(tokens).logits
    assert (peft_logits - before).abs().max() > 1e-3
    assert (peft_logits - merged_logits).abs().max() < 1e-4


def test_qwen3_moe_lora_on_the_experts_resumes_bit_identical_after_kill_9(
    initialized_workspace, tmp_path
):
    """The experts' adapters and their optimizer state go through the checkpoint like any
    adapter's: a run killed by SIGKILL and restarted ends where the uninterrupted one does (the
    bring-your-own runtime over the tiny all-sparse checkpoint)."""
    from tunepack.runtimes import catalog
    from tunepack.tiny import write_tiny_model

    source = write_tiny_model(tmp_path / "source", catalog.TINY["qwen3_moe"])
    envs = {}
    for name in ("reference", "interrupted"):
        ws = copy_workspace(initialized_workspace, tmp_path, name)
        shutil.rmtree(ws / "model")
        envs[name] = trainer_env(ws) | {"TUNEPACK_MODEL": "qwen3-moe-custom"}
        done = run_program(
            "tunepack.initializers.model", envs[name] | {"STORAGE_URI": f"file://{source}"}
        )
        assert done.returncode == 0, done.stderr
    args = ["lora_mlp=true", "max_steps=7", "batch_size=4", "warmup_steps=2"]
    args += ["checkpoint_every_steps=3", "checkpoint_every_minutes=0"]
    done = launch_trainer(envs["reference"], *args)
    assert done.returncode == 0, done.stderr
    proc = start_and_wait_for_step(envs["interrupted"], args, step=4)
    proc.kill()
    proc.wait()
    again = launch_trainer(envs["interrupted"], *args)
    assert again.returncode == 0, again.stderr
    interrupted = Path(envs["interrupted"]["TUNEPACK_WORKSPACE"])
    reference = Path(envs["reference"]["TUNEPACK_WORKSPACE"])
    assert result_of(interrupted)["resumed_from_step"] in (3, 6)
    expected, got = adapter_of(reference), adapter_of(interrupted)
    assert any("experts" in key for key in expected) and expected.keys() == got.keys()
    for key in expected:
        assert torch.equal(expected[key], got[key]), key
