"""The ``tunepack`` command line's parser: every subcommand's arguments and help, and the
``cmd_*`` function each one runs."""

from __future__ import annotations

import argparse

from tunepack.cli import optimize
from tunepack.cli.jobs import cmd_delete, cmd_download, cmd_jobs, cmd_logs, cmd_result, cmd_status
from tunepack.cli.render import cmd_render_serving, cmd_render_trainjob
from tunepack.cli.runtimes import cmd_args, cmd_install, cmd_runtimes
from tunepack.cli.tools import (
    DEFAULT_IMAGE_ROWS,
    DEFAULT_PLAN_SEQ_LEN,
    cmd_plan,
    cmd_tiny_dataset,
    cmd_tiny_model,
)
from tunepack.cli.train import cmd_train
from tunepack.runtimes import catalog, methods
from tunepack.runtimes.planner import DEFAULT_GPU, DEFAULT_MEMORY_CHECK, GPUS, MEMORY_CHECKS
from tunepack.tools.serving_memory import DEFAULT_CONCURRENCY

DESCRIPTION = (
    "Fine-tune LLMs with tunepack's Kubeflow Trainer runtimes, on a Kubernetes cluster or on "
    "this machine; `tunepack COMMAND --help` describes each command."
)
URI_HELP = (
    "hf://org/name, s3://bucket/prefix, https://host/file, file:///absolute/path or a local path"
)
JOBS_DIR_HELP = "local backend jobs dir (default: $TUNEPACK_HOME/jobs or ~/.tunepack/jobs)"
GPU_HELP = (
    f"one of {', '.join(GPUS)} (default {DEFAULT_GPU}), in any case; h100: the one size there is"
)


def _add_backend_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--local", action="store_true", help="jobs of the local backend")
    parser.add_argument("--jobs-dir", help=JOBS_DIR_HELP)
    parser.add_argument("--namespace", help="cluster namespace (default: the kubeconfig's)")
    parser.add_argument("--context", help="kubeconfig context")


def _add_job_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--runtime", required=True, help="runtime name, e.g. tunepack-tiny-llama3")
    parser.add_argument("--dataset", required=True, help=f"dataset storage URI: {URI_HELP}")
    parser.add_argument("--model", required=True, help=f"model storage URI: {URI_HELP}")
    parser.add_argument(
        "--name",
        help="TrainJob name (default, local: <model>-<digest of the dataset, model and trainer "
        "arguments>, so the same command resumes its job; cluster: <model>-<timestamp>)",
    )
    parser.add_argument("--num-nodes", type=int, help="number of trainer nodes")
    parser.add_argument(
        "--gpus-per-node",
        type=int,
        metavar="N",
        help="GPUs each trainer node holds (the pods' nvidia.com/gpu; default: the runtime's; 0: "
        "none), one trainer process per GPU; the memory check plans with them (--local: the "
        "first N GPUs of this machine)",
    )
    parser.add_argument(
        "--num-proc-per-node",
        type=int,
        help="trainer processes per node: one per GPU on nodes with GPUs (the default; another "
        "number is refused: set --gpus-per-node), any number on nodes without (default 1); "
        "--local without --gpus-per-node: as this machine's GPUs allow",
    )
    parser.add_argument(
        "--queue", help="Kueue LocalQueue for the TrainJob (label kueue.x-k8s.io/queue-name)"
    )
    for what in ("dataset", "model"):
        parser.add_argument(
            f"--{what}-secret",
            metavar="SECRET",
            help=f"cluster: a Secret whose keys (HF_TOKEN, AWS_ACCESS_KEY_ID, HTTPS_USERNAME, ...) "
            f"the {what} initializer gets",
        )
    parser.add_argument(
        "--column-map",
        metavar="MAP",
        help="rename the dataset's columns to a schema's fields first: from:to,... (e.g. "
        "question:instruction,answer:output; the dataset initializer's COLUMN_MAP)",
    )
    parser.add_argument(
        "--dataset-schema",
        metavar="SCHEMA",
        help="the dataset's schema instead of detecting it from the first row: instruction, chat, "
        "sharegpt, text, preference, prompt or unpaired (DATASET_SCHEMA)",
    )
    parser.add_argument(
        "--export",
        metavar="URI",
        help="where the result goes after training: s3://bucket/prefix, hf://org/name (a "
        "private model repository) or a path (docs/export.md)",
    )
    parser.add_argument(
        "--export-secret",
        metavar="SECRET",
        help="cluster: a Secret whose keys (HF_TOKEN, AWS_ACCESS_KEY_ID, ...) the exporter gets",
    )
    parser.add_argument(
        "trainer_args", nargs="*", metavar="key=value", help="trainer arguments (tunepack args)"
    )


def _add_memory_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--gpu", default=DEFAULT_GPU, help=f"GPU type the memory check assumes: {GPU_HELP}"
    )
    parser.add_argument(
        "--memory-check",
        choices=MEMORY_CHECKS,
        default=DEFAULT_MEMORY_CHECK,
        help="when the planner says the job cannot fit in GPU memory (as TrainingClient's "
        "memory_check; train on a cluster or --local, and render trainjob alike)",
    )


class _Parser(argparse.ArgumentParser):
    """argparse, with a usage mistake reported like any other bad input: one line, exit 65."""

    def error(self, message: str):
        from tunepack.core.errors import BadValueError, UnknownKeyError

        pair = _pair_for_a_flag(message)
        hint = (
            f"trainer arguments are key=value pairs: write {pair}; see `tunepack args`"
            if pair
            else None
        )
        # argparse tells an option it does not know only by its words; any other usage mistake
        # (a missing argument, an invalid choice or value) is a bad value.
        unknown = message.startswith("unrecognized arguments")
        line = f"{message} ({hint or f'see `{self.prog} --help`'})"
        if unknown:
            given = message.removeprefix("unrecognized arguments:").split()
            raise UnknownKeyError(
                line, key=given[0] if given else None, suggestions=(pair,) if pair else ()
            )
        raise BadValueError(line)


def _pair_for_a_flag(message: str) -> str | None:
    """A trainer argument written as a flag (``--learning-rate 1e-4``, ``--lr 1e-4``): the
    ``key=value`` spelling it takes (``lr=VALUE``)."""
    if not message.startswith("unrecognized arguments: "):
        return None
    from tunepack.runtimes import args as vocabulary

    for token in message.removeprefix("unrecognized arguments: ").split():
        name = token.removeprefix("--").partition("=")[0]
        if not token.startswith("--"):
            continue
        if name.replace("-", "_") in vocabulary.VOCABULARY_KEYS:
            key, value = name.replace("-", "_"), None
        elif meant := vocabulary.foreign_name(name):
            key, value = meant
        else:
            continue
        return f"{key}={value or 'VALUE'}"
    return None


def optimize_action_parser() -> argparse.ArgumentParser:
    """``tunepack optimize jobs|status|best|logs|delete ...``: its own parser (the search's
    run takes trainer arguments as words, which a nested command could not tell apart)."""
    return optimize.action_parser(_Parser, JOBS_DIR_HELP)


def build_parser() -> argparse.ArgumentParser:
    """The command line: the commands in the order ``tunepack --help`` lists them."""
    parser = _Parser(prog="tunepack", description=DESCRIPTION)
    parser.add_argument("--version", action="version", version=f"%(prog)s {_version()}")
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("runtimes", help="list tunepack runtimes").set_defaults(func=cmd_runtimes)
    sub.add_parser("args", help="list trainer arguments").set_defaults(func=cmd_args)
    _add_tiny_model(sub)
    _add_tiny_dataset(sub)
    _add_train(sub)
    optimize.add_parsers(sub, _Parser, _add_job_arguments, _add_memory_arguments, JOBS_DIR_HELP)
    _add_jobs(sub)
    _add_status(sub)
    _add_logs(sub)
    _add_result(sub)
    _add_delete(sub)
    _add_download(sub)
    _add_plan(sub)
    _add_install(sub)
    _add_render(sub)
    return parser


# The subcommands' parsers, one function each; ``sub`` is build_parser's subparsers action.
_Commands = argparse._SubParsersAction


def _add_tiny_model(sub: _Commands) -> None:
    p = sub.add_parser("tiny-model", help="write a tiny random model to try a runtime (offline)")
    p.add_argument("directory", help="directory to write the model to (config, weights, tokenizer)")
    p.add_argument(
        "--model",
        choices=list(catalog.TINY_MODELS),
        default=catalog.TINY_LLAMA3.name,
        help="; ".join(
            f"{name}: for --runtime {tiny.runtime}, method={', '.join(tiny.methods)}"
            for name, tiny in catalog.TINY_MODELS.items()
        )
        + f" (default {catalog.TINY_LLAMA3.name}; {catalog.TINY_VISION_NF4.name} is written with "
        "transformers, which make dev installs)",
    )
    p.add_argument(
        "--seed", type=int, default=0, help="seed of the random weights (default 0: the same model)"
    )
    p.set_defaults(func=cmd_tiny_model)


def _add_tiny_dataset(sub: _Commands) -> None:
    p = sub.add_parser("tiny-dataset", help="write a small instruction dataset (offline)")
    p.add_argument(
        "file",
        help="the JSON Lines file to write (e.g. data/instructions.jsonl); with --images, the "
        "directory to write the pictures and their train.jsonl to",
    )
    kind = p.add_mutually_exclusive_group()
    kind.add_argument(
        "--preference",
        action="store_true",
        help="preference pairs for method=dpo or orpo instead",
    )
    kind.add_argument(
        "--unpaired",
        action="store_true",
        help="answers labelled desirable or undesirable for method=kto instead",
    )
    kind.add_argument(
        "--prompts",
        action="store_true",
        help="prompts with verifiable answers (sums) for method=grpo instead",
    )
    kind.add_argument(
        "--images",
        action="store_true",
        help="pictures of coloured squares and circles with questions (image_chat rows) for "
        f"{catalog.TINY_VISION_NF4.name} instead; FILE is a directory (needs Pillow: make dev)",
    )
    p.add_argument(
        "--rows",
        type=int,
        help=f"number of rows (default 256; {DEFAULT_IMAGE_ROWS} pictures with --images)",
    )
    p.add_argument(
        "--seed", type=int, default=0, help="seed of the rows' choice (default 0: the same rows)"
    )
    p.set_defaults(func=cmd_tiny_dataset)


def _add_train(sub: _Commands) -> None:
    p = sub.add_parser("train", help="fine-tune: run a TrainJob")
    _add_job_arguments(p)
    p.add_argument("--local", action="store_true", help="run on this machine (local backend)")
    p.add_argument("--namespace", help="cluster namespace (default: the kubeconfig's)")
    p.add_argument("--context", help="kubeconfig context (cluster)")
    _add_memory_arguments(p)
    p.add_argument(
        "--workspace",
        help="local workspace dir (default: the job's, .tunepack/runs/<name> when it is new; "
        "a re-run of the same command, or of --name NAME, resumes in that job's)",
    )
    p.add_argument(
        "--verbose",
        action="store_true",
        help="show the steps' third-party warnings and debug lines (TUNEPACK_VERBOSE=1), and "
        "tunepack's own info messages",
    )
    p.add_argument("--jobs-dir", help=JOBS_DIR_HELP)
    p.add_argument("--quiet", action="store_true", help="do not echo step output")
    p.set_defaults(func=cmd_train)


def _add_jobs(sub: _Commands) -> None:
    p = sub.add_parser("jobs", help="list TrainJobs: name, runtime, status, created, workspace")
    _add_backend_arguments(p)
    p.set_defaults(func=cmd_jobs)


def _add_one_job_command(sub: _Commands, cmd: str, func, helptext: str) -> argparse.ArgumentParser:
    """A command about one TrainJob: its name and the backend flags; the caller adds the rest."""
    p = sub.add_parser(cmd, help=helptext)
    p.add_argument("name", help="TrainJob name")
    _add_backend_arguments(p)
    p.set_defaults(func=func)
    return p


def _add_status(sub: _Commands) -> None:
    _add_one_job_command(sub, "status", cmd_status, "a TrainJob's status, steps and progress")


def _add_logs(sub: _Commands) -> None:
    p = _add_one_job_command(sub, "logs", cmd_logs, "a TrainJob step's log")
    p.add_argument(
        "--step",
        default="node-0",
        help="dataset-initializer, model-initializer, node (a one-node job's trainer, as "
        "the console and logs/node.log name it; node-0, node-1 ... of several nodes), "
        "export (default: the first node's)",
    )
    p.add_argument(
        "--follow",
        "-f",
        action="store_true",
        help="keep printing new lines until the job ends (Ctrl-C stops following, not the job)",
    )


def _add_result(sub: _Commands) -> None:
    _add_one_job_command(
        sub, "result", cmd_result, "a finished TrainJob's adapter (or model) and final loss"
    )


def _add_delete(sub: _Commands) -> None:
    p = _add_one_job_command(sub, "delete", cmd_delete, "delete a TrainJob (its workspace is kept)")
    p.add_argument(
        "--workspace-too",
        action="store_true",
        help="also remove the local job's workspace (default: kept)",
    )


def _add_download(sub: _Commands) -> None:
    p = sub.add_parser(
        "download", help="fetch a TrainJob's exported result (or the export at a URI), verified"
    )
    p.add_argument("name", help="TrainJob name, or an export URI (s3://, hf://, a path)")
    p.add_argument("dir", help="directory to create (it appears only when complete)")
    _add_backend_arguments(p)
    p.set_defaults(func=cmd_download)


def _add_plan(sub: _Commands) -> None:
    p = sub.add_parser("plan", help="estimate GPU memory and recommend nodes x GPUs")
    p.add_argument("--model", required=True, help="catalog model or runtime name")
    p.add_argument("--method", default=methods.DEFAULT, help=", ".join(methods.NAMES))
    p.add_argument(
        "--seq-len",
        type=int,
        help=f"tokens per sequence (max_seq_len; default {DEFAULT_PLAN_SEQ_LEN}, or the model's "
        "context where shorter)",
    )
    p.add_argument(
        "--batch-size",
        type=int,
        help="examples per device (default: a job's, the model's batch_size in the catalog, as "
        "tunepack train and render trainjob take it; the plan's first line says it)",
    )
    p.add_argument("--gpu", default=DEFAULT_GPU, help=GPU_HELP)
    p.add_argument("--nodes", type=int, default=1, help="trainer nodes (default 1)")
    p.add_argument("--gpus-per-node", type=int, default=1, help="GPUs per node (default 1)")
    p.add_argument("--lora-rank", type=int, help="LoRA rank (lora, qlora, dora; default 16)")
    p.add_argument(
        "--lora-mlp",
        action=argparse.BooleanOptionalAction,
        help="plan LoRA on the MLPs (a mixture of experts: every expert) or not (default: the "
        "runtime's lora_mlp)",
    )
    p.add_argument(
        "--activation-checkpointing",
        action=argparse.BooleanOptionalAction,
        default="auto",
        help="plan with activation checkpointing on every layer (or on none), which recomputes "
        "activations for less memory (default: as the trainer chooses on the GPU: as few "
        "layers as the job needs to fit)",
    )
    p.add_argument(
        "--loss-chunk",
        type=_loss_chunk,
        default="auto",
        metavar="ROWS",
        help="plan the loss computing ROWS rows of logits at once (default: as the trainer "
        "chooses on the GPU: all of them where they fit)",
    )
    p.add_argument(
        "--num-generations",
        type=int,
        help="answers sampled per prompt (method grpo; default 4)",
    )
    p.add_argument("--model-dir", help="checkpoint directory a -custom runtime is sized from")
    p.set_defaults(func=cmd_plan)


def _add_install(sub: _Commands) -> None:
    p = sub.add_parser(
        "install",
        help="server-side apply tunepack's runtimes to the cluster",
        epilog="Queues: with Kueue (TrainJob integration on), `kubectl apply --server-side -k "
        "manifests/kueue` adds a ClusterQueue with GPU quota, the LocalQueue 'team' and two "
        "priority classes; then `tunepack train --queue team ...` (docs/cluster.md, 'Gang "
        "scheduling and queues').",
    )
    p.add_argument("--namespace", help="install namespace-scoped TrainingRuntimes there instead")
    p.add_argument("--runtime", action="append", help="only this runtime (repeatable)")
    p.add_argument("--context", help="kubeconfig context")
    p.add_argument(
        "--delete-timeout",
        type=float,
        default=60.0,
        metavar="SECONDS",
        help="how long to wait for a runtime that must be re-created to be deleted (default 60)",
    )
    p.add_argument(
        "--registry",
        help="pull tunepack's images from this registry, e.g. registry.example.com/ml (default "
        "ghcr.io/tunepack; push them there with `make push-images REGISTRY=...`)",
    )
    p.add_argument("--tag", help="the images' tag (default: tunepack's version)")
    p.add_argument(
        "--no-image-check",
        dest="image_check",
        action="store_false",
        help="install without first checking that the cluster's nodes can pull the images "
        "(the check runs a short probe Pod per image the nodes do not hold yet)",
    )
    p.add_argument(
        "--image-check-timeout",
        type=float,
        default=60.0,
        metavar="SECONDS",
        help="how long the image check waits for the probes' pulls (default 60)",
    )
    p.add_argument(
        "--dry-run",
        action="store_true",
        help="print the objects it would apply as YAML documents (as `kubectl apply "
        "--dry-run=client -o yaml`) and apply nothing: no cluster or kubeconfig needed",
    )
    p.set_defaults(func=cmd_install)


def _add_render(sub: _Commands) -> None:
    p = sub.add_parser("render", help="print Kubernetes objects as YAML")
    render = p.add_subparsers(dest="kind", required=True)
    _add_render_trainjob(render)
    _add_render_serving(render)


def _add_render_trainjob(render: _Commands) -> None:
    p = render.add_parser("trainjob", help="the TrainJob for `kubectl apply -f -`")
    _add_job_arguments(p)
    p.add_argument("--namespace", help="metadata.namespace of the TrainJob")
    p.add_argument(
        "--namespaced",
        action="store_true",
        help="reference a TrainingRuntime in the TrainJob's namespace (tunepack install "
        "--namespace) instead of the ClusterTrainingRuntime",
    )
    _add_memory_arguments(p)
    p.set_defaults(func=cmd_render_trainjob)


def _add_render_serving(render: _Commands) -> None:
    p = render.add_parser(
        "serving",
        help="vLLM serving a finished TrainJob's result (give --job NAME, or the training's "
        "runtime, name and key=value arguments)",
    )
    source = p.add_mutually_exclusive_group()
    source.add_argument(
        "--job",
        metavar="NAME",
        help="the finished TrainJob (a cluster's, or --local): its runtime and arguments are "
        "read from it, its name is --name's default",
    )
    source.add_argument(
        "--result",
        metavar="PATH",
        help="a finished run's result.json, or the workspace (or output directory) holding it: "
        "its runtime and arguments are read from it",
    )
    p.add_argument(
        "--runtime", help="the runtime the TrainJob ran (default: --job's or --result's)"
    )
    p.add_argument("--name", help="the TrainJob's name, its PVC is served (default: --job's)")
    p.add_argument(
        "--gpus",
        type=int,
        help="GPUs for the vLLM pod, the model split over all of them (tensor parallelism; "
        "default: the fewest of 1, 2, 4, 8 that hold it)",
    )
    p.add_argument("--gpu", default=DEFAULT_GPU, help=f"the GPU type of the pod: {GPU_HELP}")
    p.add_argument(
        "--max-model-len",
        type=int,
        help="tokens of prompt and answer per request (default: the run's max_seq_len)",
    )
    p.add_argument(
        "--concurrency",
        type=int,
        default=DEFAULT_CONCURRENCY,
        help=f"requests of --max-model-len tokens the KV cache must hold at once (default "
        f"{DEFAULT_CONCURRENCY}; shorter ones share it, so more of them run)",
    )
    _add_backend_arguments(p)
    p.add_argument(
        "trainer_args",
        nargs="*",
        metavar="key=value",
        help="the training arguments (with --job or --result: the ones to change)",
    )
    p.set_defaults(func=cmd_render_serving)


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("tunepack")
    except PackageNotFoundError:
        return "unknown (not installed)"


def _loss_chunk(raw: str) -> str | int:
    """--loss-chunk: auto or a number of rows (the trainer's loss_chunk), in the flag's words."""
    try:
        return "auto" if raw == "auto" else int(raw)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected auto or an integer >= 1, not {raw!r}") from None
