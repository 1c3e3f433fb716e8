"""A model's transformer dimensions (``Shape``): what the catalog writes for each model and
runtimes/custom.py reads from a checkpoint's config.json, and what the planner counts and plans
memory with. Below both the catalog and custom.py, which import it."""

from __future__ import annotations

from dataclasses import dataclass

# torchao's NF4 quantizes a weight in blocks of 64 values with one scale each, and those scales
# again in blocks of 256: a weight's size must be a multiple of both, or building the model fails
# deep inside torchao with an assertion.
NF4_BLOCK = 64 * 256


@dataclass(frozen=True)
class DecoderDims:
    """The dimensions every decoder has, by torchtune's builders' names: what ``Shape`` and the
    shape records of tunepack's own families' builders (trainers/models/) start with."""

    vocab_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    embed_dim: int
    intermediate_dim: int
    max_seq_len: int


@dataclass(frozen=True)
class Shape(DecoderDims):
    """Transformer dimensions, enough to count parameters and plan memory."""

    tied_embeddings: bool = False
    qkv_bias: bool = False
    # 0 means embed_dim // num_heads; Gemma sets it explicitly (256 with a 2048 model dim).
    head_dim: int = 0
    # RMSNorms per layer: before attention and MLP; Gemma 2 also normalises their outputs.
    norms_per_layer: int = 2
    # Tokens each query sees in the layers that use sliding-window attention (every layer for
    # Mistral v0.1 and Phi-3 Mini, every other layer for Gemma 2), as config.json says; None
    # where every layer sees the whole context.
    sliding_window: int | None = None
    # Qwen 3's RMSNorm over each head's query and key (one head_dim-wide scale each per layer).
    qk_norm: bool = False
    # Mixture of experts (Qwen3-MoE): experts per sparse layer, how many each token uses, their
    # MLP width, and the layers that keep a dense MLP of ``intermediate_dim`` instead (0 and
    # () for a dense model).
    num_experts: int = 0
    experts_per_token: int = 0
    moe_intermediate_dim: int = 0
    dense_layers: tuple[int, ...] = ()
    # Parameters outside the decoder the fields above describe: Llama 3.2 Vision's vision tower
    # and projector (counted, not planned layer by layer).
    extra_parameters: int = 0

    def __post_init__(self) -> None:
        if not self.head_dim:
            object.__setattr__(self, "head_dim", self.embed_dim // self.num_heads)

    def projections(self) -> dict[str, tuple[int, int]]:
        """(rows, cols) of each projection weight of a layer, by HF module name."""
        q_out, kv_out = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        return {
            "q_proj": (q_out, self.embed_dim),
            "k_proj": (kv_out, self.embed_dim),
            "v_proj": (kv_out, self.embed_dim),
            "o_proj": (self.embed_dim, q_out),
            "gate_proj/up_proj": (self.intermediate_dim, self.embed_dim),
            "down_proj": (self.embed_dim, self.intermediate_dim),
        }

    @property
    def sparse_layers(self) -> int:
        """Layers whose MLP is a mixture of experts."""
        return self.num_layers - len(self.dense_layers) if self.num_experts else 0

    def expert_parameter_count(self) -> int:
        """Every expert's weights (router included): held by the model, whichever tokens use."""
        per_layer = self.num_experts * (3 * self.embed_dim * self.moe_intermediate_dim)
        return self.sparse_layers * (per_layer + self.num_experts * self.embed_dim)

    def active_parameter_count(self) -> int:
        """The parameters one token's forward pass uses: of the experts, the router and the
        ``experts_per_token`` it is sent to (the whole model for a dense one)."""
        if not self.num_experts:
            return self.parameter_count()
        used = self.experts_per_token * 3 * self.embed_dim * self.moe_intermediate_dim
        unused = self.expert_parameter_count() - self.sparse_layers * (
            used + self.num_experts * self.embed_dim
        )
        return self.parameter_count() - unused

    def nf4_obstacle(self) -> str | None:
        """Why NF4 (QLoRA) cannot quantize this shape's weights, or None when it can."""
        if self.num_experts:
            return "its experts are stacked weights, which tunepack does not quantize to NF4"
        for name, (rows, cols) in self.projections().items():
            if rows * cols % NF4_BLOCK:
                return (
                    f"its {name} weight ({rows}x{cols} = {rows * cols} values) is not a "
                    f"multiple of NF4's block of {NF4_BLOCK} values"
                )
        return None

    def parameter_count(self) -> int:
        d, hd = self.embed_dim, self.head_dim
        q_out, kv_out = self.num_heads * hd, self.num_kv_heads * hd
        attention = d * q_out + 2 * d * kv_out + q_out * d
        if self.qkv_bias:
            attention += q_out + 2 * kv_out
        mlp = 3 * d * self.intermediate_dim
        norms = self.norms_per_layer * d + (2 * hd if self.qk_norm else 0)
        embeddings = self.vocab_size * d * (1 if self.tied_embeddings else 2)
        dense = self.num_layers - self.sparse_layers
        return (
            embeddings
            + self.num_layers * (attention + norms)
            + dense * mlp
            + self.expert_parameter_count()
            + d
            + self.extra_parameters
        )
