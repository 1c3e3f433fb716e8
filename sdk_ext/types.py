"""The types tunepack's backends return, as ``kubeflow.trainer.types`` holds the SDK's: runtimes,
jobs and a finished job's result (what a notebook gets back from ``TrainingClient``).

- ``TunepackRuntime`` and ``TrainJob`` subclass the Kubeflow SDK's dataclasses
  (``kubeflow.trainer.types``), so code written for ``TrainerClient`` (``runtime.name``,
  ``job.status``, ``job.steps``) keeps working; the extra fields carry what a fine-tune needs: the
  catalog model and methods, ``Progress``, and why a job failed. ``RuntimeList`` shows as a table.
- ``Result`` (``client.result(name)``): where the adapter (or model) is, and a quick generation.
  On the local backend the result is a directory; ``load()`` reads the base model from the job's
  workspace and the LoRA adapter with transformers + peft. On a cluster the result is on the
  job's workspace PVC (``initializer-<job>``, kept after the TrainJob is deleted, mounted at
  ``/workspace``; the adapter under ``/workspace/output/adapter``): ``Result.path`` names it and
  docs/cluster.md shows how to read it. A job given ``FineTune(export=...)`` also has its result
  where the exporter put it (``Result.export``), and ``Result.download(dir)`` fetches it from
  there, verified (docs/export.md).

What a notebook shows of them, the progress bar and the loss plot, is
``tunepack.notebook_progress``'s.
"""

from __future__ import annotations

import contextlib
import html
import json
import logging
import warnings
from dataclasses import dataclass, field
from pathlib import Path

from kubeflow.trainer.types import types as kf

from tunepack.core.errors import BadValueError, NotAvailableError, UnsupportedError
from tunepack.runtimes import catalog, methods

COLUMNS = ("name", "model", "methods", "parameters", "default_gpus", "description")


@dataclass
class TunepackRuntime(kf.Runtime):
    """A runtime, with the catalog's facts when it is a tunepack runtime."""

    model: str | None = None
    methods: tuple[str, ...] = ()
    parameters: int | None = None
    default_gpus: int | None = None
    description: str = ""

    @classmethod
    def wrap(cls, runtime: kf.Runtime) -> TunepackRuntime:
        """Add the catalog's facts to an SDK ``Runtime`` (unchanged when not tunepack's)."""
        extra: dict = {}
        if runtime.name.startswith(catalog.RUNTIME_PREFIX):
            key = runtime.name.removeprefix(catalog.RUNTIME_PREFIX)
            entry = catalog.CATALOG.get(key)
            if entry is not None:
                extra = {
                    "model": entry.name,
                    "methods": entry.methods,
                    "parameters": None if entry.custom else entry.parameter_count,
                    "default_gpus": entry.resources.gpus,
                    "description": entry.description,
                }
        return cls(
            name=runtime.name,
            trainer=runtime.trainer,
            kind=runtime.kind,
            pretrained_model=runtime.pretrained_model,
            **extra,
        )

    def __eq__(self, other):
        """Equal to the SDK's ``Runtime`` (or another ``TunepackRuntime``) that describes the same
        runtime: the catalog's extra fields are derived from the name, so they are not compared."""
        if not isinstance(other, kf.Runtime):
            return NotImplemented
        fields = ("name", "trainer", "kind", "pretrained_model")
        return all(getattr(self, f) == getattr(other, f) for f in fields)

    __hash__ = None  # as the SDK's Runtime (a mutable dataclass)

    def row(self) -> dict:
        return {
            "name": self.name,
            "model": self.model or "",
            "methods": ",".join(self.methods),
            "parameters": _count(self.parameters) if self.parameters else "",
            "default_gpus": "" if self.default_gpus is None else self.default_gpus,
            "description": self.description,
        }


class RuntimeList(list):
    """A list of runtimes that shows as a table in Jupyter (and converts to pandas).

    >>> client.list_runtimes()                      # an HTML table in a notebook
    >>> pandas.DataFrame(client.list_runtimes().rows())
    """

    def rows(self) -> list[dict]:
        return [
            TunepackRuntime.wrap(r).row() if not isinstance(r, TunepackRuntime) else r.row()
            for r in self
        ]

    def _repr_html_(self) -> str:
        head = "".join(f"<th>{html.escape(c)}</th>" for c in COLUMNS)
        body = "".join(
            "<tr>" + "".join(f"<td>{html.escape(str(row[c]))}</td>" for c in COLUMNS) + "</tr>"
            for row in self.rows()
        )
        return f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"

    def __str__(self) -> str:
        rows = [[str(r[c]) for c in COLUMNS] for r in self.rows()]
        widths = [max(len(x) for x in col) for col in zip(COLUMNS, *rows, strict=False)]
        lines = [
            "  ".join(v.ljust(w) for v, w in zip(line, widths, strict=True)).rstrip()
            for line in [list(COLUMNS), *rows]
        ]
        return "\n".join(lines)


@dataclass
class Progress:
    """Training progress, from the TrainJob's ``trainerStatus`` or a local ``metrics.jsonl``."""

    percent: int | None = None
    step: int | None = None
    total_steps: int | None = None
    loss: float | None = None
    estimated_remaining_seconds: int | None = None
    val_loss: float | None = None  # the latest validation loss (runs with val_fraction)
    val_perplexity: float | None = None
    tokens_per_second: float | None = None  # of the latest optimizer step
    reward: float | None = None  # method=grpo: the latest step's mean reward


@dataclass
class TrainJob(kf.TrainJob):
    """The SDK's ``TrainJob`` plus a failure ``message``, training ``progress`` and, for a failed
    job, the ``exit_code`` of its failed step where it is known (65: bad input; 75: transient)."""

    message: str | None = None
    progress: Progress | None = None
    exit_code: int | None = None


def _count(n: int) -> str:
    for div, unit in ((1e9, "B"), (1e6, "M"), (1e3, "K")):
        if n >= div:
            return f"{n / div:.2f}{unit}"
    return str(n)


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
    # The chat format it was trained in (result.json; trainers/data/prompt_format.py) and its
    # default system prompt: prompt_ids() and generate() use them.
    chat_template: str | None = None
    system_prompt: str | None = None
    # The validation loss of the last evaluation and the best one (result.json; runs with
    # val_fraction), and where the experiment tracker has the run (``tracker_line``), if any.
    val_loss: float | None = None
    best_val_loss: float | None = None
    tracker: dict | None = None
    # What load() and prompt_ids() built, kept so that each generate() after the first is fast.
    _loaded: dict = field(default_factory=dict, init=False, repr=False, compare=False)

    def tracker_line(self) -> str | None:
        """Where to look at the run's metrics in its experiment tracker, or None."""
        return tracker_pointer(self.tracker)

    def load(self):
        """(model, tokenizer) with transformers + peft (local backend only), loaded once: later
        calls return the same objects. Other packages' progress bars and warnings are hidden
        unless ``TUNEPACK_VERBOSE=1``.

        Raises:
            NotAvailableError: If the result is on a cluster's volume (copy it out first).
            ImportError: If transformers (or peft, for adapters) is not installed.
            OSError: If transformers cannot read the model's files there.
        """
        if not self.local:
            raise NotAvailableError(
                f"the result is on the cluster volume {self.path}; copy it out first "
                "(docs/cluster.md, 'Getting the result') and load it from there"
            )
        if "model" in self._loaded:
            return self._loaded["model"], self._loaded["tokenizer"]
        with _quiet_hub():
            try:
                from transformers import AutoModelForCausalLM, AutoTokenizer
            except ImportError:
                raise ImportError(
                    "loading the result needs transformers: pip install transformers"
                ) from None
            tokenizer = AutoTokenizer.from_pretrained(self.base_model)
            model_class = AutoModelForCausalLM
            if self._takes_images():  # transformers' class of the family (MllamaForConditional...)
                import transformers

                model_class = getattr(transformers, self._entry().family.hf_architecture)
            if self.method is not None and not methods.get(self.method).adapters:
                model = model_class.from_pretrained(self.path)
            else:
                from peft import PeftModel

                base = model_class.from_pretrained(self.base_model)
                model = PeftModel.from_pretrained(base, self.path)
            if self._takes_images():
                from tunepack.trainers.models.mllama import run_as_trained

                run_as_trained(model)  # the vision features it trained with
        model.eval()
        self._loaded.update(model=model, tokenizer=tokenizer)
        return model, tokenizer

    def generate(
        self, prompt: str, max_new_tokens: int = 32, *, input: str = "", image=None
    ) -> str:
        """The fine-tuned model's answer to ``prompt`` (greedy), asked the way it was trained:
        an instruction dataset's Alpaca template (``input``: the row's input column) or a chat
        turn, in the model's own format (``prompt_ids``); a text-completion run continues
        ``prompt`` as it is. ``image`` (a path or a PIL image; a model that takes images, such
        as Llama 3.2 Vision): the picture the question is about, placed before it in the turn.

        Raises:
            UnsupportedError: If ``image`` is given to a model that reads text only.
            BadValueError: If ``image`` is a path that cannot be read as a picture.
            NotAvailableError: If the result is on a cluster's volume (``load``).
            ImportError: If transformers (or peft) is not installed (``load``).
            OSError: If transformers cannot read the model's files there (``load``).
        """
        import torch

        if image is not None and not self._takes_images():
            try:
                name = self._entry().name
            except FileNotFoundError:
                name = self.base_model
            raise UnsupportedError(
                f"image= needs a model that takes images; {name} reads text only"
            )
        model, tokenizer = self.load()
        ids = self.prompt_ids(prompt, input=input, image=image is not None)
        if ids is None:
            ids = tokenizer(prompt)["input_ids"]
        input_ids = torch.tensor([ids])
        pictures = self._image_inputs(image, ids, model) if image is not None else {}
        threads = torch.get_num_threads()
        if self._loaded.setdefault("small", _small(model)):
            # A tiny model's every op takes microseconds: threads only add their handshakes
            # (measured: 0.64 s for 12 tokens on 2 busy cores, 0.04 s on one thread).
            torch.set_num_threads(1)
        try:
            with _quiet_hub(), torch.inference_mode():
                out = model.generate(
                    input_ids=input_ids,
                    attention_mask=torch.ones_like(input_ids),
                    max_new_tokens=max_new_tokens,
                    do_sample=False,
                    **pictures,
                )
        finally:
            torch.set_num_threads(threads)
        return tokenizer.decode(out[0][len(ids) :], skip_special_tokens=True)

    def prompt_ids(self, prompt: str, *, input: str = "", image: bool = False) -> list[int] | None:
        """The tokens the model saw before each response in training, for ``prompt``: the
        dataset's schema (workspace ``dataset/`` manifest) in the run's chat format
        (``chat_template``, with its ``system_prompt``), up to the opening of the assistant's
        turn, as the model's Hugging Face chat template renders it with
        ``add_generation_prompt=True``. None for a text-completion run (the prompt is the text).

        Raises:
            NotAvailableError: If the result is on a cluster's volume (copy it out first).
            FileNotFoundError: If the workspace has no dataset manifest or ``result.json`` (not
                a tunepack run's workspace, or one cleaned since).
        """
        from tunepack.core.workspace import DATASET_DIR, MANIFEST_FILE, MODEL_DIR, result_file

        workspace = self._workspace()
        if "schema" not in self._loaded:
            manifest = json.loads((workspace / DATASET_DIR / MANIFEST_FILE).read_text())
            self._loaded["schema"] = manifest["schema"]
        schema = self._loaded["schema"]
        if schema == "text":
            return None
        with _quiet_hub():
            from torchtune.data import AlpacaToMessages, Message

            if "prompt_tokenizer" not in self._loaded:
                from omegaconf import OmegaConf
                from torchtune import config as tt_config

                from tunepack.runtimes import catalog
                from tunepack.trainers.config import tokenizer_config

                info = json.loads(result_file(workspace).read_text())
                node = tokenizer_config(catalog.get(info["model"]), workspace / MODEL_DIR, None)
                # Results written before the format was recorded trained in the model's own.
                node["chat_template"] = info.get("chat_template") or node["chat_template"]
                node["system_prompt"] = info.get("system_prompt")
                self._loaded["prompt_tokenizer"] = tt_config.instantiate(OmegaConf.create(node))
        tokenizer = self._loaded["prompt_tokenizer"]
        if schema == "instruction":
            sample = {"instruction": prompt, "input": input, "output": ""}
            messages = AlpacaToMessages(train_on_input=True)(sample)["messages"]
        else:  # chat: one user turn (the image first, if any), then the assistant's
            from tunepack.trainers.data.prompt_format import IMAGE_TOKEN

            content = IMAGE_TOKEN + prompt if image else prompt
            messages = [Message(role="user", content=content), Message("assistant", "")]
        ids, _ = tokenizer.tokenize_messages(messages, add_end_tokens=False)
        return ids

    def _entry(self):
        """The catalog entry of the trained model (from result.json)."""
        if "entry" not in self._loaded:
            from tunepack.core.workspace import result_file

            info = json.loads(result_file(self._workspace()).read_text())
            self._loaded["entry"] = catalog.get(info["model"])
        return self._loaded["entry"]

    def _takes_images(self) -> bool:
        try:
            return self._entry().family.reads_images
        except FileNotFoundError:  # no result.json beside the model: not a tunepack run's
            return False

    def _image_inputs(self, image, ids: list[int], model) -> dict:
        """transformers' image inputs for ``image`` (tiles by the checkpoint's
        preprocessor_config.json) and the cross-attention mask of prompt ``ids``."""
        import torch
        from transformers import MllamaImageProcessor
        from transformers.models.mllama.processing_mllama import (
            convert_sparse_cross_attention_mask_to_dense,
            get_cross_attention_token_mask,
        )

        from tunepack.trainers.data.vision_data import load_image

        if not hasattr(image, "convert"):  # a path, not a PIL image
            path = Path(image).expanduser()
            try:
                image = load_image(path)
            except (OSError, ValueError) as error:
                raise BadValueError(f"image={str(path)!r} cannot be read ({error})") from None
        image = image.convert("RGB")
        if "image_processor" not in self._loaded:
            self._loaded["image_processor"] = MllamaImageProcessor.from_pretrained(self.base_model)
        processor = self._loaded["image_processor"]
        pixels = processor(images=[[image]], return_tensors="pt")
        image_id = model.config.image_token_index
        spans = [get_cross_attention_token_mask(ids, image_id)]
        mask = convert_sparse_cross_attention_mask_to_dense(
            spans, pixels.pop("num_tiles"), processor.max_image_tiles, len(ids)
        )
        return {**pixels, "cross_attention_mask": torch.tensor(mask)}

    def download(self, directory: str | Path, log=print) -> Path:
        """Fetch the exported result into ``directory`` (created; it appears only when complete
        and every file matches the export's manifest) and return its path: the artifact is
        ``<directory>/adapter`` (LoRA methods) or ``<directory>/model`` (full).

        Raises:
            NotAvailableError: If the job was not exported (``FineTune(export=...)``).
            NotFoundError: If the export is not there whole: no manifest (it did not finish),
                or a file it lists is missing (``.name``: the file).
            BadModelError: If a file does not match the export's manifest, or the manifest is
                not an export's.
            DeniedError: If the storage refused the credentials (or there are none).
            TransientError: If the storage could not be reached, after the retries.
        """
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


SMALL_MODEL_PARAMETERS = 10_000_000  # below this, generate() runs on one CPU thread


def _small(model) -> bool:
    on_cpu = all(p.device.type == "cpu" for p in model.parameters())
    return on_cpu and sum(p.numel() for p in model.parameters()) < SMALL_MODEL_PARAMETERS


@contextlib.contextmanager
def _quiet_hub():
    """Hide transformers' and the hub's progress bars, other packages' warnings and their log
    records below ERROR while a result is loaded or generates, as the trainer does
    (``tunepack.trainers.process.noise``); ``TUNEPACK_VERBOSE=1`` shows them. The settings are put
    back after: the notebook's own stay as they were."""
    from tunepack.trainers.process import noise

    if noise.verbose():
        yield
        return
    restore = []
    try:
        # transformers' switch turns the hub's bars off and on with its own; it reads the hub's
        # state when first imported, so it is imported before anything is switched.
        from transformers.utils import logging as hf_logging

        verbosity = hf_logging.get_verbosity()
        hf_logging.set_verbosity_error()
        restore.append(lambda: hf_logging.set_verbosity(verbosity))
        if hf_logging.is_progress_bar_enabled():
            hf_logging.disable_progress_bar()
            restore.append(hf_logging.enable_progress_bar)
    except ImportError:
        pass  # load() says that transformers is missing
    disabled = logging.root.manager.disable
    logging.disable(logging.WARNING)  # e.g. torchao's notice when torchtune is first imported
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield
    finally:
        logging.disable(disabled)
        for undo in reversed(restore):
            undo()


def tracker_pointer(tracker: dict | None) -> str | None:
    """One line saying where the experiment tracker has the run (``result.json``'s ``tracker``,
    as ``tunepack.trainers.outputs.tracking`` records it), or None when no tracker took the run."""
    if not tracker:
        return None
    kind = tracker.get("kind")
    if kind == "tensorboard":
        return f"tensorboard --logdir {tracker['log_dir']}"
    if kind == "mlflow":
        if tracker.get("run_url"):
            return f"MLflow run {tracker['run_url']}"
        uri = tracker.get("tracking_uri")
        return f"MLflow run {tracker.get('run_id')}: mlflow ui --backend-store-uri {uri}"
    if kind == "wandb":
        if tracker.get("run_url"):
            return f"W&B run {tracker['run_url']}"
        return f"W&B offline run: wandb sync {tracker.get('run_dir')}"
    return None
