"""The GRPO side-by-side benchmark's TRL trainer (run by grpo_side_by_side.py in TRL's venv).

    python sbs_trl_grpo.py SETTINGS.json

TRL's ``GRPOTrainer`` with a PEFT LoRA adapter on the benchmark's model (its Hugging Face files)
and prompts (each a conversational prompt, one user turn, laid out by the model's chat template),
with the settings of tunepack's ``method=grpo`` run: ``batch_size`` prompts x ``num_generations``
answers per optimizer step (one micro-batch of that many completions, one update per generation,
so the old log-probabilities are the policy's own, detached), sampling by transformers'
``generate`` with a KV cache (temperature, top_p, no top-k, at most ``max_new_tokens``), the
group-normalised advantages (sample std + 1e-4: ``scale_rewards="group"``), the clipped
objective with the k3 KL estimate against the model with its adapters disabled (``beta``), each
answer's mean over its tokens then the mean over answers (``loss_type="grpo"``), AdamW, cosine
schedule without warm-up, no gradient clipping, fp32, CPU.

The reward is tunepack's ``format`` reward: 1.0 where ``re.search(pattern, answer, re.DOTALL)``
matches the decoded answer (TRL decodes without special tokens, so without its end-of-turn
token), else 0.0.

Each optimizer step's end is stamped (process CPU time and wall clock, from a callback); the
stamps, TRL's log history (reward, KL, completion length per step), the settings TRL resolved
and the versions go to ``SETTINGS["out"]/result.json``.
"""

from __future__ import annotations

import json
import re
import sys
import time
from pathlib import Path

from sbs_trl import (  # this folder: the script's own directory is on sys.path
    cpu_run_args,
    model_and_lora,
)

# tunepack's LoRA targets (runtimes' names) as Hugging Face Llama module names.
HF_MODULES = {
    "q_proj": "q_proj",
    "k_proj": "k_proj",
    "v_proj": "v_proj",
    "output_proj": "o_proj",
    "w1": "gate_proj",
    "w3": "up_proj",
    "w2": "down_proj",
}


def format_reward(pattern: str):
    """TRL's reward function form of tunepack's ``format`` reward."""
    compiled = re.compile(pattern, re.DOTALL)

    def format(completions, **_unused) -> list[float]:  # noqa: A001 (the metric's name)
        out = []
        for completion in completions:
            # Conversational prompts give message lists: the answer is the last one's content.
            text = completion[-1]["content"] if isinstance(completion, list) else completion
            out.append(1.0 if compiled.search(text) else 0.0)
        return out

    return format


def main(settings_path: str) -> int:
    s = json.loads(Path(settings_path).read_text())
    import datasets
    import peft
    import torch
    import transformers
    import trl

    class Stamps(transformers.TrainerCallback):
        """The process CPU time and the wall clock at the end of every optimizer step."""

        def __init__(self) -> None:
            self.records: list[dict] = []

        def on_step_end(self, args, state, control, **kwargs):
            self.records.append(
                {
                    "step": state.global_step,
                    "cpu_s": time.process_time(),
                    "wall_s": time.perf_counter(),
                }
            )

    tokenizer, model, lora = model_and_lora(s, [HF_MODULES[m] for m in s["lora_modules"]])
    config = trl.GRPOConfig(
        **cpu_run_args(s),
        # A batch counts completions: batch_size prompts, num_generations answers each.
        per_device_train_batch_size=s["batch_size"] * s["num_generations"],
        gradient_accumulation_steps=1,
        num_generations=s["num_generations"],
        steps_per_generation=1,
        num_iterations=1,
        max_completion_length=s["max_new_tokens"],
        temperature=s["temperature"],
        top_p=s["top_p"],
        top_k=0,
        beta=s["beta"],
        epsilon=s["epsilon"],
        loss_type="grpo",
        scale_rewards="group",
        mask_truncated_completions=False,
        use_vllm=False,
        gradient_checkpointing=False,
        log_completions=False,
    )
    rows = [json.loads(line) for line in Path(s["prompts"]).read_text().splitlines() if line]
    dataset = datasets.Dataset.from_list(
        [
            {"prompt": [{"role": "user", "content": r["prompt"]}], "answer": r["answer"]}
            for r in rows
        ]
    )
    stamps = Stamps()
    trainer = trl.GRPOTrainer(
        model=model,
        reward_funcs=format_reward(s["reward_pattern"]),
        args=config,
        train_dataset=dataset,
        processing_class=tokenizer,
        peft_config=lora,
        callbacks=[stamps],
    )
    trainable = sum(p.numel() for p in trainer.model.parameters() if p.requires_grad)
    trainer.train()
    resolved = {
        key: getattr(trainer.args, key)
        for key in (
            "per_device_train_batch_size",
            "generation_batch_size",
            "steps_per_generation",
            "num_iterations",
            "num_generations",
            "loss_type",
            "scale_rewards",
            "beta",
            "epsilon",
            "epsilon_high",
            "max_grad_norm",
            "weight_decay",
            "lr_scheduler_type",
            "gradient_checkpointing",
        )
    }
    resolved["eos_token_ids"] = list(trainer.eos_token_ids)
    resolved["trainable_parameters"] = trainable
    resolved["lora_target_modules"] = sorted(lora.target_modules)
    result = {
        "stamps": stamps.records,
        "log_history": trainer.state.log_history,
        "resolved": resolved,
        "versions": {m.__name__: m.__version__ for m in (trl, peft, transformers, torch, datasets)},
        "paths": {m.__name__: m.__file__ for m in (trl, peft, transformers, torch)},
    }
    Path(s["out"], "result.json").write_text(json.dumps(result, indent=2, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
