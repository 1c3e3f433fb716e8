"""Process-group plumbing for the recipe: who am I, which device, the few collectives it uses,
and how a collective fails when another process of the group died first (``peer_failed``).

A worker started by torchrun has ``RANK``, ``WORLD_SIZE`` and ``LOCAL_RANK`` in its environment;
a run without them (the launcher's in-process path for world size 1, or a test) is rank 0 of 1
and never creates a process group, so every helper here also works without one.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

# Long enough for rank 0 to write a full-model checkpoint while the others wait in a barrier.
COLLECTIVE_TIMEOUT = timedelta(minutes=30)


@dataclass(frozen=True)
class Topology:
    rank: int
    world_size: int
    local_rank: int

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.world_size > 1


def init(device_kind: str) -> tuple[Topology, torch.device]:
    """Join the process group torchrun set up (if any) and pick this rank's device."""
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    topo = Topology(rank, world_size, local_rank)

    if device_kind == "cuda":
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
    else:
        device = torch.device("cpu")
    if topo.distributed and not dist.is_initialized():
        # On GPUs, gloo rides along for the CPU-side collectives of checkpoint planning; on CPU,
        # gloo alone (torchtune's stock recipes hard-code nccl and cannot run there).
        backend = "cuda:nccl,cpu:gloo" if device.type == "cuda" else "gloo"
        dist.init_process_group(backend=backend, timeout=COLLECTIVE_TIMEOUT)
    return topo, device


def shutdown() -> None:
    """Leave the process group together: a rank that tears gloo down while a peer is still in
    its last collectives was seen to abort at exit ("terminate called without an active
    exception"), turning a finished run into a failed one."""
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


def barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def all_reduce_sum(values: list[float], device: torch.device) -> list[float]:
    """Sum a few numbers over all ranks in one collective (identity on one process)."""
    if not dist.is_initialized():
        return list(values)
    # float64: token counts and summed losses must add up exactly, whatever the training dtype.
    tensor = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(tensor, op=dist.ReduceOp.SUM)
    return tensor.tolist()


def broadcast_from_main(obj):
    """Rank 0's value of a small picklable object, on every rank."""
    if not dist.is_initialized():
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


# What a collective raises in the processes left behind when one process of the group has died
# (gloo on CPU, NCCL on GPU).
_PEER_GONE = (
    "Connection closed by peer",
    "Connection reset by peer",
    "remote worker crashing",
    "NCCL communicator was aborted",
    "Broken pipe",
)


def peer_failed(err: BaseException) -> bool:
    """Whether ``err`` is this worker's collective failing because another process of the run
    failed first (a guess from the backend's message: neither gloo nor NCCL says it otherwise)."""
    if int(os.environ.get("WORLD_SIZE", "1")) < 2 or not isinstance(err, RuntimeError):
        return False
    return any(sign in str(err) for sign in _PEER_GONE)
