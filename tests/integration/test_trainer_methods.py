"""Every method in one process, in-process: full, DoRA (+ merge), QLoRA; the progress reporter."""

from __future__ import annotations

import http.server
import json
import math
import shutil
import ssl
import subprocess
import threading
import types

import pytest
import torch
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper
from torchtune.modules.peft import LoRALinear

from tests.helpers import NF4_TINY, TINY, losses_of, run_program, setup_recipe, trainer_config
from tunepack.core.errors import EXIT_BAD_INPUT, BadInputError
from tunepack.runtimes.args import parse_trainer_args
from tunepack.runtimes.planner import Step
from tunepack.tiny import write_tiny_model
from tunepack.trainers.models.lora_product import FusedLoRALinear
from tunepack.trainers.outputs.trainjob_status import StatusReporter
from tunepack.trainers.process import compiling

FAST = ["warmup_steps=0", "batch_size=8", "checkpoint_every_minutes=0"]


def train_in_process(workspace, output, argv, entry=TINY, model_dir=None):
    recipe = setup_recipe(
        entry,
        [*FAST, *argv],
        model_dir=model_dir or workspace / "model",
        dataset_dir=workspace / "dataset",
        output=output,
    )
    recipe.train()
    recipe.save()
    return recipe


def sample_tokens(vocab: int) -> torch.Tensor:
    return torch.randint(0, vocab, (2, 20), generator=torch.Generator().manual_seed(3))


def test_full_fine_tune_writes_an_hf_model_that_reproduces_the_trained_one(
    initialized_workspace, tmp_path
):
    import transformers

    recipe = train_in_process(initialized_workspace, tmp_path, ["method=full", "max_steps=3"])
    model_dir = tmp_path / "model"
    assert (model_dir / "config.json").is_file()
    hf = transformers.AutoModelForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32)
    tokens = sample_tokens(TINY.shape.vocab_size)
    recipe.model.eval()
    with torch.no_grad():
        assert torch.allclose(hf(tokens).logits, recipe.model(tokens), atol=1e-4)
    result = json.loads((tmp_path / "result.json").read_text())
    assert (result["method"], result["steps"], result["world_size"]) == ("full", 3, 1)
    assert result["peak_memory_gib"] > 0 and result["tokens_seen"] > 0


def test_dora_adapter_loads_with_peft_and_merge_matches_it(initialized_workspace, tmp_path):
    import peft
    import transformers

    recipe = train_in_process(
        initialized_workspace, tmp_path, ["method=dora", "max_steps=8", "merge=true"]
    )
    adapter_config = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert adapter_config["use_dora"] is True and adapter_config["peft_type"] == "LORA"

    def load_base():
        return transformers.AutoModelForCausalLM.from_pretrained(
            initialized_workspace / "model", torch_dtype=torch.float32
        )

    tokens = sample_tokens(TINY.shape.vocab_size)
    recipe.model.eval()
    with torch.no_grad():
        base_logits = load_base()(tokens).logits
        tuned = peft.PeftModel.from_pretrained(load_base(), tmp_path / "adapter").eval()
        peft_logits = tuned(tokens).logits
        trained_logits = recipe.model(tokens)
        merged = transformers.AutoModelForCausalLM.from_pretrained(
            tmp_path / "merged", torch_dtype=torch.float32
        )
        merged_logits = merged(tokens).logits
    assert torch.allclose(peft_logits, trained_logits, atol=1e-4)
    assert torch.allclose(merged_logits, trained_logits, atol=1e-4)
    assert (peft_logits - base_logits).abs().max() > 1e-3  # the adapter did learn something
    result = json.loads((tmp_path / "result.json").read_text())
    assert result["merged_model"] == str(tmp_path / "merged")


def test_qlora_on_a_model_nf4_cannot_quantize_fails_with_the_reason():
    assert "qlora" not in TINY.methods and "qlora" in NF4_TINY.methods
    with pytest.raises(
        BadInputError, match="method=qlora cannot quantize tiny-llama3: its q_proj weight .96x96"
    ):
        parse_trainer_args(["method=qlora"], TINY)


def test_qlora_trains_on_cpu_and_exports_a_plain_lora_adapter(initialized_workspace, tmp_path):
    import peft
    import transformers

    model_dir = write_tiny_model(tmp_path / "nf4-model", NF4_TINY)
    recipe = train_in_process(
        initialized_workspace,
        tmp_path / "out",
        ["method=qlora", "max_steps=4", "lr=1e-2"],
        entry=NF4_TINY,
        model_dir=model_dir,
    )
    assert type(recipe.model.layers[0].attn.k_proj.weight).__name__ == "NF4Tensor"
    adapter_dir = tmp_path / "out" / "adapter"
    config = json.loads((adapter_dir / "adapter_config.json").read_text())
    assert config["use_dora"] is False
    base = transformers.AutoModelForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32)
    tokens = sample_tokens(NF4_TINY.shape.vocab_size)
    with torch.no_grad():
        base_logits = base(tokens).logits
        tuned = peft.PeftModel.from_pretrained(base, adapter_dir).eval()
        assert (tuned(tokens).logits - base_logits).abs().max() > 1e-4


def test_launcher_refuses_qlora_for_tiny_with_exit_65(initialized_workspace):
    env = {"TUNEPACK_WORKSPACE": str(initialized_workspace), "TUNEPACK_MODEL": "tiny-llama3"}
    done = run_program("tunepack.trainers.launch", env, "method=qlora")
    assert done.returncode == EXIT_BAD_INPUT, done.stderr
    assert "method=qlora cannot quantize tiny-llama3" in done.stderr
    assert "use method=lora" in done.stderr


# ------------------------------------------------------------------ progress


class _StatusHandler(http.server.BaseHTTPRequestHandler):
    received: list[tuple[str, dict]] = []

    def do_POST(self):  # noqa: N802 (http.server's naming)
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        self.received.append((self.headers.get("Authorization"), body))
        self.send_response(200)
        self.end_headers()

    def log_message(self, *args):
        pass


@pytest.fixture
def status_server(tmp_path, monkeypatch):
    """A local HTTPS endpoint with a self-signed certificate, like the controller's, and the
    trainer's environment pointing at it with a token: the posts it receives (header, body)."""
    cert, key = tmp_path / "ca.crt", tmp_path / "tls.key"
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1"]
        + ["-keyout", str(key), "-out", str(cert), "-subj", "/CN=localhost"]
        + ["-addext", "subjectAltName=IP:127.0.0.1"],
        check=True,
        capture_output=True,
    )
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _StatusHandler)
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(cert, key)
    server.socket = context.wrap_socket(server.socket, server_side=True)
    _StatusHandler.received = []
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    token = tmp_path / "token"
    token.write_text("s3cret\n")
    url = f"https://127.0.0.1:{server.server_address[1]}/status"
    monkeypatch.setenv("KUBEFLOW_TRAINER_SERVER_URL", url)
    monkeypatch.setenv("KUBEFLOW_TRAINER_SERVER_CA_CERT", str(cert))
    monkeypatch.setenv("KUBEFLOW_TRAINER_SERVER_TOKEN", str(token))
    yield _StatusHandler.received
    server.shutdown()


def test_progress_reaches_an_https_server_with_token_and_ca(
    initialized_workspace, tmp_path, status_server, monkeypatch
):
    received = status_server
    # A clock that never moves: however slow the machine, all 5 steps fall within one interval,
    # so the rate limit lets out at most the first snapshot and the final one (its rule on a
    # moving clock: tests/unit/test_trainjob_status.py).
    monkeypatch.setattr(StatusReporter, "clock", staticmethod(lambda: 0.0))
    train_in_process(initialized_workspace, tmp_path / "out", ["max_steps=5"])

    assert received, "no status update arrived"
    assert all(auth == "Bearer s3cret" for auth, _ in received)
    assert 1 <= len(received) <= 2
    final = received[-1][1]["trainerStatus"]
    assert final["progressPercentage"] == 100 and final["estimatedRemainingSeconds"] == 0
    metrics = {m["name"]: m["value"] for m in final["metrics"]}
    assert set(metrics) >= {"loss", "learning_rate", "tokens_per_second", "peak_memory_gib"}
    assert float(metrics["loss"]) > 0 and final["lastUpdatedTime"]


def test_progress_server_down_never_fails_training(initialized_workspace, tmp_path, monkeypatch):
    monkeypatch.setenv("KUBEFLOW_TRAINER_SERVER_URL", "https://127.0.0.1:9/status")  # discard port
    recipe = train_in_process(initialized_workspace, tmp_path, ["max_steps=2"])
    assert recipe.global_step == 2


def test_packed_sequences_train(initialized_workspace, tmp_path):
    recipe = train_in_process(initialized_workspace, tmp_path, ["packed=true", "max_steps=2"])
    assert recipe.cfg.dataset.packed and recipe.global_step == 2
    # Packed rows are exactly max_seq_len long and carry per-example attention masks/positions.
    batch = next(iter(recipe.dataloader))
    assert batch["tokens"].shape[1] == recipe.cfg.tokenizer.max_seq_len
    assert {"mask", "input_pos"} <= set(batch)
    assert (tmp_path / "adapter" / "adapter_model.safetensors").is_file()


def test_compiled_training_matches_eager(initialized_workspace, tmp_path):
    """compile=true (torch.compile of the layers; inductor's C++ code on a CPU) changes the
    speed, not the numbers."""
    from torch._dynamo.utils import counters

    train_in_process(initialized_workspace, tmp_path / "eager", ["max_steps=4"])
    counters.clear()
    recipe = train_in_process(
        initialized_workspace, tmp_path / "compiled", ["max_steps=4", "compile=true"]
    )
    assert recipe.compiled
    # Every step has another sequence length; after the first change the length is dynamic, so
    # the layers compile at most twice for each of their two inputs (the first layer's input
    # needs no gradient under LoRA, the others' do), not once per length.
    order, lengths = recipe.sampler.global_order(), recipe.sampler.lengths
    shapes = {max(lengths[i] for i in order[k * 8 : (k + 1) * 8]) for k in range(4)}
    assert len(shapes) >= 3
    assert counters["stats"]["unique_graphs"] <= 4
    eager, compiled = losses_of(tmp_path / "eager"), losses_of(tmp_path / "compiled")
    assert len(compiled) == 4 and compiled[-1] < compiled[0]
    assert max(abs(a - b) for a, b in zip(eager, compiled, strict=True)) < 1e-3, (eager, compiled)


def test_compile_auto_leaves_a_short_run_eager_and_its_resume_keeps_the_recorded_choice(
    initialized_workspace, tmp_path, caplog
):
    caplog.set_level("INFO", logger="tunepack.trainer")
    args = ["max_steps=3", "checkpoint_every_steps=2", "compile=auto"]
    recipe = train_in_process(initialized_workspace, tmp_path, args)
    assert recipe.compiled is False
    assert "compile=auto: about 0.0 min of training planned" in caplog.text
    assert "not compiling" in caplog.text
    step = tmp_path / "checkpoints" / "step-00000002"
    manifest = json.loads((step / "manifest.json").read_text())
    assert manifest["compiled"] is False

    # A run whose checkpoint says it compiled goes on compiled, whatever the estimate says now.
    manifest["compiled"] = True
    (step / "manifest.json").write_text(json.dumps(manifest))
    shutil.rmtree(tmp_path / "adapter")
    (tmp_path / "result.json").unlink()
    resumed = setup_recipe(
        TINY,
        [*FAST, *args],
        model_dir=initialized_workspace / "model",
        dataset_dir=initialized_workspace / "dataset",
        output=tmp_path,
    )
    assert resumed.resumed_from == 2 and resumed.compiled is True


def test_a_cpu_lora_run_computes_its_lora_layers_in_one_function(initialized_workspace, tmp_path):
    """On the CPU the trainer switches every plain LoRA layer to FusedLoRALinear
    (trainers/models/lora_product.py) before training, and the loss falls."""
    recipe = train_in_process(initialized_workspace, tmp_path, ["max_steps=4"])
    layers = [m for m in recipe.model.modules() if isinstance(m, LoRALinear)]
    assert layers and all(type(m) is FusedLoRALinear for m in layers)
    losses = losses_of(tmp_path)
    assert losses[-1] < losses[0], losses


def test_the_step_is_logged_recorded_and_kept_by_a_resume(initialized_workspace, tmp_path, caplog):
    """The step (runtimes/planner.py: Step) is one log line, in result.json and in each
    checkpoint; a resumed run computes with the step its checkpoint records (here one that a GPU
    could have chosen: the first layer recomputed, 5 rows of logits at once), an explicit setting
    winning over the record."""
    caplog.set_level("INFO", logger="tunepack.trainer")
    args = ["max_steps=3", "checkpoint_every_steps=2"]
    recipe = train_in_process(initialized_workspace, tmp_path, args)
    layers = len(recipe.model.layers)
    cpu_rows = 8 * 2**20 // recipe.model.output.weight.size(0)
    assert recipe.step == Step(layers, 0, cpu_rows, chosen=False)
    line = f"step: recompute 0 of {layers} layers; loss: {cpu_rows} rows of logits at a time"
    assert f"{line} (on the CPU)" in caplog.text
    result = json.loads((tmp_path / "result.json").read_text())
    assert result["step_plan"] == {**recipe.step.record(), "compiled": False}
    checkpoint = tmp_path / "checkpoints" / "step-00000002"
    manifest = json.loads((checkpoint / "manifest.json").read_text())
    assert manifest["step_plan"] == recipe.step.record()

    manifest["step_plan"] = {"layers": layers, "recompute_layers": 1, "loss_chunk_rows": 5}
    (checkpoint / "manifest.json").write_text(json.dumps(manifest))
    shutil.rmtree(tmp_path / "adapter")
    (tmp_path / "result.json").unlink()

    def resume(*more):
        return setup_recipe(
            TINY,
            [*FAST, *args, *more],
            model_dir=initialized_workspace / "model",
            dataset_dir=initialized_workspace / "dataset",
            output=tmp_path,
        )

    resumed = resume()
    assert resumed.resumed_from == 2 and resumed.step == Step(layers, 1, 5)
    wrapped = [isinstance(layer, CheckpointWrapper) for layer in resumed.model.layers]
    assert wrapped == [True] + [False] * (layers - 1)  # the first layer recomputes, no other
    resumed.train()
    assert losses_of(tmp_path)[-1] < losses_of(tmp_path)[0]
    given = resume("loss_chunk=9", "activation_checkpointing=false")
    assert given.step == Step(layers, 0, 9)


def test_on_a_gpu_the_step_is_planned_against_the_memory_the_device_reports(
    initialized_workspace, tmp_path, monkeypatch
):
    """The trainer's GPU path without a GPU: the job the config hands the planner, sized against
    the total the device reports (less CUDA_RESERVE_GIB): the same step as the planner's for
    that job and capacity, and a device with less memory recomputes more."""
    from tunepack.runtimes import planner
    from tunepack.trainers.process import distributed
    from tunepack.trainers.recipe import FineTuneRecipe

    args = ["device=cuda", "batch_size=4", "max_seq_len=512", "method=lora"]
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # for the config's check
    cfg = trainer_config(
        TINY, args, model_dir=initialized_workspace / "model",
        dataset_dir=initialized_workspace / "dataset", output=tmp_path, cache_dir=tmp_path / "c",
    )  # fmt: skip
    recipe = FineTuneRecipe.__new__(FineTuneRecipe)  # no process group, no device
    recipe.cfg, recipe.device = cfg, torch.device("cuda")
    recipe.topo = distributed.Topology(rank=0, world_size=1, local_rank=0)
    steps = {}
    for total_gib in (80.0, 2.003):
        device = type("Device", (), {"total_memory": int(total_gib * planner.GIB)})
        monkeypatch.setattr(torch.cuda, "get_device_properties", lambda _d, device=device: device)
        steps[total_gib] = recipe._choose_step(None)
        expected = planner.estimate(
            "tiny-llama3", "lora", 512, 4, dtype="bf16",
            capacity_gib=total_gib - planner.CUDA_RESERVE_GIB,
        ).step  # fmt: skip
        assert steps[total_gib] == expected
    layers = steps[80.0].layers
    assert steps[80.0] == Step(layers, 0, 4 * 512)  # everything fits: the whole logits at once
    assert steps[2.003].recompute_layers > 0  # 3 MiB left: some layers recompute


def test_compile_auto_compiles_where_the_saving_pays_for_the_compilation():
    cpu = torch.device("cpu")
    # 10^6 positions of a 10^8-parameter LoRA model at 10^11 operations/s: 4,000 s of training.
    lora = compiling.estimated_training_s(tokens=1e6, parameters=10**8, trains_all=False, rate=1e11)
    assert lora == pytest.approx(4000.0)
    full = compiling.estimated_training_s(tokens=1e6, parameters=10**8, trains_all=True, rate=1e11)
    assert full == pytest.approx(6000.0)
    # Ten hours of training pay for a minute of compiling on either device; two minutes do not.
    for device in (cpu, torch.device("cuda")):
        compiled, why = compiling.choose("auto", device=device, estimate_s=36000.0)
        assert compiled and why.endswith(": compiling") and "600.0 min of training" in why
        compiled, why = compiling.choose("auto", device=device, estimate_s=120.0)
        assert not compiled and why.endswith("not compiling")
    assert compiling.choose(True, device=cpu, estimate_s=None) == (True, "compile=true")
    assert compiling.choose(False, device=cpu, estimate_s=1e9) == (False, "compile=false")


# Binary fractions of a second, which the fake clock adds up exactly; ``timed``: the first count
# of matmuls that makes both 3 and 0.05 s.
@pytest.mark.parametrize(("seconds_per_matmul", "timed"), [(2**-6, 4), (2**-10, 52), (4.0, 3)])
def test_the_matmul_rate_is_the_operations_over_the_time_they_took(
    monkeypatch, seconds_per_matmul, timed
):
    """A device on a fake clock that each 512 x 512 matmul advances by ``seconds_per_matmul``:
    the rate is 2 * 512^3 operations per matmul over that time, whatever the speed. The warm-up
    matmul is not counted; the timing stops at the first matmul that makes both 3 matmuls and
    0.05 s."""
    clock = {"now": 1000.0, "matmuls": 0}
    matmul = torch.Tensor.__matmul__

    def one_matmul(a, b):
        clock["now"] += seconds_per_matmul
        clock["matmuls"] += 1
        return matmul(a, b)

    monkeypatch.setattr(torch.Tensor, "__matmul__", one_matmul)
    monkeypatch.setattr(compiling, "time", types.SimpleNamespace(perf_counter=lambda: clock["now"]))
    rate = compiling.matmul_rate(torch.device("cpu"), torch.float32)
    assert rate == pytest.approx(2 * 512**3 / seconds_per_matmul)
    assert clock["matmuls"] == 1 + timed  # the warm-up, then the timed ones


def test_the_matmul_rate_measured_for_real_is_a_rate():
    """On the real clock the figure is a positive, finite number of operations per second (no
    speed asserted: the machine's is its own)."""
    rate = compiling.matmul_rate(torch.device("cpu"), torch.float32)
    assert 0 < rate < math.inf, rate


def test_bf16_trains_in_bf16(initialized_workspace, tmp_path):
    recipe = train_in_process(initialized_workspace, tmp_path, ["max_steps=6", "dtype=bf16"])
    layer = recipe.model.layers[0].attn.q_proj
    assert layer.weight.dtype == layer.lora_a.weight.dtype == torch.bfloat16
    losses = losses_of(tmp_path)
    assert len(losses) == 6 and losses[-1] < losses[0]
    assert json.loads((tmp_path / "result.json").read_text())["dtype"] == "bf16"


def test_progress_posts_carry_the_validation_loss(initialized_workspace, tmp_path, status_server):
    received = status_server
    output = tmp_path / "out"
    train_in_process(
        initialized_workspace, output, ["max_steps=3", "val_fraction=0.1", "eval_every_steps=2"]
    )
    final = received[-1][1]["trainerStatus"]
    assert final["progressPercentage"] == 100 and final["estimatedRemainingSeconds"] == 0
    metrics = {m["name"]: m["value"] for m in final["metrics"]}
    result = json.loads((output / "result.json").read_text())
    assert float(metrics["val_loss"]) == pytest.approx(result["val_loss"], abs=1e-5)
    assert float(metrics["val_perplexity"]) == pytest.approx(result["val_perplexity"], rel=1e-3)
    assert float(metrics["loss"]) > 0
