"""Translate the Kubeflow SDK's trainer and initializer types into tunepack's, and ``Initializer``.

``BuiltinTrainer(config=TorchTuneConfig(...))`` becomes a ``FineTune``, the SDK's initializers
storage URIs, so notebooks written for ``kubeflow.trainer`` keep working; whatever has no
equivalent is refused by name, never dropped. docs/sdk.md, "BuiltinTrainer" and "Initializer"."""

from __future__ import annotations

from dataclasses import dataclass, field

from kubeflow.trainer.constants import constants as kf_constants
from kubeflow.trainer.types import types as kf

from tunepack.core.errors import BadInputError, BadValueError, ConflictError, UnsupportedError
from tunepack.finetune import FineTune
from tunepack.runtimes import methods


@dataclass
class Initializer:
    """Where the dataset and the model come from, as tunepack storage URIs.

    Args:
        dataset: ``file:///abs/path``, a path, ``hf://org/name``, ``s3://bucket/key`` or
            ``https://...``; or an upstream ``HuggingFaceDatasetInitializer`` /
            ``S3DatasetInitializer``.
        model: the same for the model (``hf://meta-llama/Llama-3.1-8B-Instruct``), or an upstream
            ``HuggingFaceModelInitializer`` / ``S3ModelInitializer``.
        dataset_secret: name of a Secret in the TrainJob's namespace holding the credentials the
            dataset initializer needs (e.g. ``HF_TOKEN``); passed by reference, never by value.
        model_secret: the same for the model initializer.
        env: extra environment for both initializers (plain, non-secret values).

    Example:
        >>> Initializer(dataset="hf://tatsu-lab/alpaca",
        ...             model="hf://meta-llama/Llama-3.1-8B-Instruct", model_secret="hf-token")
    """

    dataset: str | kf.BaseInitializer | None = None
    model: str | kf.BaseInitializer | None = None
    dataset_secret: str | None = None
    model_secret: str | None = None
    env: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class StorageSource:
    """One initializer of the TrainJob: its URI and a Secret reference, if any."""

    uri: str
    secret: str | None = None


def to_initializer(initializer: Initializer | kf.Initializer | None) -> Initializer:
    """Accept tunepack's or the upstream SDK's ``Initializer``; return tunepack's."""
    if initializer is None:
        raise BadValueError(
            "tunepack runtimes need an initializer: pass "
            "initializer=Initializer(dataset='file:///data/train.jsonl', model='hf://org/model')"
        )
    if isinstance(initializer, Initializer):
        return initializer
    if isinstance(initializer, kf.Initializer):
        return Initializer(dataset=initializer.dataset, model=initializer.model)
    raise BadValueError(
        f"initializer must be tunepack.Initializer or kubeflow.trainer.Initializer, "
        f"got {type(initializer).__name__}"
    )


def storage_uri(source: str | kf.BaseInitializer | None, what: str) -> str:
    """The tunepack storage URI for a dataset or model source (``what``: dataset or model)."""
    if source is None:
        raise BadValueError(
            f"Initializer.{what} is missing: tunepack runtimes need both a dataset and a model "
            f"(e.g. {what}='file:///abs/path' or 'hf://org/name')"
        )
    if isinstance(source, str):
        return source
    if isinstance(source, kf.DataCacheInitializer):
        raise UnsupportedError(
            "DataCacheInitializer is not supported by tunepack runtimes: give the dataset as a "
            "storage URI (file://, hf://, s3://, https://)"
        )
    if isinstance(source, kf.HuggingFaceDatasetInitializer | kf.HuggingFaceModelInitializer):
        uri = source.storage_uri
        # The SDK takes a bare hub id ("org/name"); a URI with a scheme is kept as it is.
        uri = uri if "://" in uri else "hf://" + uri
    elif isinstance(source, kf.S3DatasetInitializer | kf.S3ModelInitializer):
        uri = source.storage_uri
    else:
        raise BadValueError(
            f"Initializer.{what} of type {type(source).__name__} is not supported: use a storage "
            "URI string or HuggingFace/S3 initializer"
        )
    _refuse_untranslatable_initializer_fields(source, what)
    return uri


def _refuse_untranslatable_initializer_fields(source: kf.BaseInitializer, what: str) -> None:
    cls = type(source).__name__
    if getattr(source, "access_token", None) is not None:
        # The token itself is never repeated: this message reaches logs and notebooks.
        raise UnsupportedError(
            f"{cls}.access_token: tunepack does not put tokens into the TrainJob, where anyone "
            f"who can read TrainJobs would see them. Create a Secret (kubectl create secret "
            f"generic hf-token --from-literal=HF_TOKEN=<token>) and pass it by reference: "
            f"tunepack.Initializer({what}={cls}(storage_uri=...) without access_token, "
            f"{what}_secret='hf-token'); on the local backend, export HF_TOKEN instead"
        )
    for name in ("endpoint", "access_key_id", "secret_access_key", "region", "role_arn"):
        if getattr(source, name, None) is not None:
            raise UnsupportedError(
                f"{cls}.{name} cannot be translated: put S3 settings and credentials in a Secret "
                f"and pass Initializer(..., {what}_secret='<secret name>')"
            )
    patterns = getattr(source, "ignore_patterns", None)
    if patterns and list(patterns) != list(kf_constants.INITIALIZER_DEFAULT_IGNORE_PATTERNS):
        raise UnsupportedError(
            f"{cls}.ignore_patterns={patterns!r} cannot be translated: tunepack's model "
            "initializer fetches exactly the files the runtime's model needs (and datasets "
            "whole); leave ignore_patterns unset"
        )


def to_finetune(trainer: FineTune | kf.BuiltinTrainer | None) -> FineTune:
    """Accept ``FineTune`` or ``BuiltinTrainer(config=TorchTuneConfig(...))``."""
    if trainer is None:
        return FineTune()
    if isinstance(trainer, FineTune):
        return trainer
    if isinstance(trainer, kf.BuiltinTrainer):
        if not isinstance(trainer.config, kf.TorchTuneConfig):
            raise BadValueError(
                f"BuiltinTrainer.config must be a TorchTuneConfig, got {type(trainer.config)}"
            )
        return from_torchtune_config(trainer.config)
    if isinstance(trainer, kf.CustomTrainer | kf.CustomTrainerContainer):
        raise UnsupportedError(
            f"{type(trainer).__name__} cannot run on a tunepack runtime, whose trainer is "
            "tunepack's fine-tuning program: pass trainer=FineTune(...) (or "
            "BuiltinTrainer(config=TorchTuneConfig(...))), or use a torch-distributed runtime "
            "for your own training function"
        )
    raise BadValueError(
        f"trainer must be tunepack.FineTune or kubeflow.trainer.BuiltinTrainer, "
        f"got {type(trainer).__name__}"
    )


def from_torchtune_config(config: kf.TorchTuneConfig) -> FineTune:
    """Translate the upstream TorchTune configuration field by field (see module docstring)."""
    values: dict[str, object] = {}
    if config.dtype is not None:
        values["dtype"] = kf.DataType(config.dtype).value
    if config.batch_size is not None:
        values["batch_size"] = config.batch_size
    if config.epochs is not None:
        values["epochs"] = config.epochs
    if config.loss is not None and config.loss != kf.Loss.CEWithChunkedOutputLoss:
        raise UnsupportedError(f"TorchTuneConfig.loss={config.loss!r} cannot be translated")
    # CEWithChunkedOutputLoss is cross-entropy computed in chunks to save memory; tunepack's
    # recipe computes the same token-level cross-entropy, so the choice carries over as is.
    if config.num_nodes is not None:
        values["num_nodes"] = config.num_nodes
    if config.resources_per_node is not None:
        values["resources_per_node"] = dict(config.resources_per_node)
    if config.peft_config is not None:
        values.update(_from_lora(config.peft_config))
    else:
        # Upstream, no PEFT config is a full fine-tune (its runtimes render the
        # full_finetune_* recipe), not tunepack's default of LoRA.
        values["method"] = "full"
    if config.dataset_preprocess_config is not None:
        values.update(_from_dataset_config(config.dataset_preprocess_config))
    return FineTune(**values)


def upstream_full(trainer: object) -> bool:
    """Whether ``trainer`` is upstream's ``BuiltinTrainer(config=TorchTuneConfig(...))``
    without a ``peft_config``: a full fine-tune (``from_torchtune_config``)."""
    return (
        isinstance(trainer, kf.BuiltinTrainer)
        and isinstance(trainer.config, kf.TorchTuneConfig)
        and trainer.config.peft_config is None
    )


def refuse_upstream_full(trainer: object, entry) -> None:
    """A full fine-tune that upstream's ``TorchTuneConfig`` without ``peft_config`` means,
    refused with the reason where ``entry``'s runtime does not offer ``method=full``."""
    from tunepack.runtimes.args import unavailable_method_message

    if upstream_full(trainer) and "full" not in entry.methods:
        raise UnsupportedError(
            "TorchTuneConfig without peft_config means a full fine-tune (as upstream's "
            f"runtimes run it), but {unavailable_method_message(entry, 'full')}; pass "
            "peft_config=LoraConfig(...) for LoRA"
        )


def _from_lora(lora: kf.LoraConfig) -> dict[str, object]:
    if lora.quantize_base and lora.use_dora:
        raise ConflictError("LoraConfig: quantize_base and use_dora cannot be combined")
    # The supervised LoRA method with the same base storage and magnitude as the config's.
    method = next(
        m.name
        for m in methods.METHODS.values()
        if m.adapters
        and m.loss is methods.Loss.CROSS_ENTROPY
        and m.quantize_base == bool(lora.quantize_base)
        and m.dora == bool(lora.use_dora)
    )
    if flag := "quantize_base" if lora.quantize_base else "use_dora" if lora.use_dora else "":
        try:
            FineTune(method=method)
        except BadInputError as err:
            raise UnsupportedError(
                f"LoraConfig.{flag}=True means method={method!r}, which this tunepack version "
                f"does not offer ({err}); leave {flag} unset for plain LoRA"
            ) from None
    values: dict[str, object] = {"method": method}
    if lora.apply_lora_to_output:
        raise UnsupportedError(
            "LoraConfig.apply_lora_to_output=True cannot be translated: tunepack applies LoRA "
            "to attention (lora_attn_modules) and optionally the MLP (apply_lora_to_mlp)"
        )
    if lora.lora_rank is not None:
        values["lora_rank"] = lora.lora_rank
    if lora.lora_alpha is not None:
        values["lora_alpha"] = float(lora.lora_alpha)
    if lora.lora_dropout is not None:
        values["lora_dropout"] = lora.lora_dropout
    if lora.apply_lora_to_mlp is not None:
        values["lora_mlp"] = lora.apply_lora_to_mlp
    if lora.lora_attn_modules:
        values["lora_attn_modules"] = tuple(lora.lora_attn_modules)
    return values


# Upstream's data formats the dataset initializer reads (it tells them by the files' suffixes).
_READ_FORMATS = (kf.DataFormat.JSON, kf.DataFormat.CSV, kf.DataFormat.PARQUET, kf.DataFormat.ARROW)


def dataset_split(trainer: object) -> str | None:
    """The split upstream's ``TorchTuneInstructDataset.split`` names (``train[:1000]``), for the
    dataset initializer (``TrainJobSpec.dataset_split``); None for the default, ``train``.
    Checked as the initializer checks it: ``BadInputError`` naming the field."""
    from tunepack.initializers.data import splits

    config = getattr(trainer, "config", None) if isinstance(trainer, kf.BuiltinTrainer) else None
    ds = getattr(config, "dataset_preprocess_config", None)
    if ds is None or ds.split is None:
        return None
    try:
        split = splits.parse(ds.split)
    except BadInputError as err:
        raise BadValueError(f"TorchTuneInstructDataset.split: {err}") from None
    return None if split.spec == splits.DEFAULT_SPLIT else split.spec


def _from_dataset_config(ds: kf.TorchTuneInstructDataset) -> dict[str, object]:
    if ds.source is not None and kf.DataFormat(ds.source) not in _READ_FORMATS:
        raise UnsupportedError(
            f"TorchTuneInstructDataset.source={kf.DataFormat(ds.source).value!r} cannot be "
            "translated: tunepack's dataset initializer reads JSON (.json, .jsonl), CSV, Parquet "
            "and Arrow files; convert the data to one of them"
        )
    _column_map(ds)  # refused here, by name, as the other fields; the initializer's env: below
    values: dict[str, object] = {}
    if ds.train_on_input is not None:
        values["train_on_input"] = ds.train_on_input
    if ds.new_system_prompt is not None:
        # torchtune prepends it as the system message of every instruction row (which has
        # none): tunepack's system_prompt, the system message of the rows that have none.
        values["system_prompt"] = ds.new_system_prompt
    return values


# torchtune's instruction fields (InputOutputToMessages: "input", the prompt, and "output") as
# tunepack's instruction schema names them (initializers/data/schemas.py: 'instruction', 'output').
_INSTRUCT_FIELDS = {"input": "instruction", "output": "output"}


def _column_map(ds: kf.TorchTuneInstructDataset) -> dict[str, str] | None:
    """Upstream's ``column_map`` ({torchtune field: dataset column}, as torchtune 0.6.1's
    ``instruct_dataset`` reads it: both ``input`` and ``output``) as the dataset initializer's
    ``COLUMN_MAP`` ({dataset column: tunepack field}); None when not given."""
    given = ds.column_map
    if given is None:
        return None
    example = "e.g. {'input': 'question', 'output': 'answer'}"
    if not isinstance(given, dict) or not all(
        isinstance(k, str) and isinstance(v, str) and v.strip() for k, v in given.items()
    ):
        raise BadValueError(
            f"TorchTuneInstructDataset.column_map={given!r} is not valid: expected a dict of "
            f"torchtune's field names to the dataset's column names, {example}"
        )
    unknown = [k for k in given if k not in _INSTRUCT_FIELDS]
    missing = [k for k in _INSTRUCT_FIELDS if k not in given]
    if unknown or missing:
        problem = (
            f"key {unknown[0]!r} is not one of torchtune's instruction fields"
            if unknown
            else f"it has no key {missing[0]!r} (torchtune needs both)"
        )
        raise BadValueError(
            f"TorchTuneInstructDataset.column_map={given!r} is not valid: {problem}; its keys "
            f"are 'input' (the prompt) and 'output' (the answer), each mapped to the dataset's "
            f"column, {example}"
        )
    if given["input"] == given["output"]:
        raise BadValueError(
            f"TorchTuneInstructDataset.column_map={given!r} maps 'input' and 'output' to the "
            "same column: the prompt and the answer need a column each"
        )
    return {given[field]: ours for field, ours in _INSTRUCT_FIELDS.items()}


def dataset_env(trainer: object) -> dict[str, str]:
    """The dataset initializer's environment for upstream's ``TorchTuneInstructDataset``:
    ``COLUMN_MAP`` from its ``column_map`` (``TrainJobSpec.initializer_env``); empty when it
    names none."""
    import json

    from tunepack.initializers.data.schemas import COLUMN_MAP_ENV

    config = getattr(trainer, "config", None) if isinstance(trainer, kf.BuiltinTrainer) else None
    ds = getattr(config, "dataset_preprocess_config", None)
    mapping = _column_map(ds) if ds is not None else None
    if not mapping:
        return {}
    if any(c in column for column in mapping for c in ",:{"):
        return {COLUMN_MAP_ENV: json.dumps(mapping)}  # the pairs cannot spell such a name
    return {COLUMN_MAP_ENV: ",".join(f"{column}:{ours}" for column, ours in mapping.items())}


def initializer_env(init: Initializer, trainer: object) -> dict[str, str] | None:
    """The initializers' environment: ``init.env`` with ``dataset_env(trainer)``, refused when
    both set a variable to different values (None: no variable)."""
    env = dict(init.env or {})
    for name, value in dataset_env(trainer).items():
        if name in env and env[name] != value:
            raise ConflictError(
                f"the column map is given twice and differs: Initializer env {name}="
                f"{env[name]!r}, TorchTuneInstructDataset.column_map as {name}={value!r}; "
                "give it once"
            )
        env[name] = value
    return env or None
