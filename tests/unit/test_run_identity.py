"""A run's identity does not depend on where tunepack's modules live.

The config names tunepack's own components by module path (the model builder, the tokenizer, the
Qwen 3 / Gemma 3 / Llama 3.2 Vision builders and checkpointers, the GRPO and KTO datasets), and
the identity hashes the config: a checkpoint's manifest and a result's ``config_digest`` carry
it. The trainer's modules moved from ``tunepack.trainers.<module>`` into rooms
(``tunepack.trainers.models.<module>``, ...); runs written before must still resume and still
count as done.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from tests import REPO
from tunepack.runtimes import catalog
from tunepack.runtimes.args import parse_trainer_args
from tunepack.trainers import config

# (model, method, dataset schema): between them every kind of tunepack component the config names
CASES = [
    ("tiny-llama3", "lora", "instruction"),
    ("qwen3-0.6b", "grpo", "prompt"),
    ("qwen3-30b-a3b", "kto", "unpaired"),
    ("gemma3-1b", "dpo", "preference"),
]


def _config(tmp_path: Path, model: str, method: str, schema: str, *args: str):
    model_dir, dataset_dir = tmp_path / "model", tmp_path / "dataset"
    model_dir.mkdir()
    dataset_dir.mkdir()
    # Only what build_config reads: the dataset's manifest and a sharded checkpoint's index.
    manifest = {"schema": schema, "files": {"train.jsonl": {"sha256": "ab"}}}
    (dataset_dir / "tunepack-manifest.json").write_text(json.dumps(manifest))
    index = {"weight_map": {"a": "model-00001-of-00002.safetensors"}}
    (model_dir / catalog.SAFETENSORS_INDEX).write_text(json.dumps(index))
    entry = catalog.get(model)
    words = [
        f"method={method}",
        "device=cpu",
        *(["batch_size=4"] if method == "kto" else []),
        *args,
    ]
    return config.build_config(
        entry,
        parse_trainer_args(words, entry),
        model_dir=model_dir,
        dataset_dir=dataset_dir,
        output_dir=tmp_path / "output",
        cache_dir=tmp_path / "cache",
    )


def _as_before_the_rooms(cfg):
    """The same config as the trainer wrote it while its modules were tunepack.trainers.<module>."""
    text = re.sub(rf"tunepack\.trainers\.(?:{'|'.join(config.ROOMS)})\.", "tunepack.trainers.",
                  json.dumps(OmegaConf.to_container(cfg)))  # fmt: skip
    return OmegaConf.create(json.loads(text))


@pytest.mark.parametrize(("model", "method", "schema"), CASES)
def test_the_identity_is_the_one_of_the_same_run_before_the_rooms(tmp_path, model, method, schema):
    cfg = _config(tmp_path, model, method, schema)
    before = _as_before_the_rooms(cfg)
    assert before != cfg  # the config does name components inside the rooms
    assert config.run_identity(before) == config.run_identity(cfg)
    assert config.result_digest(before) == config.result_digest(cfg)


def test_a_pinned_run_keeps_the_digest_its_checkpoints_carry(tmp_path):
    # tiny-llama3 LoRA's digests as tunepack computed them before the trainer's modules were
    # grouped into rooms. A change here means checkpoints and results of earlier versions no longer
    # resume or count as done: change it only when that is intended.
    cfg = _config(tmp_path, "tiny-llama3", "lora", "instruction")
    assert config.run_digest(cfg) == (
        "bb67d16f06859ee114aea860a6ba13e7489c1e8e17374ff26e22f3d49ec27fb8"
    )
    assert config.result_digest(cfg) == (
        "e5160e887149aaaf076676dbf817099a0146f6eadafbd1ea5b9df31e67dcad6b"
    )


def test_another_component_is_another_run(tmp_path):
    # Only the room is taken out of a name: a different component is still a different run.
    cfg = _config(tmp_path, "tiny-llama3", "lora", "instruction")
    other = OmegaConf.create(OmegaConf.to_container(cfg))
    other.tokenizer._component_ = "tunepack.trainers.data.other_module.build_tokenizer"
    assert config.run_identity(other)["training"] != config.run_identity(cfg)["training"]


def test_the_rooms_are_the_trainers_subpackages():
    # A room added without its name here would put its module paths into runs' identities.
    found = {p.parent.name for p in (REPO / "trainers").glob("*/__init__.py")}
    assert found == set(config.ROOMS)
