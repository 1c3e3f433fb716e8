"""A finished job's result: where the adapter (or model) is, and a quick generation.

On the local backend the result is a directory; ``load()`` reads the base model from the job's
workspace and the LoRA adapter with transformers + peft. On a cluster the result is on the job's
workspace PVC (``initializer-<job>``, kept after the TrainJob is deleted, mounted at
``/workspace``; the adapter under ``/workspace/output/adapter``): ``Result.path`` names it and
docs/cluster.md shows how to read it. A job given ``FineTune(export=...)`` also has its result
where the exporter put it (``Result.export``), and ``Result.download(dir)`` fetches it from
there, verified (docs/export.md).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from tunepack.core.errors import NotAvailableError


@dataclass
class Result:
    """``path``: the adapter (LoRA) or model (full) directory; ``base_model``: its base."""

    job: str
    path: str
    base_model: str
    method: str | None = None
    final_loss: float | None = None
    local: bool = True
    export: str | None = None  # where the exporter uploaded the result (FineTune(export=...))
    # The chat format it was trained in (result.json; trainers/prompt_format.py) and its default
    # system prompt: prompt_ids() and generate() use them.
    chat_template: str | None = None
    system_prompt: str | None = None

    def load(self):
        """(model, tokenizer) with transformers + peft (local backend only)."""
        if not self.local:
            raise NotAvailableError(
                f"the result is on the cluster volume {self.path}; copy it out first "
                "(docs/cluster.md, 'Getting the result') and load it from there"
            )
        try:
            from transformers import AutoModelForCausalLM, AutoTokenizer
        except ImportError:
            raise ImportError(
                "loading the result needs transformers: pip install transformers"
            ) from None
        tokenizer = AutoTokenizer.from_pretrained(self.base_model)
        if self.method == "full":
            return AutoModelForCausalLM.from_pretrained(self.path), tokenizer
        from peft import PeftModel

        base = AutoModelForCausalLM.from_pretrained(self.base_model)
        return PeftModel.from_pretrained(base, self.path), tokenizer

    def generate(self, prompt: str, max_new_tokens: int = 32, *, input: str = "") -> str:
        """The fine-tuned model's answer to ``prompt`` (greedy), asked the way it was trained:
        an instruction dataset's Alpaca template (``input``: the row's input column) or a chat
        turn, in the model's own format (``prompt_ids``); a text-completion run continues
        ``prompt`` as it is."""
        import torch

        model, tokenizer = self.load()
        ids = self.prompt_ids(prompt, input=input)
        if ids is None:
            ids = tokenizer(prompt)["input_ids"]
        input_ids = torch.tensor([ids])
        out = model.generate(
            input_ids=input_ids,
            attention_mask=torch.ones_like(input_ids),
            max_new_tokens=max_new_tokens,
            do_sample=False,
        )
        return tokenizer.decode(out[0][len(ids) :], skip_special_tokens=True)

    def prompt_ids(self, prompt: str, *, input: str = "") -> list[int] | None:
        """The tokens the model saw before each response in training, for ``prompt``: the
        dataset's schema (workspace ``dataset/`` manifest) in the run's chat format
        (``chat_template``, with its ``system_prompt``), up to the opening of the assistant's
        turn, as the model's Hugging Face chat template renders it with
        ``add_generation_prompt=True``. None for a text-completion run (the prompt is the text)."""
        from tunepack.core.workspace import DATASET_DIR, MANIFEST_FILE, MODEL_DIR, result_file

        workspace = self._workspace()
        schema = json.loads((workspace / DATASET_DIR / MANIFEST_FILE).read_text())["schema"]
        if schema == "text":
            return None
        from omegaconf import OmegaConf
        from torchtune import config as tt_config
        from torchtune.data import AlpacaToMessages, Message

        from tunepack.runtimes import catalog
        from tunepack.trainers.config import tokenizer_config

        info = json.loads(result_file(workspace).read_text())
        node = tokenizer_config(catalog.get(info["model"]), workspace / MODEL_DIR, None)
        # Results written before the format was recorded trained in the model's own format.
        node["chat_template"] = info.get("chat_template") or node["chat_template"]
        node["system_prompt"] = info.get("system_prompt")
        tokenizer = tt_config.instantiate(OmegaConf.create(node))
        if schema == "instruction":
            sample = {"instruction": prompt, "input": input, "output": ""}
            messages = AlpacaToMessages(train_on_input=True)(sample)["messages"]
        else:  # chat: one user turn, then the assistant's
            messages = [Message(role="user", content=prompt), Message("assistant", "")]
        ids, _ = tokenizer.tokenize_messages(messages, add_end_tokens=False)
        return ids

    def download(self, directory: str | Path, log=print) -> Path:
        """Fetch the exported result into ``directory`` (created; it appears only when complete
        and every file matches the export's manifest) and return its path: the artifact is
        ``<directory>/adapter`` (LoRA methods) or ``<directory>/model`` (full)."""
        from tunepack.initializers.sinks import fetch_export

        if not self.export:
            where = "" if not self.local else f"; the local result is at {self.path}"
            raise NotAvailableError(
                f"TrainJob {self.job} was not exported, so there is nothing to download: train "
                f"with FineTune(export='s3://bucket/prefix') (tunepack train --export URI){where}"
            )
        fetch_export(self.export, Path(directory), log)
        return Path(directory).expanduser().absolute()

    def _workspace(self) -> Path:
        if not self.local:
            raise NotAvailableError(
                f"the result is on the cluster volume {self.path}; copy it out first "
                "(docs/cluster.md, 'Getting the result') and use it from there"
            )
        return Path(self.base_model).parent
