"""The memory planner against numbers computed by hand (docs/planner.md has the formulas)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tunepack.core.errors import BadInputError
from tunepack.tools.planner import estimate, plan

# Llama 3.1 8B: d=4096, 32 layers, 32 heads (head_dim 128), 8 KV heads (kv=1024),
# i=14336, V=128256, untied embeddings.
P_8B = (
    2 * 128_256 * 4096  # embeddings + output
    + 32 * (4096 * 4096 + 2 * 4096 * 1024 + 4096 * 4096 + 3 * 4096 * 14_336 + 2 * 4096)
    + 4096  # final norm
)


def test_parameter_count_by_hand():
    assert P_8B == 8_030_261_248
    assert estimate("llama3.1-8b", "full", 8, 1).parameters == P_8B


def test_lora_8b_one_gpu_by_hand():
    r, s, b = 16, 2048, 2
    # LoRA on q,k,v,o and the three MLP projections: r * (in + out) each, per layer.
    per_layer = r * ((4096 + 4096) + 2 * (4096 + 1024) + (4096 + 4096) + 3 * (4096 + 14_336))
    trainable = 32 * per_layer
    assert trainable == 41_943_040
    weights = P_8B * 2 + trainable * 2  # frozen base and adapters in bf16
    grads = trainable * 2
    optim = 2 * trainable * 2  # AdamW: two states
    act = s * b * 32 * (6 * 4096 + 2 * 1024 + 4 * 14_336) * 2
    logits = s * b * 128_256 * (2 + 4)  # bf16 logits + fp32 copy for the loss
    p = plan("llama3.1-8b", "lora", s, b, lora_rank=r, activation_checkpointing=False)
    assert p.trainable == trainable
    assert (p.weights, p.gradients, p.optimizer, p.activations, p.logits) == (
        weights,
        grads,
        optim,
        act,
        logits,
    )
    assert p.peak_bytes == weights + grads + optim + act + logits
    assert round(p.peak_gib, 2) == 38.71 and p.fits and p.recommended == (1, 1)


def test_full_8b_needs_checkpointing_and_sharding_divides_states():
    s, b = 2048, 2
    one = estimate("llama3.1-8b", "full", s, b, activation_checkpointing=False)
    assert one.peak_bytes == P_8B * 2 * 4 + s * b * 32 * 83_968 * 2 + s * b * 128_256 * 6
    assert not one.fits  # 83.27 GiB > 79.2 - 2
    ckpt = estimate("llama3.1-8b", "full", s, b, activation_checkpointing=True)
    # Checkpointing keeps each layer's input (d) plus one layer's full activations.
    assert ckpt.activations == s * b * (32 * 4096 + 83_968) * 2
    eight = estimate("llama3.1-8b", "full", s, b, nodes=2, gpus_per_node=4,
                     activation_checkpointing=False)  # fmt: skip
    assert eight.weights == P_8B * 2 / 8 and eight.optimizer == 2 * P_8B * 2 / 8
    assert eight.activations == one.activations  # data parallel: per-device batch unchanged


def test_qlora_base_is_nf4():
    p = estimate("llama3.1-8b", "qlora", 512, 1, lora_rank=8)
    trainable = 32 * 8 * ((4096 + 4096) + 2 * (4096 + 1024) + (4096 + 4096) + 3 * (4096 + 14_336))
    assert p.weights == P_8B * (0.5 + 4 / 64) + trainable * 2


def test_impossible_shapes_recommend_more_or_say_none_fits():
    p = plan("llama3.1-8b", "full", 8192, 8)
    assert not p.fits and p.recommended is not None
    n, g = p.recommended
    assert estimate("llama3.1-8b", "full", 8192, 8, nodes=n, gpus_per_node=g,
                    activation_checkpointing=True).fits  # fmt: skip
    p = plan("llama3.1-8b", "full", 131_072, 64, gpu="L4-24GB")
    assert p.recommended is None and "no layout" in p.notes[0]


def test_bad_planner_input_is_named():
    with pytest.raises(BadInputError, match="gpu='B300' is not known"):
        plan("llama3.1-8b", "lora", 2048, 1, gpu="B300")
    with pytest.raises(BadInputError, match="seq_len=200000 is larger than llama3.1-8b's context"):
        plan("llama3.1-8b", "lora", 200_000, 1)


def test_cli_plan_exit_code_says_whether_it_fits():
    run = [sys.executable, "-m", "tunepack.cli", "plan", "--model", "llama3.1-8b"]
    fits = subprocess.run([*run, "--method", "lora", "--batch-size", "2"], capture_output=True,
                          text=True)  # fmt: skip
    assert fits.returncode == 0 and "fits in 77.2 GiB" in fits.stdout
    too_big = subprocess.run([*run, "--method", "full", "--batch-size", "16"], capture_output=True,
                             text=True)  # fmt: skip
    assert too_big.returncode == 1 and "does NOT fit" in too_big.stdout


def test_benchmark_dry_mode_exercises_the_measurement_path(tmp_path):
    out = tmp_path / "report.json"
    done = subprocess.run(
        [sys.executable, "benchmarks/planner_accuracy.py", "--dry", "--json", str(out)],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    report = json.loads(out.read_text())
    assert report["mode"] == "dry" and report["rows"]
    row = report["rows"][0]
    assert row["estimate_bytes"] > 0 and row["measured_bytes"] is None
    assert row["steps_run"] == 1 and row["loss"] > 0


def test_qwen3_by_hand_head_dim_wider_than_the_model_and_q_k_norms():
    # Qwen 3 0.6B (config.json of Qwen/Qwen3-0.6B): d=1024, 28 layers, 16 heads of 128 (q=2048,
    # twice d), 8 KV heads (kv=1024), i=3072, V=151936 tied, an RMSNorm of 128 on q and on k.
    d, q, kv, i, layers = 1024, 2048, 1024, 3072, 28
    per_layer = d * q + 2 * d * kv + q * d + 3 * d * i + 2 * d + 2 * 128
    params = 151_936 * d + layers * per_layer + d
    assert params == 596_049_920
    assert estimate("qwen3-0.6b", "full", 2048, 1).parameters == params
    r = 16
    lora = layers * r * ((d + q) + 2 * (d + kv) + (q + d) + 3 * (d + i))
    assert plan("qwen3-0.6b", "lora", 2048, 1, lora_rank=r).trainable == lora


def _cli(capsys, *argv: str) -> tuple[int, str, str]:
    from tunepack.cli import main

    code = main(["plan", *argv])
    out, err = capsys.readouterr()
    return code, out, err


@pytest.mark.parametrize(
    ("spelling", "name"),
    [("h100", "H100-80GB"), ("H100", "H100-80GB"), ("h100-80gb", "H100-80GB"),
     ("a100-40gb", "A100-40GB"), ("A100_80GB", "A100-80GB"), ("nvidia-l40s", "L40S-48GB")],
)  # fmt: skip
def test_cli_plan_accepts_the_usual_gpu_spellings(capsys, spelling, name):
    code, out, err = _cli(capsys, "--model", "llama3.2-1b", "--gpu", spelling)
    assert (code, err) == (0, "")
    assert out.splitlines()[0].endswith(f"1 node(s) x 1 {name}, activation checkpointing")
    assert plan("llama3.2-1b", "lora", 2048, 1, gpu=spelling).gpu == name


def test_cli_plan_names_an_ambiguous_or_unknown_gpu(capsys):
    code, _, err = _cli(capsys, "--model", "llama3.2-1b", "--gpu", "a100")
    assert code == 65
    assert err == (
        "tunepack: error: gpu='a100' is ambiguous: give its memory size, one of A100-80GB, "
        "A100-40GB\n"
    )
    code, _, err = _cli(capsys, "--model", "llama3.2-1b", "--gpu", "rtx-4090")
    assert code == 65 and "gpu='rtx-4090' is not known: expected one of H100-80GB" in err


def test_cli_plan_defaults_seq_len_to_a_shorter_context_and_shows_tiny_sizes(capsys):
    # tiny-llama3's context is 512 tokens: without --seq-len the plan is for 512, with a note.
    code, out, err = _cli(capsys, "--model", "tiny-llama3", "--no-activation-checkpointing")
    assert (code, err) == (0, "")
    assert out.splitlines()[0].startswith("tiny-llama3 lora, seq_len 512,")
    assert "note: seq_len 512 is tiny-llama3's context (the default 2048 is longer)" in out
    # Its sizes are MiB, not 0.00 GiB.
    assert " 0.00 " not in out and "peak            7.45 MiB" in out
    # An explicit --seq-len longer than the context is still refused.
    code, _, err = _cli(capsys, "--model", "tiny-llama3", "--seq-len", "1024")
    assert code == 65 and "seq_len=1024 is larger than tiny-llama3's context of 512" in err


def test_plan_assumes_the_trainers_activation_checkpointing(capsys):
    """The trainer checkpoints activations on a GPU unless told not to
    (activation_checkpointing=auto); the planner, which plans GPUs, assumes the same."""
    with_ckpt = plan("llama3.1-8b", "lora", 2048, 2, activation_checkpointing=True)
    for default in (plan("llama3.1-8b", "lora", 2048, 2), estimate("llama3.1-8b", "lora", 2048, 2)):
        assert default.activation_checkpointing and default.peak_bytes == with_ckpt.peak_bytes
    code, out, _ = _cli(capsys, "--model", "llama3.1-8b", "--batch-size", "2")
    assert code == 0 and out.splitlines()[0].endswith(", activation checkpointing")
    code, out, _ = _cli(capsys, "--model", "llama3.1-8b", "--no-activation-checkpointing")
    assert code == 0 and out.splitlines()[0].endswith("1 node(s) x 1 H100-80GB")
    with pytest.raises(BadInputError, match="activation_checkpointing='yes' is not valid"):
        plan("llama3.1-8b", "lora", 2048, 2, activation_checkpointing="yes")
