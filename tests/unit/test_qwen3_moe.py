"""Qwen3-MoE against transformers' own Qwen3MoeForCausalLM, on random checkpoints of shapes no
catalog entry has (six experts, two per token, a dense layer among sparse ones, head_dim wider
than hidden / heads): logits, the load-balancing loss, the conversion both ways and the
checkpointer's files. The trainer end to end is in tests/integration (test_families.py for the
tiny catalog model, test_custom_checkpoints.py for the custom runtime).
"""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file
from torchtune.modules.peft import get_adapter_params
from torchtune.training import MODEL_KEY

from tunepack.core.errors import BadModelError, ConflictError
from tunepack.runtimes import catalog, custom
from tunepack.trainers.models import moe
from tunepack.trainers.models.qwen3_moe import (
    Qwen3MoeHFCheckpointer,
    lora_qwen3_moe,
    qwen3_moe,
    qwen3_moe_hf_to_tune,
    qwen3_moe_tune_to_hf,
)
from tunepack.trainers.outputs.peft_export import export_adapter

VOCAB = 200
# transformers' config keywords; mlp_only_layers=[1] makes layer 1 dense.
HF_CONFIG = {
    "vocab_size": VOCAB,
    "hidden_size": 48,
    "intermediate_size": 80,
    "num_hidden_layers": 3,
    "num_attention_heads": 3,
    "num_key_value_heads": 1,
    "head_dim": 24,
    "max_position_embeddings": 256,
    "rms_norm_eps": 1e-5,
    "rope_parameters": {"rope_type": "default", "rope_theta": 30_000.0},
    "num_experts": 6,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 40,
    "mlp_only_layers": [1],
    "decoder_sparse_step": 1,
    "router_aux_loss_coef": 0.02,
    "tie_word_embeddings": False,
}
SHAPE = {"num_heads": 3, "num_kv_heads": 1, "dim": 48, "tie_word_embeddings": False}


def _hf_model(norm_topk_prob: bool, seed: int = 0, **extra):
    from transformers import AutoModelForCausalLM, Qwen3MoeConfig

    config = Qwen3MoeConfig(**HF_CONFIG, norm_topk_prob=norm_topk_prob, **extra)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    with torch.no_grad():  # norms away from neutral, a router that prefers some experts
        for name, param in model.named_parameters():
            if "norm" in name:
                param.add_(torch.randn_like(param) * 0.3)
            elif name.endswith("mlp.gate.weight"):
                param.mul_(40)
    return model


def _checkpoint(tmp_path, norm_topk_prob: bool, **extra):
    model = _hf_model(norm_topk_prob, **extra)
    model.save_pretrained(tmp_path / "ckpt")
    return model, tmp_path / "ckpt"


def _tokens(seed: int = 1, batch: int = 2, length: int = 40) -> torch.Tensor:
    return torch.randint(0, VOCAB, (batch, length), generator=torch.Generator().manual_seed(seed))


def _built(model_dir, tmp_path, **lora):
    config = json.loads((model_dir / "config.json").read_text())
    resolved = custom.with_config(catalog.CUSTOM["qwen3-moe-custom"], config, "test")
    kwargs = resolved.builder_kwargs()
    model = lora_qwen3_moe(**kwargs, **lora) if lora else qwen3_moe(**kwargs)
    checkpointer = Qwen3MoeHFCheckpointer(
        checkpoint_dir=str(model_dir),
        checkpoint_files=["model.safetensors"],
        model_type="QWEN2",
        output_dir=str(tmp_path / "out"),
    )
    state = checkpointer.load_checkpoint()[MODEL_KEY]
    model.load_state_dict(state, strict=not lora)
    return model.eval(), checkpointer, resolved


def test_save_pretrained_writes_each_expert_and_the_router_as_gate(tmp_path):
    _, model_dir = _checkpoint(tmp_path, True)
    keys = load_file(model_dir / "model.safetensors").keys()
    assert "model.layers.0.mlp.experts.5.down_proj.weight" in keys
    assert "model.layers.0.mlp.gate.weight" in keys
    assert "model.layers.1.mlp.gate_proj.weight" in keys  # the dense layer
    assert not any(k.endswith("gate_up_proj") for k in keys)


@pytest.mark.parametrize("norm_topk_prob", [True, False])
def test_logits_equal_transformers(tmp_path, norm_topk_prob):
    hf, model_dir = _checkpoint(tmp_path, norm_topk_prob)
    model, _, resolved = _built(model_dir, tmp_path)
    assert resolved.shape.dense_layers == (1,)
    assert sum(p.numel() for p in model.parameters()) == hf.num_parameters()
    assert hf.num_parameters() == resolved.parameter_count
    tokens = _tokens()
    with torch.no_grad():
        expected = hf(tokens).logits
        got = model(tokens)
    assert expected.abs().max() > 1e-2
    diff = float((got - expected).abs().max())
    assert diff < 1e-4, diff
    # The routing matters: send each token to its top experts with equal weights instead.
    with torch.no_grad():
        for layer in model.layers:
            if isinstance(layer.mlp, moe.MoEFeedForward):
                layer.mlp.norm_topk_prob = not norm_topk_prob
        assert (model(tokens) - expected).abs().max() > 1e-3


def test_norm_topk_prob_changes_the_model(tmp_path):
    hf = _hf_model(True)
    tokens = _tokens()
    with torch.no_grad():
        normalised = hf(tokens).logits
        hf.config.norm_topk_prob = False
        for layer in hf.model.layers:
            if hasattr(layer.mlp, "gate"):
                layer.mlp.gate.norm_topk_prob = False
        assert (hf(tokens).logits - normalised).abs().max() > 1e-3


@pytest.mark.parametrize("masked", [False, True])
def test_load_balancing_loss_equals_transformers(masked):
    from transformers.models.qwen3_moe.modeling_qwen3_moe import load_balancing_loss_func

    generator = torch.Generator().manual_seed(5)
    logits = tuple(torch.randn(2 * 7, 6, generator=generator) * 3 for _ in range(3))
    mask = torch.ones(2, 7, dtype=torch.long)
    mask[1, 4:] = 0
    expected = load_balancing_loss_func(logits, 6, 2, mask if masked else None)
    got = moe.load_balancing_loss(logits, 6, 2, mask if masked else None)
    assert torch.allclose(got, expected, rtol=1e-6, atol=0), (got, expected)
    if masked:  # the mask matters
        assert not torch.allclose(got, moe.load_balancing_loss(logits, 6, 2))


def test_training_loss_adds_the_auxiliary_loss_as_transformers(tmp_path):
    """Cross-entropy + coef x aux: transformers' loss with output_router_logits and labels, and
    the recipe's (summed cross-entropy + router_aux_loss, divided by the counted tokens)."""
    hf, model_dir = _checkpoint(tmp_path, True)
    model, _, _ = _built(model_dir, tmp_path)
    tokens = _tokens(batch=1)
    labels = tokens.clone()
    with torch.no_grad():
        out = hf(tokens, labels=labels, output_router_logits=True)
    model.train()
    logits = model(tokens)
    ce = torch.nn.functional.cross_entropy(logits[0, :-1].float(), labels[0, 1:], reduction="sum")
    n_tokens = labels.size(1) - 1
    aux = moe.router_aux_loss(model, labels, n_tokens)
    assert isinstance(aux, torch.Tensor) and aux.requires_grad
    assert abs(float(aux) / n_tokens - 0.02 * float(out.aux_loss)) < 1e-6
    assert abs(float((ce + aux) / n_tokens) - float(out.loss)) < 1e-5
    # The logits were consumed; evaluation keeps none.
    assert moe.router_aux_loss(model, labels, n_tokens) == 0.0
    model.eval()
    with torch.no_grad():
        model(tokens)
    assert moe.router_aux_loss(model, labels, n_tokens) == 0.0


def test_conversion_round_trip_is_exact_in_both_expert_layouts(tmp_path):
    hf, model_dir = _checkpoint(tmp_path, True)
    per_expert = load_file(model_dir / "model.safetensors")
    tune = qwen3_moe_hf_to_tune(per_expert, **SHAPE)
    assert tune["layers.0.mlp.experts.gate_proj"].shape == (6, 40, 48)
    assert tune["layers.2.mlp.router.weight"].shape == (6, 48)
    assert "layers.1.mlp.w1.weight" in tune and "layers.0.attn.q_norm.scale" in tune
    back = qwen3_moe_tune_to_hf(tune, **SHAPE)
    assert back.keys() == per_expert.keys()
    assert all(torch.equal(back[k], per_expert[k]) for k in per_expert)
    # transformers' in-memory layout (experts fused): the same model either way.
    fused = {k: v for k, v in hf.state_dict().items() if "rotary" not in k}
    assert "model.layers.0.mlp.experts.gate_up_proj" in fused
    from_fused = qwen3_moe_hf_to_tune(fused, **SHAPE)
    assert from_fused.keys() == tune.keys()
    assert all(torch.equal(from_fused[k], tune[k]) for k in tune)
    again = qwen3_moe_tune_to_hf(from_fused, fused_experts=True, **SHAPE)
    assert again.keys() == fused.keys()
    assert all(torch.equal(again[k], fused[k]) for k in fused)


@pytest.mark.parametrize("fused", [False, True])
def test_checkpointer_saves_what_transformers_loads(tmp_path, fused):
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    hf, model_dir = _checkpoint(tmp_path, True)
    if fused:  # a checkpoint in transformers' fused layout: written back in it
        state = {k: v.contiguous() for k, v in hf.state_dict().items() if "rotary" not in k}
        save_file(state, model_dir / "model.safetensors", {"format": "pt"})
    model, checkpointer, _ = _built(model_dir, tmp_path)
    with torch.no_grad():  # a change in the experts and the router only
        for layer in (model.layers[0], model.layers[2]):
            layer.mlp.experts.down_proj.mul_(1.5)
            layer.mlp.router.weight.add_(torch.randn_like(layer.mlp.router.weight))
    checkpointer.save_checkpoint({MODEL_KEY: model.state_dict()}, epoch=0)
    saved = next((tmp_path / "out").rglob("*.safetensors"))
    keys = load_file(saved).keys()
    assert ("model.layers.0.mlp.experts.gate_up_proj" in keys) == fused
    assert ("model.layers.0.mlp.experts.3.up_proj.weight" in keys) == (not fused)
    loaded = AutoModelForCausalLM.from_pretrained(saved.parent, dtype=torch.float32).eval()
    tokens = _tokens(seed=4)
    with torch.no_grad():
        reloaded = loaded(tokens).logits
        assert (reloaded - hf(tokens).logits).abs().max() > 1e-3
        assert (reloaded - model(tokens)).abs().max() < 1e-4


LORA = {"lora_attn_modules": ["q_proj", "v_proj"], "lora_rank": 4, "lora_alpha": 8}


def _perturbed_lora(model_dir, tmp_path, only_experts: bool = False):
    """The LoRA model with every adapter away from zero (B is zero when built): only the
    experts' with ``only_experts``."""
    model, _, _ = _built(model_dir, tmp_path, apply_lora_to_mlp=True, **LORA)
    generator = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for name, param in model.named_parameters():
            expert = moe.EXPERT_ADAPTER_KEY.match(name)
            if (expert or ".lora_b" in name) and not (only_experts and not expert):
                param.copy_(torch.randn(param.shape, generator=generator) * 0.05)
            elif only_experts and ".lora_" in name:
                param.zero_()
    return model


def _peft_logits(model, model_dir, tmp_path, tokens):
    """``model``'s adapters exported as the trainer exports them, applied by peft to
    transformers' Qwen3MoeForCausalLM."""
    from peft import PeftModel
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    adapter = {k: v for k, v in model.state_dict().items() if "lora" in k}
    config = json.loads((model_dir / "config.json").read_text())
    weights, targets = export_adapter(
        adapter, model_type="QWEN2", hf_config=config, rank=LORA["lora_rank"],
        alpha=LORA["lora_alpha"],
    )  # fmt: skip
    out = tmp_path / "adapter"
    out.mkdir(exist_ok=True)
    save_file({k: v.contiguous() for k, v in weights.items()}, out / "adapter_model.safetensors")
    peft_config = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": LORA["lora_rank"],
                   "lora_alpha": LORA["lora_alpha"], "lora_dropout": 0.0, **targets}  # fmt: skip
    (out / "adapter_config.json").write_text(json.dumps(peft_config))
    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    with torch.no_grad():
        return PeftModel.from_pretrained(base, out).eval()(tokens).logits, targets


def test_lora_on_the_experts_is_peft_on_transformers_fused_experts(tmp_path):
    hf, model_dir = _checkpoint(tmp_path, True)
    model = _perturbed_lora(model_dir, tmp_path)
    adapted = set(get_adapter_params(model))  # what the trainer trains
    assert "layers.0.mlp.experts.gate_up_lora_a" in adapted  # every expert, stacked
    assert "layers.1.mlp.w1.lora_a.weight" in adapted  # the dense layer's MLP
    assert "layers.0.attn.q_proj.lora_a.weight" in adapted
    assert not any("router" in n for n in adapted)
    experts = model.layers[0].mlp.experts
    assert experts.gate_up_lora_a.shape == (6, 4, 48) and experts.down_lora_b.shape == (6, 48, 4)
    tokens = _tokens()
    with torch.no_grad():
        base, got = hf(tokens).logits, model.eval()(tokens)
    peft_logits, targets = _peft_logits(model, model_dir, tmp_path, tokens)
    assert targets["target_parameters"] == ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]
    assert (got - base).abs().max() > 1e-2
    assert float((peft_logits - got).abs().max()) < 1e-4


def test_the_experts_adapters_alone_reach_peft_and_the_merged_weights(tmp_path):
    """Only the experts' adapters away from zero: peft's model is the trained one, and so is the
    base with the adapters merged (``merge=true``'s weights)."""
    from torchtune.modules.peft import get_merged_lora_ckpt

    hf, model_dir = _checkpoint(tmp_path, True)
    model = _perturbed_lora(model_dir, tmp_path, only_experts=True)
    tokens = _tokens()
    with torch.no_grad():
        base, got = hf(tokens).logits, model.eval()(tokens)
    assert (got - base).abs().max() > 1e-2
    peft_logits, _ = _peft_logits(model, model_dir, tmp_path, tokens)
    assert float((peft_logits - got).abs().max()) < 1e-4

    state = {k: v.clone() for k, v in model.state_dict().items()}
    moe.merge_expert_adapters(state, LORA["lora_alpha"] / LORA["lora_rank"])
    state = get_merged_lora_ckpt(state, rank=LORA["lora_rank"], alpha=LORA["lora_alpha"])
    merged, _, _ = _built(model_dir, tmp_path)
    merged.load_state_dict(state, strict=True)
    with torch.no_grad():
        assert float((merged(tokens) - got).abs().max()) < 1e-4


NO_DROPOUT = (
    "LoRA on the experts (lora_mlp=true) adds its update to the expert weights, as PEFT's, and "
    "takes no dropout; set lora_dropout=0 or lora_mlp=false"
)
NO_DORA = (
    "LoRA on the experts (lora_mlp=true) adds its update to the expert weights, as PEFT's, and "
    "has no DoRA form; use method=lora or lora_mlp=false"
)


@pytest.mark.parametrize(
    ("given", "message"),
    [
        ({"lora_dropout": 0.1}, f"lora_dropout=0.1: {NO_DROPOUT}"),
        ({"use_dora": True}, f"method=dora: {NO_DORA}"),
    ],
)
def test_what_peft_cannot_hold_on_the_experts_is_refused(tmp_path, given, message):
    _, model_dir = _checkpoint(tmp_path, True)
    config = json.loads((model_dir / "config.json").read_text()) | {"mlp_only_layers": []}
    resolved = custom.with_config(catalog.CUSTOM["qwen3-moe-custom"], config, "test")
    assert resolved.defaults["lora_mlp"] is False  # every layer sparse: off by default
    with pytest.raises(ConflictError) as err:
        lora_qwen3_moe(**resolved.builder_kwargs(), apply_lora_to_mlp=True, **LORA, **given)
    assert str(err.value) == message
    # Attention alone takes both.
    lora_qwen3_moe(**resolved.builder_kwargs(), **LORA, **given)


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["lora_mlp=true", "lora_dropout=0.05"], f"lora_dropout=0.05: {NO_DROPOUT}"),
        (["lora_mlp=true", "method=dora"], f"method=dora: {NO_DORA}"),
    ],
)
def test_the_trainer_arguments_refuse_it_before_anything_runs(argv, message):
    from tunepack.runtimes.args import parse_trainer_args

    entry = catalog.TINY["qwen3_moe"]
    assert parse_trainer_args(["lora_mlp=true"], entry).lora_mlp is True
    with pytest.raises(ConflictError) as err:
        parse_trainer_args(argv, entry)
    assert str(err.value) == message
    parse_trainer_args(argv[1:], entry)  # the experts left alone: both run


def _config(**changes) -> dict:
    base = {"model_type": "qwen3_moe", "hidden_act": "silu", **HF_CONFIG}
    return {k: v for k, v in (base | changes).items() if v is not None}


def test_custom_config_reads_the_experts():
    built = custom.read_config("qwen3_moe", _config(decoder_sparse_step=2, mlp_only_layers=[]),
                               "ckpt")  # fmt: skip
    assert built.shape.dense_layers == (0, 2)  # layers 1 and 3 of 1..3 (i + 1) are sparse
    assert built.shape.num_experts == 6 and built.shape.experts_per_token == 2
    assert built.shape.head_dim == 24 and built.shape.qk_norm
    assert built.options["router_aux_loss_coef"] == 0.02
    no_head_dim = custom.read_config("qwen3_moe", _config(head_dim=None), "ckpt")
    assert no_head_dim.shape.head_dim == 16  # hidden_size // heads, as transformers reads it


@pytest.mark.parametrize(
    "change, field",
    [
        ({"num_experts_per_tok": 7}, "num_experts_per_tok=7"),
        ({"num_experts": 0}, "num_experts=0"),
        ({"mlp_only_layers": [5]}, "mlp_only_layers=[5]"),
        ({"decoder_sparse_step": 4}, "decoder_sparse_step=4"),
        ({"norm_topk_prob": "yes"}, "norm_topk_prob='yes'"),
        ({"router_aux_loss_coef": -1}, "router_aux_loss_coef=-1"),
        ({"hidden_act": "gelu"}, "hidden_act='gelu'"),
        ({"attention_bias": True}, "attention_bias=True"),
        ({"use_sliding_window": True}, "use_sliding_window=True"),
    ],
)
def test_custom_config_refuses_what_the_builders_cannot_reproduce(change, field):
    with pytest.raises(BadModelError) as error:
        custom.read_config("qwen3_moe", _config(**change), "ckpt")
    message = str(error.value)
    assert "\n" not in message and field in message, message


def test_published_sizes_count_total_and_active_parameters():
    small, large = catalog.get("qwen3-30b-a3b").shape, catalog.get("qwen3-235b-a22b").shape
    # The published "30B-A3B" and "235B-A22B".
    assert 30.4e9 < small.parameter_count() < 30.6e9
    assert 3.2e9 < small.active_parameter_count() < 3.4e9
    assert 234e9 < large.parameter_count() < 236e9
    assert 21.5e9 < large.active_parameter_count() < 22.5e9
    with torch.device("meta"):
        built = qwen3_moe(**catalog.TINY["qwen3_moe"].builder_kwargs())
    tiny = catalog.TINY["qwen3_moe"].shape
    assert sum(p.numel() for p in built.parameters()) == tiny.parameter_count()
    assert catalog.get("qwen3-30b-a3b").why_not("qlora") is not None
