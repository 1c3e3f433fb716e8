"""Hugging Face model formats: config.json and safetensors key names, one dataclass per format.

Weights are random, normal(0, 0.02) like a fresh HF model, except the RMSNorm weights, which are
drawn around their neutral value (1, or 0 for Gemma's ``1 + w`` norms) so that a checkpoint
converter mixing up two norms shows in the logits instead of hiding behind identical weights.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from tunepack.runtimes.catalog import ModelEntry
from tunepack.tiny.bpe import TokenizerFiles

INIT_STD = 0.02
_NORM_STD = 0.1
_HEAD_NORM_STD = 0.5
# torchtune's Llama3ScaledRoPE defaults, which its llama3_1 / llama3_2 builders use.
_LLAMA3_ROPE = {
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}


def _llama_extra(entry: ModelEntry) -> dict:
    options = entry.family.options
    scaling = None
    if "scale_factor" in options:
        scaling = {"rope_type": "llama3", "factor": float(options["scale_factor"]), **_LLAMA3_ROPE}
    return {"rope_scaling": scaling, "attention_bias": False, "mlp_bias": False}


def _gemma2_extra(entry: ModelEntry) -> dict:
    attention_cap, final_cap = entry.family.softcapping
    return {
        "hidden_activation": "gelu_pytorch_tanh",
        "attn_logit_softcapping": attention_cap,
        "final_logit_softcapping": final_cap,
        # torchtune scales queries by head_dim ** -0.5 unless told otherwise; so does this.
        "query_pre_attn_scalar": entry.shape.head_dim,
        "sliding_window": entry.shape.sliding_window,
    }


def _gemma3_extra(entry: ModelEntry) -> dict:
    """Gemma3ForCausalLM's own fields, in transformers 5's layout (RoPE by layer type), from the
    family's builder options."""
    options, s = entry.family.options, entry.shape
    pattern = options["sliding_window_pattern"]
    full = {"rope_type": "default", "rope_theta": options["rope_base"]}
    if options["rope_scaling_factor"] != 1.0:
        full = {**full, "rope_type": "linear", "factor": options["rope_scaling_factor"]}
    return {
        "hidden_activation": "gelu_pytorch_tanh",
        "query_pre_attn_scalar": s.head_dim,
        "sliding_window": s.sliding_window,
        "layer_types": [
            "full_attention" if (i + 1) % pattern == 0 else "sliding_attention"
            for i in range(s.num_layers)
        ],
        "rope_parameters": {
            "full_attention": full,
            "sliding_attention": {"rope_type": "default", "rope_theta": options["rope_local_base"]},
        },
        "attn_logit_softcapping": None,
        "final_logit_softcapping": None,
        "attention_bias": False,
    }


def _qwen2_extra(entry: ModelEntry) -> dict:
    """Every Qwen's: full attention in every layer (no sliding window)."""
    return {
        "use_sliding_window": False,
        "sliding_window": None,
        "max_window_layers": entry.shape.num_layers,
    }


def _qwen3_extra(entry: ModelEntry) -> dict:
    """Qwen 3's: Qwen 2's, without the q/k/v biases."""
    return {"attention_bias": False, **_qwen2_extra(entry)}


@dataclass(frozen=True)
class HfFormat:
    hidden_act: str = "silu"
    # Phi-3 stores q/k/v as one qkv_proj and gate/up as one gate_up_proj.
    fused: bool = False
    # Gemma's RMSNorm multiplies by (1 + weight), so a neutral weight is 0.
    offset_norms: bool = False
    # Gemma 2 also normalises the attention and MLP outputs.
    layer_norms: tuple[str, ...] = ("input_layernorm", "post_attention_layernorm")
    extra: Callable[[ModelEntry], dict] = field(default=lambda entry: {})

    def config(self, entry: ModelEntry, tokenizer: TokenizerFiles) -> dict:
        s, options = entry.shape, entry.family.options
        config = {
            "architectures": [entry.family.hf_architecture],
            "model_type": entry.family.hf_model_type,
            "vocab_size": s.vocab_size,
            "hidden_size": s.embed_dim,
            "intermediate_size": s.intermediate_dim,
            "num_hidden_layers": s.num_layers,
            "num_attention_heads": s.num_heads,
            "num_key_value_heads": s.num_kv_heads,
            "head_dim": s.head_dim,
            "hidden_act": self.hidden_act,
            "max_position_embeddings": s.max_seq_len,
            "initializer_range": INIT_STD,
            # The family's builder options: both formats must describe the same model.
            "rms_norm_eps": options["norm_eps"],
            "rope_theta": options["rope_base"],
            "rope_scaling": None,
            "attention_dropout": 0.0,
            "tie_word_embeddings": s.tied_embeddings,
            "bos_token_id": tokenizer.bos_id,
            "eos_token_id": tokenizer.eos_id,
            "pad_token_id": tokenizer.pad_id,
            "torch_dtype": "float32",
            "use_cache": True,
        }
        return config | self.extra(entry)

    def weights(self, entry: ModelEntry, seed: int) -> dict:
        import torch

        s = entry.shape
        generator = torch.Generator().manual_seed(seed)

        def normal(*size: int) -> torch.Tensor:
            return torch.randn(*size, generator=generator) * INIT_STD

        def norm(size: int = 0, std: float = _NORM_STD) -> torch.Tensor:
            neutral = 0.0 if self.offset_norms else 1.0
            return neutral + torch.randn(size or d, generator=generator) * std

        d, q_out, kv_out = s.embed_dim, s.num_heads * s.head_dim, s.num_kv_heads * s.head_dim
        weights = {"model.embed_tokens.weight": normal(s.vocab_size, d)}
        for n in range(s.num_layers):
            attn, mlp = f"model.layers.{n}.self_attn", f"model.layers.{n}.mlp"
            q, k, v = normal(q_out, d), normal(kv_out, d), normal(kv_out, d)
            gate, up = normal(s.intermediate_dim, d), normal(s.intermediate_dim, d)
            layer = {
                f"{attn}.o_proj.weight": normal(d, q_out),
                f"{mlp}.down_proj.weight": normal(d, s.intermediate_dim),
            }
            if s.num_experts and n not in s.dense_layers:
                # A mixture of experts instead of the dense MLP, per expert as the Hub's files
                # and save_pretrained hold it; the router scaled up so routing is not uniform.
                del layer[f"{mlp}.down_proj.weight"]
                gate = up = None
                w = s.moe_intermediate_dim
                layer[f"{mlp}.gate.weight"] = normal(s.num_experts, d) * 25
                for e in range(s.num_experts):
                    layer[f"{mlp}.experts.{e}.gate_proj.weight"] = normal(w, d)
                    layer[f"{mlp}.experts.{e}.up_proj.weight"] = normal(w, d)
                    layer[f"{mlp}.experts.{e}.down_proj.weight"] = normal(d, w)
            if self.fused:
                layer[f"{attn}.qkv_proj.weight"] = torch.cat([q, k, v])
                layer[f"{mlp}.gate_up_proj.weight"] = torch.cat([gate, up])
            else:
                layer |= {
                    f"{attn}.{name}_proj.weight": w
                    for name, w in zip("qkv", (q, k, v), strict=True)
                }
                if gate is not None:
                    layer |= {f"{mlp}.gate_proj.weight": gate, f"{mlp}.up_proj.weight": up}
            if s.qkv_bias:
                sizes = {"q": q_out, "k": kv_out, "v": kv_out}
                layer |= {f"{attn}.{name}_proj.bias": normal(size) for name, size in sizes.items()}
            layer |= {f"model.layers.{n}.{name}.weight": norm() for name in self.layer_norms}
            if s.qk_norm:
                # Far from neutral, and different across each rotary pair, so that a norm left
                # out or applied after RoPE instead of before changes the logits clearly.
                layer |= {
                    f"{attn}.{name}.weight": norm(s.head_dim, _HEAD_NORM_STD)
                    for name in ("q_norm", "k_norm")
                }
            weights |= layer
        weights["model.norm.weight"] = norm()
        if not s.tied_embeddings:
            weights["lm_head.weight"] = normal(s.vocab_size, d)
        return weights


LLAMA = HfFormat(extra=_llama_extra)
MISTRAL = HfFormat(extra=lambda entry: {"sliding_window": entry.shape.sliding_window})
GEMMA = HfFormat(
    hidden_act="gelu_pytorch_tanh",
    offset_norms=True,
    extra=lambda entry: {"hidden_activation": "gelu_pytorch_tanh"},
)
GEMMA2 = HfFormat(
    hidden_act="gelu_pytorch_tanh",
    offset_norms=True,
    layer_norms=(
        "input_layernorm",
        "post_attention_layernorm",
        "pre_feedforward_layernorm",
        "post_feedforward_layernorm",
    ),
    extra=_gemma2_extra,
)
GEMMA3 = HfFormat(
    hidden_act="gelu_pytorch_tanh",
    offset_norms=True,
    layer_norms=GEMMA2.layer_norms,
    extra=_gemma3_extra,
)
PHI3 = HfFormat(
    fused=True,
    extra=lambda entry: {
        "original_max_position_embeddings": entry.shape.max_seq_len,
        "sliding_window": entry.shape.sliding_window,
        "resid_pdrop": 0.0,
        "embd_pdrop": 0.0,
    },
)
QWEN2 = HfFormat(extra=_qwen2_extra)
QWEN3 = HfFormat(extra=_qwen3_extra)
QWEN3_MOE = HfFormat(
    extra=lambda entry: {
        **_qwen3_extra(entry),
        "num_experts": entry.shape.num_experts,
        "num_experts_per_tok": entry.shape.experts_per_token,
        "moe_intermediate_size": entry.shape.moe_intermediate_dim,
        # Sparse layers as the shape has them: those not listed as dense.
        "decoder_sparse_step": 1,
        "mlp_only_layers": list(entry.shape.dense_layers),
        "norm_topk_prob": entry.family.options["norm_topk_prob"],
        "router_aux_loss_coef": entry.family.options["router_aux_loss_coef"],
        "output_router_logits": False,
    }
)

# The tiny models' formats by config.json's ``model_type`` (a family's ``hf_model_type``).
FORMATS: dict[str, HfFormat] = {
    "llama": LLAMA,
    "mistral": MISTRAL,
    "gemma": GEMMA,
    "gemma2": GEMMA2,
    "gemma3_text": GEMMA3,
    "phi3": PHI3,
    "qwen2": QWEN2,
    "qwen3": QWEN3,
    "qwen3_moe": QWEN3_MOE,
}
