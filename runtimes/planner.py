"""Memory planner: will a fine-tune fit on the GPUs, and on how many?

``plan()`` estimates one device's peak GPU memory from the catalog's ``Shape`` and recommends the
smallest nodes x GPUs layout that fits; ``choose_step`` is the step the trainer takes for its
device. Each term is derived in docs/planner.md and checked against the H100 measurements in
``benchmarks/results/`` (``tests/unit/test_planner.py``).

    >>> from tunepack.runtimes.planner import plan
    >>> p = plan("llama3.1-8b", "lora", seq_len=2048, batch_size=2)
    >>> p.fits, round(p.peak_gib, 1)            # one H100-80GB, activation checkpointing
    (True, 17.3)
    >>> print(p.summary())                       # the breakdown, in GiB"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal, get_args

from tunepack.core.errors import BadValueError, ConflictError, UnsupportedError
from tunepack.runtimes import catalog, custom, methods
from tunepack.runtimes.shape import Shape

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


@dataclass(frozen=True)
class Step:
    """How the trainer spends memory for speed on a device (``choose_step``): the first
    ``recompute_layers`` of the model's ``layers`` transformer layers recompute their activations
    in the backward (activation checkpointing), and the fused loss computes ``loss_chunk_rows``
    rows of logits at once (None: the method's loss needs the whole logits). Recomputing the
    first layers rather than every k-th holds the least at the recomputation: by the time the
    backward reaches them, every later layer's activations are freed."""

    layers: int
    recompute_layers: int
    loss_chunk_rows: int | None
    # False: both settings were given (how it came about, not what it computes)
    chosen: bool = field(default=True, compare=False)

    @property
    def activation_checkpointing(self) -> bool:
        return self.recompute_layers > 0

    def describe(self, rows: int | None = None) -> str:
        """One line, e.g. ``recompute 0 of 16 layers; loss: the whole logits (8192 rows)``;
        ``rows``: the rows a micro-batch counts, where known."""
        recompute = f"recompute {self.recompute_layers} of {self.layers} layers"
        if self.loss_chunk_rows is None:
            loss = "loss: the whole logits (the method's own loss)"
        elif rows is not None and self.loss_chunk_rows >= rows:
            loss = f"loss: the whole logits at once ({rows} rows)"
        else:
            loss = f"loss: {self.loss_chunk_rows} rows of logits at a time"
        return f"{recompute}; {loss}"

    def record(self) -> dict:
        """What result.json and each checkpoint keep as ``step_plan`` (``from_record`` reads it
        back)."""
        return {
            "layers": self.layers,
            "recompute_layers": self.recompute_layers,
            "loss_chunk_rows": self.loss_chunk_rows,
        }

    @classmethod
    def from_record(cls, record: dict) -> Step:
        return cls(
            layers=int(record["layers"]),
            recompute_layers=int(record["recompute_layers"]),
            loss_chunk_rows=record["loss_chunk_rows"],
        )


def parse_activation_checkpointing(value: object) -> str | bool:
    """``auto``, True or False (the trainer argument's parsed forms), or BadInputError."""
    if value in ("auto", True, False):
        return value
    raise BadValueError(
        f"activation_checkpointing={value!r} is not valid: expected 'auto', True or False"
    )


def parse_loss_chunk(value: object) -> str | int:
    """``auto`` or a number of rows >= 1 (the trainer argument's parsed forms), or BadInputError."""
    if value == "auto" or (isinstance(value, int) and not isinstance(value, bool) and value >= 1):
        return value
    raise BadValueError(f"loss_chunk={value!r} is not valid: expected 'auto' or an integer >= 1")


def cpu_step(layers: int, vocab: int, fused_loss: bool, activation_checkpointing, loss_chunk):
    """The step on a CPU, whose runs here are small and whose memory is the host's: no
    recomputation and cache-sized chunks of logits unless told otherwise."""
    recompute = layers if activation_checkpointing is True else 0
    rows = loss_chunk if loss_chunk != "auto" else max(1, LOSS_CHUNK_ELEMENTS // vocab)
    return Step(layers, recompute, rows if fused_loss else None, chosen=False)


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
            raise BadValueError(
                f"gpu={gpu!r} is ambiguous: give its memory size, one of {', '.join(family)}",
                name="gpu",
                value=gpu,
                expected=f"one of {', '.join(family)}",
            )
    raise BadValueError(
        f"gpu={gpu!r} is not known: expected one of {', '.join(GPUS)} (any case; the size may be "
        "left out where only one exists, e.g. h100)",
        name="gpu",
        value=gpu,
        expected=f"one of {', '.join(GPUS)}",
    )


CUDA_RESERVE_GIB = 2.0  # context + fragmentation, kept free on every device
DTYPE_BYTES = {"bf16": 2, "fp32": 4}
FP32 = 4
# torchao's NF4 (torchtune's to_nf4 defaults): 4 bits a value, an int8 scale per block of 64
# values, and an fp32 factor per 256 of those scales (double quantization).
NF4_BYTES = 0.5 + 1 / 64 + FP32 / (64 * 256)
# Dequantizing an NF4 weight (torchao's get_original_weight, pure PyTorch) holds, per value, its
# two 4-bit halves as int64 indices (8 bytes), their looked-up values and their scaled values (one
# value each in the dtype) and the two stacked together (one more): 8 + 3w bytes.
NF4_DEQUANT_INDEX_BYTES = 8
# The whole logits in the backward of log_softmax(logits.float()) (DPO): the fp32 log-probabilities
# it saved, the fp32 gradient of the loss w.r.t. them and the fp32 gradient it returns.
WHOLE_LOGIT_BYTES = 3 * FP32
# tunepack.trainers.objectives.vocab_loss.CHUNK_ELEMENTS: the logits the fused loss computes at once
# on a CPU (a test checks the two agree; the planner does not import the trainer, which needs
# torch).
LOSS_CHUNK_ELEMENTS = 8 * 2**20
# On a GPU the fused loss takes as many rows at once as memory allows, but no fewer than this
# where it must chunk: a (rows x width) @ (width x vocabulary) matmul of 4096 rows keeps a GPU's
# tensor cores busy, where the CPU chunk (65 rows at a 128k vocabulary) left them idle.
LOSS_EFFICIENT_ROWS = 4096
# The share of the device's usable memory the chosen step leaves free for the estimate's error
# (the planner is within 1-5% of measured peaks on an H100: docs/planner.md).
STEP_MARGIN = 0.05
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
    """The estimate for one layout. Byte counts are per device.

    ``weights`` and ``optimizer`` are held all along, ``gradients`` from the backward to the
    update; ``activations`` (the backward), ``logits`` (the loss) and ``update`` (the optimizer
    step) are what three moments of a step add, and the peak is the largest moment
    (``peak_moment``). At the loss the forward's ``kept`` activations are held too, and the
    gradients only where gradient accumulation keeps them from the micro-batch before
    (``gradients_at_loss``).
    """

    model: str
    method: str
    seq_len: int
    batch_size: int
    gpu: str
    nodes: int
    gpus_per_node: int
    step: Step  # the trainer's step on this device (choose_step)
    tokens: int  # positions of one micro-batch (every sequence of it)
    parameters: int
    trainable: int
    weights: float
    gradients: float
    optimizer: float
    activations: float
    logits: float
    update: float
    kept: float  # the part of ``activations`` the forward keeps, also held at the loss
    gradients_at_loss: bool
    recommended: tuple[int, int] | None = None  # (nodes, gpus per node) that fits, if any
    notes: list[str] = field(default_factory=list)
    # A mixture of experts: the parameters one token uses, and every expert's weights (part of
    # ``weights``: all are held, whichever tokens use them), per device. None/0 for dense ones.
    active_parameters: int | None = None
    expert_weights: float = 0.0
    # A generating method (GRPO): its KV cache and sampling buffers, while answers are sampled.
    generation: float = 0.0

    @property
    def activation_checkpointing(self) -> bool:
        return self.step.activation_checkpointing

    def moments(self) -> dict[str, float]:
        """What each moment of a step holds on top of the weights and the optimizer's states."""
        at_loss = self.gradients if self.gradients_at_loss else 0.0
        moments = {
            "backward": self.gradients + self.activations,
            "loss": at_loss + self.kept + self.logits,
            "update": self.gradients + self.update,
        }
        if self.generation:  # between micro-batches: gradients only with gradient accumulation
            moments["generation"] = at_loss + self.generation
        return moments

    @property
    def peak_moment(self) -> str:
        moments = self.moments()
        return max(moments, key=moments.__getitem__)

    @property
    def peak_bytes(self) -> float:
        return self.weights + self.optimizer + max(self.moments().values())

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
        parts = self._parts()
        lines = [parts["head"], f"  step ({parts['how']}): {parts['step']}"]
        lines += [f"  {name:<12}{value:8.2f} {parts['unit']}" for name, value in parts["rows"]]
        peak = f"{parts['peak']:8.2f} {parts['unit']}"
        lines.append(f"  {'peak':<12}{peak} {parts['where']}: {parts['sum']}")
        lines.append(f"  {parts['verdict']}")
        lines += [f"  {line}" for line in parts["after"]]
        return "\n".join(lines)

    def _repr_html_(self) -> str:
        """The plan as a table in a notebook: the memory per device, term by term, the peak and
        the verdict (what ``summary()`` says, in the same words)."""
        import html

        parts = self._parts()
        esc = html.escape
        rows = "".join(
            f"<tr><td>{esc(name)}</td><td>{value:.2f}</td></tr>" for name, value in parts["rows"]
        )
        peak = (
            f"<tr><th>peak</th><td><b>{parts['peak']:.2f}</b></td></tr>"
            f'<tr><td colspan="2">{esc(parts["where"])}: {esc(parts["sum"])}</td></tr>'
        )
        after = "".join(f"<li>{esc(line)}</li>" for line in parts["after"])
        return (
            f"<div><table><caption>{esc(parts['head'])}</caption>"
            f"<thead><tr><th>memory per device</th><th>{parts['unit']}</th></tr></thead>"
            f"<tbody>{rows}{peak}</tbody></table>"
            f"<p>step ({esc(parts['how'])}): {esc(parts['step'])}</p>"
            f"<p><b>{esc(parts['verdict'])}</b></p>"
            + (f"<ul>{after}</ul>" if after else "")
            + "</div>"
        )

    def _parts(self) -> dict:
        """What ``summary`` and ``_repr_html_`` show, each part once: the sizes in ``unit``."""
        rows = [
            ("weights", self.weights),
            ("gradients", self.gradients),
            ("optimizer", self.optimizer),
            ("activations", self.activations),
            ("logits", self.logits),
            ("update", self.update),
            *([("generation", self.generation)] if self.generation else []),
        ]
        head = (
            f"{self.model} {self.method}, seq_len {self.seq_len}, batch {self.batch_size}/device, "
            f"{self.nodes} node(s) x {self.gpus_per_node} {self.gpu}"
        )
        unit, scale = _unit(self.peak_bytes)
        moment = self.peak_moment
        if moment == "loss":
            parts = "weights + optimizer + " + ("gradients + " if self.gradients_at_loss else "")
            parts += f"the kept activations ({self.kept / scale:.2f} {unit}) + logits"
        elif moment == "generation":
            parts = "weights + optimizer + " + ("gradients + " if self.gradients_at_loss else "")
            parts += "the KV cache and sampling of the answers"
        else:
            parts = "weights + gradients + optimizer + "
            parts += "activations" if moment == "backward" else "update"
        where = {
            "backward": "in the backward",
            "loss": "at the loss",
            "update": "at the update",
            "generation": "while sampling answers",
        }
        verdict = "fits" if self.fits else "does NOT fit"
        after = []
        if self.recommended:
            n, g = self.recommended
            after.append(f"recommended: {n} node(s) x {g} GPU(s)")
        if self.active_parameters is not None:
            after.append(
                f"note: mixture of experts: {self.parameters / 1e9:.2f}B parameters, "
                f"{self.active_parameters / 1e9:.2f}B active per token; every expert's weights "
                f"are held ({self.expert_weights / scale:.2f} {unit} of the weights per device), "
                "activations follow the active ones"
            )
        after += [f"note: {note}" for note in self.notes]
        return {
            "head": head,
            "how": "chosen for the device" if self.step.chosen else "as given",
            "step": self.step.describe(self.tokens),
            "unit": unit,
            "rows": [(name, value / scale) for name, value in rows],
            "peak": self.peak_bytes / scale,
            "where": where[moment],
            "sum": parts,
            "verdict": f"{verdict} in {self.capacity_gib:.1f} GiB usable per device",
            "after": after,
        }


def _unit(size: float) -> tuple[str, int]:
    """The unit a plan's rows are shown in: GiB, or MiB/KiB for a tiny model, so that no row
    reads 0.00."""
    for unit, scale in (("GiB", GIB), ("MiB", 1024**2)):
        if size >= scale:
            return unit, scale
    return "KiB", 1024


def _projections(shape: Shape) -> dict[str, tuple[int, int]]:
    """(in, out) of each projection of a layer, by torchtune's LoRA target name."""
    d, kv = shape.embed_dim, shape.num_kv_heads * shape.head_dim
    q, i = shape.num_heads * shape.head_dim, shape.intermediate_dim
    return {
        "q_proj": (d, q),
        "k_proj": (d, kv),
        "v_proj": (d, kv),
        "output_proj": (q, d),
        "w1": (d, i),  # gate
        "w3": (d, i),  # up
        "w2": (i, d),  # down
    }


def _adapted(shape: Shape, attn_modules, mlp: bool) -> list[tuple[int, int]]:
    """(in, out) of the projections of a layer that carry adapters."""
    chosen = [*attn_modules, *(("w1", "w3", "w2") if mlp else ())]
    return [dims for name, dims in _projections(shape).items() if name in chosen]


def _adapted_count(shape: Shape, attn_modules, mlp: bool, size) -> int:
    """``size(in, out)`` summed over the adapted projections of every layer: in a mixture of
    experts, attention's and the dense layers' MLPs (the experts' adapters: lora_parameters)."""
    attention = sum(size(i, o) for i, o in _adapted(shape, attn_modules, False))
    mlps = sum(size(i, o) for i, o in _adapted(shape, (), mlp))
    return shape.num_layers * attention + (shape.num_layers - shape.sparse_layers) * mlps


def lora_parameters(shape: Shape, rank: int, attn_modules=LORA_TARGETS_ALL, mlp=True) -> int:
    """Trainable LoRA parameters: ``rank * (in + out)`` for every adapted projection, and with
    ``mlp`` in a mixture of experts a pair per expert on its fused gate/up (hidden -> 2 x width)
    and its down projection (trainers/models/moe.py's LoRAExperts)."""
    count = _adapted_count(shape, attn_modules, mlp, lambda i, o: rank * (i + o))
    if mlp and shape.sparse_layers:
        d, width = shape.embed_dim, shape.moe_intermediate_dim
        count += shape.sparse_layers * shape.num_experts * rank * ((d + 2 * width) + (width + d))
    return count


def layer_saved_bytes(shape: Shape, width: int, *, dora: bool = False, adapted=()) -> int:
    """Bytes per token one layer keeps for its backward (torchtune 0.6.1's layer, flash attention).

    Norms, attention, MLP and DoRA's parts, each derived in docs/planner.md, "Formulas (per device)"
    (``S``); ``adapted``: the (in, out) of DoRA's adapted projections."""
    d, kv = shape.embed_dim, shape.num_kv_heads * shape.head_dim
    q, i = shape.num_heads * shape.head_dim, mlp_width(shape)
    saved = shape.norms_per_layer * FP32 * d + 2 * width * d
    saved += 4 * width * q + (FP32 * (q + kv) if shape.qk_norm else 0)
    saved += 4 * width * i
    if shape.sparse_layers:
        # A mixture of experts: the router's logits and fp32 probabilities, and for each of the
        # token's experts the gathered input and the output it weights.
        saved += (width + FP32) * shape.num_experts + 2 * width * shape.experts_per_token * d
    if dora:
        saved += 2 * width * sum(out for _, out in adapted)
    return saved


def mlp_width(shape: Shape) -> int:
    """The MLP width one token's activations follow: the dense MLP's, or in a mixture of experts
    the widths of the experts it is sent to (whichever is larger where a model has both)."""
    sparse = shape.experts_per_token * shape.moe_intermediate_dim if shape.sparse_layers else 0
    dense = shape.intermediate_dim if shape.sparse_layers < shape.num_layers else 0
    return max(sparse, dense)


def _weight_transient(how: methods.Method, width: int, adapted) -> float:
    """The largest weight-sized temporary of a layer's forward or backward: a QLoRA projection's
    weight dequantized from NF4, DoRA's weight norm (an identity of the input size pushed through
    the adapter, the adapter's weight, and the base weight plus it scaled)."""
    largest = 0.0
    if how.quantize_base:
        largest += max((i * o for i, o in adapted), default=0) * (
            NF4_DEQUANT_INDEX_BYTES + 3 * width
        )
    if how.dora:
        largest += max(((i * i + 3 * i * o) * width for i, o in adapted), default=0)
    return largest


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
    loss_chunk: str | int = "auto",
    dtype: str = "bf16",
    lora_rank: int = 16,
    lora_attn_modules: tuple[str, ...] = LORA_TARGETS_ALL,
    lora_mlp: bool | None = None,
    grad_accum: int = 1,
    fused_loss: bool | None = None,
    model_dir: str | Path | None = None,
    num_generations: int = 4,
    capacity_gib: float | None = None,
    step: Step | None = None,
) -> Plan:
    """The per-device estimate for one layout (no recommendation), with the step the trainer
    would choose there (``choose_step``). A bring-your-own runtime (``tunepack-<arch>-custom``)
    is sized from ``model_dir``'s config.json.
    ``activation_checkpointing`` and ``loss_chunk`` are the trainer arguments: ``auto`` is what
    the trainer chooses for the device's memory (``capacity_gib``, by default the GPU's usable
    memory in the table); an explicit value is kept. ``grad_accum`` is the trainer's: more than
    one micro-batch a step keeps the gradients through the next loss. ``fused_loss`` is None for
    what the trainer does (the fused loss for a cross-entropy method, the whole logits for DPO);
    False plans the whole logits for a cross-entropy method too (the trainer's plain loss,
    torchtune's recipes). ``num_generations`` is GRPO's: the answers sampled per prompt.
    ``lora_mlp`` None is the runtime's default (off for a model whose every MLP is a mixture of
    experts). ``step`` plans exactly that step (a run's record: result.json's ``step_plan``)
    instead of choosing one."""
    job = _job(
        model_entry(model, model_dir),
        method,
        seq_len,
        batch_size,
        gpu_type(gpu),
        nodes=nodes,
        gpus_per_node=gpus_per_node,
        dtype=dtype,
        lora_rank=lora_rank,
        lora_attn_modules=lora_attn_modules,
        lora_mlp=lora_mlp,
        grad_accum=grad_accum,
        fused_loss=fused_loss,
        num_generations=num_generations,
    )
    if step is not None:
        return _plan(job, step)
    capacity = (GPUS[job.gpu] - CUDA_RESERVE_GIB) if capacity_gib is None else capacity_gib
    step = choose_step(
        job,
        capacity * GIB,
        parse_activation_checkpointing(activation_checkpointing),
        parse_loss_chunk(loss_chunk),
    )
    return _plan(job, step)


@dataclass(frozen=True)
class _Job:
    """What one device's estimate depends on besides the step: the checked inputs and what
    follows from them."""

    entry: catalog.ModelEntry
    method: str
    how: methods.Method
    seq_len: int
    batch_size: int
    gpu: str
    nodes: int
    gpus_per_node: int
    width: int
    adapted: list
    trainable: int
    weights: float
    tokens: int
    fused_loss: bool
    grad_accum: int
    sequences: int  # per example: DPO's pair, GRPO's answers

    @property
    def devices(self) -> int:
        return self.nodes * self.gpus_per_node


def _job(entry, method, seq_len, batch_size, gpu, *, nodes, gpus_per_node, dtype, lora_rank,
         lora_attn_modules, lora_mlp, grad_accum, fused_loss, num_generations) -> _Job:  # fmt: skip
    if lora_mlp is None:
        lora_mlp = bool(entry.defaults.get("lora_mlp", True))
    how = methods.get(method)
    _check(seq_len, batch_size, gpu, nodes, gpus_per_node, dtype, entry)
    if how.adapters and (
        isinstance(lora_rank, bool) or not isinstance(lora_rank, int) or lora_rank < 1
    ):
        raise BadValueError(f"lora_rank={lora_rank!r} is not valid: expected an integer >= 1")
    if isinstance(grad_accum, bool) or not isinstance(grad_accum, int) or grad_accum < 1:
        raise BadValueError(f"grad_accum={grad_accum!r} is not valid: expected an integer >= 1")
    # The trainer fuses the loss into a decoder's output projection; a model that takes images
    # (torchtune's DeepFusionModel) hands it whole logits.
    fusable = how.loss is methods.Loss.CROSS_ENTROPY and not entry.family.reads_images
    if fused_loss is None:
        fused_loss = fusable
    elif fused_loss and how.loss is not methods.Loss.CROSS_ENTROPY:
        raise ConflictError(f"method={method} needs the whole logits: its loss cannot be fused")
    elif fused_loss and not fusable:
        raise UnsupportedError(f"{entry.name} takes images: its loss cannot be fused")
    width = DTYPE_BYTES[dtype]
    adapted = _adapted(entry.shape, lora_attn_modules, lora_mlp) if how.adapters else []
    trainable, weights = _weights(
        entry.shape, how, width, lora_rank, adapted, lora_attn_modules, lora_mlp
    )
    sequences = how.sequences
    if how.sequences_key:
        if (
            isinstance(num_generations, bool)
            or not isinstance(num_generations, int)
            or (num_generations < 2)
        ):
            raise BadValueError(
                f"num_generations={num_generations!r} is not valid: expected an integer >= 2"
            )
        sequences = num_generations
    return _Job(
        entry=entry,
        method=method,
        how=how,
        seq_len=seq_len,
        batch_size=batch_size,
        gpu=gpu,
        nodes=nodes,
        gpus_per_node=gpus_per_node,
        width=width,
        adapted=adapted,
        trainable=trainable,
        weights=weights,
        tokens=seq_len * batch_size * sequences,
        fused_loss=fused_loss,
        grad_accum=grad_accum,
        sequences=sequences,
    )


def _plan(job: _Job, step: Step) -> Plan:
    """One device's estimate of ``job`` computed with ``step``."""
    shape, how, width, devices = job.entry.shape, job.how, job.width, job.devices
    kept, activations = _activations(
        shape, how, width, job.adapted, job.tokens, step.recompute_layers
    )
    return Plan(
        model=job.entry.name,
        method=job.method,
        seq_len=job.seq_len,
        batch_size=job.batch_size,
        gpu=job.gpu,
        nodes=job.nodes,
        gpus_per_node=job.gpus_per_node,
        step=step,
        tokens=job.tokens,
        parameters=shape.parameter_count(),
        trainable=job.trainable,
        # + the RoPE table on every device: cos and sin of head_dim / 2 frequencies
        weights=job.weights / devices + shape.max_seq_len * shape.head_dim * FP32,
        gradients=job.trainable * width / devices,
        optimizer=2 * job.trainable * width / devices,
        activations=activations,
        logits=_logits(shape, how, width, job.tokens, step.loss_chunk_rows),
        # AdamW (foreach, the default on a GPU) takes the square root of every second moment
        # into a new tensor before dividing by it.
        update=job.trainable * width / devices,
        kept=kept,
        gradients_at_loss=job.grad_accum > 1,
        **_experts(shape, how, width, devices),
        generation=_generation(shape, width, job.batch_size * job.sequences, job.seq_len)
        if how.sequences_key
        else 0.0,
    )


def choose_step(
    job: _Job, capacity_bytes: float, activation_checkpointing="auto", loss_chunk="auto"
) -> Step:
    """The fastest step that fits in ``capacity_bytes`` less ``STEP_MARGIN``: what a setting of
    ``auto`` becomes on a GPU, the explicit ones kept. When nothing fits, the most frugal step (the
    plan then says it does not fit). The order of the candidates and why: docs/planner.md, "The
    step chosen for the device"."""
    layers = job.entry.shape.num_layers
    whole = job.tokens if job.fused_loss else None
    if not job.fused_loss:
        chunks = [None]
    elif loss_chunk != "auto":
        chunks = [loss_chunk]
    else:
        smallest = max(1, LOSS_CHUNK_ELEMENTS // job.entry.shape.vocab_size)
        chunks = list(dict.fromkeys([whole, min(whole, LOSS_EFFICIENT_ROWS), smallest]))
    if activation_checkpointing != "auto":
        recomputed = [layers if activation_checkpointing else 0]
    elif job.entry.family.reads_images:
        recomputed = [layers]
    else:
        recomputed = list(range(layers + 1))
    chosen = activation_checkpointing == "auto" or loss_chunk == "auto"
    budget = capacity_bytes * (1 - STEP_MARGIN)
    # The CPU-sized chunks only once every layer is recomputed: (layers, rows) in order.
    order = [(n, rows) for n in recomputed for rows in chunks[:2]]
    order += [(recomputed[-1], rows) for rows in chunks[2:]]
    for n, rows in order:
        step = Step(layers, n, rows, chosen=chosen)
        if _plan(job, step).peak_bytes <= budget:
            return step
    return Step(layers, recomputed[-1], chunks[-1], chosen=chosen)


# What sampling holds per answer and vocabulary entry besides the cache: the fp32 logits, their
# probabilities, the sorted probabilities and their cumulative sum (fp32), the order (int64).
SAMPLING_BYTES_PER_LOGIT = 4 * FP32 + 8


def _generation(shape: Shape, width: int, answers: int, seq_len: int) -> float:
    """The KV cache of ``answers`` sequences of ``seq_len`` tokens and one position's sampling
    buffers per answer, in bytes (trainers/objectives/grpo.py: ``generate``)."""
    cache = 2 * shape.num_layers * shape.num_kv_heads * shape.head_dim * seq_len * width
    return answers * (cache + shape.vocab_size * SAMPLING_BYTES_PER_LOGIT)


def _experts(shape: Shape, how: methods.Method, width: int, devices: int) -> dict:
    """A mixture of experts' active parameters and its experts' weights per device (FSDP shards
    the stacked expert weights along the experts, so each device holds 1/N of them)."""
    if not shape.num_experts:
        return {}
    return {
        "active_parameters": shape.active_parameter_count(),
        "expert_weights": shape.expert_parameter_count() * width / devices,
    }


def _weights(shape, how, width, lora_rank, adapted, lora_attn_modules, lora_mlp):
    """(trainable parameters, the weights' bytes on one device before sharding)."""
    p = shape.parameter_count()
    if not how.adapters:
        trainable = p
    else:
        trainable = lora_parameters(shape, lora_rank, lora_attn_modules, lora_mlp)
        if how.dora:
            # DoRA adds one magnitude vector per adapted projection (its output size).
            trainable += _adapted_count(shape, lora_attn_modules, lora_mlp, lambda i, o: o)
    # The frozen base: QLoRA stores its adapted projections in NF4 (torchtune's LoRALinear with
    # quantize_base); embeddings, output and norms stay in the dtype. Projections without
    # adapters are counted in the dtype: torchtune's Llama, Mistral, Gemma and Phi-3 builders
    # store them in NF4 too (FrozenNF4Linear), its Qwen 2 builders do not.
    nf4 = shape.num_layers * sum(i * o for i, o in adapted) if how.quantize_base else 0
    frozen = (nf4 * NF4_BYTES + (p - nf4) * width) if how.adapters else 0
    if not how.adapters and how.loss is methods.Loss.GRPO:
        frozen = p * width  # grpo_full's KL reference: a frozen copy of the weights
    return trainable, frozen + trainable * width


def _activations(shape, how, width, adapted, tokens, recomputed: int) -> tuple[float, float]:
    """(what the forward keeps, what the backward holds at its peak), in bytes, with the first
    ``recomputed`` layers keeping only their input."""
    layer = layer_saved_bytes(shape, width, dora=how.dora, adapted=adapted)
    kept = (shape.num_layers - recomputed) * layer + recomputed * width * shape.embed_dim
    # + one recomputed layer where any is, and the incoming gradient
    in_backward = kept + (layer if recomputed else 0) + width * shape.embed_dim
    # In the MLP's backward: three intermediate-size gradients while its product is freed, or a
    # weight-sized temporary of the layer (QLoRA, DoRA) with everything it saved.
    mlp_gradients = 2 * width * mlp_width(shape)
    held = tokens * in_backward + max(
        tokens * mlp_gradients, _weight_transient(how, width, adapted)
    )
    return tokens * kept, held


def _logits(shape, how, width, tokens, chunk_rows: int | None) -> float:
    """What the loss holds, in bytes: the fused loss's chunk of ``chunk_rows`` rows, or (None)
    the whole logits."""
    d, vocab = shape.embed_dim, shape.vocab_size
    if chunk_rows is None:
        return tokens * ((FP32 + width) * d + vocab * WHOLE_LOGIT_BYTES)
    # The last hidden states, the final norm's fp32 input and output, the counted rows' copy
    # and the gradient w.r.t. them; one chunk of logits in fp32 while its copy in the dtype is
    # made or read (trainers/objectives/vocab_loss.py: the softmax is computed in place).
    chunks = math.ceil(tokens / chunk_rows)
    logits = tokens * (FP32 + 4 * width) * d + min(chunk_rows, tokens) * vocab * (FP32 + width)
    if not how.adapters:
        # The output weight's gradient: in the dtype from one chunk; accumulated in fp32 over
        # several, then handed back in the dtype.
        logits += vocab * d * (width if chunks == 1 else FP32 + width)
    return logits


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
    given layout (default 1 x 1); ``recommended`` names the smallest layout that fits with the
    step the trainer would choose there (recomputing activations before taking more GPUs).
    """
    model = model_entry(model, kwargs.pop("model_dir", None))  # config.json read once
    gpu = gpu_type(gpu)
    current = estimate(model, method, seq_len, batch_size, gpu, **kwargs)
    search = {k: v for k, v in kwargs.items() if k not in ("nodes", "gpus_per_node")}
    notes = []
    recommended = None
    given = kwargs.get("activation_checkpointing", "auto")
    for nodes, per_node in sorted(LAYOUTS, key=lambda layout: (layout[0] * layout[1], layout[0])):
        for setting in dict.fromkeys((given, "auto")):
            candidate = estimate(
                model,
                method,
                seq_len,
                batch_size,
                gpu,
                **{**search, "activation_checkpointing": setting},
                nodes=nodes,
                gpus_per_node=per_node,
            )
            if candidate.fits:
                recommended = (nodes, per_node)
                if setting != given and candidate.activation_checkpointing:
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
    if model.family.reads_images:
        notes.append(
            "the vision tower's weights are counted, not its activations nor the images' "
            "cross-attention keys and values: leave room for them (more with method=full)"
        )
    return Plan(**{**current.__dict__, "recommended": recommended, "notes": notes})


def model_entry(model: str | catalog.ModelEntry, model_dir: str | Path | None = None):
    """The catalog entry to size; a bring-your-own runtime's from its checkpoint's config.json
    (``model_dir``), or ``BadInputError`` saying the planner needs it."""
    entry = model if isinstance(model, catalog.ModelEntry) else catalog.get(model)
    if model_dir is not None and entry.custom:
        return custom.resolve(entry, Path(model_dir))
    if catalog.is_placeholder(entry):
        raise BadValueError(
            f"{entry.runtime_name} is sized from its checkpoint's config.json: give the "
            "checkpoint's local directory (tunepack plan --model-dir DIR; "
            "plan(..., model_dir=DIR)); without it the trainer checks the shape when it starts"
        )
    return entry


def _check(seq_len, batch_size, gpu, nodes, gpus_per_node, dtype, entry) -> None:
    if dtype not in DTYPE_BYTES:
        raise BadValueError(f"dtype={dtype!r} is not valid: expected one of bf16, fp32")
    for name, value in (
        ("seq_len", seq_len),
        ("batch_size", batch_size),
        ("nodes", nodes),
        ("gpus_per_node", gpus_per_node),
    ):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise BadValueError(f"{name}={value!r} is not valid: expected an integer >= 1")
    if seq_len > entry.shape.max_seq_len:
        raise BadValueError(
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
                raise BadValueError(
                    f"resources_per_node[{key!r}]={value!r} is not a number"
                ) from None
    return default
