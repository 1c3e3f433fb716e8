"""The next-token loss computed with the output projection, in chunks, on labelled rows only.

A plain forward materializes the logits of every position, ``positions x vocabulary`` floats
(4 x 512 x 128,256 fp32 is 1 GiB for one Llama 3 micro-batch), keeps them for the backward, and
spends the largest single matmul of the model on positions whose loss is never counted: padding
and, by default, the prompt. Here the model stops at the final norm; ``LinearCrossEntropy``
projects only the labelled positions, a chunk of rows at a time, and computes each chunk's loss
and its gradient at once. Only the gradient with respect to the hidden states (and, when the
projection trains, its weight) is kept, so at most one chunk's logits exist at any time.

The numbers are those of ``cross_entropy(logits.float(), labels, reduction="sum")``: log-sum-exp
in fp32, the gradient ``softmax - one_hot``. ``loss_instead_of_logits`` applies to a torchtune
``TransformerDecoder`` whose output is a plain linear layer or tied to the embedding; otherwise
(LoRA on the output projection) the model keeps returning logits.
"""

from __future__ import annotations

import types
from contextlib import contextmanager

import torch
from torch import nn
from torchtune.modules import TransformerDecoder
from torchtune.modules.tied_linear import TiedLinear


def chunked_loss(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    rows: int,
    *,
    grads=(False, False),
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """Summed cross-entropy of ``hidden @ weight.T`` against ``targets``, ``rows`` rows at a
    time, with the gradients asked for (hidden, weight) computed along the way.

    The matmuls run in the weight's dtype (bf16 on a GPU, fp32 accumulation inside them); the
    log-sum-exp and the softmax in fp32, in place of the chunk's logits, so a chunk holds its
    logits once in fp32 and once, briefly, in the dtype. The weight's gradient of one chunk stays
    in the dtype, as autograd's would; over several chunks it is accumulated in fp32."""
    loss = torch.zeros((), dtype=torch.float32, device=hidden.device)
    grad_hidden = None
    if grads[0]:  # row-major, so that each chunk's rows are written in place
        grad_hidden = torch.empty(hidden.shape, dtype=hidden.dtype, device=hidden.device)
    several = hidden.size(0) > rows
    grad_weight = None
    if grads[1] and several:
        grad_weight = torch.zeros_like(weight, dtype=torch.float32)
    # One buffer for every chunk's logits: on the CPU a fresh one per chunk is a fresh mapping
    # whose pages fault in on first touch (14% of the projection's time at 256 x 32,768 fp32).
    logits = torch.empty(
        min(rows, hidden.size(0)), weight.size(0), dtype=weight.dtype, device=hidden.device
    )
    for begin in range(0, hidden.size(0), rows):
        h = hidden[begin : begin + rows]
        t = targets[begin : begin + rows]
        z = torch.mm(h, weight.T, out=logits[: h.size(0)]).float()
        target = z.gather(1, t[:, None]).squeeze(1)
        top = z.amax(dim=-1, keepdim=True)
        total = z.sub_(top).exp_().sum(dim=-1)  # z is now exp(logits - top)
        loss += (top.squeeze(1) + total.log() - target).sum()
        if not any(grads):
            continue
        z.div_(total[:, None])  # the softmax
        z[torch.arange(t.size(0), device=t.device), t] -= 1.0
        grad = z.to(weight.dtype)
        del z
        if grad_hidden is not None:
            torch.mm(grad, weight, out=grad_hidden[begin : begin + rows])
        if grads[1]:
            chunk_grad = grad.T @ h
            if several:
                grad_weight += chunk_grad
            else:
                grad_weight = chunk_grad
    return loss, grad_hidden, grad_weight


class LinearCrossEntropy(torch.autograd.Function):
    """``chunked_loss`` as an autograd function: the gradients are computed in the forward and
    only they are kept for the backward."""

    @staticmethod
    def forward(ctx, hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, rows):
        loss, grad_hidden, grad_weight = chunked_loss(
            hidden, weight, targets, rows, grads=ctx.needs_input_grad[:2]
        )
        ctx.weight_dtype = weight.dtype
        ctx.save_for_backward(
            *(g if g is not None else torch.empty(0) for g in (grad_hidden, grad_weight))
        )
        return loss

    @staticmethod
    def backward(ctx, grad_loss: torch.Tensor):
        grad_hidden, grad_weight = ctx.saved_tensors
        needs = ctx.needs_input_grad
        if needs[0]:
            grad_hidden = grad_hidden.mul_(grad_loss.to(grad_hidden.dtype))
        if needs[1]:  # scaled in place: the saved gradient is read once
            grad_weight = grad_weight.mul_(grad_loss).to(ctx.weight_dtype)
        return (
            grad_hidden if needs[0] else None,
            grad_weight if needs[1] else None,
            None,
            None,
        )


def output_weight(model: nn.Module) -> torch.Tensor | None:
    """The output projection's weight, or None where the loss must go through the model's own
    output layer (not a torchtune decoder, LoRA on the output, a bias)."""
    if not isinstance(model, TransformerDecoder) or model.num_output_chunks:
        return None
    output = model.output
    if isinstance(output, TiedLinear):
        return output.tied_module.weight
    if type(output) is nn.Linear and output.bias is None:
        return output.weight
    return None


def supports(model: nn.Module) -> bool:
    return output_weight(model) is not None


@contextmanager
def loss_instead_of_logits(
    model: TransformerDecoder, rows: torch.Tensor, targets: torch.Tensor, chunk_rows: int
):
    """Within the block, ``model(tokens)`` returns the summed loss of the positions ``rows``
    (indices into the flattened batch x sequence) against ``targets`` instead of logits,
    computed ``chunk_rows`` rows of logits at a time.

    The projection runs inside the model's forward (where FSDP has gathered its weight), by
    standing in for the decoder's ``unembed`` on this one instance.
    """

    def unembed(self: TransformerDecoder, h: torch.Tensor) -> torch.Tensor:
        h = self.norm(h)
        selected = h.reshape(-1, h.size(-1)).index_select(0, rows)
        if not torch.is_grad_enabled():  # evaluation: the loss alone
            return chunked_loss(selected, output_weight(self), targets, chunk_rows)[0]
        return LinearCrossEntropy.apply(selected, output_weight(self), targets, chunk_rows)

    model.unembed = types.MethodType(unembed, model)
    try:
        yield
    finally:
        del model.unembed  # back to the class's own


@contextmanager
def logits_from(model: TransformerDecoder, start: int):
    """Within the block, ``model(tokens)`` returns the fp32 logits of positions ``start`` and
    after only: the output projection is spent on those alone (GRPO's answer positions), not on
    every position as the class's ``unembed`` does."""

    def unembed(self: TransformerDecoder, h: torch.Tensor) -> torch.Tensor:
        return self.output(self.norm(h[:, start:])).float()

    model.unembed = types.MethodType(unembed, model)
    try:
        yield
    finally:
        del model.unembed
