"""The model catalog: the one place where tunepack's knowledge of each model is written.

Everything else is derived from it: the ClusterTrainingRuntime YAML (``runtimes/generate.py``),
the trainer's torchtune configuration (``trainers/config.py``), the model initializer's file
checks, the runtime list the CLI and SDK show, and the docs.

Component paths here (``torchtune.models...``) are chosen by tunepack, never by a user: user
arguments only fill in values such as the LoRA rank.
"""

from __future__ import annotations

from dataclasses import dataclass, field

RUNTIME_PREFIX = "tunepack-"


@dataclass(frozen=True)
class Shape:
    """Transformer dimensions, enough to count parameters and plan memory."""

    vocab_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    embed_dim: int
    intermediate_dim: int
    max_seq_len: int
    tied_embeddings: bool = False
    qkv_bias: bool = False

    @property
    def head_dim(self) -> int:
        return self.embed_dim // self.num_heads

    def parameter_count(self) -> int:
        d, hd = self.embed_dim, self.head_dim
        q_out, kv_out = self.num_heads * hd, self.num_kv_heads * hd
        attention = d * q_out + 2 * d * kv_out + q_out * d
        if self.qkv_bias:
            attention += q_out + 2 * kv_out
        mlp = 3 * d * self.intermediate_dim
        norms = 2 * d
        embeddings = self.vocab_size * d * (1 if self.tied_embeddings else 2)
        return embeddings + self.num_layers * (attention + mlp + norms) + d


@dataclass(frozen=True)
class Tokenizer:
    """The torchtune tokenizer builder and the files (relative to the model dir) it reads.

    ``files`` maps builder keyword -> file; all of them must exist before training starts.
    """

    component: str
    files: dict[str, str]


@dataclass(frozen=True)
class Resources:
    """Default per-node resources of the runtime's trainer Pod."""

    gpus: int
    cpu: str
    memory: str
    workspace_storage: str


@dataclass(frozen=True)
class ModelEntry:
    name: str
    family: str
    hub_id: str
    description: str
    shape: Shape
    # torchtune builders by method. A builder taking the shape as keywords sets ``shape_kwargs``.
    builders: dict[str, str]
    tokenizer: Tokenizer
    checkpoint_files: tuple[str, ...]
    checkpoint_model_type: str  # torchtune's ModelType for the HF checkpointer
    resources: Resources
    shape_kwargs: bool = False
    # The catalog's default trainer arguments for this model (users override per job).
    defaults: dict[str, object] = field(default_factory=dict)

    @property
    def runtime_name(self) -> str:
        return RUNTIME_PREFIX + self.name

    @property
    def methods(self) -> tuple[str, ...]:
        return tuple(self.builders)

    @property
    def parameter_count(self) -> int:
        return self.shape.parameter_count()

    def required_files(self) -> tuple[str, ...]:
        """Files the model initializer must deliver for the trainer to start."""
        return ("config.json", *self.checkpoint_files, *self.tokenizer.files.values())

    def builder_kwargs(self) -> dict[str, object]:
        """Keyword arguments for a builder that takes the shape (``llama3.llama3``)."""
        if not self.shape_kwargs:
            return {}
        s = self.shape
        return {
            "vocab_size": s.vocab_size,
            "num_layers": s.num_layers,
            "num_heads": s.num_heads,
            "num_kv_heads": s.num_kv_heads,
            "embed_dim": s.embed_dim,
            "intermediate_dim": s.intermediate_dim,
            "max_seq_len": s.max_seq_len,
        }


_LLAMA3_TOKENIZER = Tokenizer(
    component="torchtune.models.llama3.llama3_tokenizer",
    files={"path": "original/tokenizer.model", "special_tokens_path": "tokenizer.json"},
)
_QWEN2_5_TOKENIZER = Tokenizer(
    component="torchtune.models.qwen2_5.qwen2_5_tokenizer",
    files={
        "path": "vocab.json",
        "merges_file": "merges.txt",
        "special_tokens_path": "tokenizer.json",
    },
)


def _shards(count: int) -> tuple[str, ...]:
    return tuple(f"model-{i:05d}-of-{count:05d}.safetensors" for i in range(1, count + 1))


_ENTRIES = (
    ModelEntry(
        name="tiny-llama3",
        family="llama3",
        hub_id="tunepack/tiny-llama3",
        description="Tiny random Llama-3 model for the quickstart and tests (CPU, no download)",
        shape=Shape(
            vocab_size=384,
            num_layers=3,
            num_heads=4,
            num_kv_heads=2,
            embed_dim=96,
            intermediate_dim=256,
            max_seq_len=512,
        ),
        builders={
            "full": "torchtune.models.llama3.llama3",
            "lora": "torchtune.models.llama3.lora_llama3",
        },
        shape_kwargs=True,
        tokenizer=_LLAMA3_TOKENIZER,
        checkpoint_files=("model.safetensors",),
        checkpoint_model_type="LLAMA3",
        resources=Resources(gpus=0, cpu="2", memory="4Gi", workspace_storage="1Gi"),
        # A random base learns only through the adapter, so it wants a higher rate than real ones.
        defaults={
            "max_seq_len": 256,
            "batch_size": 8,
            "lora_rank": 8,
            "lora_alpha": 16,
            "lr": 3e-3,
        },
    ),
    ModelEntry(
        name="llama3.2-1b",
        family="llama3_2",
        hub_id="meta-llama/Llama-3.2-1B-Instruct",
        description="Llama 3.2 1B Instruct",
        shape=Shape(
            vocab_size=128_256,
            num_layers=16,
            num_heads=32,
            num_kv_heads=8,
            embed_dim=2048,
            intermediate_dim=8192,
            max_seq_len=131_072,
            tied_embeddings=True,
        ),
        builders={
            "full": "torchtune.models.llama3_2.llama3_2_1b",
            "lora": "torchtune.models.llama3_2.lora_llama3_2_1b",
        },
        tokenizer=_LLAMA3_TOKENIZER,
        checkpoint_files=("model.safetensors",),
        checkpoint_model_type="LLAMA3_2",
        resources=Resources(gpus=1, cpu="8", memory="32Gi", workspace_storage="20Gi"),
        defaults={"max_seq_len": 2048, "batch_size": 4, "lora_rank": 16, "lora_alpha": 32},
    ),
    ModelEntry(
        name="llama3.1-8b",
        family="llama3_1",
        hub_id="meta-llama/Llama-3.1-8B-Instruct",
        description="Llama 3.1 8B Instruct",
        shape=Shape(
            vocab_size=128_256,
            num_layers=32,
            num_heads=32,
            num_kv_heads=8,
            embed_dim=4096,
            intermediate_dim=14_336,
            max_seq_len=131_072,
        ),
        builders={
            "full": "torchtune.models.llama3_1.llama3_1_8b",
            "lora": "torchtune.models.llama3_1.lora_llama3_1_8b",
        },
        tokenizer=_LLAMA3_TOKENIZER,
        checkpoint_files=_shards(4),
        checkpoint_model_type="LLAMA3",
        resources=Resources(gpus=1, cpu="16", memory="96Gi", workspace_storage="60Gi"),
        defaults={"max_seq_len": 2048, "batch_size": 2, "lora_rank": 16, "lora_alpha": 32},
    ),
    ModelEntry(
        name="qwen2.5-1.5b",
        family="qwen2_5",
        hub_id="Qwen/Qwen2.5-1.5B-Instruct",
        description="Qwen 2.5 1.5B Instruct",
        shape=Shape(
            vocab_size=151_936,
            num_layers=28,
            num_heads=12,
            num_kv_heads=2,
            embed_dim=1536,
            intermediate_dim=8960,
            max_seq_len=32_768,
            tied_embeddings=True,
            qkv_bias=True,
        ),
        builders={
            "full": "torchtune.models.qwen2_5.qwen2_5_1_5b_instruct",
            "lora": "torchtune.models.qwen2_5.lora_qwen2_5_1_5b_instruct",
        },
        tokenizer=_QWEN2_5_TOKENIZER,
        checkpoint_files=("model.safetensors",),
        checkpoint_model_type="QWEN2",
        resources=Resources(gpus=1, cpu="8", memory="32Gi", workspace_storage="20Gi"),
        defaults={"max_seq_len": 2048, "batch_size": 4, "lora_rank": 16, "lora_alpha": 32},
    ),
    ModelEntry(
        name="qwen2.5-7b",
        family="qwen2_5",
        hub_id="Qwen/Qwen2.5-7B-Instruct",
        description="Qwen 2.5 7B Instruct",
        shape=Shape(
            vocab_size=152_064,
            num_layers=28,
            num_heads=28,
            num_kv_heads=4,
            embed_dim=3584,
            intermediate_dim=18_944,
            max_seq_len=32_768,
            qkv_bias=True,
        ),
        builders={
            "full": "torchtune.models.qwen2_5.qwen2_5_7b_instruct",
            "lora": "torchtune.models.qwen2_5.lora_qwen2_5_7b_instruct",
        },
        tokenizer=_QWEN2_5_TOKENIZER,
        checkpoint_files=_shards(4),
        checkpoint_model_type="QWEN2",
        resources=Resources(gpus=1, cpu="16", memory="96Gi", workspace_storage="60Gi"),
        defaults={"max_seq_len": 2048, "batch_size": 2, "lora_rank": 16, "lora_alpha": 32},
    ),
)

CATALOG: dict[str, ModelEntry] = {entry.name: entry for entry in _ENTRIES}


def get(name: str) -> ModelEntry:
    """Return the entry for a model name or runtime name (``tunepack-<model>``)."""
    from tunepack.errors import BadInputError

    key = name.removeprefix(RUNTIME_PREFIX)
    try:
        return CATALOG[key]
    except KeyError:
        known = ", ".join(entry.runtime_name for entry in _ENTRIES)
        raise BadInputError(
            f"unknown runtime or model {name!r}; tunepack runtimes are: {known}"
        ) from None
