"""LoRA's product on the CPU in one autograd function: fewer passes over the big activations.

torchtune's ``LoRALinear`` computes ``W x + (alpha / r) B A x`` as four operations, and the
scaling and the sum each read and write a whole ``tokens x out`` tensor, forward and backward.
``FusedLoRALinear`` computes the same value with the scaling on the ``tokens x r`` product and
the low-rank part added to the base product in place, as one rank-``r`` update (``addmm_``); its
backward adds the low-rank part of the input gradient the same way. The rank-wide products are
written as their transposes where the ``tokens x r`` result is the tall one: MKL's single-thread
GEMM computes an ``r x tokens`` result several times faster than the same ``tokens x r`` one
(``g^T (A x)`` at 2,048 tokens, 1,536 wide, rank 8: 6.9 ms against 1.5 ms).

Measured on one CPU thread (``benchmarks/side_by_side.py``'s 58.7M model, rank 8): the LoRA
layers' cost beyond the frozen product fell from 21-26 ms to 7-9 ms per layer and step (MLP
projections at 2,048 tokens), and the whole step by about 9%.
On a GPU it is not measured yet, so GPU runs keep torchtune's forward (docs/gpu.md).

The value differs from torchtune's by rounding only (the scale applied before ``B`` instead of
after it); parameters, names and state dicts are torchtune's, so checkpoints, adapters and their
export are unchanged.
"""

from __future__ import annotations

import torch
from torch import nn
from torchtune.modules.peft import LoRALinear


class _LoRAProduct(torch.autograd.Function):
    """``x W^T + bias + scale (x A^T) B^T`` and its gradients, with ``x`` as rows."""

    @staticmethod
    def forward(ctx, x, weight, bias, lora_a, lora_b, scale: float):
        rows = x.reshape(-1, x.shape[-1])
        low = (lora_a @ rows.t()).t().mul(scale)  # tokens x r, computed as its transpose
        out = nn.functional.linear(rows, weight, bias).addmm_(low, lora_b.t())
        ctx.save_for_backward(rows, weight, lora_a, lora_b, low)
        ctx.scale = scale
        return out.view(*x.shape[:-1], weight.shape[0])

    @staticmethod
    def backward(ctx, grad):
        rows, weight, lora_a, lora_b, low = ctx.saved_tensors
        need_x, _, need_bias, need_a, need_b, _ = ctx.needs_input_grad
        grad_rows = grad.reshape(-1, grad.shape[-1])
        grad_low = (lora_b.t() @ grad_rows.t()).t().mul(ctx.scale)  # tokens x r, transposed
        grad_x = grad_bias = grad_a = grad_b = None
        if need_x:
            grad_x = (grad_rows @ weight).addmm_(grad_low, lora_a)
            grad_x = grad_x.view(*grad.shape[:-1], weight.shape[1])
        if need_bias:
            grad_bias = grad_rows.sum(0)
        if need_a:
            grad_a = grad_low.t() @ rows
        if need_b:
            grad_b = (low.t() @ grad_rows).t()  # out x r, computed as its transpose
        return grad_x, None, grad_bias, grad_a, grad_b, None


class FusedLoRALinear(LoRALinear):
    """torchtune's ``LoRALinear`` whose forward is ``_LoRAProduct``: the same parameters and
    state dict. Adapters switched off (the preference methods' reference pass), dropout on the
    LoRA path and an NF4 base keep torchtune's forward."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.disabled or self._quantize_base or not isinstance(self.dropout, nn.Identity):
            return super().forward(x)
        return _LoRAProduct.apply(
            x,
            self.weight,
            self.bias,
            self.lora_a.weight,
            self.lora_b.weight,
            self.alpha / self.rank,
        )


def applies(device: torch.device) -> bool:
    """Whether a run on ``device`` computes LoRA with ``FusedLoRALinear``: on the CPU, where it
    was measured (module docstring)."""
    return device.type == "cpu"


def fuse(model: nn.Module) -> int:
    """Switch the model's plain LoRA layers (torchtune's ``LoRALinear``, not DoRA's or an
    expert's, with an unquantized base and no dropout) to ``FusedLoRALinear``, in place, before
    any compile or sharding sees their forward. Returns how many were switched."""
    switched = 0
    for module in model.modules():
        if (
            type(module) is LoRALinear
            and not module._quantize_base
            and isinstance(module.dropout, nn.Identity)
        ):
            # A subclass that only overrides forward: no state to move, isinstance still holds.
            module.__class__ = FusedLoRALinear
            switched += 1
    return switched
