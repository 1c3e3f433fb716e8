"""Export torchtune LoRA/DoRA adapter weights as a PEFT adapter for the Hugging Face model.

torchtune's own exporter (``tune_to_peft_adapter_weights``) assumes the Llama layout everywhere.
That is right for families whose HF checkpoints torchtune converts by permuting q/k rows (Llama,
Mistral, Gemma), but wrong for the others:

- Qwen 2/2.5 keep HF's q/k row order in torchtune, so no permutation applies;
- Phi-3/Phi-4 fuse ``qkv_proj`` and ``gate_up_proj`` in HF, so PEFT must target the fused
  modules. A LoRA pair per part becomes one LoRA of summed rank on the fused module:
  ``A = [A_q; A_k; A_v]`` and ``B = blockdiag(B_q, B_k, B_v)``, so ``B @ A`` stacks the parts'
  updates. ``rank_pattern``/``alpha_pattern`` keep each module's ``alpha / r`` scale unchanged.

- Qwen3-MoE's expert adapters (``moe.LoRAExperts``) become PEFT's ``target_parameters`` on
  transformers' fused ``mlp.experts.gate_up_proj`` and ``mlp.experts.down_proj`` (below).

tests/integration/test_families.py loads every family's exported adapter with peft and compares
logits with the trained torchtune model.
"""

from __future__ import annotations

import re

import torch

from tunepack.runtimes.families import peft_layout
from tunepack.trainers.models import moe

# torchtune module path (inside a layer) -> HF module path, for unfused families.
_MODULES = {
    "attn.q_proj": "self_attn.q_proj",
    "attn.k_proj": "self_attn.k_proj",
    "attn.v_proj": "self_attn.v_proj",
    "attn.output_proj": "self_attn.o_proj",
    "mlp.w1": "mlp.gate_proj",
    "mlp.w2": "mlp.down_proj",
    "mlp.w3": "mlp.up_proj",
}
# Phi's fused HF modules: parts in the order HF stacks their rows.
_FUSED = {
    "self_attn.qkv_proj": ("attn.q_proj", "attn.k_proj", "attn.v_proj"),
    "mlp.gate_up_proj": ("mlp.w1", "mlp.w3"),
}
_PEFT_TENSOR = {"lora_a": "lora_A", "lora_b": "lora_B", "magnitude": "lora_magnitude_vector"}
_KEY = re.compile(r"^layers\.(\d+)\.(.+)\.(lora_a|lora_b|magnitude)(?:\.weight)?$")


def _permute_rows(t: torch.Tensor, n_heads: int, head_dim: int) -> torch.Tensor:
    """torchtune's interleaved rotary row order -> HF's half-split order (rows are outputs)."""
    trailing = t.shape[1:]
    return (
        t.reshape(n_heads, head_dim // 2, 2, *trailing)
        .transpose(1, 2)
        .reshape(n_heads * head_dim, *trailing)
    )


def _hf_key(layer: str, module: str, tensor: str) -> str:
    suffix = "" if tensor == "magnitude" else ".weight"
    return f"base_model.model.model.layers.{layer}.{module}.{_PEFT_TENSOR[tensor]}{suffix}"


def export_adapter(
    adapter: dict[str, torch.Tensor],
    *,
    model_type: str,
    hf_config: dict,
    rank: int,
    alpha: float,
) -> tuple[dict[str, torch.Tensor], dict]:
    """Return PEFT weights and the extra config (target modules, rank/alpha patterns), in the
    layout of ``model_type``'s families (their record's ``peft_layout``; Llama 3.2 Vision's is
    ``export_mllama_adapter``'s)."""
    layout = peft_layout(model_type)
    if layout == "mllama":  # adapters on its text model and projector
        return export_mllama_adapter(adapter, hf_config=hf_config)
    n_heads, n_kv = hf_config["num_attention_heads"], hf_config["num_key_value_heads"]
    head_dim = hf_config.get("head_dim") or hf_config["hidden_size"] // n_heads
    adapter = dict(adapter)
    experts = _export_experts(adapter)  # pops the experts' adapters
    parts: dict[tuple[str, str], dict[str, torch.Tensor]] = {}
    for key, value in adapter.items():
        match = _KEY.match(key)
        if not match:
            raise ValueError(f"unexpected adapter parameter {key!r} (LoRA on the output layer?)")
        layer, module, tensor = match.groups()
        # B and the DoRA magnitude are indexed by output row, so they follow the row order.
        qk = module in ("attn.q_proj", "attn.k_proj")
        if layout == "permuted_qk" and qk and tensor != "lora_a":
            value = _permute_rows(value, n_heads if module == "attn.q_proj" else n_kv, head_dim)
        parts.setdefault((layer, module), {})[tensor] = value

    if layout != "fused":
        weights = {
            _hf_key(layer, _MODULES[module], tensor): value
            for (layer, module), tensors in parts.items()
            for tensor, value in tensors.items()
        }
        targets = sorted({_MODULES[module].split(".")[-1] for _, module in parts})
        return weights | experts, {"target_modules": targets} | _expert_targets(experts)

    weights, targets, rank_pattern, alpha_pattern = {}, set(), {}, {}
    layers = sorted({layer for layer, _ in parts}, key=int)
    for layer in layers:
        for module in ("attn.output_proj", "mlp.w2"):  # unfused in HF too
            for tensor, value in parts.get((layer, module), {}).items():
                weights[_hf_key(layer, _MODULES[module], tensor)] = value
                targets.add(_MODULES[module].split(".")[-1])
        for fused, members in _FUSED.items():
            present = [m for m in members if (layer, m) in parts]
            if not present:
                continue
            if any("magnitude" in parts[(layer, m)] for m in present):
                raise ValueError("DoRA adapters cannot be exported for fused Phi modules")
            # Every part's output rows appear in the fused B, zero where a part has no LoRA.
            out_rows = [_part_rows(m, hf_config, n_heads, n_kv, head_dim) for m in members]
            lora_a = torch.cat([parts[(layer, m)]["lora_a"] for m in present], dim=0)
            lora_b = torch.zeros(sum(out_rows), lora_a.shape[0], dtype=lora_a.dtype)
            row, col = 0, 0
            for member, rows in zip(members, out_rows, strict=True):
                if member in present:
                    b = parts[(layer, member)]["lora_b"]
                    lora_b[row : row + rows, col : col + b.shape[1]] = b
                    col += b.shape[1]
                row += rows
            weights[_hf_key(layer, fused, "lora_a")] = lora_a
            weights[_hf_key(layer, fused, "lora_b")] = lora_b
            name = fused.split(".")[-1]
            targets.add(name)
            rank_pattern[name] = rank * len(present)
            alpha_pattern[name] = alpha * len(present)  # same alpha / r as the parts had
    return weights, {
        "target_modules": sorted(targets),
        "rank_pattern": rank_pattern,
        "alpha_pattern": alpha_pattern,
    }


# transformers' fused expert weights, in the order PEFT nests its wrappers on ``mlp.experts``
# (the order the module defines them: the first is wrapped first, so its adapter sits under
# ``base_layer``).
_EXPERT_PARAMETERS = (("gate_up", "gate_up_proj", ".base_layer"), ("down", "down_proj", ""))


def _export_experts(adapter: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Pop the experts' adapters from ``adapter`` and return them in PEFT's layout.

    PEFT's adapter on a stacked parameter W (experts x d1 x d2) keeps ``lora_A.weight``
    ((experts * r) x d1, expert-major rows) and ``lora_B.weight`` (d2 x (r * experts), rank-major
    columns) and adds ``delta[e] = scaling x A_e^T @ B_e^T``. transformers applies ``W[e]`` as
    ``x @ W[e]^T``, so d1 is the output side: tunepack's B (experts x out x r) is PEFT's A, and
    tunepack's A (experts x r x in) is PEFT's B."""
    stacked: dict[tuple[str, str], dict[str, torch.Tensor]] = {}
    for key in [k for k in adapter if moe.EXPERT_ADAPTER_KEY.match(k)]:
        prefix, projection, side = moe.EXPERT_ADAPTER_KEY.match(key).groups()
        stacked.setdefault((prefix, projection), {})[side] = adapter.pop(key)
    weights = {}
    for (prefix, projection), sides in stacked.items():
        wrapper = next(w for p, _, w in _EXPERT_PARAMETERS if p == projection)
        b, a = sides["b"], sides["a"]  # experts x out x r, experts x r x in
        name = f"base_model.model.model.{prefix}{wrapper}"
        weights[f"{name}.lora_A.weight"] = b.permute(0, 2, 1).reshape(-1, b.shape[1])
        weights[f"{name}.lora_B.weight"] = a.permute(2, 1, 0).reshape(a.shape[2], -1)
    return weights


def _expert_targets(experts: dict[str, torch.Tensor]) -> dict:
    if not experts:
        return {}
    return {"target_parameters": [f"mlp.experts.{name}" for _, name, _ in _EXPERT_PARAMETERS]}


def _part_rows(module: str, hf_config: dict, n_heads: int, n_kv: int, head_dim: int) -> int:
    if module == "attn.q_proj":
        return n_heads * head_dim
    if module in ("attn.k_proj", "attn.v_proj"):
        return n_kv * head_dim
    return hf_config["intermediate_size"]  # mlp.w1 (gate) and mlp.w3 (up)


# --- Llama 3.2 Vision (trainers/models/mllama.py) ------------------------------------------------

_MLLAMA_KEY = re.compile(
    r"^decoder\.layers\.(\d+)\.(fusion_layer\.)?(.+)\.(lora_a|lora_b|magnitude)(?:\.weight)?$"
)
# torchtune's cross-attention module -> transformers' (its MLP names are the self layers').
_CROSS = {
    "attn.q_proj": "cross_attn.q_proj",
    "attn.k_proj": "cross_attn.k_proj",
    "attn.v_proj": "cross_attn.v_proj",
    "attn.output_proj": "cross_attn.o_proj",
}


def export_mllama_adapter(
    adapter: dict[str, torch.Tensor], *, hf_config: dict
) -> tuple[dict[str, torch.Tensor], dict]:
    """A Llama 3.2 Vision adapter (LoRA/DoRA on the text model) as PEFT's for transformers'
    ``MllamaForConditionalGeneration`` (transformers 5's module names,
    ``model.language_model.layers.N``): torchtune's layer j (and its fusion part) back to
    transformers' self-attention layer (and the cross-attention layer before it); q/k rows of the
    self-attention permuted as the checkpoint conversion permutes them (cross-attention has no
    RoPE and keeps its order); the projector's (``lora_projector``) as ``multi_modal_projector``'s.
    ``target_modules`` is a pattern that names only the adapted modules, so the vision tower's
    same-named projections stay untouched."""
    from tunepack.runtimes.mllama_config import fusion_positions
    from tunepack.trainers.models.mllama import PROJECTOR_ADAPTER

    text = hf_config["text_config"]
    n_heads, n_kv = text["num_attention_heads"], text["num_key_value_heads"]
    head_dim = text["hidden_size"] // n_heads
    layers, cross = text["num_hidden_layers"], set(text["cross_attention_layers"])
    positions = fusion_positions(layers, sorted(cross))
    self_of = {tune: hf for hf, tune in positions.items() if hf not in cross}
    cross_of = {tune: hf for hf, tune in positions.items() if hf in cross}
    weights: dict[str, torch.Tensor] = {}
    targets: set[str] = set()
    projector = False
    for key, value in adapter.items():
        if key.startswith(PROJECTOR_ADAPTER):  # the projector: one linear map, no row order
            tensor = key.removeprefix(PROJECTOR_ADAPTER).removesuffix(".weight")
            prefix = "base_model.model.model.multi_modal_projector"
            weights[f"{prefix}.{_PEFT_TENSOR[f'lora_{tensor}']}.weight"] = value
            projector = True
            continue
        match = _MLLAMA_KEY.match(key)
        if not match:
            raise ValueError(f"unexpected Llama 3.2 Vision adapter parameter {key!r}")
        index, fusion, module, tensor = match.groups()
        if fusion:
            hf_index, name = cross_of[int(index)], _CROSS.get(module) or _MODULES[module]
        else:
            hf_index, name = self_of[int(index)], _MODULES[module]
            if module in ("attn.q_proj", "attn.k_proj") and tensor != "lora_a":
                heads = n_heads if module == "attn.q_proj" else n_kv
                value = _permute_rows(value, heads, head_dim)
        suffix = "" if tensor == "magnitude" else ".weight"
        prefix = f"base_model.model.model.language_model.layers.{hf_index}.{name}"
        weights[f"{prefix}.{_PEFT_TENSOR[tensor]}{suffix}"] = value
        targets.add(name)
    alternatives = "|".join(re.escape(t) for t in sorted(targets))
    pattern = rf"model\.language_model\.layers\.\d+\.(?:{alternatives})"
    if projector:
        pattern = rf"{pattern}|model\.multi_modal_projector"
    return weights, {"target_modules": pattern}
