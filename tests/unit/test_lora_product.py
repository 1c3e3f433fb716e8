"""LoRA's product in one autograd function (trainers/models/lora_product.py) computes what
torchtune's LoRALinear computes, and the trainer switches exactly the layers it can take."""

from __future__ import annotations

import copy

import pytest
import torch
from torchtune.models.llama3_2 import lora_llama3_2
from torchtune.modules.peft import DoRALinear, LoRALinear

from tests.helpers import small_decoder
from tunepack.trainers.models import lora_product
from tunepack.trainers.models.lora_product import FusedLoRALinear
from tunepack.trainers.process import allocator

# The scale is applied to the rank-wide product, before B, instead of to the result: the same value
# up to fp32 rounding.
CLOSE = {"rtol": 1e-4, "atol": 1e-4}


def _pair(in_dim=24, out_dim=40, *, bias=False, dtype=torch.float32, **kwargs):
    torch.manual_seed(0)
    theirs = LoRALinear(in_dim, out_dim, rank=4, alpha=8.0, use_bias=bias, **kwargs).to(dtype)
    torch.nn.init.normal_(theirs.lora_b.weight)  # B starts at zero; a trained one does not
    if bias:
        torch.nn.init.normal_(theirs.bias)
    theirs.weight.requires_grad_(False)
    ours = copy.deepcopy(theirs)
    assert lora_product.fuse(ours) == 1 and type(ours) is FusedLoRALinear
    return theirs, ours


def _forward_backward(module, x, grad):
    x = x.detach().requires_grad_(x.requires_grad)
    out = module(x)
    out.backward(grad)
    grads = [
        p.grad for p in (module.lora_a.weight, module.lora_b.weight, module.bias) if p is not None
    ]
    return out.detach(), x.grad, grads


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("input_trains", [True, False])  # the first layer's input has no gradient
def test_the_fused_layer_equals_torchtunes_and_its_gradients(bias, input_trains):
    theirs, ours = _pair(bias=bias)
    if bias:
        for module in (theirs, ours):
            module.bias.requires_grad_(True)
    x = torch.randn(3, 7, 24, requires_grad=input_trains)
    grad = torch.randn(3, 7, 40)
    expected, got = _forward_backward(theirs, x, grad), _forward_backward(ours, x, grad)
    torch.testing.assert_close(got[0], expected[0], **CLOSE)
    if input_trains:
        torch.testing.assert_close(got[1], expected[1], **CLOSE)
    else:
        assert got[1] is None and expected[1] is None
    assert len(got[2]) == len(expected[2]) == (3 if bias else 2)
    for g, e in zip(got[2], expected[2], strict=True):
        torch.testing.assert_close(g, e, **CLOSE)
    assert ours.weight.grad is None  # the frozen base gets no gradient


def test_in_bf16_it_is_as_close_to_the_fp32_result_as_torchtunes_bf16_layer():
    theirs32, _ = _pair()
    theirs, ours = _pair(dtype=torch.bfloat16)
    x = torch.randn(4, 16, 24)
    exact = theirs32(x)
    their_error = (theirs(x.bfloat16()).float() - exact).abs().max()
    our_error = (ours(x.bfloat16()).float() - exact).abs().max()
    assert our_error <= 2 * their_error


def test_switched_off_adapters_give_the_base_layer():
    _, ours = _pair()
    x = torch.randn(5, 24)
    ours.disabled = True
    torch.testing.assert_close(ours(x), x @ ours.weight.T)


def test_dropout_keeps_torchtunes_forward():
    layer = LoRALinear(24, 40, rank=4, alpha=8.0, dropout=0.1)
    assert lora_product.fuse(layer) == 0 and type(layer) is LoRALinear


def test_fuse_switches_the_plain_lora_layers_of_a_model_and_keeps_its_state_and_output():
    torch.manual_seed(0)
    model = small_decoder(
        lora_llama3_2,
        num_layers=2,
        lora_attn_modules=["q_proj", "k_proj", "v_proj", "output_proj"],
        apply_lora_to_mlp=True,
        lora_rank=4,
        lora_alpha=8.0,
    )
    for module in model.modules():
        if isinstance(module, LoRALinear):
            torch.nn.init.normal_(module.lora_b.weight)
    plain = sum(type(m) is LoRALinear for m in model.modules())
    tokens = torch.randint(0, 97, (2, 9))
    before, keys = model(tokens), list(model.state_dict())
    assert lora_product.fuse(model) == plain == 2 * 7  # q, k, v, output and the MLP's three
    assert not any(type(m) is LoRALinear for m in model.modules())
    assert list(model.state_dict()) == keys
    torch.testing.assert_close(model(tokens), before, **CLOSE)


def test_dora_and_an_nf4_base_are_left_to_torchtune():
    dora = DoRALinear(64, 256, rank=4, alpha=8.0)
    qlora = LoRALinear(64, 256, rank=4, alpha=8.0, quantize_base=True)
    assert lora_product.fuse(torch.nn.ModuleList([dora, qlora])) == 0
    assert type(dora) is DoRALinear and type(qlora) is LoRALinear


def test_it_applies_on_the_cpu_where_it_was_measured():
    assert lora_product.applies(torch.device("cpu"))
    assert not lora_product.applies(torch.device("cuda", 0))


def test_glibc_takes_the_cpu_trainers_allocator_settings():
    # This machine's Python links glibc; mallopt returns 0 for a setting it refuses.
    assert allocator.keep_large_blocks()
