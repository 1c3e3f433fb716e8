"""The side-by-side benchmark's TRL + PEFT trainer (run by side_by_side.py in TRL's venv).

    python sbs_trl.py SETTINGS.json

TRL's ``SFTTrainer`` with a PEFT LoRA adapter, on the benchmark's model (its Hugging Face files)
and rows (alpaca rows as a conversational prompt/completion dataset, laid out by the model's chat
template, loss on the completion only), with the same settings as tunepack's run: batch size,
sequence length, LoRA rank/alpha/dropout on the attention and MLP projections, AdamW, learning
rate, weight decay, cosine schedule without warm-up, no gradient clipping, fp32, CPU. ``packing``
false pads each batch to its longest row; true is TRL's best-fit-decreasing packing, which is
padding-free (the batch is one row; the attention keeps the examples apart by their positions).
Batches go through ``sbs_probe.counting``; the last logged loss and the versions go to
``SETTINGS["out"]/result.json``.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def _rows(path: str) -> list[dict]:
    rows = []
    for line in Path(path).read_text(encoding="utf-8").splitlines():
        row = json.loads(line)
        prompt = row["instruction"] + (f"\n\n{row['input']}" if row["input"] else "")
        rows.append(
            {
                "prompt": [{"role": "user", "content": prompt}],
                "completion": [{"role": "assistant", "content": row["output"]}],
            }
        )
    return rows


def cpu_run_args(s: dict) -> dict:
    """The training arguments both TRL runs (this one and sbs_trl_grpo.py's) take from the
    settings, as tunepack runs: AdamW, a cosine schedule without warm-up, no gradient clipping,
    fp32 on the CPU, seeded, a loss logged every step and nothing saved."""
    return dict(
        output_dir=s["out"],
        max_steps=s["steps"],
        learning_rate=s["lr"],
        weight_decay=s["weight_decay"],
        lr_scheduler_type="cosine",
        warmup_steps=0,
        max_grad_norm=0.0,
        optim="adamw_torch",
        bf16=False,
        fp16=False,
        use_cpu=True,
        seed=s["seed"],
        data_seed=s["seed"],
        dataloader_num_workers=0,
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        disable_tqdm=True,
    )


def model_and_lora(s: dict, target_modules: list[str]):
    """The benchmark's model (its Hugging Face files, fp32, SDPA attention), its tokenizer and the
    PEFT LoRA config TRL puts on it, with the settings' threads and seed: both TRL runs' start."""
    import peft
    import torch
    import transformers

    torch.set_num_threads(s["threads"])
    torch.manual_seed(s["seed"])
    tokenizer = transformers.AutoTokenizer.from_pretrained(s["model_dir"])
    model = transformers.AutoModelForCausalLM.from_pretrained(
        s["model_dir"], dtype=torch.float32, attn_implementation="sdpa"
    )
    lora = peft.LoraConfig(
        r=s["lora_rank"],
        lora_alpha=s["lora_alpha"],
        lora_dropout=s["lora_dropout"],
        target_modules=target_modules,
        task_type="CAUSAL_LM",
    )
    return tokenizer, model, lora


def main(settings_path: str) -> int:
    s = json.loads(Path(settings_path).read_text())
    import datasets
    import peft
    import torch
    import transformers
    import trl
    from sbs_probe import counting

    modules = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    tokenizer, model, lora = model_and_lora(s, modules)
    packing = bool(s["packing"])
    config = trl.SFTConfig(
        **cpu_run_args(s),
        per_device_train_batch_size=s["batch_size"],
        max_length=s["max_seq_len"],
        packing=packing,
        packing_strategy="bfd",
        padding_free=packing,
    )
    trainer = trl.SFTTrainer(
        model=model,
        args=config,
        train_dataset=datasets.Dataset.from_list(_rows(s["data"])),
        processing_class=tokenizer,
        peft_config=lora,
    )
    trainer.data_collator = counting(trainer.data_collator)
    trainer.train()
    losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    result = {
        "loss": losses[-1] if losses else None,
        "first_loss": losses[0] if losses else None,
        "versions": {m.__name__: m.__version__ for m in (trl, peft, transformers, torch, datasets)},
        "paths": {m.__name__: m.__file__ for m in (trl, peft, transformers)},
    }
    Path(s["out"], "result.json").write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
