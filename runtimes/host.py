"""What a trainer Pod needs of its node besides GPUs: CPU and memory requests, from the model.

The runtimes' ``node`` container requests (``runtimes/builder.py``) come from here, so that a
runtime schedules on the smallest node that can run it (one L4 or A10G with 4 CPUs and 16 GiB
for the 1B-3B models) instead of a fixed tier's 8 CPUs and 48 GiB.

Memory. The host-side peak is loading the checkpoint: the trainer reads the base model's whole
state dict into host memory before it goes to the GPUs (``trainers/recipe.py``,
``_load_base_weights``), once per node: rank 0 streams it to the other ranks' FSDP shards. The
published checkpoints are bf16, and the trainer loads in bf16, so that is 2 bytes per parameter
(every expert of a mixture of experts included). QLoRA on several GPUs is the exception that
is not sized for: each rank quantizes its shard from its own full copy, so such a job holds one
copy per GPU and should raise its memory request (``resourcesPerNode``). Each process adds what
torch, its CUDA libraries and context, the tokenizer and the dataset hold on the host; a margin
covers torchrun's agent and the page cache of the files being read.

CPU. The trainer starts one process per GPU and loads data in that process (no DataLoader
workers: ``num_workers`` is torchtune's default 0); each gets a core for its step loop and one
for its host-side work (tokenizing, NCCL's proxy thread, checkpoint writes).

Requests are what the scheduler reserves, not limits: a TrainJob's ``resourcesPerNode`` can
raise or lower them (docs/cluster.md, "Node shapes"). A job that asks for another number of GPUs
per node and names no CPU or memory gets them sized for its processes by the SDK and CLI
(``tunepack.jobs.trainjob.requested_resources``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from tunepack.runtimes import catalog
from tunepack.runtimes.catalog import ModelEntry

GIB = 1024**3
WEIGHT_BYTES = 2  # bf16: the published checkpoints' dtype and the trainer's
PROCESS_GIB = 3  # per trainer process: torch + CUDA libraries and context, tokenizer, dataset
MARGIN_GIB = 2  # torchrun's agent, the page cache of the checkpoint being read
CPUS_PER_PROCESS = 2  # the step loop, and the process's host-side work


@dataclass(frozen=True)
class NodeShape:
    """What one trainer node must offer the runtime's Pod."""

    gpus: int
    cpu: str  # Kubernetes quantities, as the runtime requests them
    memory: str
    nodes: int

    def describe(self) -> str:
        """``1 GPU, 2 CPUs, 8Gi memory`` (``2 nodes of ...`` where there are several)."""
        gpus = f"{self.gpus} GPU{'s' if self.gpus != 1 else ''}, " if self.gpus else ""
        each = f"{gpus}{self.cpu} CPUs, {self.memory} memory"
        return each if self.nodes == 1 else f"{self.nodes} nodes of {each}"


def sized_parameters(entry: ModelEntry) -> int:
    """The parameter count the requests are sized for: the model's, or for a ``-custom``
    runtime (its checkpoint is unknown until a job runs) the largest of its tier."""
    if entry.custom:
        return int(catalog.CUSTOM_TIER.up_to_billions * 1e9)
    return entry.parameter_count


def node_shape(entry: ModelEntry, gpus: int | None = None) -> NodeShape:
    """What each trainer node of the runtime must offer: sized here for a GPU runtime, the
    catalog's own requests for a CPU runtime. ``gpus``: a job's GPUs per node instead of the
    runtime's (one trainer process each)."""
    res = entry.resources
    if gpus is None:
        if res.cpu is not None and res.memory is not None:
            return NodeShape(res.gpus, res.cpu, res.memory, res.nodes)
        gpus = res.gpus
    processes = max(1, gpus)
    weights = sized_parameters(entry) * WEIGHT_BYTES / GIB
    memory = math.ceil(weights + processes * PROCESS_GIB + MARGIN_GIB)
    return NodeShape(gpus, str(CPUS_PER_PROCESS * processes), f"{memory}Gi", res.nodes)


def trainer_requests(entry: ModelEntry) -> dict[str, str]:
    """The ``node`` container's CPU and memory requests."""
    shape = node_shape(entry)
    return {"cpu": shape.cpu, "memory": shape.memory}
