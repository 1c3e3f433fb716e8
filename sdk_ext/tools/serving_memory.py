"""How much GPU memory vLLM needs to serve a model, and on how many GPUs (tensor parallelism).

What each part of the plan counts (weights, KV cache, LoRA buffers, vLLM's own): docs/serving.md,
"Serve a result: ``tunepack render serving``"."""

from __future__ import annotations

from dataclasses import dataclass

from tunepack.core.errors import BadInputError, DoesNotFitError, UnsupportedError
from tunepack.runtimes.catalog import ModelEntry, Shape
from tunepack.runtimes.planner import GIB, GPUS, mlp_width

# vLLM's dtype=auto serves a bf16 checkpoint in bf16 and an fp32 or fp16 one in fp16: 2 bytes.
SERVED_BYTES = 2
GPU_MEMORY_UTILIZATION = 0.9  # vLLM's default --gpu-memory-utilization
TENSOR_PARALLEL = (1, 2, 4, 8)  # the layouts tried, smallest first: one pod, one node
# Full-context requests the KV cache must hold at once: a server, not a single request (vLLM
# refuses to start below one). Shorter requests share the same pages, so it batches more of them.
DEFAULT_CONCURRENCY = 8
# Per GPU, outside the weights, the KV cache and the profiled activations: the CUDA context
# (~0.5 GiB), the CUDA graphs vLLM captures for its decode batch sizes (0.5-1 GiB on 8B-70B
# models, as its start-up log reports) and NCCL's buffers with tensor parallelism (~0.5 GiB).
FIXED_OVERHEAD_GIB = 2.0
# vLLM v0.11's OpenAI server defaults (EngineArgs.get_batch_defaults): on a GPU of 70 GiB or more
# other than an A100, 8192 prefill tokens per step and 1024 sequences, else 2048 and 256. The
# profiling pass runs a step of that many tokens and samples that many sequences.
LARGE_GPU_GIB = 70
LARGE_GPU_BATCH = (8192, 1024)
SMALL_GPU_BATCH = (2048, 256)
FP32 = 4


@dataclass(frozen=True)
class ServingPlan:
    """GPU memory per GPU of serving ``model`` on ``gpus`` x ``gpu``, in GiB."""

    model: str
    gpu: str
    gpus: int
    context: int
    concurrency: int
    weights: float
    kv_cache: float
    lora: float
    overhead: float

    @property
    def total(self) -> float:
        return self.weights + self.kv_cache + self.lora + self.overhead

    @property
    def capacity(self) -> float:
        """What vLLM takes of each GPU (``--gpu-memory-utilization``)."""
        return GPUS[self.gpu] * GPU_MEMORY_UTILIZATION

    @property
    def fits(self) -> bool:
        return self.total <= self.capacity

    def breakdown(self) -> str:
        lora = f" + {self.lora:.1f} LoRA" if self.lora else ""
        return (
            f"{self.weights:.1f} weights + {self.kv_cache:.1f} KV cache ({self.concurrency} x "
            f"{self.context} tokens){lora} + {self.overhead:.1f} vLLM"
        )


def tensor_parallel_obstacle(entry: ModelEntry, gpus: int) -> str | None:
    """Why vLLM cannot split ``entry`` over ``gpus`` GPUs, or None: each GPU takes an equal
    share of the attention heads, of the KV heads (or one replicated head where there are fewer
    KV heads than GPUs) and of the MLP's width."""
    shape = entry.shape
    kv = shape.num_kv_heads
    counts = [(shape.num_heads, "attention heads")]
    counts += [(kv, "KV heads")] if kv >= gpus else []
    if shape.sparse_layers < shape.num_layers:
        counts.append((shape.intermediate_dim, "MLP width"))
    if shape.num_experts:
        counts.append((shape.moe_intermediate_dim, "experts' MLP width"))
    for count, what in counts:
        if count % gpus:
            return f"its {count} {what} do not split evenly over {gpus} GPUs"
    if kv < gpus and gpus % kv:
        return f"its {kv} KV heads cannot be replicated evenly over {gpus} GPUs"
    return None


def plan(
    entry: ModelEntry,
    gpu: str,
    gpus: int,
    context: int,
    concurrency: int = DEFAULT_CONCURRENCY,
    lora_rank: int | None = None,
) -> ServingPlan:
    """The memory per GPU of serving ``entry`` on ``gpus`` x ``gpu`` (a name of ``GPUS``) at
    ``context`` tokens for ``concurrency`` sequences, with a LoRA adapter of ``lora_rank``."""
    shape = entry.shape
    kv_heads = max(shape.num_kv_heads // gpus, 1)  # fewer KV heads than GPUs: one, replicated
    kv_weights = shape.num_layers * 2 * shape.num_kv_heads * shape.head_dim * shape.embed_dim
    kv_weights_here = shape.num_layers * 2 * kv_heads * shape.head_dim * shape.embed_dim
    weights = (shape.parameter_count() - kv_weights) / gpus + kv_weights_here
    tokens = context * concurrency
    kv_cache = 2 * shape.num_layers * kv_heads * shape.head_dim * tokens
    lora = _lora_buffers(shape, lora_rank) if lora_rank else 0
    prefill, sequences = _batch_defaults(gpu)
    activations = prefill * (4 * shape.embed_dim + 3 * mlp_width(shape) / gpus) * SERVED_BYTES
    sampler = sequences * shape.vocab_size * 2 * FP32  # the logits and their probabilities
    return ServingPlan(
        model=entry.name,
        gpu=gpu,
        gpus=gpus,
        context=context,
        concurrency=concurrency,
        weights=weights * SERVED_BYTES / GIB,
        kv_cache=kv_cache * SERVED_BYTES / GIB,
        lora=lora * SERVED_BYTES / GIB,
        overhead=FIXED_OVERHEAD_GIB + (activations + sampler) / GIB,
    )


def _batch_defaults(gpu: str) -> tuple[int, int]:
    large = GPUS[gpu] >= LARGE_GPU_GIB and not gpu.startswith("A100")
    return LARGE_GPU_BATCH if large else SMALL_GPU_BATCH


def _lora_buffers(shape: Shape, rank: int) -> int:
    """Values of the LoRA A and B buffers vLLM preallocates for one adapter: the attention's
    fused qkv and output projections in every layer, the MLP's gate/up and down where it is
    dense (vLLM v0.11 puts no LoRA on experts)."""
    q, kv = shape.num_heads * shape.head_dim, shape.num_kv_heads * shape.head_dim
    d, mlp = shape.embed_dim, shape.intermediate_dim
    attention = (d + q + 2 * kv) + (q + d)
    dense = (d + 2 * mlp) + (mlp + d)
    return rank * (shape.num_layers * attention + (shape.num_layers - shape.sparse_layers) * dense)


def choose(
    entry: ModelEntry,
    gpu: str,
    context: int,
    concurrency: int = DEFAULT_CONCURRENCY,
    lora_rank: int | None = None,
    gpus: int | None = None,
) -> ServingPlan:
    """The plan of ``gpus`` GPUs (``--gpus``), or of the fewest of ``TENSOR_PARALLEL`` that hold
    the model; ``BadInputError`` naming the value and what would fit where that cannot serve."""
    if gpus is not None:
        obstacle = tensor_parallel_obstacle(entry, gpus)
        chosen = None if obstacle else plan(entry, gpu, gpus, context, concurrency, lora_rank)
        if chosen is not None and chosen.fits:
            return chosen
        instead = _what_fits(entry, gpu, context, concurrency, lora_rank)
        if chosen is None:
            raise UnsupportedError(
                f"--gpus {gpus}: vLLM cannot split {entry.name} over {gpus} GPUs (tensor "
                f"parallelism): {obstacle}; {instead}"
            )
        raise DoesNotFitError(
            f"--gpus {gpus}: {entry.name} needs {chosen.total:.1f} GiB per GPU on {gpus} x "
            f"{gpu} ({chosen.breakdown()}), more than the {chosen.capacity:.1f} GiB vLLM uses "
            f"of each; {instead}",
            need_gib=chosen.total,
            have_gib=chosen.capacity,
            gpu=gpu,
        )
    tried = None
    for size in TENSOR_PARALLEL:
        if tensor_parallel_obstacle(entry, size) is None:
            tried = plan(entry, gpu, size, context, concurrency, lora_rank)
            if tried.fits:
                return tried
    if tried is None:
        raise UnsupportedError(
            f"{entry.name}: vLLM cannot split it over {', '.join(map(str, TENSOR_PARALLEL))} "
            f"GPUs ({tensor_parallel_obstacle(entry, TENSOR_PARALLEL[1])}); give --gpus"
        )
    raise DoesNotFitError(
        f"{entry.name} does not fit on {tried.gpus} x {gpu} at --max-model-len {context} with "
        f"--concurrency {concurrency}: it needs {tried.total:.1f} GiB per GPU "
        f"({tried.breakdown()}), more than the {tried.capacity:.1f} GiB vLLM uses of each; "
        "serve on a larger --gpu, or with a shorter --max-model-len or a lower --concurrency",
        need_gib=tried.total,
        have_gib=tried.capacity,
        gpu=gpu,
    )


def _what_fits(entry, gpu, context, concurrency, lora_rank) -> str:
    """The end of a refusal of ``--gpus``: the layout that fits, or why none does."""
    try:
        fits = choose(entry, gpu, context, concurrency, lora_rank)
    except BadInputError as err:
        return str(err)
    return f"--gpus {fits.gpus} fits ({fits.total:.1f} GiB of {fits.capacity:.1f} per GPU)"
