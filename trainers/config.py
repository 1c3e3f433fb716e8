"""Build the torchtune configuration for one training run.

Inputs are trusted and validated: the catalog entry (which names every component) and the parsed
trainer arguments (which only fill in values). The result is an ordinary torchtune-style config
(``_component_`` + keywords) that the recipe instantiates and that is saved next to the output so
a run can be read and reproduced.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch
from omegaconf import DictConfig, OmegaConf

from tunepack.core.digest import json_digest as _sha256_json
from tunepack.core.errors import (
    BadDatasetError,
    BadModelError,
    ConflictError,
    DoesNotFitError,
    NotFoundError,
    UnsupportedError,
)
from tunepack.core.workspace import CHECKPOINTS_DIR, MANIFEST_FILE
from tunepack.runtimes import custom, methods
from tunepack.runtimes.args import TrainArgs, builder_for
from tunepack.runtimes.catalog import ModelEntry
from tunepack.trainers.objectives.table import OBJECTIVES

# The dataset schemas the initializer writes, and the torchtune dataset builder for each.
DATASET_BUILDERS = {
    "instruction": "torchtune.datasets.alpaca_dataset",
    "chat": "torchtune.datasets.chat_dataset",
    "text": "torchtune.datasets.text_completion_dataset",
    "preference": "torchtune.datasets.preference_dataset",
    "prompt": "tunepack.trainers.objectives.grpo.prompt_dataset",  # prompts to sample answers to
    "unpaired": "tunepack.trainers.objectives.kto.unpaired_dataset",  # answers labelled good or bad
}
# Image-text rows (the initializer's image_chat): only a model that takes images reads them.
IMAGE_SCHEMAS = ("image_chat",)
IMAGE_DATASET_BUILDER = "tunepack.trainers.data.vision_data.image_chat_dataset"
# Builder keywords per schema: the initializer writes chat rows as OpenAI-style "messages" and
# text rows as "text"; text completion has no prompt to mask, so no train_on_input.
DATASET_OPTIONS: dict[str, dict[str, object]] = {
    "instruction": {"train_on_input": True},
    "chat": {
        "conversation_column": "messages",
        "conversation_style": "openai",
        "train_on_input": True,
    },
    "text": {"column": "text"},
    "preference": {"train_on_input": True},  # chosen/rejected conversations
    "prompt": {},
    "unpaired": {},
}


# The family's torchtune tokenizer (named by the catalog) laying conversations out in the chat
# format of the model's published template (trainers/data/prompt_format.py).
TOKENIZER_BUILDER = "tunepack.trainers.data.prompt_format.build_tokenizer"


def tokenizer_config(
    entry: ModelEntry, model_dir: Path, max_seq_len: int | None, args: TrainArgs | None = None
) -> dict:
    """The tokenizer of a catalog model, as a config node (``_component_`` chosen by tunepack,
    never by user input): the run's chat format (``chat_template``, ``system_prompt``; without
    ``args`` the model's own format); ``Result.generate`` formats prompts with the same one."""
    from tunepack.trainers.data.prompt_format import check_chat_template

    node = {
        "_component_": TOKENIZER_BUILDER,
        "family": entry.family.name,
        "files": {kw: str(model_dir / rel) for kw, rel in entry.tokenizer.files.items()},
        "max_seq_len": max_seq_len,
        "chat_template": check_chat_template(
            entry.family.name, args.chat_template if args else None
        ),
        "system_prompt": (args.system_prompt if args else "") or None,
    }
    if entry.custom:  # the checkpoint's own tokenizer.json, in the family's chat format
        node["checkpoint_tokenizer"] = True
    return node


def resolve_device(device: str) -> str:
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda" and not torch.cuda.is_available():
        raise DoesNotFitError(
            "device=cuda was asked for, but no CUDA GPU is visible to PyTorch",
            gpu="cuda",
            need_gpus=1,
            have_gpus=0,
        )
    return device


def resolve_dtype(dtype: str, device: str) -> str:
    if dtype == "auto":
        return "bf16" if device == "cuda" else "fp32"
    return dtype


def read_dataset_manifest(dataset_dir: Path) -> dict:
    path = dataset_dir / MANIFEST_FILE
    try:
        manifest = json.loads(path.read_text())
    except FileNotFoundError:
        raise NotFoundError(
            f"no dataset manifest at {path}: the dataset-initializer step has not completed",
            what="dataset manifest",
            name=str(path),
        ) from None
    schema = manifest.get("schema")
    if schema not in DATASET_BUILDERS and schema not in IMAGE_SCHEMAS:
        raise BadDatasetError(
            f"dataset schema {schema!r} in {path} is not supported by this trainer: "
            f"expected one of {', '.join([*DATASET_BUILDERS, *IMAGE_SCHEMAS])}"
        )
    return manifest


def read_model_hashes(model_dir: Path) -> dict[str, str | None] | None:
    """Each base-model file's sha256 from the model initializer's manifest (None: no manifest)."""
    try:
        manifest = json.loads((model_dir / MANIFEST_FILE).read_text())
    except FileNotFoundError:
        return None  # a model directory not made by the initializer (tests, benchmarks)
    except ValueError:
        raise BadModelError(
            f"the model manifest {model_dir / MANIFEST_FILE} is not valid JSON: run the "
            "model-initializer step again"
        ) from None
    return {name: info.get("sha256") for name, info in sorted(manifest.get("files", {}).items())}


# The run's identity: everything that determines the computation. Keys that only change how a run
# is observed, checkpointed or accelerated are left out, so changing them neither retrains a
# finished run nor discards its checkpoints. (``merge`` changes the published artifacts, not the
# training: it is part of the result's identity, not the checkpoints'.)
# How often the validation loss is computed, which tracker hears about it and keep_best do not
# change the training either (keep_best changes the published result: the result's identity).
BOOKKEEPING_KEYS = (
    "checkpointing",
    "trainer_args",
    "log_every_n_steps",
    "merge",
    "compile",
    "step",  # how the step spends memory: the same numbers (a resume keeps the chosen step)
    "deterministic",
    "eval",
    "tracker",
)
# Why two identities differ, per part, for the "starting fresh" / "training again" messages.
IDENTITY_CHANGES = {
    "base_model": "the base model changed (model/{manifest} differs from the {of}'s)",
    "dataset": "the dataset changed (dataset/{manifest} differs from the {of}'s)",
    "training": "the training configuration changed",
    "merge": "merge changed",
    "keep_best": "keep_best changed",
}


# tunepack.trainers' subpackages. Which of them holds a component the config names is not part of
# a run's identity: the modules were all tunepack.trainers.<module> once, and the checkpoints and
# results written then must still resume and count as done (tests/unit/test_run_identity.py).
ROOMS = ("data", "models", "objectives", "outputs", "process")
_IN_A_ROOM = re.compile(rf"^tunepack\.trainers\.(?:{'|'.join(ROOMS)})\.")


def run_identity(cfg: DictConfig) -> dict[str, str]:
    """The training computation's identity in parts: base model, dataset, training config."""
    data = OmegaConf.to_container(cfg, resolve=True)
    for key in BOOKKEEPING_KEYS:
        data.pop(key, None)
    data = _without_rooms(_without_workspace_paths(data))
    base_model = data.pop("model_sha256", None)
    dataset = data.pop("dataset_sha256", None)
    return {
        "base_model": _sha256_json(base_model),
        "dataset": _sha256_json(dataset),
        "training": _sha256_json(data),
    }


def _without_workspace_paths(data: dict) -> dict:
    """The config with the workspace's location taken out: a copied or moved workspace (another
    mount path in a Pod than on the host) is the same run; the content hashes stand for the files.
    """
    data.pop("output_dir", None)
    data.get("checkpointer", {}).pop("output_dir", None)
    data.get("dataset", {}).pop("cache_dir", None)
    roots = {}
    if data.get("checkpointer", {}).get("checkpoint_dir"):
        roots[str(data["checkpointer"]["checkpoint_dir"])] = "<model>"
    files = data.get("dataset", {}).get("data_files") or []
    if files:
        roots[str(Path(files[0]).parent)] = "<dataset>"

    def strip(value: str) -> str:
        for root, name in roots.items():
            if value == root or value.startswith(root + "/"):
                return name + value[len(root) :]
        return value

    return _map_strings(data, strip)


def _without_rooms(data: dict) -> dict:
    """Every ``tunepack.trainers.<room>.<module>...`` name in the config as
    ``tunepack.trainers.<module>...``."""
    return _map_strings(data, lambda value: _IN_A_ROOM.sub("tunepack.trainers.", value))


def _map_strings(value, change):
    """``value`` (a config's dicts, lists and scalars) with ``change`` applied to every string."""
    if isinstance(value, dict):
        return {k: _map_strings(v, change) for k, v in value.items()}
    if isinstance(value, list):
        return [_map_strings(v, change) for v in value]
    if isinstance(value, str):
        return change(value)
    return value


def run_digest(cfg: DictConfig) -> str:
    """Matches checkpoints to the computation that wrote them."""
    return _sha256_json(run_identity(cfg))


def result_identity(cfg: DictConfig) -> dict[str, str]:
    """The result's identity: the run's, plus what changes the published artifacts."""
    identity = {**run_identity(cfg), "merge": _sha256_json(bool(cfg.get("merge", False)))}
    keep_best = bool(cfg.get("eval", {}).get("keep_best", False))
    if keep_best:  # absent when off: results written before evaluation existed stay finished
        identity["keep_best"] = _sha256_json(keep_best)
    return identity


def result_digest(cfg: DictConfig) -> str:
    """``config_digest`` in result.json: a finished run with this digest has nothing to do."""
    return _sha256_json(result_identity(cfg))


def identity_changes(old: dict | None, new: dict[str, str], of: str) -> str:
    """Why ``old`` (a checkpoint's or result's identity) is not ``new``, in words."""
    if not isinstance(old, dict):
        return f"the {of} was written by another version of tunepack or another configuration"
    changed = [
        IDENTITY_CHANGES.get(part, f"{part} changed").format(manifest=MANIFEST_FILE, of=of)
        for part in new
        if old.get(part) != new[part]
    ]
    return "; ".join(changed) or f"the {of} was written by another configuration"


def _check_method_fits_data(method: methods.Method, schema: str) -> None:
    if schema not in method.data.schemas:
        raise ConflictError(methods.wrong_data_message(method, schema))


def _check_model_reads_data(entry: ModelEntry, schema: str) -> None:
    if schema in IMAGE_SCHEMAS and not entry.family.reads_images:
        raise UnsupportedError(
            f"the dataset holds images (schema image_chat), but {entry.name} "
            f"({entry.family.title}) reads text only; an image-text dataset needs a model that "
            "takes images"
        )


# Every model is built by this function around the catalog's torchtune builder: it corrects
# the builders that would not reproduce their checkpoint (see trainers/models/builders.py).
MODEL_BUILDER = "tunepack.trainers.models.builders.build"


def read_model_config(model_dir: Path) -> dict:
    """The checkpoint's config.json (a vision model's builders take their shape from it)."""
    path = Path(model_dir) / "config.json"
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise BadModelError(f"no config.json in the model directory {model_dir}") from None
    except ValueError as error:
        raise BadModelError(f"{path} is not valid JSON ({error})") from None


def model_component(
    entry: ModelEntry, method: methods.Method, model_dir: Path | None = None
) -> dict:
    """The model's config node for ``method`` (its record), before any LoRA settings. A model
    that reads images is built from its checkpoint's config.json (``model_dir``), any size."""
    if entry.family.reads_images:
        from tunepack.runtimes.mllama_config import mllama_builder_kwargs

        if model_dir is None:
            raise ValueError(f"{entry.name} is built from its checkpoint's config.json: model_dir")
        kwargs = mllama_builder_kwargs(read_model_config(model_dir), f"model at {str(model_dir)!r}")
        node = {
            "_component_": MODEL_BUILDER,
            "builder": builder_for(entry, method),
            **kwargs,
        }
        if not method.adapters:  # full: every weight, the text model's too
            node |= {"decoder_trainable": True, "encoder_trainable": True, "fusion_trainable": True}
        return node
    node: dict = {
        "_component_": MODEL_BUILDER,
        "builder": builder_for(entry, method),
        **entry.builder_kwargs(),
        "rope_base": entry.family.options["rope_base"],
    }
    if entry.family.softcapping is not None:
        node["softcapping"] = list(entry.family.softcapping)
    return node


def build_config(
    entry: ModelEntry,
    args: TrainArgs,
    *,
    model_dir: Path,
    dataset_dir: Path,
    output_dir: Path,
    cache_dir: Path,
    checkpoint_dir: Path | None = None,
) -> DictConfig:
    """The run's config: the data and the arguments checked against each other first, then the
    parts below, in the order config.yaml shows them."""
    entry = custom.resolve(entry, model_dir)  # a bring-your-own checkpoint's own shape
    device = resolve_device(args.device)
    manifest = read_dataset_manifest(dataset_dir)
    # The dataset initializer writes the source's own validation split next to the training rows.
    own_validation = manifest.get("validation") or None
    val_file = own_validation["file"] if own_validation else None
    data_files = [str(dataset_dir / name) for name in sorted(manifest["files"]) if name != val_file]
    if manifest["schema"] == "chat":  # conversations the chat format refuses: before any model
        from tunepack.trainers.data.prompt_format import check_conversations

        for name in (*data_files, *([str(dataset_dir / val_file)] if val_file else [])):
            check_conversations(Path(name), args.chat_template, args.system_prompt or None)

    model = _model(entry, args, model_dir)
    tokenizer = tokenizer_config(entry, model_dir, args.max_seq_len, args)
    _check_method_fits_data(args.method_record, manifest["schema"])
    _check_model_reads_data(entry, manifest["schema"])
    has_validation = _check_validation(args, own_validation)

    cfg = {
        **_run(entry, args, device, output_dir),
        "checkpointing": _checkpointing(args, checkpoint_dir or output_dir / CHECKPOINTS_DIR),
        # Ties checkpoints and results to the data and base model they were trained on, not just
        # their paths: another revision at the same URI is another run.
        "dataset_sha256": {n: info.get("sha256") for n, info in sorted(manifest["files"].items())},
        "model_sha256": read_model_hashes(model_dir),
        "model": model,
        "tokenizer": tokenizer,
        "checkpointer": _checkpointer(entry, model_dir, output_dir),
        "dataset": _dataset(args, manifest["schema"], data_files, cache_dir, model_dir),
        **_optimizer_and_schedule(args),
        **_bookkeeping(args, output_dir),
        "step": _step(entry, args, model_dir, tokenizer["max_seq_len"]),
    }
    method = args.method_record
    if declared := OBJECTIVES.get(method.loss):
        # only for a loss of the method's own: other methods' run identities stay as they were
        cfg[method.loss.value] = declared.settings(args)
    if method.data is methods.PROMPTS:  # the prompt builder leaves room for the answers
        cfg["dataset"]["max_new_tokens"] = args.max_new_tokens
    # Part of the run's identity: it changes which rows are trained on (the dataset's own split's
    # content is in dataset_sha256 already).
    if own_validation and has_validation:
        cfg["validation"] = {"data_files": [str(dataset_dir / val_file)]}
    elif has_validation:
        cfg["validation"] = {"fraction": args.val_fraction}
    return OmegaConf.create(cfg)


def _check_validation(args: TrainArgs, own_validation: dict | None) -> bool:
    """Whether the run evaluates on held-out rows; refuses settings that contradict the data."""
    method = args.method_record
    if not method.validates:
        given = [
            f"{k}={args.given[k]}"
            for k in ("val_fraction", "eval_every_steps", "keep_best")
            if k in args.given
        ]
        if given:
            raise ConflictError(
                f"{', '.join(given)}: method={method.name} has no validation loss to compute "
                "(its progress is the reward in each step's metrics); leave "
                f"{'it' if len(given) == 1 else 'them'} out"
            )
        return False  # a dataset's own validation split is not read
    if own_validation and args.val_fraction > 0:
        raise ConflictError(
            f"val_fraction={args.val_fraction} would hold out training rows, but the dataset has "
            f"its own {own_validation.get('split', 'validation')} split "
            f"({own_validation.get('rows', '?')} rows), which the trainer evaluates on: "
            "drop val_fraction"
        )
    has_validation = args.val_fraction > 0 or bool(own_validation)
    if not has_validation and args.keep_best:
        raise ConflictError(
            "keep_best=true needs a validation split, and this run has none: set val_fraction "
            "(for example val_fraction=0.05) or give a dataset with a validation split"
        )
    if not has_validation and args.eval_every_steps:
        raise ConflictError(
            f"eval_every_steps={args.eval_every_steps} needs a validation split, and this run "
            "has none: set val_fraction (for example val_fraction=0.05) or give a dataset with a "
            "validation split"
        )
    return has_validation


def _run(entry: ModelEntry, args: TrainArgs, device: str, output_dir: Path) -> dict:
    """What the run is and how it runs: model, method, device and precision, batches, length."""
    return {
        "model_name": entry.name,
        "hub_id": entry.hub_id,
        "method": args.method,
        "seed": args.seed,
        "device": device,
        "dtype": resolve_dtype(args.dtype, device),
        "compile": args.compile,
        "deterministic": args.deterministic,
        # Which examples make each batch (trainers/data/batching.py): part of the run's identity.
        "batching": (
            "packed" if args.packed else "length_grouped" if args.group_by_length else "shuffled"
        ),
        "epochs": args.epochs,
        "max_steps": args.max_steps,
        "batch_size": args.batch_size,
        "gradient_accumulation_steps": args.grad_accum,
        "log_every_n_steps": args.log_every,
        "output_dir": str(output_dir),
        "merge": args.merge,
    }


def _checkpointing(args: TrainArgs, directory: Path) -> dict:
    """Where and how often resumable checkpoints are written (trainers/outputs/checkpoint.py)."""
    return {
        "dir": str(directory),
        "every_steps": args.checkpoint_every_steps,
        "every_minutes": args.checkpoint_every_minutes,
        "keep": args.keep_checkpoints,
        "resume": args.resume,
    }


def _model(entry: ModelEntry, args: TrainArgs, model_dir: Path) -> dict:
    """The model's node: the catalog's builder, with the LoRA family's adapter settings."""
    method = args.method_record
    model = model_component(entry, method, model_dir)
    if method.adapters:
        model.update(
            lora_attn_modules=list(args.lora_attn_modules),
            apply_lora_to_mlp=args.lora_mlp,
            apply_lora_to_output=False,
            lora_rank=args.lora_rank,
            lora_alpha=args.lora_alpha,
            lora_dropout=args.lora_dropout,
        )
        if entry.family.reads_images:  # Llama 3.2 Vision: its multi_modal_projector too
            model["apply_lora_to_projection"] = args.lora_projector
        if method.quantize_base:
            model["quantize_base"] = True
        if method.dora:
            model["use_dora"] = True
    return model


def _checkpointer(entry: ModelEntry, model_dir: Path, output_dir: Path) -> dict:
    """How the base weights are read (and a full model written): the catalog's checkpointer."""
    return {
        # torchtune's HF checkpointer, or the family's own where torchtune cannot convert it.
        "_component_": entry.family.checkpointer,
        "checkpoint_dir": str(model_dir),
        "checkpoint_files": list(entry.weight_files(model_dir)),
        "model_type": entry.checkpoint_model_type,
        "output_dir": str(output_dir / ".torchtune"),
    }


def _dataset(
    args: TrainArgs, schema: str, data_files: list[str], cache_dir: Path, model_dir: Path
) -> dict:
    """The training rows: the schema's torchtune builder over the initializer's files (image
    rows: tunepack's, with the checkpoint's image processing)."""
    if schema in IMAGE_SCHEMAS:
        from tunepack.trainers.data.vision_data import image_settings

        settings = image_settings(model_dir, read_model_config(model_dir))
        return {
            "_component_": IMAGE_DATASET_BUILDER,
            "train_on_input": args.train_on_input,
            "data_files": data_files,
            "image": settings.as_dict(),
            "packed": args.packed,
        }
    return {
        "_component_": DATASET_BUILDERS[schema],
        **{
            key: args.train_on_input if key == "train_on_input" else value
            for key, value in DATASET_OPTIONS[schema].items()
        },
        "source": "json",
        "data_files": data_files,
        "split": "train",
        "packed": args.packed,
        "cache_dir": str(cache_dir),
    }


def _optimizer_and_schedule(args: TrainArgs) -> dict:
    """AdamW and a cosine schedule with linear warmup."""
    return {
        "optimizer": {
            "_component_": "torch.optim.AdamW",
            "lr": args.lr,
            "weight_decay": args.weight_decay,
        },
        "lr_scheduler": {
            "_component_": "torchtune.training.lr_schedulers.get_cosine_schedule_with_warmup",
            "num_warmup_steps": args.warmup_steps,
        },
    }


def _step(entry: ModelEntry, args: TrainArgs, model_dir: Path, max_seq_len: int) -> dict:
    """The settings the trainer chooses its step from when it knows its device (recipe.py,
    runtimes/planner.py: choose_step), and the job as the memory planner sees it."""
    how = args.method_record
    job = {
        "model": entry.name,
        "model_dir": str(model_dir) if entry.custom else None,
        "method": args.method,
        "seq_len": max_seq_len,
        "batch_size": args.batch_size,
        "grad_accum": args.grad_accum,
    }
    if how.adapters:
        job.update(
            lora_rank=args.lora_rank,
            lora_attn_modules=list(args.lora_attn_modules),
            lora_mlp=args.lora_mlp,
        )
    if how.sequences_key:
        job["num_generations"] = args.num_generations
    return {
        "activation_checkpointing": args.activation_checkpointing,
        "loss_chunk": args.loss_chunk,
        # What a CPU's step needs (no plan): the model's layers and vocabulary.
        "layers": entry.shape.num_layers,
        "vocab": entry.shape.vocab_size,
        "fused_loss": how.loss is methods.Loss.CROSS_ENTROPY and not entry.family.reads_images,
        "job": job,
    }


def _bookkeeping(args: TrainArgs, output_dir: Path) -> dict:
    """What the run records: the arguments as given, evaluation, the experiment tracker."""
    return {
        "trainer_args": dict(args.given),
        "eval": {"every_steps": args.eval_every_steps, "keep_best": args.keep_best},
        "tracker": {
            "kind": args.tracker,
            "uri": args.tracker_uri,
            "project": args.tracker_project,
            "log_dir": str(output_dir / "tracker"),
        },
    }
