"""The caller's words: how a message names what the caller wrote, in a notebook (the SDK's
arguments: ``FineTune(num_nodes=0)``, ``search_space['lr']``) or at the ``tunepack`` command
(its flags and ``key=value`` arguments: ``--num-nodes 0``, ``--search lr``).

The SDK's functions take a ``Spelling`` (``SDK`` by default); the CLI passes ``CLI``. The
programs the steps run (the initializers) have their own, read from their environment:
``tunepack.initializers.data.schemas.spelling``."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Spelling:
    """How the caller names things in messages: the SDK's arguments or the CLI's flags."""

    space: str = "search_space[{!r}]"
    objective: str = "Objective(metric={!r})"
    algorithm: str = "algorithm"
    trials: str = "TrialConfig.num_trials"
    # A FineTune field that is not a trainer argument (num_nodes, export, ...), with its value.
    field: str = "FineTune.{name}={value!r}"
    field_name: str = "FineTune.{name}"
    # Another field, named in a message about the first (export_secret needs export='...').
    other: str = "{name}"
    other_field: str = "{name}={value!r}"
    # What FineTune's own checks put before a message about several fields ("FineTune: ...").
    finetune: str = "FineTune: "
    # A trainer argument with its value, as the caller wrote it (lora_rank=8, merge=True).
    arg: str = "{name}={value!r}"
    # GPUs per node: to ask for {} of them; as the caller gave them ({value}: the
    # resources_per_node dict, {gpus}: the GPUs it gives a node).
    gpus: str = "resources_per_node={{'gpu': {}}}"
    gpus_given: str = "resources_per_node={value!r}"
    # The memory check's ways out: more GPUs, another method, submitting anyway.
    more_gpus: str = "add GPUs (resources_per_node / num_nodes)"
    method: str = "method={!r}"
    memory_check: str = "pass memory_check='warn' to TrainingClient"

    def key(self, name: str) -> str:
        return self.space.format(name)

    def named(self, name: str) -> str:
        """A FineTune field (``FineTune.num_nodes``, ``--num-nodes``)."""
        return self.field_name.format(name=name, flag=_flag(name))

    def given(self, name: str, value: object) -> str:
        """A FineTune field with its value (``FineTune.num_nodes=0``, ``--num-nodes 0``)."""
        return self.field.format(name=name, flag=_flag(name), value=value)

    def named_other(self, name: str) -> str:
        """Another field, in a message about the first (``export``, ``--export``)."""
        return self.other.format(name=name, flag=_flag(name))

    def given_other(self, name: str, value: object) -> str:
        """Another field with its value (``export='s3://b/p'``, ``--export s3://b/p``)."""
        return self.other_field.format(name=name, flag=_flag(name), value=value)

    def given_arg(self, name: str, value: object, raw: str) -> str:
        """A trainer argument with its value (``merge=True``; the CLI's ``merge=true``: ``raw``,
        its ``key=value`` spelling)."""
        return self.arg.format(name=name, value=value, raw=raw)


def _flag(name: str) -> str:
    return name.replace("_", "-")


SDK = Spelling()
CLI = Spelling(
    space="--search {}",
    objective="--objective {}",
    algorithm="--algorithm",
    trials="--trials",
    field="--{flag} {value}",
    field_name="--{flag}",
    other="--{flag}",
    other_field="--{flag} {value}",
    finetune="",
    arg="{name}={raw}",
    gpus="--gpus-per-node {}",
    gpus_given="--gpus-per-node {gpus}",
    more_gpus="add GPUs (--gpus-per-node / --num-nodes)",
    method="method={}",
    memory_check="pass --memory-check warn",
)
