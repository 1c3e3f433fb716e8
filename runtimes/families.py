"""The model families: one ``Family`` record per torchtune model family, each fact once.

What every size of a family shares: its Hugging Face ``model_type`` and architecture, the
tokenizer torchtune builds it with and the files it reads, how torchtune converts its checkpoint,
the builders that take its shape, its architecture options, its default chat format, its PEFT
layout, and what the trainer refuses for it. The catalog (``runtimes/catalog.py``) adds the
published sizes; the custom runtimes (``runtimes/custom.py``), the chat templates, the trainer's
chat formats and PEFT export, and the tiny models read a family's facts here and keep no table of
their own. docs/architecture.md, "A new family"; ``tests/unit/test_families.py``.

Pure Python: no import of the catalog, the trainer or torch (the initializers read it too)."""

from __future__ import annotations

from dataclasses import dataclass

# How a family's LoRA adapters become a PEFT adapter of the Hugging Face model
# (trainers/outputs/peft_export.py): "permuted_qk", torchtune's checkpoint conversion permutes the
# q/k rows (Llama, Mistral, Gemma 1/2), so the adapters' output rows are permuted back;
# "hf_order", torchtune keeps HF's row order (Qwen, Gemma 3); "fused", HF fuses q/k/v and
# gate/up (Phi), so the parts' adapters become one of summed rank; "mllama", Llama 3.2 Vision's
# text model and projector under transformers' names.
PEFT_LAYOUTS = ("permuted_qk", "hf_order", "fused", "mllama")


def peft_layout(model_type: str) -> str:
    """The PEFT layout of the families whose checkpoints torchtune converts as ``model_type``
    (its ``ModelType``: the checkpointer's ``model_type``); those families share one."""
    layouts = {f.peft_layout for f in FAMILIES.values() if f.checkpoint_model_type == model_type}
    if len(layouts) != 1:
        raise ValueError(f"no one PEFT layout for checkpoint model type {model_type!r}: {layouts}")
    return layouts.pop()


@dataclass(frozen=True)
class Tokenizer:
    """The torchtune tokenizer builder and the files (relative to the model dir) it reads.

    ``files`` maps builder keyword -> file; all of them must exist before training starts.
    """

    component: str
    files: dict[str, str]


@dataclass(frozen=True)
class Family:
    """What every size of one torchtune model family shares."""

    name: str  # the torchtune package: torchtune.models.<name>
    title: str
    hf_model_type: str  # config.json "model_type"
    hf_architecture: str  # config.json "architectures"[0]
    tokenizer: Tokenizer
    checkpoint_model_type: str  # torchtune's ModelType for the HF checkpointer
    # Builders that take the shape as keywords (tiny variants use them).
    component_builders: dict[str, str]
    # Architecture constants the component builders take besides the shape; the tiny generator
    # writes the same values into config.json so both formats describe one model.
    options: dict[str, object]
    # The chat format of its published model (runtimes/chat_templates.py's TEMPLATES: the format
    # it trains in by default, that serving and the initializer check against).
    chat_format: str
    # How its adapters map onto the Hugging Face model's modules for PEFT (PEFT_LAYOUTS,
    # trainers/outputs/peft_export.py).
    peft_layout: str
    # Shape fields the component builders take beyond the common seven, by keyword.
    shape_keywords: tuple[str, ...] = ()
    # Default of ModelEntry.lora_output for the family's sizes.
    lora_output: bool = True
    # (attention, final logit) tanh soft-capping of the HF model, for Gemma 2: torchtune's Gemma 2
    # caps elsewhere, so the trainer corrects the model it builds (trainers/models/builders.py).
    softcapping: tuple[float, float] | None = None
    # Why the trainer refuses packed=true for this family, if it does.
    no_packing: str | None = None
    # The checkpointer that converts the family's HF checkpoints (a tunepack subclass where
    # torchtune 0.6.1's conversion does not know every key, as for Qwen 3's q/k norms).
    checkpointer: str = "torchtune.training.FullModelHFCheckpointer"
    # Whether its models take images (an image_chat dataset): none of the text families do.
    reads_images: bool = False
    # The only methods its models train with, where not every method (None: every one).
    only_methods: tuple[str, ...] | None = None
    # The tokenizer format of its tiny variant (tunepack.tiny.model.TOKENIZERS; its model format
    # is config.json's model_type's, tunepack.tiny.hf.FORMATS). None: transformers writes the
    # tiny model (a family that reads images, tunepack.tiny.mllama).
    tiny_tokenizer: str | None = None


_SENTENCEPIECE = {"path": "tokenizer.model"}
# Llama 3's tiktoken model lives under original/; tokenizer.json supplies the special tokens.
TIKTOKEN_FILES = {"path": "original/tokenizer.model", "special_tokens_path": "tokenizer.json"}
# GPT-2-style byte-level BPE; tokenizer.json supplies the special tokens and their ids.
_QWEN_BPE = {
    "path": "vocab.json",
    "merges_file": "merges.txt",
    "special_tokens_path": "tokenizer.json",
}
_LLAMA2_OPTIONS = {"rope_base": 10_000.0, "norm_eps": 1e-5}
_LLAMA3_OPTIONS = {"rope_base": 500_000.0, "norm_eps": 1e-5}


def _family(name: str, title: str, hf_model_type: str, hf_architecture: str, *,
            tokenizer: Tokenizer, model_type: str, builders: str, options: dict,
            **extra) -> Family:  # fmt: skip
    """``builders`` is the component builder's module path: ``torchtune.models.qwen2.qwen2``."""
    package, function = builders.rsplit(".", 1)
    return Family(
        name=name,
        title=title,
        hf_model_type=hf_model_type,
        hf_architecture=hf_architecture,
        tokenizer=tokenizer,
        checkpoint_model_type=model_type,
        component_builders={"full": builders, "lora": f"{package}.lora_{function}"},
        options=options,
        **extra,
    )


def _tokenizer(family: str, files: dict[str, str], builder: str | None = None) -> Tokenizer:
    return Tokenizer(f"torchtune.models.{family}.{builder or family + '_tokenizer'}", files)


_LLAMA2_TOKENIZER = _tokenizer("llama2", _SENTENCEPIECE)
# Gemma 3's builder options at every size (the sizes' own values are in GEMMA3_SIZES): global
# layers' rope_theta, local layers' rope_local_base_freq, no RoPE scaling (1B), one global layer
# in sliding_window_pattern (transformers' default layer_types).
GEMMA3_OPTIONS = {"rope_base": 1_000_000.0, "norm_eps": 1e-6, "rope_local_base": 10_000.0,
                  "rope_scaling_factor": 1.0, "sliding_window_pattern": 6}  # fmt: skip
_LLAMA3_TOKENIZER = _tokenizer("llama3", TIKTOKEN_FILES)

FAMILIES: dict[str, Family] = {
    f.name: f
    for f in (
        _family("llama2", "Llama 2", "llama", "LlamaForCausalLM",
                chat_format="llama2", peft_layout="permuted_qk", tiny_tokenizer="llama_spm",
                tokenizer=_LLAMA2_TOKENIZER, model_type="LLAMA2",
                builders="torchtune.models.llama2.llama2", options=_LLAMA2_OPTIONS),
        # Code Llama is a Llama 2 with a longer RoPE period; torchtune builds it with llama2().
        _family("code_llama2", "Code Llama 2", "llama", "LlamaForCausalLM",
                chat_format="llama2", peft_layout="permuted_qk", tiny_tokenizer="llama_spm",
                tokenizer=_LLAMA2_TOKENIZER, model_type="LLAMA2",
                builders="torchtune.models.llama2.llama2",
                options={"rope_base": 1_000_000.0, "norm_eps": 1e-5}),
        _family("llama3", "Llama 3", "llama", "LlamaForCausalLM",
                chat_format="llama3", peft_layout="permuted_qk", tiny_tokenizer="tiktoken",
                tokenizer=_LLAMA3_TOKENIZER, model_type="LLAMA3",
                builders="torchtune.models.llama3.llama3", options=_LLAMA3_OPTIONS),
        # 3.1 and 3.3 stretch RoPE by 8 for their 128K context; 3.2 by 32 and ties embeddings.
        _family("llama3_1", "Llama 3.1", "llama", "LlamaForCausalLM",
                chat_format="llama3.1", peft_layout="permuted_qk", tiny_tokenizer="tiktoken",
                tokenizer=_LLAMA3_TOKENIZER, model_type="LLAMA3",
                builders="torchtune.models.llama3_1.llama3_1",
                options=_LLAMA3_OPTIONS | {"scale_factor": 8}),
        _family("llama3_2", "Llama 3.2", "llama", "LlamaForCausalLM",
                chat_format="llama3.2", peft_layout="permuted_qk", tiny_tokenizer="tiktoken",
                tokenizer=_LLAMA3_TOKENIZER, model_type="LLAMA3_2",
                builders="torchtune.models.llama3_2.llama3_2",
                options=_LLAMA3_OPTIONS | {"scale_factor": 32},
                shape_keywords=("tie_word_embeddings",)),
        # torchtune's llama3_3 builders are its llama3_1 builders under another name.
        _family("llama3_3", "Llama 3.3", "llama", "LlamaForCausalLM",
                chat_format="llama3.1", peft_layout="permuted_qk", tiny_tokenizer="tiktoken",
                tokenizer=_LLAMA3_TOKENIZER, model_type="LLAMA3",
                builders="torchtune.models.llama3_1.llama3_1",
                options=_LLAMA3_OPTIONS | {"scale_factor": 8}),
        _family("mistral", "Mistral", "mistral", "MistralForCausalLM",
                chat_format="mistral", peft_layout="permuted_qk", tiny_tokenizer="llama_spm",
                tokenizer=_tokenizer("mistral", _SENTENCEPIECE), model_type="MISTRAL",
                builders="torchtune.models.mistral.mistral", options=_LLAMA2_OPTIONS),
        # Gemma: GeGLU MLP, embeddings scaled by sqrt(dim) and tied to the output, (1 + w) norms.
        _family("gemma", "Gemma", "gemma", "GemmaForCausalLM",
                chat_format="gemma", peft_layout="permuted_qk", tiny_tokenizer="gemma_spm",
                tokenizer=_tokenizer("gemma", _SENTENCEPIECE), model_type="GEMMA",
                builders="torchtune.models.gemma.gemma",
                options={"rope_base": 10_000.0, "norm_eps": 1e-6},
                shape_keywords=("head_dim",), lora_output=False),
        # Gemma 2 adds tanh soft-capping of attention scores and logits, sliding-window attention
        # on every other layer and post-attention/post-MLP norms. torchtune 0.6.1 gets the norms'
        # order and the capping wrong; the trainer corrects its model (trainers/models/builders.py).
        _family("gemma2", "Gemma 2", "gemma2", "Gemma2ForCausalLM",
                chat_format="gemma", peft_layout="permuted_qk", tiny_tokenizer="gemma_spm",
                tokenizer=_tokenizer("gemma", _SENTENCEPIECE), model_type="GEMMA2",
                builders="torchtune.models.gemma2.gemma2",
                options={"rope_base": 10_000.0, "norm_eps": 1e-6},
                shape_keywords=("head_dim", "sliding_window_size"), lora_output=False,
                softcapping=(50.0, 30.0),
                no_packing="torchtune 0.6.1's Gemma 2 attention cannot take the block masks "
                "packing uses on a GPU"),
        # Phi-3 fuses q/k/v and gate/up in its HF checkpoint; the checkpointer splits them.
        _family("phi3", "Phi-3", "phi3", "Phi3ForCausalLM",
                chat_format="phi3", peft_layout="fused", tiny_tokenizer="phi3_spm",
                tokenizer=_tokenizer("phi3", {**_SENTENCEPIECE, "special_tokens_path":
                                              "tokenizer.json"}, "phi3_mini_tokenizer"),
                model_type="PHI3_MINI", builders="torchtune.models.phi3.phi3",
                options=_LLAMA2_OPTIONS),
        # Phi-4 is a Phi-3 architecture (torchtune builds it with phi3()) with a tiktoken-derived
        # byte-level BPE vocabulary shipped as vocab.json + merges.txt.
        _family("phi4", "Phi-4", "phi3", "Phi3ForCausalLM",
                chat_format="phi4", peft_layout="fused", tiny_tokenizer="phi4_bpe",
                tokenizer=_tokenizer("phi4", {"vocab_path": "vocab.json",
                                              "merges_path": "merges.txt",
                                              "special_tokens_path": "tokenizer.json"}),
                model_type="PHI4", builders="torchtune.models.phi3.phi3",
                # microsoft/phi-4's rope_theta; torchtune's phi4_14b builds 10000 (the trainer
                # rebuilds RoPE, trainers/models/builders.py).
                options={"rope_base": 250_000.0, "norm_eps": 1e-5}),
        _family("qwen2", "Qwen 2", "qwen2", "Qwen2ForCausalLM",
                chat_format="qwen2", peft_layout="hf_order", tiny_tokenizer="qwen2_bpe",
                tokenizer=_tokenizer("qwen2", _QWEN_BPE), model_type="QWEN2",
                builders="torchtune.models.qwen2.qwen2",
                options={"rope_base": 1_000_000.0, "norm_eps": 1e-6},
                shape_keywords=("tie_word_embeddings",)),
        # Qwen 2.5 is the Qwen 2 architecture with more special tokens.
        _family("qwen2_5", "Qwen 2.5", "qwen2", "Qwen2ForCausalLM",
                chat_format="qwen2.5", peft_layout="hf_order", tiny_tokenizer="qwen2_5_bpe",
                tokenizer=_tokenizer("qwen2_5", _QWEN_BPE), model_type="QWEN2",
                builders="torchtune.models.qwen2.qwen2",
                options={"rope_base": 1_000_000.0, "norm_eps": 1e-6},
                shape_keywords=("tie_word_embeddings",)),
        # Qwen 3 (dense): not in torchtune 0.6.1, so built by tunepack on its components
        # (trainers/models/qwen3.py): Qwen 2 without q/k/v biases, with an explicit head_dim and an
        # RMSNorm over each head's query and key. Qwen 2.5's BPE vocabulary and ChatML format.
        _family("qwen3", "Qwen 3", "qwen3", "Qwen3ForCausalLM",
                chat_format="qwen3", peft_layout="hf_order", tiny_tokenizer="qwen3_bpe",
                tokenizer=_tokenizer("qwen2_5", _QWEN_BPE), model_type="QWEN2",
                builders="tunepack.trainers.models.qwen3.qwen3",
                options={"rope_base": 1_000_000.0, "norm_eps": 1e-6},
                shape_keywords=("head_dim", "tie_word_embeddings"),
                checkpointer="tunepack.trainers.models.qwen3.Qwen3HFCheckpointer"),
        # Gemma 3 (text): not in torchtune 0.6.1, so built by tunepack on its components
        # (trainers/models/gemma3.py): Gemma 2's four norms per layer without its soft-capping, q/k
        # RMSNorm per head, five sliding-window layers to one global layer, separate RoPE bases
        # for the two kinds. Gemma's SentencePiece vocabulary and turn markers.
        _family("gemma3", "Gemma 3", "gemma3_text", "Gemma3ForCausalLM",
                chat_format="gemma3", peft_layout="hf_order", tiny_tokenizer="gemma_spm",
                tokenizer=_tokenizer("gemma", _SENTENCEPIECE), model_type="GEMMA3",
                builders="tunepack.trainers.models.gemma3.gemma3",
                options=GEMMA3_OPTIONS, shape_keywords=("head_dim", "sliding_window_size"),
                lora_output=False,
                checkpointer="tunepack.trainers.models.gemma3.Gemma3HFCheckpointer"),
        # Qwen3-MoE: Qwen 3's attention with a mixture-of-experts MLP (router, top-k SwiGLU
        # experts), built by tunepack (trainers/models/qwen3_moe.py, trainers/models/moe.py). The
        # options are config.json's norm_topk_prob and router_aux_loss_coef (the load-balancing
        # loss's weight, added to the training loss when above 0).
        _family("qwen3_moe", "Qwen3-MoE", "qwen3_moe", "Qwen3MoeForCausalLM",
                chat_format="qwen3", peft_layout="hf_order", tiny_tokenizer="qwen3_bpe",
                tokenizer=_tokenizer("qwen2_5", _QWEN_BPE), model_type="QWEN2",
                builders="tunepack.trainers.models.qwen3_moe.qwen3_moe",
                options={"rope_base": 1_000_000.0, "norm_eps": 1e-6, "norm_topk_prob": True,
                         "router_aux_loss_coef": 0.001},
                shape_keywords=("head_dim", "tie_word_embeddings", "num_experts",
                                "experts_per_token", "moe_intermediate_dim", "dense_layers"),
                checkpointer="tunepack.trainers.models.qwen3_moe.Qwen3MoeHFCheckpointer"),
        # Llama 3.2 Vision (transformers' Mllama): a Llama 3.1-style text model with gated
        # cross-attention layers reading a two-stage CLIP-style vision tower
        # (trainers/models/mllama.py, built by tunepack on torchtune's components). Its builders
        # take their shape from the checkpoint's config.json (mllama_builder_kwargs), not from the
        # catalog's Shape, which describes the text model only. Llama 3's tiktoken vocabulary with
        # <|image|> after it.
        _family("mllama", "Llama 3.2 Vision", "mllama", "MllamaForConditionalGeneration",
                chat_format="llama3.2-vision", peft_layout="mllama",
                tokenizer=_LLAMA3_TOKENIZER, model_type="MLLAMA",
                builders="tunepack.trainers.models.mllama.mllama",
                options=_LLAMA3_OPTIONS | {"scale_factor": 8},
                checkpointer="tunepack.trainers.models.mllama.MllamaHFCheckpointer",
                no_packing="Llama 3.2 Vision's rows carry images, which packing cannot join",
                reads_images=True,
                # Supervised fine-tuning on image-text (and text) chats: the text model's LoRA,
                # DoRA or QLoRA (its projections in NF4; the vision tower stays in the dtype), or
                # every weight. The preference and RL methods are not wired for images yet.
                only_methods=("full", "lora", "dora", "qlora")),
    )
}  # fmt: skip
