"""What a trainer Pod needs of its node besides GPUs: CPU and memory requests, from the model.

Sized so a runtime schedules on the smallest node that can run it, not a fixed tier: host memory
for loading the bf16 checkpoint once per node plus each process's share; two cores a process (no
DataLoader workers). docs/cluster.md, "Node shapes"."""

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
