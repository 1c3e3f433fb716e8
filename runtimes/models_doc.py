"""The model table of docs/models.md, rendered from the catalog.

``python -m tunepack.runtimes.models_doc`` rewrites docs/models.md (``--check``: exit 1 while it is
stale; ``make generate`` runs it with the other generators); tests/unit/test_catalog.py fails
when the file differs from what the catalog renders, so the table cannot go stale.
"""

from __future__ import annotations

import sys
from pathlib import Path

from tunepack.runtimes import catalog, host

DOC = Path(__file__).resolve().parent.parent / "docs" / "models.md"

_HEADER = """\
# Models

Generated from `runtimes/catalog.py` by `python -m tunepack.runtimes.models_doc`; do not edit.
A test fails when this page and the catalog differ.

Every runtime trains the checkpoint's own model: `tests/integration/test_families.py` compares
each family's logits with transformers' on a tiny random checkpoint, and the exported PEFT
adapter with the trained model. Qwen 3 is not in torchtune 0.6.1: tunepack builds it on
torchtune's components
(`trainers/models/qwen3.py`: q/k RMSNorm per head before RoPE, as Hugging Face's Qwen 3) and
converts its checkpoints with a checkpointer that knows the q/k norms. Gemma 3 is not in torchtune
0.6.1 either (`trainers/models/gemma3.py`: five sliding-window layers to one global one, each kind
with its own RoPE base, q/k norms before RoPE). Gemma 3 4B, 12B and 27B are published as image-text
checkpoints (`Gemma3ForConditionalGeneration`): tunepack trains their text weights (the vision tower
is not read) and saves a text-only `Gemma3ForCausalLM` (`model/`, `merged/`); their LoRA adapter is
for that text model. Qwen3-MoE is not in torchtune 0.6.1 either (`trainers/models/qwen3_moe.py`,
`trainers/models/moe.py`: Qwen 3's attention, a router sending each token to its top experts,
transformers' load-balancing loss added to the training loss): its parameter count is the total,
every expert held; `tunepack plan` also shows the parameters a token uses. Its LoRA adapts attention
by default; `lora_mlp=true` adds a LoRA pair per expert (and the dense MLP layers, where a
checkpoint has them), which loads in PEFT as `target_parameters` on transformers' fused expert
weights (no dropout or DoRA there, as in PEFT; the router stays frozen).

"Chat template" is the format a runtime trains chat and instruction data in by default: the
published chat template of the checkpoint's `tokenizer_config.json`, token for token
(`runtimes/chat_templates.py`; docs/trainer.md, "Chat format"; `chat_template=` picks another of
the same tokens).

The `-custom` runtimes take your own checkpoint of an architecture (a fine-tune, a
re-trained or resized model): the model is built from the checkpoint's `config.json` and its text
encoded by the checkpoint's own `tokenizer.json`, in the chat format shown. What the builders
cannot reproduce is refused by the model initializer with the field and its value
(`runtimes/custom.py`; docs/trainer.md, "Models"). Mistral's and Phi-3's sliding window caps
`max_seq_len` (torchtune's models attend over the whole sequence, which agrees with the window
up to its length); Gemma 2's and Gemma 3's are built in.


| Custom runtime | Architecture | Built with | Default chat template | Refused |
|---|---|---|---|---|
{custom}

"Trainer node" is what each trainer Pod of the runtime requests of its node by default: the
GPUs, and CPU and memory sized from the model (`runtimes/host.py`: the checkpoint loaded into
host memory in bf16 once per node, 3 GiB per trainer process and a 2 GiB margin; 2 CPUs per
process). A node with less allocatable CPU or memory leaves the Pod Pending (`tunepack status`
says which resource); a TrainJob's `resourcesPerNode` changes the requests (docs/cluster.md,
"Node shapes"). The `-custom` runtimes' trainer node is {custom_node}, sized for checkpoints of
up to {custom_billions:g}B parameters.

| Runtime | Hugging Face checkpoint | Family | Parameters | Methods | Chat template | Trainer node |
|---|---|---|---|---|---|---|
"""


def _billions(count: int) -> str:
    return f"{count / 1e9:.2f}B" if count >= 1e9 else f"{count / 1e6:.1f}M"


def _custom_rows() -> str:
    from tunepack.runtimes import custom

    rows = []
    for e in catalog.CUSTOM.values():
        arch = custom.ARCHITECTURES[e.custom]
        refused = [
            f"{arch.activation_field} other than {arch.activation}",
            "MLP biases" if arch.qkv_bias else "attention/MLP biases",
        ]
        if arch.head_dim == "derived":
            refused.append("head_dim other than hidden_size / heads")
        refused.append(
            {"never": "tied embeddings", "always": "untied embeddings", "either": ""}[arch.tied]
        )
        if arch.gemma3:
            refused.append("RoPE scaling other than linear on the global layers")
            refused.append("soft-capping")
        else:
            refused.append("RoPE scaling other than llama3" if arch.llama3_rope else "RoPE scaling")
        if arch.qkv_bias:  # Qwen 2's config has the switch
            refused.append("use_sliding_window=true")
        if arch.softcapping:
            refused.append("query_pre_attn_scalar other than head_dim")
        if arch.moe:
            refused.append("use_sliding_window=true; no sparse layer (decoder_sparse_step)")
        rows.append(
            f"| `{e.runtime_name}` | {arch.model_type} | {e.family.title}'s builders"
            f" | {e.family.chat_format} | {'; '.join(r for r in refused if r)} |"
        )
    return "\n".join(rows)


def render() -> str:
    rows = [
        f"| `{e.runtime_name}` | `{e.hub_id}` | {e.family.title} | {_billions(e.parameter_count)}"
        f" | {', '.join(e.methods)} | {e.family.chat_format}"
        f" | {host.node_shape(e).describe()} |"
        for e in catalog.CATALOG.values()
        if not e.custom
    ]
    header = _HEADER.format(
        custom=_custom_rows(),
        custom_node=host.node_shape(next(iter(catalog.CUSTOM.values()))).describe(),
        custom_billions=catalog.CUSTOM_TIER.up_to_billions,
    )
    return header + "\n".join(rows) + "\n"


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv not in ([], ["--check"]):
        print("usage: python -m tunepack.runtimes.models_doc [--check]", file=sys.stderr)
        return 64  # EX_USAGE
    if not DOC.parent.is_dir():
        print(
            f"tunepack.runtimes.models_doc: error: {DOC.parent} is not here (run it in a checkout)"
        )
        return 65
    if argv == ["--check"]:
        if not DOC.is_file() or DOC.read_text(encoding="utf-8") != render():
            print(f"{DOC} is stale: run `make generate`", file=sys.stderr)
            return 1
        print(f"{DOC} is up to date")
        return 0
    DOC.write_text(render(), encoding="utf-8")
    print(f"wrote {DOC}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
