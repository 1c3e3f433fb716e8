"""A finished job's result: where the adapter (or model) is, and a quick generation.

On the local backend the result is a directory; ``load()`` reads the base model from the job's
workspace and the LoRA adapter with transformers + peft. On a cluster the result is on the job's
workspace PVC (``initializer-<job>``, kept after the TrainJob is deleted, mounted at
``/workspace``; the adapter under ``/workspace/output/adapter``): ``Result.path`` names it and
docs/cluster.md shows how to read it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from tunepack.errors import NotAvailableError
from tunepack.runtimes.generate import workspace_pvc


@dataclass
class Result:
    """``path``: the adapter (LoRA) or model (full) directory; ``base_model``: its base."""

    job: str
    path: str
    base_model: str
    method: str | None = None
    final_loss: float | None = None
    local: bool = True

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

    def generate(self, prompt: str, max_new_tokens: int = 32) -> str:
        """Generate a continuation of ``prompt`` with the fine-tuned model (greedy)."""
        model, tokenizer = self.load()
        inputs = tokenizer(prompt, return_tensors="pt")
        out = model.generate(**inputs, max_new_tokens=max_new_tokens, do_sample=False)
        return tokenizer.decode(out[0][inputs["input_ids"].shape[1] :], skip_special_tokens=True)


def result_for(backend, name: str) -> Result:
    from tunepack.backend_local import LocalBackend

    job = backend.get_job(name)
    if job.status != "Complete":
        raise ValueError(
            f"TrainJob {name} is {job.status}, not Complete"
            + (f": {job.message}" if getattr(job, "message", None) else "")
            + "; wait_for_job_status(name) first"
        )
    if isinstance(backend, LocalBackend):
        workspace = backend.workspace(name)
        info = json.loads((workspace / "output" / "result.json").read_text())
        return Result(
            job=name,
            path=info["artifact"],
            base_model=str(workspace / "model"),
            method=info.get("method"),
            final_loss=info.get("final_loss"),
        )
    pvc = workspace_pvc(name)
    return Result(
        job=name,
        path=f"pvc/{pvc}:/workspace/output/adapter",
        base_model=f"pvc/{pvc}:/workspace/model",
        local=False,
    )
