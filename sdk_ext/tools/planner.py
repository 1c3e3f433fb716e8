"""Memory planner: will a fine-tune fit on the GPUs, and on how many?

``plan()`` estimates the peak GPU memory one device needs for a catalog model, a method, a sequence
length and a per-device batch size, from the model's shape in the catalog (``Shape``); it then
recommends the smallest nodes x GPUs layout that fits. The formulas are in ``docs/planner.md``;
``benchmarks/planner_accuracy.py`` measures the real peak on a GPU to check them.

    >>> from tunepack.tools.planner import plan
    >>> p = plan("llama3.1-8b", "lora", seq_len=2048, batch_size=2)
    >>> p.fits, round(p.peak_gib, 1)            # one H100-80GB, activation checkpointing
    (True, 19.8)
    >>> print(p.summary())                       # the breakdown, in GiB

Terms (per device, ``N`` = devices the model is sharded over, FSDP when ``N > 1``):

- weights: ``P * bytes(dtype) / N`` (QLoRA: the frozen base in NF4, ``NF4_BYTES`` per parameter);
- gradients: ``T * bytes(dtype) / N`` for the ``T`` trainable parameters;
- optimizer (AdamW, two states in the parameters' dtype): ``2 * T * bytes(dtype) / N``;
- activations: per token per layer ``(6d + 2kv + 4i)`` values saved for backward, or only the
  layer input ``d`` with activation checkpointing (plus one layer's worth while recomputing);
- logits: ``s * b * V`` values in the dtype plus their float32 copy for the loss.

DPO (``dpo``) trains LoRA adapters on two sequences per example (chosen and rejected): its
activations and logits count ``2 * s * b`` tokens. Its reference forward pass (adapters off, no
gradient) keeps no activations and is reduced to one number per sequence before the policy's
pass starts, so it adds compute (about a third more per sequence), not peak memory.

The estimate is what ``torch.cuda.max_memory_allocated`` measures; for "fits" it is compared with
the GPU's memory less ``CUDA_RESERVE_GIB`` (CUDA context, allocator fragmentation).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal, get_args

from tunepack.core.errors import BadInputError
from tunepack.runtimes import catalog, methods
from tunepack.runtimes.catalog import Shape
from tunepack.trainers.args import activation_checkpointing_on

GIB = 1024**3
# GPU name -> memory in GiB (what the device reports). The one list of GPU names: ``gpu_type``
# also accepts each name in any case, without its memory size where that is unambiguous
# (``h100``), and with ``-``, ``_``, spaces or an ``nvidia-`` prefix (``h100_80gb``).
GPUS: dict[str, float] = {
    "H100-80GB": 79.2,
    "H200-141GB": 139.8,
    "A100-80GB": 79.2,
    "A100-40GB": 39.4,
    "L40S-48GB": 44.5,
    "A10G-24GB": 22.0,
    "L4-24GB": 22.0,
}


def _spelling(name: str) -> str:
    key = re.sub(r"[^0-9a-z]", "", name.lower())
    return key.removeprefix("nvidia")


def gpu_type(gpu: object) -> str:
    """The planner's name for a GPU (``"h100"``, ``"H100"``, ``"h100-80gb"`` -> ``"H100-80GB"``),
    or ``BadInputError`` naming the value and the known types."""
    if isinstance(gpu, str):
        key = _spelling(gpu)
        exact = [name for name in GPUS if _spelling(name) == key]
        family = [name for name in GPUS if _spelling(name.split("-")[0]) == key]
        if exact or len(family) == 1:
            return (exact or family)[0]
        if family:
            raise BadInputError(
                f"gpu={gpu!r} is ambiguous: give its memory size, one of {', '.join(family)}"
            )
    raise BadInputError(
        f"gpu={gpu!r} is not known: expected one of {', '.join(GPUS)} (any case; the size may be "
        "left out where only one exists, e.g. h100)"
    )


CUDA_RESERVE_GIB = 2.0  # context + fragmentation, kept free on every device
DTYPE_BYTES = {"bf16": 2, "fp32": 4}
NF4_BYTES = 0.5 + 4 / 64  # 4-bit values plus one fp32 scale per block of 64
# What a job builder does with a plan that does not fit (TrainingClient memory_check=).
MemoryCheck = Literal["refuse", "warn", "off"]
MEMORY_CHECKS: tuple[str, ...] = get_args(MemoryCheck)
DEFAULT_MEMORY_CHECK: MemoryCheck = "refuse"
# The GPU a plan assumes when none is named (the SDK's, the CLI's and the backends' default).
DEFAULT_GPU = "H100-80GB"
LORA_TARGETS_ALL = ("q_proj", "k_proj", "v_proj", "output_proj")
LAYOUTS = tuple((n, g) for n in (1, 2, 4, 8, 16) for g in (1, 2, 4, 8))


@dataclass(frozen=True)
class Plan:
    """The estimate for one layout. Byte counts are per device."""

    model: str
    method: str
    seq_len: int
    batch_size: int
    gpu: str
    nodes: int
    gpus_per_node: int
    activation_checkpointing: bool
    parameters: int
    trainable: int
    weights: float
    gradients: float
    optimizer: float
    activations: float
    logits: float
    recommended: tuple[int, int] | None = None  # (nodes, gpus per node) that fits, if any
    notes: list[str] = field(default_factory=list)

    @property
    def peak_bytes(self) -> float:
        return self.weights + self.gradients + self.optimizer + self.activations + self.logits

    @property
    def peak_gib(self) -> float:
        return self.peak_bytes / GIB

    @property
    def capacity_gib(self) -> float:
        return GPUS[self.gpu] - CUDA_RESERVE_GIB

    @property
    def fits(self) -> bool:
        return self.peak_gib <= self.capacity_gib

    def summary(self) -> str:
        rows = [
            ("weights", self.weights),
            ("gradients", self.gradients),
            ("optimizer", self.optimizer),
            ("activations", self.activations),
            ("logits", self.logits),
            ("peak", self.peak_bytes),
        ]
        head = (
            f"{self.model} {self.method}, seq_len {self.seq_len}, batch {self.batch_size}/device, "
            f"{self.nodes} node(s) x {self.gpus_per_node} {self.gpu}"
            + (", activation checkpointing" if self.activation_checkpointing else "")
        )
        unit, scale = _unit(self.peak_bytes)
        lines = [head] + [f"  {name:<12}{value / scale:8.2f} {unit}" for name, value in rows]
        verdict = "fits" if self.fits else "does NOT fit"
        lines.append(f"  {verdict} in {self.capacity_gib:.1f} GiB usable per device")
        if self.recommended:
            n, g = self.recommended
            lines.append(f"  recommended: {n} node(s) x {g} GPU(s)")
        lines += [f"  note: {note}" for note in self.notes]
        return "\n".join(lines)


def _unit(size: float) -> tuple[str, int]:
    """The unit a plan's rows are shown in: GiB, or MiB/KiB for a tiny model, so that no row
    reads 0.00."""
    for unit, scale in (("GiB", GIB), ("MiB", 1024**2)):
        if size >= scale:
            return unit, scale
    return "KiB", 1024


def lora_parameters(shape: Shape, rank: int, attn_modules=LORA_TARGETS_ALL, mlp=True) -> int:
    """Trainable LoRA parameters: ``rank * (in + out)`` for every adapted projection."""
    d, kv = shape.embed_dim, shape.num_kv_heads * shape.head_dim
    q = shape.num_heads * shape.head_dim
    dims = {"q_proj": (d, q), "k_proj": (d, kv), "v_proj": (d, kv), "output_proj": (q, d)}
    per_layer = sum(rank * (i + o) for name, (i, o) in dims.items() if name in attn_modules)
    if mlp:
        i = shape.intermediate_dim
        per_layer += 3 * rank * (d + i)  # gate (w1), up (w3): d->i; down (w2): i->d
    return shape.num_layers * per_layer


def activation_values_per_token(shape: Shape, checkpointing: bool) -> int:
    """Values kept for the backward pass, per token, over all layers."""
    d, i = shape.embed_dim, shape.intermediate_dim
    kv = shape.num_kv_heads * shape.head_dim
    full_layer = 6 * d + 2 * kv + 4 * i
    if checkpointing:
        return shape.num_layers * d + full_layer  # layer inputs + one layer being recomputed
    return shape.num_layers * full_layer


def estimate(
    model: str | catalog.ModelEntry,
    method: str,
    seq_len: int,
    batch_size: int,
    gpu: str = DEFAULT_GPU,
    *,
    nodes: int = 1,
    gpus_per_node: int = 1,
    activation_checkpointing: str | bool = "auto",
    dtype: str = "bf16",
    lora_rank: int = 16,
    lora_attn_modules: tuple[str, ...] = LORA_TARGETS_ALL,
    lora_mlp: bool = True,
    model_dir: str | Path | None = None,
) -> Plan:
    """The per-device estimate for one layout (no recommendation). A bring-your-own runtime
    (``tunepack-<arch>-custom``) is sized from ``model_dir``'s config.json.
    ``activation_checkpointing`` is the trainer argument's: ``auto`` is what the trainer does on
    a GPU (on)."""
    entry = model_entry(model, model_dir)
    if activation_checkpointing not in ("auto", True, False):
        raise BadInputError(
            f"activation_checkpointing={activation_checkpointing!r} is not valid: expected "
            "'auto', True or False"
        )
    activation_checkpointing = activation_checkpointing_on(activation_checkpointing, "cuda")
    gpu = gpu_type(gpu)
    how = methods.get(method)
    _check(seq_len, batch_size, gpu, nodes, gpus_per_node, dtype, entry)
    if how.adapters and (
        isinstance(lora_rank, bool) or not isinstance(lora_rank, int) or lora_rank < 1
    ):
        raise BadInputError(f"lora_rank={lora_rank!r} is not valid: expected an integer >= 1")
    shape = entry.shape
    devices = nodes * gpus_per_node
    p = shape.parameter_count()
    width = DTYPE_BYTES[dtype]
    if not how.adapters:
        trainable = p
    else:
        trainable = lora_parameters(shape, lora_rank, lora_attn_modules, lora_mlp)
        if how.dora:
            # DoRA adds one magnitude vector per adapted projection (its output size).
            trainable += _dora_magnitudes(shape, lora_attn_modules, lora_mlp)
    base_bytes = NF4_BYTES if how.quantize_base else width
    frozen = p if how.adapters else 0
    weights = (frozen * base_bytes + trainable * width) / devices
    tokens = seq_len * batch_size * how.sequences
    return Plan(
        model=entry.name,
        method=method,
        seq_len=seq_len,
        batch_size=batch_size,
        gpu=gpu,
        nodes=nodes,
        gpus_per_node=gpus_per_node,
        activation_checkpointing=activation_checkpointing,
        parameters=p,
        trainable=trainable,
        weights=weights,
        gradients=trainable * width / devices,
        optimizer=2 * trainable * width / devices,
        activations=tokens * activation_values_per_token(shape, activation_checkpointing) * width,
        logits=tokens * shape.vocab_size * (width + 4),
    )


def plan(
    model: str | catalog.ModelEntry,
    method: str,
    seq_len: int,
    batch_size: int,
    gpu: str = DEFAULT_GPU,
    **kwargs,
) -> Plan:
    """Estimate one device's peak and recommend the smallest nodes x GPUs layout that fits.

    ``kwargs`` are those of ``estimate`` (``nodes``, ``gpus_per_node``,
    ``activation_checkpointing``, ``dtype``, ``lora_rank``...). The returned plan is for the
    given layout (default 1 x 1); ``recommended`` names the smallest layout that fits, trying
    activation checkpointing (the trainer's default on a GPU) before more GPUs.
    """
    model = model_entry(model, kwargs.pop("model_dir", None))  # config.json read once
    gpu = gpu_type(gpu)
    current = estimate(model, method, seq_len, batch_size, gpu, **kwargs)
    search = {k: v for k, v in kwargs.items() if k not in ("nodes", "gpus_per_node")}
    notes = []
    recommended = None
    for nodes, per_node in sorted(LAYOUTS, key=lambda layout: (layout[0] * layout[1], layout[0])):
        for checkpointing in dict.fromkeys((current.activation_checkpointing, True)):
            candidate = estimate(
                model,
                method,
                seq_len,
                batch_size,
                gpu,
                **{**search, "activation_checkpointing": checkpointing},
                nodes=nodes,
                gpus_per_node=per_node,
            )
            if candidate.fits:
                recommended = (nodes, per_node)
                if checkpointing and not current.activation_checkpointing:
                    notes.append("the recommended layout needs activation checkpointing")
                break
        if recommended:
            break
    if recommended is None:
        notes.append(
            f"no layout up to {LAYOUTS[-1][0]} x {LAYOUTS[-1][1]} fits: lower seq_len or "
            "batch_size, or use a larger GPU"
        )
    if recommended and recommended[0] * recommended[1] > 1:
        notes.append("more than one device means FSDP sharding across all of them")
    if note := methods.get(method).plan_note:
        notes.append(note)
    return Plan(**{**current.__dict__, "recommended": recommended, "notes": notes})


def model_entry(model: str | catalog.ModelEntry, model_dir: str | Path | None = None):
    """The catalog entry to size; a bring-your-own runtime's from its checkpoint's config.json
    (``model_dir``), or ``BadInputError`` saying the planner needs it."""
    from tunepack.runtimes import custom

    entry = model if isinstance(model, catalog.ModelEntry) else catalog.get(model)
    if model_dir is not None and entry.custom:
        return custom.resolve(entry, Path(model_dir))
    if custom.is_placeholder(entry):
        raise BadInputError(
            f"{entry.runtime_name} is sized from its checkpoint's config.json: give the "
            "checkpoint's local directory (tunepack plan --model-dir DIR; "
            "plan(..., model_dir=DIR)); without it the trainer checks the shape when it starts"
        )
    return entry


def _dora_magnitudes(shape: Shape, attn_modules, mlp: bool) -> int:
    d, kv = shape.embed_dim, shape.num_kv_heads * shape.head_dim
    q = shape.num_heads * shape.head_dim
    outs = {"q_proj": q, "k_proj": kv, "v_proj": kv, "output_proj": d}
    per_layer = sum(o for name, o in outs.items() if name in attn_modules)
    if mlp:
        per_layer += 2 * shape.intermediate_dim + d
    return shape.num_layers * per_layer


def _check(seq_len, batch_size, gpu, nodes, gpus_per_node, dtype, entry) -> None:
    if dtype not in DTYPE_BYTES:
        raise BadInputError(f"dtype={dtype!r} is not valid: expected one of bf16, fp32")
    for name, value in (
        ("seq_len", seq_len),
        ("batch_size", batch_size),
        ("nodes", nodes),
        ("gpus_per_node", gpus_per_node),
    ):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise BadInputError(f"{name}={value!r} is not valid: expected an integer >= 1")
    if seq_len > entry.shape.max_seq_len:
        raise BadInputError(
            f"seq_len={seq_len} is larger than {entry.name}'s context of "
            f"{entry.shape.max_seq_len} tokens"
        )


def gpus_from_resources(resources: dict | None, default: int) -> int:
    """GPUs per node from an SDK resources dict (``{"gpu": 4}``) or the runtime default."""
    if not resources:
        return default
    for key in ("gpu", "nvidia.com/gpu"):
        if key in resources:
            value = resources[key]
            try:
                return max(int(math.ceil(float(value))), 0)
            except (TypeError, ValueError):
                raise BadInputError(
                    f"resources_per_node[{key!r}]={value!r} is not a number"
                ) from None
    return default
