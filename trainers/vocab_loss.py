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

# Logit elements computed at once: 8M fp32 floats (32 MiB) per chunk, whatever the vocabulary.
CHUNK_ELEMENTS = 8 * 2**20


def chunked_loss(
    hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, *, grads=(False, False)
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """Summed cross-entropy of ``hidden @ weight.T`` against ``targets``, one chunk of rows at a
    time, with the gradients asked for (hidden, weight) computed along the way."""
    rows = max(1, CHUNK_ELEMENTS // weight.size(0))
    loss = torch.zeros((), dtype=torch.float32, device=hidden.device)
    grad_hidden = torch.empty_like(hidden) if grads[0] else None
    grad_weight = torch.zeros_like(weight, dtype=torch.float32) if grads[1] else None
    for begin in range(0, hidden.size(0), rows):
        h = hidden[begin : begin + rows]
        t = targets[begin : begin + rows]
        logits = (h @ weight.T).float()
        lse = torch.logsumexp(logits, dim=-1)
        loss += (lse - logits.gather(1, t[:, None]).squeeze(1)).sum()
        if not any(grads):
            continue
        grad = logits.sub_(lse[:, None]).exp_()  # softmax, in place of the logits
        grad[torch.arange(t.size(0), device=t.device), t] -= 1.0
        grad = grad.to(weight.dtype)
        if grad_hidden is not None:
            grad_hidden[begin : begin + rows] = grad @ weight
        if grad_weight is not None:
            grad_weight += grad.T.float() @ h.float()
    return loss, grad_hidden, grad_weight


class LinearCrossEntropy(torch.autograd.Function):
    """``chunked_loss`` as an autograd function: the gradients are computed in the forward and
    only they are kept for the backward."""

    @staticmethod
    def forward(ctx, hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor):
        loss, grad_hidden, grad_weight = chunked_loss(
            hidden, weight, targets, grads=ctx.needs_input_grad[:2]
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
        return (
            grad_hidden * grad_loss.to(grad_hidden.dtype) if needs[0] else None,
            (grad_weight * grad_loss).to(ctx.weight_dtype) if needs[1] else None,
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
def loss_instead_of_logits(model: TransformerDecoder, rows: torch.Tensor, targets: torch.Tensor):
    """Within the block, ``model(tokens)`` returns the summed loss of the positions ``rows``
    (indices into the flattened batch x sequence) against ``targets`` instead of logits.

    The projection runs inside the model's forward (where FSDP has gathered its weight), by
    standing in for the decoder's ``unembed`` on this one instance.
    """

    def unembed(self: TransformerDecoder, h: torch.Tensor) -> torch.Tensor:
        h = self.norm(h)
        selected = h.reshape(-1, h.size(-1)).index_select(0, rows)
        if not torch.is_grad_enabled():  # evaluation: the loss alone
            return chunked_loss(selected, output_weight(self), targets)[0]
        return LinearCrossEntropy.apply(selected, output_weight(self), targets)

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
