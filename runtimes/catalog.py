"""The model catalog: the one place where tunepack's knowledge of each model is written.

A ``Family`` per torchtune model package holds what every size shares (format, tokenizer,
checkpoint conversion, shape-taking builders: ``runtimes/families.py``, re-exported here); a
``ModelEntry`` per published size its hub id,
shape, builders and resources. ``TINY`` holds a tiny random variant per family for tests; only
``tiny-llama3`` is published as a runtime. Component paths are chosen here, never by a user.
What is derived from it: docs/architecture.md, "Runtimes"."""

from __future__ import annotations

import json
from dataclasses import dataclass, field, replace
from pathlib import Path

from tunepack.runtimes import custom
from tunepack.runtimes import methods as registry  # the name `methods` is ModelEntry's property
from tunepack.runtimes.families import FAMILIES, TIKTOKEN_FILES, Family, Tokenizer
from tunepack.runtimes.shape import Shape

RUNTIME_PREFIX = "tunepack-"
# A sharded Hugging Face checkpoint names its shards in this file's ``weight_map``.
SAFETENSORS_INDEX = "model.safetensors.index.json"


def expert_dropout_message(given: str) -> str:
    """``given``: the ``lora_dropout=...`` pair as written."""
    return f"{given}: {_EXPERTS_WHY}, and takes no dropout; set lora_dropout=0 or lora_mlp=false"


# PEFT's adapters on expert weights (and so tunepack's, to load there: trainers/models/moe.py) add
# their update to the weights: no dropout on the input, no DoRA form.
_EXPERTS_WHY = (
    "LoRA on the experts (lora_mlp=true) adds its update to the expert weights, as PEFT's"
)
EXPERT_DORA_MESSAGE = (
    f"method=dora: {_EXPERTS_WHY}, and has no DoRA form; use method=lora or lora_mlp=false"
)


def expert_lora_obstacle(lora_dropout: float, dora: bool, given: str | None = None) -> str | None:
    """Why LoRA on a mixture of experts' MLPs (``lora_mlp=true``: every expert) cannot run with
    these settings, or None. ``given``: the ``lora_dropout=...`` pair as the user wrote it."""
    if lora_dropout:
        return expert_dropout_message(given or f"lora_dropout={lora_dropout}")
    return EXPERT_DORA_MESSAGE if dora else None


@dataclass(frozen=True)
class Resources:
    """Default per-node resources of the runtime's trainer Pods, and how many nodes.

    A GPU runtime's CPU and memory requests are not written here: ``runtimes/host.py`` sizes
    them from the model (the host-side loading peak and the processes). A CPU runtime (the
    tiny models, one process per CPU) names its own.
    """

    gpus: int
    workspace_storage: str
    nodes: int = 1
    cpu: str | None = None
    memory: str | None = None


@dataclass(frozen=True)
class ModelEntry:
    name: str
    family: Family
    hub_id: str
    description: str
    shape: Shape
    # torchtune builders by method. A builder taking the shape as keywords sets ``shape_kwargs``.
    builders: dict[str, str]
    # Weight files: listed, or (for sharded checkpoints) read from SAFETENSORS_INDEX.
    checkpoint_files: tuple[str, ...]
    resources: Resources
    shape_kwargs: bool = False
    # Whether the LoRA builder takes apply_lora_to_output. Builders of models whose output
    # projection is tied to the embeddings (Gemma, Qwen 2 0.5B/1.5B) do not: LoRA cannot reach it.
    lora_output: bool = True
    # Where a repository keeps its tokenizer somewhere else than the family's usual place.
    tokenizer_files: dict[str, str] | None = None
    # The catalog's default trainer arguments for this model (users override per job).
    defaults: dict[str, object] = field(default_factory=dict)
    # A bring-your-own runtime: the runtimes/custom.py architecture whose checkpoint's
    # config.json gives the shape (``shape`` is only a placeholder until custom.resolve).
    custom: str | None = None

    @property
    def runtime_name(self) -> str:
        return RUNTIME_PREFIX + self.name

    @property
    def methods(self) -> tuple[str, ...]:
        """The fine-tuning methods this model supports: those built by one of its builders (the
        LoRA variants share the LoRA builder), less those it cannot run (``why_not``)."""
        return tuple(
            m.name
            for builder in self.builders
            for m in registry.METHODS.values()
            if m.builder == builder and self.why_not(m.name) is None
        )

    def why_not(self, method: str) -> str | None:
        """Why a LoRA variant cannot run on this model (None: nothing known against it)."""
        only = self.family.only_methods
        if only is not None and method not in only:
            return (
                f"method={method} is not available for {self.name} ({self.family.title} trains "
                f"with {', '.join(only)})"
            )
        if registry.get(method).quantize_base and (obstacle := self.shape.nf4_obstacle()):
            return f"method={method} cannot quantize {self.name}: {obstacle}; use method=lora"
        return None

    @property
    def parameter_count(self) -> int:
        return self.shape.parameter_count()

    @property
    def window_limit(self) -> int | None:
        """The longest ``max_seq_len`` that trains the checkpoint's model, where there is one.

        torchtune's Mistral and Phi-3 attend over the whole sequence; the HF models attend over
        a sliding window. The two agree on sequences no longer than the window.
        """
        if self.shape.sliding_window is None or "sliding_window_size" in self.family.shape_keywords:
            return None  # no window, or torchtune's model of the family has it
        return self.shape.sliding_window

    @property
    def tokenizer(self) -> Tokenizer:
        base = self.family.tokenizer
        if self.tokenizer_files is None:
            return base
        return Tokenizer(component=base.component, files=self.tokenizer_files)

    @property
    def checkpoint_model_type(self) -> str:
        return self.family.checkpoint_model_type

    def required_files(self) -> tuple[str, ...]:
        """Files the model initializer must deliver for the trainer to start.

        A sharded checkpoint's shards are not listed here: ``weight_files`` reads them from the
        index, which is required instead.
        """
        return ("config.json", *self.checkpoint_files, *self.tokenizer.files.values())

    def weight_files(self, model_dir: Path) -> tuple[str, ...]:
        """The weight files of the model in ``model_dir``, shards resolved through the index."""
        from tunepack.core.errors import BadModelError

        path = Path(model_dir) / SAFETENSORS_INDEX
        if self.custom and not path.is_file():  # a bring-your-own checkpoint: either layout
            if (Path(model_dir) / "model.safetensors").is_file():
                return ("model.safetensors",)
            raise BadModelError(
                f"{model_dir} has neither model.safetensors nor {SAFETENSORS_INDEX}: a "
                f"{self.runtime_name} checkpoint is Hugging Face safetensors, in one file or "
                "sharded with its index"
            )
        if self.checkpoint_files != (SAFETENSORS_INDEX,) and not self.custom:
            return self.checkpoint_files
        try:
            weight_map = json.loads(path.read_text(encoding="utf-8"))["weight_map"]
            shards = sorted(set(weight_map.values()))
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as error:
            raise BadModelError(
                f"cannot read the shard list of {self.name} from {path} ({error}); it must be the "
                f"{SAFETENSORS_INDEX} of {self.hub_id}, with a weight_map of tensor -> file"
            ) from None
        if not shards or not all(isinstance(s, str) and "/" not in s for s in shards):
            raise BadModelError(
                f"{path} names no usable shard files ({shards!r}); replace it with the "
                f"{SAFETENSORS_INDEX} of {self.hub_id}"
            )
        return tuple(shards)

    def builder_kwargs(self) -> dict[str, object]:
        """Keyword arguments for a builder that takes the shape (``llama3.llama3``)."""
        if not self.shape_kwargs:
            return {}
        s = self.shape
        kwargs: dict[str, object] = {
            "vocab_size": s.vocab_size,
            "num_layers": s.num_layers,
            "num_heads": s.num_heads,
            "num_kv_heads": s.num_kv_heads,
            "embed_dim": s.embed_dim,
            "intermediate_dim": s.intermediate_dim,
            "max_seq_len": s.max_seq_len,
        }
        kwargs |= {kw: getattr(s, _SHAPE_FIELD[kw]) for kw in self.family.shape_keywords}
        kwargs |= self.family.options
        return kwargs


# Component builder keyword -> Shape field, for Family.shape_keywords.
_SHAPE_FIELD = {
    "head_dim": "head_dim",
    "tie_word_embeddings": "tied_embeddings",
    "sliding_window_size": "sliding_window",
    "num_experts": "num_experts",
    "experts_per_token": "experts_per_token",
    "moe_intermediate_dim": "moe_intermediate_dim",
    "dense_layers": "dense_layers",
}


# --- sizes ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Tier:
    """Defaults by model size: GPUs (bf16 LoRA with FSDP across them), storage, batch size."""

    up_to_billions: float
    resources: Resources
    batch_size: int


_TIERS = (
    _Tier(4, Resources(gpus=1, workspace_storage="30Gi"), 4),
    _Tier(10, Resources(gpus=1, workspace_storage="60Gi"), 2),
    _Tier(16, Resources(gpus=2, workspace_storage="100Gi"), 2),
    _Tier(40, Resources(gpus=4, workspace_storage="200Gi"), 1),
    _Tier(100, Resources(gpus=8, workspace_storage="500Gi"), 1),
    # 405B in bf16 is 810 GB of weights alone: FSDP over two 8-GPU nodes.
    _Tier(1000, Resources(gpus=8, workspace_storage="2Ti", nodes=2), 1),
)


# A -custom runtime's checkpoint is known only when a job runs: it gets the defaults of the
# tier of models up to 10B parameters, and its requests are sized for the largest of them.
CUSTOM_TIER = _TIERS[1]


def _tier(shape: Shape) -> _Tier:
    billions = shape.parameter_count() / 1e9
    return next(tier for tier in _TIERS if billions <= tier.up_to_billions)


def _shards(count: int) -> tuple[str, ...]:
    return tuple(f"model-{i:05d}-of-{count:05d}.safetensors" for i in range(1, count + 1))


# Explicit shard lists are the ones torchtune 0.6.1's own recipe configs name for the same
# repository; every other sharded checkpoint is resolved through its index file, which the
# model initializer reads to check each shard is present.
_SINGLE = ("model.safetensors",)
_INDEXED = (SAFETENSORS_INDEX,)


def _entry(family: str, name: str, hub_id: str, description: str, shape: Shape, builder: str,
           checkpoint: tuple[str, ...], **extra) -> ModelEntry:  # fmt: skip
    """A published size. ``builder`` is torchtune's name without ``lora_``: ``qwen2_5_3b``."""
    fam = FAMILIES[family]
    module = extra.pop("module", f"torchtune.models.{family}")
    tier = _tier(shape)
    extra.setdefault("lora_output", fam.lora_output)
    entry = ModelEntry(
        name=name,
        family=fam,
        hub_id=hub_id,
        description=description,
        shape=shape,
        builders={"full": f"{module}.{builder}", "lora": f"{module}.lora_{builder}"},
        checkpoint_files=checkpoint,
        resources=tier.resources,
        defaults={"batch_size": tier.batch_size, "lora_rank": 16, "lora_alpha": 32},
        **extra,
    )
    limits = (2048, shape.max_seq_len, entry.window_limit or shape.max_seq_len)
    entry.defaults["max_seq_len"] = min(limits)
    return entry


def _llama(vocab: int, layers: int, heads: int, kv: int, dim: int, ffn: int, seq: int,
           tied: bool = False, **extra) -> Shape:  # fmt: skip
    return Shape(vocab, layers, heads, kv, dim, ffn, seq, tied_embeddings=tied, **extra)


def _gemma(layers: int, heads: int, head_dim: int, kv: int, dim: int, ffn: int,
           **gemma2) -> Shape:  # fmt: skip
    return Shape(256_000, layers, heads, kv, dim, ffn, 8192, tied_embeddings=True,
                 head_dim=head_dim, **gemma2)  # fmt: skip


_GEMMA2 = {"norms_per_layer": 4, "sliding_window": 4096}


def _qwen(vocab: int, layers: int, heads: int, kv: int, dim: int, ffn: int,
          tied: bool) -> Shape:  # fmt: skip
    # The instruct builders cap the context at 32K (the base ones at 128K with YaRN in mind).
    return Shape(vocab, layers, heads, kv, dim, ffn, 32_768, tied_embeddings=tied, qkv_bias=True)


_QWEN_SMALL_VOCAB, _QWEN_LARGE_VOCAB = 151_936, 152_064


# Qwen 3 dense sizes, from the config.json of each Qwen/Qwen3-<size> repository on the Hugging
# Face Hub: every size has head_dim 128, vocab_size 151936, rope_theta 1e6, rms_norm_eps 1e-6 and
# max_position_embeddings 40960 (we plan for the 32768 native context); tie_word_embeddings is
# true up to 4B. trainers/models/qwen3.py builds them. name: (layers, heads, kv heads, hidden,
# intermediate, tied)
QWEN3_SIZES = {
    "0_6b": (28, 16, 8, 1024, 3072, True),
    "1_7b": (28, 16, 8, 2048, 6144, True),
    "4b": (36, 32, 8, 2560, 9728, True),
    "8b": (36, 32, 8, 4096, 12_288, False),
    "14b": (40, 40, 8, 5120, 17_408, False),
    "32b": (64, 64, 8, 5120, 25_600, False),
}
QWEN3_VOCAB, QWEN3_HEAD_DIM, QWEN3_CONTEXT = 151_936, 128, 32_768


def _qwen3(size: str) -> Shape:
    layers, heads, kv, dim, ffn, tied = QWEN3_SIZES[size]
    return Shape(QWEN3_VOCAB, layers, heads, kv, dim, ffn, QWEN3_CONTEXT, tied_embeddings=tied,
                 head_dim=QWEN3_HEAD_DIM, qk_norm=True)  # fmt: skip


def _qwen3_entry(size: str, label: str, checkpoint: tuple[str, ...]) -> ModelEntry:
    # Qwen 3 repositories are hybrid thinking/instruct models; there is no separate -Instruct.
    return _entry("qwen3", f"qwen3-{label.lower()}", f"Qwen/Qwen3-{label}", f"Qwen 3 {label}",
                  _qwen3(size), f"qwen3_{size}", checkpoint,
                  module="tunepack.trainers.models.qwen3",
                  lora_output=not QWEN3_SIZES[size][-1])  # fmt: skip


@dataclass(frozen=True)
class Gemma3Size:
    layers: int
    heads: int
    kv_heads: int
    hidden: int
    intermediate: int
    head_dim: int
    query_pre_attn_scalar: int
    sliding_window: int
    vocab: int
    context: int
    rope_scaling: float  # linear RoPE scaling of the global layers (1: none)


# Gemma 3 text sizes, from the config.json of google/gemma-3-<size>-it on the Hugging Face Hub (as
# remembered: this machine has no network; the parameter counts below give the published 1B, 4B,
# 12B and 27B less the vision tower): 1B is a Gemma3ForCausalLM (vocab_size 262144,
# max_position_embeddings 32768, sliding_window 512, no rope_scaling); 4B, 12B and 27B are
# Gemma3ForConditionalGeneration whose text_config leaves most fields to Gemma3TextConfig's
# defaults (vocab_size 262208, 8 heads, 4 KV heads, head_dim 256, query_pre_attn_scalar 256,
# max_position_embeddings 131072) and sets sliding_window 1024 and rope_scaling linear, factor 8.
# Every size: rope_theta 1e6, rope_local_base_freq 1e4, sliding_window_pattern 6, rms_norm_eps
# 1e-6, tied embeddings, no soft-capping. trainers/models/gemma3.py builds them.
GEMMA3_SIZES = {
    "1b": Gemma3Size(26, 4, 1, 1152, 6912, 256, 256, 512, 262_144, 32_768, 1.0),
    "4b": Gemma3Size(34, 8, 4, 2560, 10_240, 256, 256, 1024, 262_208, 131_072, 8.0),
    "12b": Gemma3Size(48, 16, 8, 3840, 15_360, 256, 256, 1024, 262_208, 131_072, 8.0),
    "27b": Gemma3Size(62, 32, 16, 5376, 21_504, 128, 168, 1024, 262_208, 131_072, 8.0),
}


def gemma3_shape(size: str) -> Shape:
    s = GEMMA3_SIZES[size]
    return Shape(s.vocab, s.layers, s.heads, s.kv_heads, s.hidden, s.intermediate, s.context,
                 tied_embeddings=True, head_dim=s.head_dim, norms_per_layer=4,
                 sliding_window=s.sliding_window, qk_norm=True)  # fmt: skip


def _gemma3_entry(size: str, checkpoint: tuple[str, ...]) -> ModelEntry:
    label = size.upper()
    kind = "" if size == "1b" else "; text weights of the image-text checkpoint"
    return _entry("gemma3", f"gemma3-{size}", f"google/gemma-3-{size}-it",
                  f"Gemma 3 {label} Instruct{kind}", gemma3_shape(size), f"gemma3_{size}",
                  checkpoint, module="tunepack.trainers.models.gemma3")  # fmt: skip


# Llama 3.2 Vision sizes (meta-llama/Llama-3.2-{11B,90B}-Vision-Instruct), as remembered (this
# machine has no network): text_config vocab_size 128256 (<|image|> is 128256, 8 more embedding
# rows), rope_theta 5e5 with llama3 scaling (factor 8), max_position_embeddings 131072; 11B: 40
# layers of width 4096 (MLP 14336, 32 heads, 8 KV heads) of which 8 cross-attention
# (3, 8, ..., 38); 90B: 100 layers of width 8192 (MLP 28672, 64 heads, 8 KV heads) of which 20
# cross-attention (3, 8, ..., 98). Both share the vision tower: 560-pixel tiles of 14-pixel
# patches, up to 4 tiles, width 1280, 32 local + 8 global layers, 16 heads, MLP 5120, features of
# local layers 3, 7, 15, 23 and 30. Checked against torchtune 0.6.1's llama3_2_vision_11b/_90b
# builders (Meta's numbers: 32/80 self-attention layers with a fusion layer every 4th, so 8/20
# cross-attention layers; widths, heads, KV heads, MLP widths, RoPE base, context, the tower and
# its feature layers all agree); the cross-attention indices follow the 11B's published pattern.
# The Shape is the text model's (its parameter count leaves the ~0.9B vision tower out); the
# trainer builds every size from the checkpoint's config.json.
def _mllama_entry(size: str, shape: Shape) -> ModelEntry:
    # The vision tower's 40 layers of width 1280 (attention 4 x 1280^2, MLP 2 x 1280 x 5120) and
    # the projector (7680 -> the text width); its embeddings and norms are left out (< 1%).
    tower = 40 * (4 * 1280 * 1280 + 2 * 1280 * 5120) + 7680 * shape.embed_dim
    shape = replace(shape, extra_parameters=tower)
    label = size.upper()
    return _entry("mllama", f"llama3.2-vision-{size}",
                  f"meta-llama/Llama-3.2-{label}-Vision-Instruct",
                  f"Llama 3.2 {label} Vision Instruct (images and text)", shape, "mllama",
                  _INDEXED, module="tunepack.trainers.models.mllama")  # fmt: skip


# Qwen3-MoE sizes, from the config.json of Qwen/Qwen3-30B-A3B and Qwen/Qwen3-235B-A22B on the
# Hugging Face Hub (as remembered: this machine has no network; the parameter counts they give,
# 30.53B total / 3.35B active and 235.09B / 22.16B, are the published 30.5B/3.3B and
# 235B/22B): both have head_dim 128, vocab_size 151936, 128 experts of which 8 per token with
# norm_topk_prob true, decoder_sparse_step 1 and no mlp_only_layers (every layer sparse),
# router_aux_loss_coef 0.001, rope_theta 1e6, rms_norm_eps 1e-6, untied embeddings and
# max_position_embeddings 40960 (we plan for the 32768 native context). trainers/models/qwen3_moe.py
# builds them. name: (layers, heads, kv heads, hidden, dense intermediate_size, experts,
# experts per token, moe_intermediate_size, router_aux_loss_coef)
QWEN3_MOE_SIZES = {
    "30b_a3b": (48, 32, 4, 2048, 6144, 128, 8, 768, 0.001),
    "235b_a22b": (94, 64, 4, 4096, 12_288, 128, 8, 1536, 0.001),
}


def qwen3_moe_shape(size: str) -> Shape:
    layers, heads, kv, dim, ffn, experts, per_token, width, _ = QWEN3_MOE_SIZES[size]
    return Shape(QWEN3_VOCAB, layers, heads, kv, dim, ffn, QWEN3_CONTEXT, head_dim=QWEN3_HEAD_DIM,
                 qk_norm=True, num_experts=experts, experts_per_token=per_token,
                 moe_intermediate_dim=width)  # fmt: skip


def _qwen3_moe_entry(size: str, label: str) -> ModelEntry:
    entry = _entry("qwen3_moe", f"qwen3-{label.lower()}", f"Qwen/Qwen3-{label}",
                   f"Qwen3-MoE {label} (mixture of experts)", qwen3_moe_shape(size),
                   f"qwen3_moe_{size}", _INDEXED,
                   module="tunepack.trainers.models.qwen3_moe")  # fmt: skip
    # LoRA adapts attention by default; lora_mlp=true adds the experts
    # (trainers/models/qwen3_moe.py).
    entry.defaults["lora_mlp"] = False
    if entry.resources.nodes > 1:
        # 235B-A22B: LoRA's frozen bf16 base (438 GiB) fits one node of eight 80 GB GPUs (the
        # planner: 55 GiB a device); the host memory is the two-node tier's, for rank 0 reads
        # the checkpoint and stacks each layer's experts beside it.
        entry = replace(entry, resources=replace(entry.resources, nodes=1))
    return entry


# Shapes are copied from torchtune 0.6.1's model builders; test_catalog builds each one.
_PUBLISHED = (
    # Llama 2 / Code Llama: torchtune has no separate chat builders; we pick the chat/instruct
    # repositories, which share the base architecture.
    _entry("llama2", "llama2-7b", "meta-llama/Llama-2-7b-chat-hf", "Llama 2 7B Chat",
           _llama(32_000, 32, 32, 32, 4096, 11_008, 4096), "llama2_7b", _INDEXED),
    _entry("llama2", "llama2-13b", "meta-llama/Llama-2-13b-chat-hf", "Llama 2 13B Chat",
           _llama(32_000, 40, 40, 40, 5120, 13_824, 4096), "llama2_13b", _INDEXED),
    _entry("llama2", "llama2-70b", "meta-llama/Llama-2-70b-chat-hf", "Llama 2 70B Chat",
           _llama(32_000, 80, 64, 8, 8192, 28_672, 4096), "llama2_70b", _INDEXED),
    _entry("code_llama2", "code-llama2-7b", "meta-llama/CodeLlama-7b-Instruct-hf",
           "Code Llama 7B Instruct", _llama(32_016, 32, 32, 32, 4096, 11_008, 16_384),
           "code_llama2_7b", _INDEXED),
    _entry("code_llama2", "code-llama2-13b", "meta-llama/CodeLlama-13b-Instruct-hf",
           "Code Llama 13B Instruct", _llama(32_016, 40, 40, 40, 5120, 13_824, 16_384),
           "code_llama2_13b", _INDEXED),
    _entry("code_llama2", "code-llama2-70b", "meta-llama/CodeLlama-70b-Instruct-hf",
           "Code Llama 70B Instruct", _llama(32_016, 80, 64, 8, 8192, 28_672, 16_384),
           "code_llama2_70b", _INDEXED),
    _entry("llama3", "llama3-8b", "meta-llama/Meta-Llama-3-8B-Instruct", "Llama 3 8B Instruct",
           _llama(128_256, 32, 32, 8, 4096, 14_336, 8192), "llama3_8b", _INDEXED),
    _entry("llama3", "llama3-70b", "meta-llama/Meta-Llama-3-70B-Instruct",
           "Llama 3 70B Instruct", _llama(128_256, 80, 64, 8, 8192, 28_672, 8192), "llama3_70b",
           _shards(30)),
    _entry("llama3_1", "llama3.1-8b", "meta-llama/Llama-3.1-8B-Instruct", "Llama 3.1 8B Instruct",
           _llama(128_256, 32, 32, 8, 4096, 14_336, 131_072), "llama3_1_8b", _shards(4)),
    _entry("llama3_1", "llama3.1-70b", "meta-llama/Llama-3.1-70B-Instruct",
           "Llama 3.1 70B Instruct", _llama(128_256, 80, 64, 8, 8192, 28_672, 131_072),
           "llama3_1_70b", _shards(30)),
    # The 405B repository keeps its tokenizer beside the 8-way model-parallel original weights.
    _entry("llama3_1", "llama3.1-405b", "meta-llama/Llama-3.1-405B-Instruct",
           "Llama 3.1 405B Instruct (two 8-GPU nodes)",
           _llama(128_256, 126, 128, 8, 16_384, 53_248, 131_072), "llama3_1_405b", _shards(191),
           tokenizer_files={**TIKTOKEN_FILES, "path": "original/mp8/tokenizer.model"}),
    _entry("llama3_2", "llama3.2-1b", "meta-llama/Llama-3.2-1B-Instruct", "Llama 3.2 1B Instruct",
           _llama(128_256, 16, 32, 8, 2048, 8192, 131_072, tied=True), "llama3_2_1b", _SINGLE),
    _entry("llama3_2", "llama3.2-3b", "meta-llama/Llama-3.2-3B-Instruct", "Llama 3.2 3B Instruct",
           _llama(128_256, 28, 24, 8, 3072, 8192, 131_072, tied=True), "llama3_2_3b",
           _shards(2)),
    _entry("llama3_3", "llama3.3-70b", "meta-llama/Llama-3.3-70B-Instruct",
           "Llama 3.3 70B Instruct", _llama(128_256, 80, 64, 8, 8192, 28_672, 131_072),
           "llama3_3_70b", _shards(30)),
    # torchtune's mistral_7b is v0.1 (RoPE base 10000, 32000 tokens); v0.2 and later differ.
    _entry("mistral", "mistral-7b", "mistralai/Mistral-7B-Instruct-v0.1",
           "Mistral 7B Instruct v0.1",
           _llama(32_000, 32, 32, 8, 4096, 14_336, 32_768, sliding_window=4096),
           "mistral_7b", _INDEXED),
    _entry("gemma", "gemma-2b", "google/gemma-2b-it", "Gemma 2B Instruct",
           _gemma(18, 8, 256, 1, 2048, 16_384), "gemma_2b", _INDEXED),
    _entry("gemma", "gemma-7b", "google/gemma-7b-it", "Gemma 7B Instruct",
           _gemma(28, 16, 256, 16, 3072, 24_576), "gemma_7b", _INDEXED),
    _entry("gemma2", "gemma2-2b", "google/gemma-2-2b-it", "Gemma 2 2B Instruct",
           _gemma(26, 8, 256, 4, 2304, 9216, **_GEMMA2), "gemma2_2b", _INDEXED),
    _entry("gemma2", "gemma2-9b", "google/gemma-2-9b-it", "Gemma 2 9B Instruct",
           _gemma(42, 16, 256, 8, 3584, 14_336, **_GEMMA2), "gemma2_9b", _INDEXED),
    _entry("gemma2", "gemma2-27b", "google/gemma-2-27b-it", "Gemma 2 27B Instruct",
           _gemma(46, 32, 128, 16, 4608, 36_864, **_GEMMA2), "gemma2_27b", _INDEXED),
    _entry("phi3", "phi3-mini", "microsoft/Phi-3-mini-4k-instruct", "Phi-3 Mini 4K Instruct",
           _llama(32_064, 32, 32, 32, 3072, 8192, 4096, sliding_window=2047), "phi3_mini",
           _shards(2)),
    _entry("phi4", "phi4-14b", "microsoft/phi-4", "Phi-4 14B (instruction-tuned)",
           _llama(100_352, 40, 40, 10, 5120, 17_920, 16_384), "phi4_14b", _shards(6)),
    _entry("qwen2", "qwen2-0.5b", "Qwen/Qwen2-0.5B-Instruct", "Qwen 2 0.5B Instruct",
           _qwen(_QWEN_SMALL_VOCAB, 24, 14, 2, 896, 4864, tied=True), "qwen2_0_5b", _SINGLE,
           lora_output=False),
    _entry("qwen2", "qwen2-1.5b", "Qwen/Qwen2-1.5B-Instruct", "Qwen 2 1.5B Instruct",
           _qwen(_QWEN_SMALL_VOCAB, 28, 12, 2, 1536, 8960, tied=True), "qwen2_1_5b", _SINGLE,
           lora_output=False),
    _entry("qwen2", "qwen2-7b", "Qwen/Qwen2-7B-Instruct", "Qwen 2 7B Instruct",
           _qwen(_QWEN_LARGE_VOCAB, 28, 28, 4, 3584, 18_944, tied=False), "qwen2_7b",
           _shards(4)),
    # Qwen 2.5: torchtune has base and instruct builders from 1.5B up; we use the instruct ones
    # (0.5B and 3B have a single builder that serves both).
    _entry("qwen2_5", "qwen2.5-0.5b", "Qwen/Qwen2.5-0.5B-Instruct", "Qwen 2.5 0.5B Instruct",
           _qwen(_QWEN_SMALL_VOCAB, 24, 14, 2, 896, 4864, tied=True), "qwen2_5_0_5b", _SINGLE),
    _entry("qwen2_5", "qwen2.5-1.5b", "Qwen/Qwen2.5-1.5B-Instruct",
           "Qwen 2.5 1.5B Instruct (torchtune's instruct builder)",
           _qwen(_QWEN_SMALL_VOCAB, 28, 12, 2, 1536, 8960, tied=True),
           "qwen2_5_1_5b_instruct", _SINGLE),
    _entry("qwen2_5", "qwen2.5-3b", "Qwen/Qwen2.5-3B-Instruct", "Qwen 2.5 3B Instruct",
           _qwen(_QWEN_SMALL_VOCAB, 36, 16, 2, 2048, 11_008, tied=True), "qwen2_5_3b",
           _shards(2)),
    _entry("qwen2_5", "qwen2.5-7b", "Qwen/Qwen2.5-7B-Instruct",
           "Qwen 2.5 7B Instruct (torchtune's instruct builder)",
           _qwen(_QWEN_LARGE_VOCAB, 28, 28, 4, 3584, 18_944, tied=False),
           "qwen2_5_7b_instruct", _shards(4)),
    _entry("qwen2_5", "qwen2.5-14b", "Qwen/Qwen2.5-14B-Instruct",
           "Qwen 2.5 14B Instruct (torchtune's instruct builder)",
           _qwen(_QWEN_LARGE_VOCAB, 48, 40, 8, 5120, 13_824, tied=False),
           "qwen2_5_14b_instruct", _shards(8)),
    _entry("qwen2_5", "qwen2.5-32b", "Qwen/Qwen2.5-32B-Instruct",
           "Qwen 2.5 32B Instruct (torchtune's instruct builder)",
           _qwen(_QWEN_LARGE_VOCAB, 64, 40, 8, 5120, 27_648, tied=False),
           "qwen2_5_32b_instruct", _shards(17)),
    _entry("qwen2_5", "qwen2.5-72b", "Qwen/Qwen2.5-72B-Instruct",
           "Qwen 2.5 72B Instruct (torchtune's instruct builder)",
           _qwen(_QWEN_LARGE_VOCAB, 80, 64, 8, 8192, 29_568, tied=False),
           "qwen2_5_72b_instruct", _shards(37)),
    _qwen3_entry("0_6b", "0.6B", _SINGLE),
    _qwen3_entry("1_7b", "1.7B", _INDEXED),
    _qwen3_entry("4b", "4B", _INDEXED),
    _qwen3_entry("8b", "8B", _INDEXED),
    _qwen3_entry("14b", "14B", _INDEXED),
    _qwen3_entry("32b", "32B", _INDEXED),
    _gemma3_entry("1b", _SINGLE),
    _gemma3_entry("4b", _INDEXED),
    _gemma3_entry("12b", _INDEXED),
    _gemma3_entry("27b", _INDEXED),
    _qwen3_moe_entry("30b_a3b", "30B-A3B"),
    _qwen3_moe_entry("235b_a22b", "235B-A22B"),
    _mllama_entry("11b", _llama(128_256, 40, 32, 8, 4096, 14_336, 131_072)),
    _mllama_entry("90b", _llama(128_256, 100, 64, 8, 8192, 28_672, 131_072)),
)  # fmt: skip


# --- tiny variants -------------------------------------------------------------------------------

_TINY_RESOURCES = Resources(gpus=0, cpu="2", memory="4Gi", workspace_storage="1Gi")
# A random base learns only through the adapter, so it wants a higher rate than real ones.
_TINY_DEFAULTS = {"max_seq_len": 256, "batch_size": 8, "lora_rank": 8, "lora_alpha": 16, "lr": 3e-3}


def _moe_defaults(shape: Shape) -> dict[str, object]:
    """LoRA on the MLPs is off by default where every MLP is a mixture of experts: on, it adapts
    every expert (trainers/models/qwen3_moe.py), most of the trainable parameters."""
    return {"lora_mlp": False} if shape.num_experts and not shape.dense_layers else {}


def _tiny(family: str, name: str, shape: Shape, description: str = "") -> ModelEntry:
    """A tiny random model of ``family`` built by its component builders from ``shape``.

    ``tunepack.tiny.write_tiny_model`` writes it in the family's Hugging Face format, with a
    tokenizer of the family's kind whose vocabulary fits ``shape.vocab_size``.
    """
    fam = FAMILIES[family]
    return ModelEntry(
        name=name,
        family=fam,
        hub_id=f"tunepack/{name}",
        description=description or f"Tiny random {fam.title} model for tests (CPU, no download)",
        shape=shape,
        builders=dict(fam.component_builders),
        shape_kwargs=True,
        checkpoint_files=_SINGLE,
        lora_output=fam.lora_output,
        resources=_TINY_RESOURCES,
        defaults=dict(_TINY_DEFAULTS) | _moe_defaults(shape),
    )


def _tiny_shape(vocab: int = 384, kv: int = 2, **extra) -> Shape:
    """Two layers of width 64: small enough that a few training steps take a second."""
    return Shape(vocab, num_layers=2, num_heads=4, num_kv_heads=kv, embed_dim=64,
                 intermediate_dim=128, max_seq_len=512, **extra)  # fmt: skip


TINY_LLAMA3 = _tiny(
    "llama3",
    "tiny-llama3",
    Shape(
        384,
        num_layers=3,
        num_heads=4,
        num_kv_heads=2,
        embed_dim=96,
        intermediate_dim=256,
        max_seq_len=512,
    ),  # fmt: skip
    "Tiny random Llama-3 model for the quickstart and tests (CPU, no download)",
)

# One per family. The shapes exercise what sets each family apart: tied embeddings, explicit
# head_dim (twice embed_dim // num_heads), multi-query and multi-head attention, q/k/v biases,
# and a sliding window shorter than the test sequences.
TINY: dict[str, ModelEntry] = {
    entry.family.name: entry
    for entry in (
        _tiny("llama2", "tiny-llama2", _tiny_shape()),
        _tiny("code_llama2", "tiny-code-llama2", _tiny_shape()),
        TINY_LLAMA3,
        _tiny("llama3_1", "tiny-llama3.1", _tiny_shape()),
        _tiny("llama3_2", "tiny-llama3.2", _tiny_shape(tied_embeddings=True)),
        _tiny("llama3_3", "tiny-llama3.3", _tiny_shape()),
        _tiny("mistral", "tiny-mistral", _tiny_shape(sliding_window=256)),
        _tiny("gemma", "tiny-gemma", _tiny_shape(kv=1, tied_embeddings=True, head_dim=32)),
        _tiny("gemma2", "tiny-gemma2",
              _tiny_shape(tied_embeddings=True, head_dim=32, norms_per_layer=4,
                          sliding_window=32)),
        _tiny("phi3", "tiny-phi3", _tiny_shape(kv=4, sliding_window=256)),
        # Phi-4's 96 special tokens (mostly placeholders) need room beside the learned merges.
        _tiny("phi4", "tiny-phi4", _tiny_shape(vocab=448)),
        _tiny("qwen2", "tiny-qwen2", _tiny_shape(tied_embeddings=True, qkv_bias=True)),
        _tiny("qwen2_5", "tiny-qwen2.5", _tiny_shape(qkv_bias=True)),
        # head_dim twice embed_dim // num_heads, as Qwen 3 0.6B's query is twice its width.
        _tiny("qwen3", "tiny-qwen3", _tiny_shape(tied_embeddings=True, head_dim=32, qk_norm=True)),
        # Six layers (five local, one global, as the published pattern) and a window shorter
        # than the test sequences.
        _tiny("gemma3", "tiny-gemma3",
              Shape(384, num_layers=6, num_heads=4, num_kv_heads=2, embed_dim=64,
                    intermediate_dim=128, max_seq_len=512, tied_embeddings=True, head_dim=32,
                    norms_per_layer=4, sliding_window=32, qk_norm=True)),
        # Four experts of which two per token, every layer sparse as in the published sizes.
        _tiny("qwen3_moe", "tiny-qwen3-moe",
              _tiny_shape(head_dim=32, qk_norm=True, num_experts=4, experts_per_token=2,
                          moe_intermediate_dim=48)),
    )
}  # fmt: skip
# Models that read images: their builders take the checkpoint's config.json, which
# tunepack.tiny writes with transformers' own config class (a vision tower of one tile size).
TINY_VISION: dict[str, ModelEntry] = {
    "mllama": _tiny("mllama", "tiny-mllama", _tiny_shape()),
}
assert set(TINY) | set(TINY_VISION) == set(FAMILIES), "every family needs a tiny variant"
assert not set(TINY) & set(TINY_VISION)


def _custom(arch: str) -> ModelEntry:
    """A runtime for any checkpoint of ``arch`` (runtimes/custom.py): built with the family's
    shape-taking builders from the checkpoint's config.json, its text encoded by the
    checkpoint's own tokenizer.json. The shape here is the family's tiny one, a placeholder."""
    spec = custom.ARCHITECTURES[arch]
    fam, tiny = FAMILIES[spec.family], TINY[spec.family].shape
    # A placeholder that limits nothing the checkpoint may set: a long context, no window the
    # trainer caps at, weights NF4 can quantize. The trainer, initializer and planner resolve it.
    placeholder = Shape(
        tiny.vocab_size, tiny.num_layers, 4, tiny.num_kv_heads, 256, 512, 1 << 20,
        tied_embeddings=tiny.tied_embeddings, qkv_bias=tiny.qkv_bias,
        head_dim=64 if "head_dim" in fam.shape_keywords else 0,
        norms_per_layer=tiny.norms_per_layer,
        sliding_window=tiny.sliding_window if "sliding_window_size" in fam.shape_keywords else None,
        qk_norm=tiny.qk_norm, num_experts=tiny.num_experts,
        experts_per_token=tiny.experts_per_token, moe_intermediate_dim=tiny.moe_intermediate_dim,
    )  # fmt: skip
    return ModelEntry(
        name=custom.runtime_model_name(arch),
        family=fam,
        hub_id=f"<your {spec.model_type} checkpoint>",
        description=f"Your own {spec.model_type}-architecture checkpoint (shape from config.json)",
        shape=placeholder,
        builders=dict(fam.component_builders),
        shape_kwargs=True,
        checkpoint_files=(),  # model.safetensors or an index: weight_files
        lora_output=fam.lora_output,
        tokenizer_files={"path": custom.TOKENIZER_JSON},
        resources=CUSTOM_TIER.resources,
        defaults={
            "batch_size": 2,
            "lora_rank": 16,
            "lora_alpha": 32,
            "max_seq_len": 2048,
            **_moe_defaults(placeholder),
        },
        custom=arch,
    )


CUSTOM: dict[str, ModelEntry] = {
    entry.name: entry
    for entry in (
        _custom(a)
        for a in ("llama", "mistral", "qwen2", "gemma", "gemma2", "phi3", "qwen3_moe", "gemma3")
    )
}


def is_placeholder(entry: ModelEntry) -> bool:
    """Whether ``entry`` is a custom runtime not yet resolved against a checkpoint."""
    return bool(entry.custom) and entry.shape is CUSTOM[entry.name].shape


# The published runtimes: every real size, the quickstart's tiny model and one bring-your-own
# runtime per architecture.
CATALOG: dict[str, ModelEntry] = {
    entry.name: entry for entry in (TINY_LLAMA3, *_PUBLISHED, *CUSTOM.values())
}


@dataclass(frozen=True)
class TinyModel:
    """A tiny model ``tunepack tiny-model --model NAME`` writes, and the runtime it is for."""

    entry: ModelEntry
    runtime: str

    @property
    def methods(self) -> tuple[str, ...]:
        """The methods the runtime trains with that this tiny model's shape takes too."""
        return tuple(m for m in get(self.runtime).methods if self.entry.why_not(m) is None)


# A Llama 3.2 Vision whose text projections NF4 can quantize (each a multiple of its 16384-value
# block, where tiny-mllama's are not), its checkpoint indexed as the published ones are: the
# published runtime builds any size from config.json, so on this model it trains on a CPU with
# every method it has, qlora included, on images and on text-only chats.
TINY_VISION_NF4 = replace(
    _tiny("mllama", "tiny-llama3.2-vision",
          Shape(384, num_layers=4, num_heads=4, num_kv_heads=2, embed_dim=256,
                intermediate_dim=512, max_seq_len=512, head_dim=64),
          "Tiny random Llama 3.2 Vision model (text projections NF4 can quantize) for trying "
          "the Llama 3.2 Vision runtimes on a CPU (no download)"),
    checkpoint_files=_INDEXED,
)  # fmt: skip
# The one place that says which runtime each model `tunepack tiny-model` writes is for.
TINY_MODELS: dict[str, TinyModel] = {
    tiny.entry.name: tiny
    for tiny in (
        TinyModel(TINY_LLAMA3, TINY_LLAMA3.runtime_name),
        TinyModel(TINY_VISION_NF4, CATALOG["llama3.2-vision-11b"].runtime_name),
    )
}


def get(name: str) -> ModelEntry:
    """Return the entry for a model name or runtime name (``tunepack-<model>``)."""
    from tunepack.core.errors import UnknownRuntimeError

    key = name.removeprefix(RUNTIME_PREFIX)
    try:
        return CATALOG[key]
    except KeyError:
        known = ", ".join(entry.runtime_name for entry in CATALOG.values())
        raise UnknownRuntimeError(
            f"unknown runtime or model {name!r}; tunepack runtimes are: {known}", runtime=name
        ) from None
