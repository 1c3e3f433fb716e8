"""The trainer Pod's CPU and memory requests, sized from the model (runtimes/host.py): each
runtime fits the smallest node that can load its checkpoint, and says which node that is."""

from __future__ import annotations

import pytest

from tunepack.runtimes import catalog, host
from tunepack.runtimes.builder import build_runtime
from tunepack.runtimes.contract import container, replicated_job

GIB = 1024**3
# The usual single-GPU nodes (AWS g6.xlarge: one L4; g5.xlarge: one A10G): 4 vCPUs and 16 GiB,
# of which the kubelet leaves about 3.9 CPUs and 14.5 GiB allocatable.
SINGLE_L4_NODE = {"cpu": 3.9, "memory_gib": 14.5}


def _node_requests(entry: catalog.ModelEntry) -> dict:
    return container(replicated_job(build_runtime(entry), "node"))["resources"]["requests"]


def _gib(quantity: str) -> float:
    assert quantity.endswith("Gi"), quantity
    return float(quantity.removesuffix("Gi"))


@pytest.mark.parametrize("model", ["llama3.2-1b", "llama3.2-3b", "qwen2.5-1.5b", "gemma2-2b"])
def test_small_models_schedule_on_a_single_l4_or_a10g_node(model):
    requests = _node_requests(catalog.get(model))
    assert float(requests["cpu"]) <= SINGLE_L4_NODE["cpu"]
    assert _gib(requests["memory"]) <= SINGLE_L4_NODE["memory_gib"]


@pytest.mark.parametrize(
    "model", [e.name for e in catalog.CATALOG.values() if e.resources.gpus and not e.custom]
)
def test_memory_covers_loading_the_checkpoint_and_the_processes(model):
    entry = catalog.get(model)
    requests = _node_requests(entry)
    weights_gib = entry.parameter_count * host.WEIGHT_BYTES / GIB
    processes = entry.resources.gpus
    assert _gib(requests["memory"]) >= weights_gib + processes * host.PROCESS_GIB
    assert int(requests["cpu"]) == host.CPUS_PER_PROCESS * processes


def test_the_node_shape_is_what_the_runtime_requests():
    entry = catalog.get("llama3.1-8b")  # 8.03B parameters: 15 GiB of bf16 weights
    assert host.node_shape(entry).describe() == "1 GPU, 2 CPUs, 20Gi memory"
    assert _node_requests(entry) == {"cpu": "2", "memory": "20Gi"}
    assert host.node_shape(catalog.get("llama3.1-405b")).describe() == (
        "2 nodes of 8 GPUs, 16 CPUs, 782Gi memory"
    )


def test_a_custom_runtime_is_sized_for_the_largest_checkpoint_of_its_tier():
    entry = catalog.CUSTOM["llama-custom"]
    assert host.sized_parameters(entry) == int(catalog.CUSTOM_TIER.up_to_billions * 1e9)
    assert _node_requests(entry) == {"cpu": "2", "memory": "24Gi"}


def test_a_cpu_runtime_keeps_the_catalogs_requests():
    assert _node_requests(catalog.TINY_LLAMA3) == {"cpu": "2", "memory": "4Gi"}
    assert host.node_shape(catalog.TINY_LLAMA3).describe() == "2 CPUs, 4Gi memory"
