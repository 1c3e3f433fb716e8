"""Bring your own checkpoint: the ``tunepack-<arch>-custom`` runtimes (runtimes/custom.py).

Each architecture gets a random checkpoint made by transformers' own config and model classes,
with dimensions no catalog entry has (odd head counts, head_dim 16 or 24, a vocabulary that is
not the tokenizer's, RoPE bases, epsilons, windows and soft-capping of its own) and a
tokenizer.json saved by transformers. The model initializer accepts it and records its shape;
the trainer builds it from config.json, gives transformers' logits, trains LoRA adapters whose
loss falls, and the exported adapter applied by peft reproduces the trained model. What the
builders cannot reproduce is refused with the field and its value.
"""

from __future__ import annotations

import copy
import json
import math
import shutil
from pathlib import Path

import pytest
import torch

from tests.helpers import run_program, setup_recipe
from tunepack import tiny
from tunepack.core.errors import BadModelError, BadValueError
from tunepack.runtimes import catalog, custom

STEPS = 10
# Shared by every architecture: none is a catalog shape.
_DIMS = {
    "hidden_size": 80,
    "num_hidden_layers": 3,
    "intermediate_size": 176,
    "max_position_embeddings": 1024,
    "rms_norm_eps": 1e-5,
}


def _rope(theta: float, **scaling) -> dict:
    return {"rope_parameters": {"rope_type": "default", "rope_theta": theta, **scaling}}


_LLAMA3_SCALING = {
    "rope_type": "llama3",
    "factor": 4.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}

# (runtime architecture, transformers config class, the tiny family whose tokenizer it borrows,
# config keywords beyond _DIMS)
CASES = {
    "llama": ("llama", "LlamaConfig", "llama3", {
        "num_attention_heads": 5, "num_key_value_heads": 1, "tie_word_embeddings": True,
        **_rope(20_000.0, **_LLAMA3_SCALING)}),
    "llama-untied": ("llama", "LlamaConfig", "llama3", {
        "num_attention_heads": 5, "num_key_value_heads": 5, "tie_word_embeddings": False,
        **_rope(150_000.0)}),
    "mistral": ("mistral", "MistralConfig", "mistral", {
        "num_attention_heads": 5, "num_key_value_heads": 1, "sliding_window": 600,
        **_rope(30_000.0)}),
    "qwen2": ("qwen2", "Qwen2Config", "qwen2_5", {
        "num_attention_heads": 5, "num_key_value_heads": 1, "tie_word_embeddings": True,
        **_rope(40_000.0)}),
    "gemma": ("gemma", "GemmaConfig", "gemma", {
        "num_attention_heads": 5, "num_key_value_heads": 1, "head_dim": 24, **_rope(20_000.0)}),
    "gemma2": ("gemma2", "Gemma2Config", "gemma2", {
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 24,
        "query_pre_attn_scalar": 24, "sliding_window": 24, "attn_logit_softcapping": 40.0,
        "final_logit_softcapping": 20.0, **_rope(20_000.0)}),
    # Local and global layers out of the published order, each kind with its own RoPE base, the
    # global one linearly scaled, a query scale other than head_dim's.
    "gemma3": ("gemma3", "Gemma3TextConfig", "gemma3", {
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 24,
        "query_pre_attn_scalar": 20, "sliding_window": 24,
        "layer_types": ["sliding_attention", "full_attention", "sliding_attention"],
        "rope_parameters": {
            "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 40_000.0},
            "sliding_attention": {"rope_type": "default", "rope_theta": 7000.0}}}),
    "phi3": ("phi3", "Phi3Config", "phi3", {
        "num_attention_heads": 5, "num_key_value_heads": 1, "sliding_window": 700,
        **_rope(20_000.0)}),
    # Six experts, two per token, layer 1 dense (its MLP adapted by lora_mlp), the auxiliary
    # load-balancing loss on.
    "qwen3_moe": ("qwen3_moe", "Qwen3MoeConfig", "qwen3", {
        "num_attention_heads": 5, "num_key_value_heads": 1, "head_dim": 24, "num_experts": 6,
        "num_experts_per_tok": 2, "moe_intermediate_size": 40, "mlp_only_layers": [1],
        "norm_topk_prob": True, "router_aux_loss_coef": 0.01, **_rope(20_000.0)}),
}  # fmt: skip


def write_checkpoint(out: Path, case: str, seed: int = 0) -> Path:
    """A random checkpoint of ``case`` as transformers saves one, with a tokenizer.json."""
    import transformers

    arch, config_class, tokenizer_family, extra = CASES[case]
    tok_dir = tiny.write_tiny_model(
        out.parent / f"{out.name}-tokenizer", catalog.TINY[tokenizer_family]
    )
    tok_config = json.loads((tok_dir / "config.json").read_text())
    ids = {k: tok_config.get(k) for k in ("bos_token_id", "eos_token_id", "pad_token_id")}
    vocab = catalog.TINY[tokenizer_family].shape.vocab_size + 16  # more rows than tokens
    config = getattr(transformers, config_class)(vocab_size=vocab, **_DIMS, **ids, **extra)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():  # norms away from neutral and biases away from zero, as in tiny/hf.py
        for name, param in model.named_parameters():
            if "norm" in name or name.endswith(".bias"):
                param.add_(torch.randn_like(param) * 0.1)
    model.save_pretrained(out)
    tok_json, added = tok_dir / "tokenizer.json", []
    if tok_json.is_file() and "model" not in json.loads(tok_json.read_text()):
        # Phi-3's lists only its chat tokens: convert tokenizer.model, then add them back.
        added = sorted(json.loads(tok_json.read_text())["added_tokens"], key=lambda t: t["id"])
        tok_json.unlink()
    tokenizer = transformers.AutoTokenizer.from_pretrained(tok_dir)
    new = [t for t in added if tokenizer.convert_tokens_to_ids(t["content"]) != t["id"]]
    tokenizer.add_tokens([transformers.AddedToken(t["content"], special=True) for t in new],
                         special_tokens=True)  # fmt: skip
    assert all(tokenizer.convert_tokens_to_ids(t["content"]) == t["id"] for t in added)
    tokenizer.save_pretrained(out)
    assert (out / "tokenizer.json").is_file()
    shutil.rmtree(tok_dir)
    return out


@pytest.fixture(scope="module", params=list(CASES), ids=list(CASES))
def checkpoint(request, tmp_path_factory):
    """(case, entry, workspace model dir as the initializer delivered it, tokens, HF logits)."""
    from transformers import AutoModelForCausalLM

    case = request.param
    root = tmp_path_factory.mktemp(f"custom-{case}")
    source = write_checkpoint(root / "checkpoint", case)
    entry = catalog.CUSTOM[custom.runtime_model_name(CASES[case][0])]
    done = run_program(
        "tunepack.initializers.model",
        {"TUNEPACK_WORKSPACE": str(root / "ws"), "TUNEPACK_MODEL": entry.name,
         "STORAGE_URI": f"file://{source}"},
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    model_dir = root / "ws" / "model"
    manifest = json.loads((model_dir / "tunepack-manifest.json").read_text())
    config = json.loads((source / "config.json").read_text())
    assert manifest["shape"]["num_layers"] == config["num_hidden_layers"]
    assert manifest["shape"]["num_heads"] == config["num_attention_heads"]
    assert manifest["shape"]["vocab_size"] == config["vocab_size"]

    hf_model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    resolved = custom.resolve(entry, model_dir)
    assert hf_model.num_parameters() == resolved.parameter_count
    tokens = torch.randint(
        0, config["vocab_size"], (2, 80), generator=torch.Generator().manual_seed(1)
    )
    with torch.no_grad():
        hf_logits = hf_model(tokens).logits
    assert hf_logits.abs().max() > 1e-2
    return case, entry, model_dir, tokens, hf_logits


def _max_diff(model: torch.nn.Module, tokens: torch.Tensor, expected: torch.Tensor) -> float:
    with torch.no_grad():
        logits = model.eval()(tokens)
    assert logits.shape == expected.shape
    return float((logits - expected).abs().max())


def test_lora_trains_the_checkpoints_model_and_peft_reproduces_it(
    checkpoint, initialized_workspace, tmp_path
):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    case, entry, model_dir, tokens, hf_logits = checkpoint
    output = tmp_path / "output"
    recipe = setup_recipe(
        entry,
        [f"max_steps={STEPS}", "warmup_steps=0", "batch_size=4", "lr=3e-3", "lora_rank=8",
         "merge=true"],
        model_dir=model_dir,
        dataset_dir=initialized_workspace / "dataset",
        output=output,
    )  # fmt: skip
    # The trainer's model is the checkpoint's: LoRA's B matrices start at zero.
    assert _max_diff(recipe.model, tokens, hf_logits) < 1e-4
    # Its text goes through the checkpoint's own tokenizer.json.
    assert type(recipe.tokenizer._base).__name__ == "CheckpointTokenizer"
    recipe.train()
    recipe.save()

    lines = (output / "metrics.jsonl").read_text().splitlines()
    losses = [json.loads(line)["loss"] for line in lines]
    assert len(losses) == STEPS and all(math.isfinite(loss) for loss in losses)
    assert sum(losses[-3:]) < sum(losses[:3]), losses

    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    with torch.no_grad():
        peft_logits = PeftModel.from_pretrained(base, output / "adapter").eval()(tokens).logits
    assert (peft_logits - hf_logits).abs().max() > 1e-3  # the adapter changes the model
    assert _max_diff(recipe.model, tokens, peft_logits) < 1e-4
    # merge=true: the adapter folded into the checkpoint's own HF format (experts' too).
    merged = AutoModelForCausalLM.from_pretrained(output / "merged", dtype=torch.float32)
    assert json.loads((output / "merged" / "config.json").read_text()) == json.loads(
        (model_dir / "config.json").read_text()
    )
    with torch.no_grad():
        merged_logits = merged.eval()(tokens).logits
    assert float((peft_logits - merged_logits).abs().max()) < 1e-4


def test_full_fine_tune_saves_a_checkpoint_of_the_same_architecture(
    checkpoint, initialized_workspace, tmp_path
):
    """The way back: the trained weights in the checkpoint's own HF format and config.json."""
    from transformers import AutoModelForCausalLM

    case, entry, model_dir, tokens, hf_logits = checkpoint
    output = tmp_path / "output"
    recipe = setup_recipe(
        entry,
        ["method=full", "max_steps=3", "lr=1e-3", "warmup_steps=0", "batch_size=4"],
        model_dir=model_dir,
        dataset_dir=initialized_workspace / "dataset",
        output=output,
    )
    recipe.train()
    recipe.save()
    saved_config = json.loads((output / "model" / "config.json").read_text())
    assert saved_config == json.loads((model_dir / "config.json").read_text())
    saved = AutoModelForCausalLM.from_pretrained(output / "model", dtype=torch.float32)
    with torch.no_grad():
        saved_logits = saved.eval()(tokens).logits
    assert (saved_logits - hf_logits).abs().max() > 1e-3  # training changed the model
    assert _max_diff(recipe.model, tokens, saved_logits) < 1e-4


# --- refusals ------------------------------------------------------------------------------------


def _llama_config() -> dict:
    return {
        "model_type": "llama", "vocab_size": 400, "hidden_size": 80, "num_hidden_layers": 3,
        "num_attention_heads": 5, "num_key_value_heads": 1, "intermediate_size": 176,
        "max_position_embeddings": 1024, "rms_norm_eps": 1e-5, "hidden_act": "silu",
        "rope_theta": 20_000.0, "rope_scaling": None, "tie_word_embeddings": False,
    }  # fmt: skip


def test_a_config_is_read_into_the_builders_shape():
    built = custom.read_config("llama", _llama_config(), "here")
    assert (built.shape.num_layers, built.shape.num_heads, built.shape.head_dim) == (3, 5, 16)
    assert built.options == {"rope_base": 20_000.0, "norm_eps": 1e-5, "scale_factor": 1}


@pytest.mark.parametrize(
    ("arch", "change", "message"),
    [
        ("llama", {"model_type": "mistral"}, "model_type='mistral'"),
        ("llama", {"hidden_act": "gelu"}, "hidden_act='gelu'"),
        ("llama", {"attention_bias": True}, "attention_bias=True"),
        ("llama", {"mlp_bias": True}, "mlp_bias=True"),
        ("llama", {"head_dim": 32}, "head_dim=32"),
        ("llama", {"num_key_value_heads": 2}, "num_key_value_heads=2"),
        ("llama", {"hidden_size": 81}, "hidden_size=81"),
        ("llama", {"vocab_size": 0}, "vocab_size=0"),
        ("llama", {"num_hidden_layers": "3"}, "num_hidden_layers='3'"),
        ("llama", {"rope_scaling": {"rope_type": "yarn", "factor": 4.0}},
         "rope_scaling.rope_type='yarn'"),
        ("llama", {"rope_scaling": {**_LLAMA3_SCALING, "high_freq_factor": 8.0}},
         "rope_scaling.high_freq_factor=8.0"),
        ("llama", {"rope_theta": -1}, "rope_theta=-1"),
        ("llama", {"rope_scaling": {"factor": 2.0}}, "rope_scaling.rope_type=None"),
        ("llama", {"rms_norm_eps": "small"}, "rms_norm_eps='small'"),
        ("mistral", {"model_type": "mistral", "tie_word_embeddings": True},
         "tie_word_embeddings=True"),
        ("qwen2", {"model_type": "qwen2", "use_sliding_window": True}, "use_sliding_window=True"),
        ("gemma", {"model_type": "gemma", "hidden_act": "gelu_pytorch_tanh", "head_dim": 24,
                   "tie_word_embeddings": False}, "tie_word_embeddings=False"),
        ("gemma", {"model_type": "gemma", "hidden_act": "relu", "head_dim": 24,
                   "tie_word_embeddings": True}, "hidden_act='relu'"),
        ("gemma2", {"model_type": "gemma2", "hidden_activation": "gelu", "head_dim": 24,
                    "tie_word_embeddings": True}, "hidden_activation='gelu'"),
        ("gemma2", {"model_type": "gemma2", "hidden_activation": "gelu_pytorch_tanh",
                    "head_dim": 24, "tie_word_embeddings": True,
                    "query_pre_attn_scalar": 256}, "query_pre_attn_scalar=256"),
        ("gemma2", {"model_type": "gemma2", "hidden_activation": "gelu_pytorch_tanh",
                    "head_dim": 24, "tie_word_embeddings": True,
                    "attn_logit_softcapping": None},
         "attn_logit_softcapping=None"),
        ("gemma3", {"model_type": "gemma3_text", "head_dim": 24, "query_pre_attn_scalar": 24,
                    "hidden_activation": "gelu_pytorch_tanh", "tie_word_embeddings": True,
                    "final_logit_softcapping": 30.0}, "final_logit_softcapping=30.0"),
        ("phi3", {"model_type": "phi3", "rope_scaling": {"type": "longrope"}},
         "rope_scaling.rope_type='longrope'"),
        ("phi3", {"model_type": "phi3", "partial_rotary_factor": 0.5},
         "partial_rotary_factor=0.5"),
        ("qwen3_moe", {"model_type": "qwen3_moe", "num_experts": 4, "num_experts_per_tok": 6},
         "num_experts_per_tok=6"),
        ("qwen3_moe", {"model_type": "qwen3_moe", "decoder_sparse_step": 4},
         "decoder_sparse_step=4"),
        ("qwen3_moe", {"model_type": "qwen3_moe", "num_experts": 4, "num_local_experts": 8},
         "num_local_experts=8"),
    ],
)  # fmt: skip
def test_what_the_builders_cannot_reproduce_is_refused_with_field_and_value(arch, change, message):
    config = _llama_config() | change
    with pytest.raises(BadModelError) as raised:
        custom.read_config(arch, config, "model at 'x'")
    text = str(raised.value)
    assert message in text and "\n" not in text
    assert text.startswith("model at 'x': config.json has ")


def test_missing_field_is_named():
    config = _llama_config()
    del config["num_hidden_layers"]
    with pytest.raises(BadModelError) as err:
        custom.read_config("llama", config, "here")
    assert str(err.value) == (
        "here: config.json has no num_hidden_layers; expected a positive integer (give the "
        "checkpoint's original config.json)"
    )


def _initialize(source: Path, root: Path, model: str = "llama-custom"):
    return run_program(
        "tunepack.initializers.model",
        {"TUNEPACK_WORKSPACE": str(root), "TUNEPACK_MODEL": model,
         "STORAGE_URI": f"file://{source}"},
    )  # fmt: skip


@pytest.fixture(scope="module")
def llama_checkpoint(tmp_path_factory) -> Path:
    return write_checkpoint(tmp_path_factory.mktemp("byo") / "checkpoint", "llama-untied")


def _copy(source: Path, target: Path) -> Path:
    shutil.copytree(source, target)
    return target


def test_initializer_refuses_an_unbuildable_config_before_copying(llama_checkpoint, tmp_path):
    source = _copy(llama_checkpoint, tmp_path / "src")
    config = json.loads((source / "config.json").read_text())
    config["rope_parameters"] = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 2.0}
    (source / "config.json").write_text(json.dumps(config))
    done = _initialize(source, tmp_path / "ws")
    assert done.returncode == 65, done.stderr
    assert "rope_scaling.rope_type='yarn'" in done.stderr
    assert "Traceback" not in done.stderr
    assert not (tmp_path / "ws" / "model").exists()


@pytest.mark.parametrize(
    ("damage", "message"),
    [
        ("no-tokenizer", "is missing tokenizer.json"),
        ("bad-eos", "tokenizer_config.json eos_token='<|nowhere|>' is not a token"),
        ("no-eos", "names no end-of-sequence token"),
        ("no-eot", "has no <|eot_id|> token, which the llama3.2 chat format needs"),
        ("no-bos", "names no BOS token"),
    ],
)
def test_initializer_refuses_a_tokenizer_that_cannot_work(
    llama_checkpoint, tmp_path, damage, message
):
    source = _copy(llama_checkpoint, tmp_path / "src")
    token_config = json.loads((source / "tokenizer_config.json").read_text())
    config = json.loads((source / "config.json").read_text())
    if damage == "no-tokenizer":
        (source / "tokenizer.json").unlink()
    elif damage == "bad-eos":
        token_config["eos_token"] = "<|nowhere|>"
    elif damage == "no-eot":
        text = (source / "tokenizer.json").read_text()
        (source / "tokenizer.json").write_text(text.replace('"<|eot_id|>"', '"<|eot|>"'))
    elif damage == "no-bos":
        token_config.pop("bos_token")
        config["bos_token_id"] = None
        (source / "generation_config.json").unlink(missing_ok=True)
    else:
        token_config.pop("eos_token")
        config["eos_token_id"] = None
        (source / "generation_config.json").unlink(missing_ok=True)
    (source / "tokenizer_config.json").write_text(json.dumps(token_config))
    (source / "config.json").write_text(json.dumps(config))
    done = _initialize(source, tmp_path / "ws")
    assert done.returncode == 65, done.stderr
    assert message in done.stderr, done.stderr
    assert "Traceback" not in done.stderr
    assert not (tmp_path / "ws" / "model").exists()


@pytest.mark.parametrize("checkpoint", ["llama", "qwen3_moe"], indirect=True)
def test_train_local_with_a_custom_runtime(checkpoint, tiny_dataset_file, tmp_path):
    """`tunepack train --local` end to end: both initializers, the trainer (resolving the model
    from config.json), a PEFT adapter that reproduces the merged model the trainer writes. For a
    dense family and the mixture of experts; what differs by family (the model, its tokenizer,
    the adapter and the merged model in its own format) is each family's, in this process, in
    the tests above."""
    import subprocess
    import sys

    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    case, entry, model_dir, tokens, hf_logits = checkpoint
    source = model_dir.parent.parent / "checkpoint"  # what the fixture initialized from
    workspace = tmp_path / "workspace"
    done = subprocess.run(
        [sys.executable, "-m", "tunepack.cli", "train", "--local",
         "--runtime", entry.runtime_name, "--workspace", str(workspace),
         "--dataset", f"file://{tiny_dataset_file}", "--model", f"file://{source}",
         "method=lora", "max_steps=10", "lr=3e-3", "batch_size=4", "warmup_steps=0",
         "merge=true"],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr + done.stdout
    result = json.loads((workspace / "output" / "result.json").read_text())
    assert result["final_loss"] < result["first_loss"]
    config = json.loads((source / "config.json").read_text())
    trained = (workspace / "output" / "config.yaml").read_text()
    assert f"num_layers: {config['num_hidden_layers']}" in trained
    assert f"embed_dim: {config['hidden_size']}" in trained
    adapter = workspace / "output" / "adapter"
    assert json.loads((adapter / "adapter_config.json").read_text())["r"] == 16  # the default

    base = AutoModelForCausalLM.from_pretrained(workspace / "model", dtype=torch.float32)
    merged = AutoModelForCausalLM.from_pretrained(
        workspace / "output" / "merged", dtype=torch.float32
    )
    with torch.no_grad():
        peft_logits = PeftModel.from_pretrained(base, adapter).eval()(tokens).logits
        merged_logits = merged.eval()(tokens).logits
    assert (peft_logits - hf_logits).abs().max() > 1e-3  # the adapter changes the model
    assert float((peft_logits - merged_logits).abs().max()) < 1e-4


def test_custom_runtimes_are_published():
    names = {entry.runtime_name for entry in catalog.CATALOG.values()}
    # Kubernetes names: an architecture's underscore becomes a hyphen (qwen3_moe).
    expected = {f"tunepack-{arch.replace('_', '-')}-custom" for arch in custom.ARCHITECTURES}
    assert expected <= names and "tunepack-qwen3-moe-custom" in names
    assert copy.copy(custom.ARCHITECTURES["llama"]).family == "llama3_2"


def test_planner_sizes_a_custom_runtime_from_the_checkpoints_config(llama_checkpoint):
    from tunepack.runtimes import planner

    resolved = custom.resolve(catalog.CUSTOM["llama-custom"], llama_checkpoint)
    sized = planner.plan("tunepack-llama-custom", "lora", 512, 2, model_dir=llama_checkpoint)
    assert sized.parameters == resolved.parameter_count
    # 3 layers of width 80 and a 400-token vocabulary, as config.json says.
    assert sized.parameters == resolved.shape.parameter_count() and resolved.shape.num_layers == 3
    with pytest.raises(BadValueError) as err:
        planner.plan("tunepack-llama-custom", "lora", 512, 2)
    assert str(err.value) == (
        "tunepack-llama-custom is sized from its checkpoint's config.json: give the "
        "checkpoint's local directory (tunepack plan --model-dir DIR; plan(..., "
        "model_dir=DIR)); without it the trainer checks the shape when it starts"
    )


def test_plan_command_reads_the_model_dir(llama_checkpoint):
    import subprocess
    import sys

    def plan(*extra: str) -> subprocess.CompletedProcess:
        return subprocess.run(
            [sys.executable, "-m", "tunepack.cli", "plan", "--model", "tunepack-llama-custom",
             "--seq-len", "512", *extra],
            capture_output=True, text=True, timeout=120,
        )  # fmt: skip

    done = plan("--model-dir", str(llama_checkpoint))
    assert done.returncode == 0, done.stderr
    missing = plan()
    assert missing.returncode == 65
    assert "give the checkpoint's local directory" in missing.stderr
    assert "Traceback" not in missing.stderr


def test_train_checks_arguments_against_a_local_checkpoints_config(
    llama_checkpoint, tiny_dataset_file, tmp_path
):
    import subprocess
    import sys

    workspace = tmp_path / "workspace"
    done = subprocess.run(
        [sys.executable, "-m", "tunepack.cli", "train", "--local",
         "--runtime", "tunepack-llama-custom", "--workspace", str(workspace),
         "--dataset", f"file://{tiny_dataset_file}", "--model", f"file://{llama_checkpoint}",
         "max_seq_len=4096"],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 65, done.stderr + done.stdout
    assert "max_seq_len=4096" in done.stderr and "1024" in done.stderr  # config.json's context
    assert "Traceback" not in done.stderr
    assert not (workspace / "model").exists()


@pytest.mark.parametrize(
    ("source", "hub_id"),
    [
        ("hf://my-org/my-llama", "my-org/my-llama"),
        ("hf://my-org/my-llama@v2", "my-org/my-llama"),
        ("file:///data/my-llama", "<your llama checkpoint>"),
        ("s3://bucket/my-llama", "<your llama checkpoint>"),
    ],
)
def test_the_adapters_base_model_is_the_hub_repository_it_came_from(
    llama_checkpoint, tmp_path, source, hub_id
):
    model_dir = _copy(llama_checkpoint, tmp_path / "model")
    (model_dir / "tunepack-manifest.json").write_text(json.dumps({"source": source}))
    assert custom.resolve(catalog.CUSTOM["llama-custom"], model_dir).hub_id == hub_id


def test_a_hub_checkpoint_is_read_from_its_config_before_the_weights_move(
    llama_checkpoint, tmp_path
):
    from tests.fakehub import FakeHub, Repo

    files = {p.name: p.read_bytes() for p in llama_checkpoint.iterdir() if p.is_file()}
    bad_config = json.loads(files["config.json"]) | {"mlp_bias": True}
    hub = FakeHub().start()
    try:
        hub.add(Repo("someone/my-llama", files))
        hub.add(Repo("someone/biased", files | {"config.json": json.dumps(bad_config).encode()}))

        def initialize(repo: str, root: Path):
            return run_program(
                "tunepack.initializers.model",
                {"TUNEPACK_WORKSPACE": str(root), "TUNEPACK_MODEL": "llama-custom",
                 "STORAGE_URI": f"hf://{repo}", "HF_ENDPOINT": hub.url},
            )  # fmt: skip

        refused = initialize("someone/biased", tmp_path / "refused")
        assert refused.returncode == 65, refused.stderr
        assert "mlp_bias=True" in refused.stderr and "Traceback" not in refused.stderr
        assert hub.gets("model.safetensors") == []  # refused on config.json alone
        assert not (tmp_path / "refused" / "model").exists()

        done = initialize("someone/my-llama", tmp_path / "ok")
        assert done.returncode == 0, done.stderr
        assert hub.gets("model.safetensors")  # the weights move once config.json is accepted
    finally:
        hub.stop()
    model_dir = tmp_path / "ok" / "model"
    manifest = json.loads((model_dir / "tunepack-manifest.json").read_text())
    assert manifest["shape"]["embed_dim"] == 80 and manifest["shape"]["num_layers"] == 3
    assert custom.resolve(catalog.CUSTOM["llama-custom"], model_dir).hub_id == "someone/my-llama"


def test_serving_hands_vllm_the_format_a_custom_checkpoint_was_trained_in():
    from tunepack.runtimes.chat_templates import TEMPLATES
    from tunepack.tools.serving import served_result

    served = served_result("tunepack-llama-custom", ["method=lora"])
    assert served.chat_template == TEMPLATES["llama3.2"]
    # A catalog model's own template is its format: nothing to hand over.
    assert served_result("tunepack-llama3.2-1b", ["method=lora"]).chat_template is None


def test_the_initializers_format_tokens_are_the_formats():
    """custom.FORMAT_TOKENS (the initializer cannot import the trainer) is what the trainer's
    chat formats write, for each custom runtime's default format."""
    from tunepack.runtimes.chat_templates import NO_SYSTEM
    from tunepack.trainers.data.prompt_format import Turn, render

    for entry in catalog.CUSTOM.values():
        fmt = entry.family.chat_format
        conversations = [[Turn("user", "u"), Turn("assistant", "a")]]
        if fmt not in NO_SYSTEM:
            conversations.append([Turn("system", "s"), *conversations[0]])
        written = {
            piece.text
            for turns in conversations
            for generation in (False, True)
            # for generation: the conversation up to the assistant's opening
            for piece in render(fmt, turns[:-1] if generation else turns, generation=generation)
            if piece.special
        }
        assert written == set(custom.FORMAT_TOKENS[fmt]), fmt


def test_gemmas_legacy_gelu_is_the_tanh_one():
    """Gemma's published configs say hidden_act "gelu", which transformers runs as the tanh
    approximation (what torchtune's Gemma builds); Gemma 2 reads hidden_activation instead."""
    gemma = _llama_config() | {"model_type": "gemma", "hidden_act": "gelu", "head_dim": 24,
                               "tie_word_embeddings": True}  # fmt: skip
    assert custom.read_config("gemma", gemma, "here").shape.head_dim == 24
    gemma2 = gemma | {"model_type": "gemma2", "hidden_act": "gelu"}  # hidden_activation: default
    assert custom.read_config("gemma2", gemma2, "here").softcapping == (50.0, 30.0)


def test_transformers_4_configs_read_as_the_catalog_builds_them():
    """Older config.json files keep rope_theta and rope_scaling at the top: Llama 3.2 1B's and
    Mistral 7B v0.1's, read through the custom runtimes, are the catalog's shapes and options."""
    llama = {
        "model_type": "llama", "vocab_size": 128_256, "hidden_size": 2048,
        "num_hidden_layers": 16, "num_attention_heads": 32, "num_key_value_heads": 8,
        "intermediate_size": 8192, "max_position_embeddings": 131_072, "rms_norm_eps": 1e-5,
        "hidden_act": "silu", "rope_theta": 500_000.0, "tie_word_embeddings": True,
        "attention_bias": False, "mlp_bias": False,
        "rope_scaling": {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
                         "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
    }  # fmt: skip
    built = custom.read_config("llama", llama, "here")
    published = catalog.CATALOG["llama3.2-1b"]
    assert built.shape == published.shape
    assert built.options == dict(published.family.options)
    mistral = {
        "model_type": "mistral", "vocab_size": 32_000, "hidden_size": 4096,
        "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
        "intermediate_size": 14_336, "max_position_embeddings": 32_768, "rms_norm_eps": 1e-5,
        "hidden_act": "silu", "rope_theta": 10_000.0, "sliding_window": 4096,
        "tie_word_embeddings": False,
    }  # fmt: skip
    resolved = custom.with_config(catalog.CUSTOM["mistral-custom"], mistral, "here")
    assert resolved.shape == catalog.CATALOG["mistral-7b"].shape
    assert resolved.window_limit == 4096 and resolved.defaults["max_seq_len"] == 2048


def test_plan_command_caps_the_default_seq_len_to_the_checkpoints_context(llama_checkpoint):
    import subprocess
    import sys

    context = json.loads((llama_checkpoint / "config.json").read_text())["max_position_embeddings"]
    assert context < 2048  # shorter than plan's default --seq-len
    done = subprocess.run(
        [sys.executable, "-m", "tunepack.cli", "plan", "--model", "tunepack-llama-custom",
         "--model-dir", str(llama_checkpoint)],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert f"lora, seq_len {context}, batch 2/device" in done.stdout  # a job's: CUSTOM_TIER's
    assert f"note: seq_len {context} is " in done.stdout and "--seq-len N to choose" in done.stdout
