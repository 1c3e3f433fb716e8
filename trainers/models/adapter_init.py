"""Fresh LoRA adapters that are the same whatever the number of processes.

torchtune draws each adapter's ``A`` matrix from the global random generator when the module is
built (one process) or when its shard is filled in (FSDP2: each rank draws its own shard, from
``seed + rank``): the same run on one process and on two started from different adapters. Here
each ``A`` is drawn whole, on the host, from a generator of its own seeded by the run's seed and
the module's name, with torchtune's distribution (Kaiming-uniform with ``a = sqrt(5)``, i.e.
uniform in ``+-1/sqrt(in_features)``); a sharded run keeps its rank's part. ``B`` stays zero, so
the model starts as its base. The global generator is not touched: what draws from it later
(dropout) is as before.
"""

from __future__ import annotations

import math
import zlib

import torch
from torch import nn
from torch.distributed.tensor import DTensor, distribute_tensor
from torchtune.modules.peft import DoRALinear, LoRALinear

from tunepack.trainers.models.moe import LoRAExperts

# Wrappers that add a level to module names (activation checkpointing, torch.compile).
_WRAPPERS = ("_checkpoint_wrapped_module.", "_orig_mod.")


def _plain(name: str) -> str:
    for wrapper in _WRAPPERS:
        name = name.replace(wrapper, "")
    return name


@torch.no_grad()
def initialize(model: nn.Module, seed: int) -> int:
    """Draw every adapter's ``A`` (see the module's docstring); returns how many were drawn."""
    count = 0
    for name, weight in _adapter_inputs(model):
        generator = torch.Generator().manual_seed(
            (seed * 1_000_003 + zlib.crc32(_plain(name).encode())) % (1 << 63)
        )
        shape = weight.shape  # a DTensor's is the whole tensor's
        bound = 1 / math.sqrt(shape[-1])
        full = torch.empty(shape, dtype=torch.float32).uniform_(-bound, bound, generator=generator)
        full = full.to(device=weight.device, dtype=weight.dtype)
        if isinstance(weight, DTensor):
            full = distribute_tensor(full, weight.device_mesh, weight.placements)
        weight.copy_(full)
        count += 1
    return count


def _adapter_inputs(model: nn.Module):
    """(name, A) of every adapter: LoRALinear's ``lora_a`` (out x in) and the experts' stacked
    ones (experts x rank x in: each expert's ``A`` in +-1/sqrt(in) too)."""
    for name, module in model.named_modules():
        if isinstance(module, LoRALinear | DoRALinear):
            yield name, module.lora_a.weight
        elif isinstance(module, LoRAExperts):
            yield f"{name}.gate_up", module.gate_up_lora_a
            yield f"{name}.down", module.down_lora_a
