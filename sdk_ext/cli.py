"""The ``tunepack`` command line.

tunepack runtimes                     # the runtimes tunepack ships
tunepack args                         # the trainer argument vocabulary
tunepack tiny-model DIR               # a tiny random Llama-3 model, offline
tunepack tiny-dataset FILE            # a small instruction dataset, offline
tunepack train --local --runtime R --dataset URI --model URI [key=value ...]
tunepack render trainjob --runtime R --dataset URI --model URI [key=value ...]
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import time
from pathlib import Path

from tunepack.errors import TunepackError


def _table(rows: list[list[str]], header: list[str]) -> str:
    widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(len(header))]
    lines = [
        "  ".join(str(c).ljust(w) for c, w in zip(row, widths, strict=True))
        for row in [header, *rows]
    ]
    return "\n".join(line.rstrip() for line in lines)


def _count(n: int) -> str:
    for div, unit in ((1e9, "B"), (1e6, "M"), (1e3, "K")):
        if n >= div:
            return f"{n / div:.2f}{unit}"
    return str(n)


def cmd_runtimes(_: argparse.Namespace) -> int:
    from tunepack.runtimes.generate import list_runtimes

    rows = [
        [r["name"], ",".join(r["methods"]), _count(r["params"]), r["gpus"], r["description"]]
        for r in list_runtimes()
    ]
    print(_table(rows, ["RUNTIME", "METHODS", "PARAMS", "GPUS", "DESCRIPTION"]))
    return 0


def cmd_args(_: argparse.Namespace) -> int:
    from tunepack.trainers.args import vocabulary_table

    print(_table([list(r) for r in vocabulary_table()], ["KEY", "DEFAULT", "MEANING"]))
    return 0


def cmd_tiny_model(ns: argparse.Namespace) -> int:
    from tunepack.tiny import write_tiny_model

    path = write_tiny_model(Path(ns.directory), seed=ns.seed)
    print(f"tiny model ready at {path}")
    return 0


def cmd_tiny_dataset(ns: argparse.Namespace) -> int:
    from tunepack.tiny import write_tiny_dataset

    path = write_tiny_dataset(Path(ns.file), rows=ns.rows, seed=ns.seed)
    print(f"tiny dataset ready at {path}")
    return 0


def _default_job_name(runtime: str) -> str:
    model = runtime.removeprefix("tunepack-")
    return re.sub(r"[^a-z0-9-]", "-", f"{model}-{time.strftime('%Y%m%d-%H%M%S')}")


def _trainjob(ns: argparse.Namespace) -> dict:
    from tunepack.trainjob import build_trainjob

    return build_trainjob(
        name=ns.name or _default_job_name(ns.runtime),
        runtime=ns.runtime,
        dataset_uri=ns.dataset,
        model_uri=ns.model,
        trainer_args=ns.trainer_args,
        num_nodes=ns.num_nodes,
        namespace=getattr(ns, "namespace", None),
    )


def cmd_render_trainjob(ns: argparse.Namespace) -> int:
    from tunepack.trainjob import to_yaml

    sys.stdout.write(to_yaml(_trainjob(ns)))
    return 0


def cmd_train(ns: argparse.Namespace) -> int:
    from tunepack.errors import BadInputError

    if not ns.local:
        raise BadInputError(
            "cluster submission from the CLI is not available yet: run with --local, or submit "
            "the job with `tunepack render trainjob ... | kubectl apply -f -`"
        )
    from tunepack.local import describe_exit, run_trainjob
    from tunepack.runtimes.generate import load_runtime

    trainjob = _trainjob(ns)
    name = trainjob["metadata"]["name"]
    runtime = load_runtime(trainjob["spec"]["runtimeRef"]["name"])
    workspace = Path(ns.workspace or Path(".tunepack/runs") / name).resolve()
    print(f"tunepack: local run {name!r} of {ns.runtime} in {workspace}")
    started = time.perf_counter()
    outcome = run_trainjob(runtime, trainjob, workspace, echo=None if ns.quiet else print)
    failed = outcome.failed
    if failed:
        reason = failed.error_line()
        print(
            f"tunepack: step {failed.name!r} failed with exit code {failed.exit_code} "
            f"({describe_exit(failed.exit_code)}); log: {failed.log}"
            + (f"\n  {reason}" if reason else ""),
            file=sys.stderr,
        )
        return failed.exit_code
    _print_summary(ns.runtime, workspace, time.perf_counter() - started)
    return 0


def _print_summary(runtime: str, workspace: Path, elapsed: float) -> None:
    result = json.loads((workspace / "output" / "result.json").read_text())
    print()
    print("tunepack: training finished")
    print(f"  runtime     {runtime}")
    print(f"  method      {result['method']}")
    print(f"  steps       {result['steps']}")
    first, last = result["first_loss"], result["final_loss"]
    print(f"  loss        {first:.4f} (first step) -> {last:.4f} (last step)")
    print(f"  elapsed     {elapsed:.1f} s")
    print(f"  result      {result['artifact']}")
    print(f"  logs        {workspace / 'logs'}")


def _add_job_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--runtime", required=True, help="runtime name, e.g. tunepack-tiny-llama3")
    parser.add_argument("--dataset", required=True, help="dataset storage URI (file://, path)")
    parser.add_argument("--model", required=True, help="model storage URI (file://, path)")
    parser.add_argument("--name", help="TrainJob name (default: <model>-<timestamp>)")
    parser.add_argument("--num-nodes", type=int, help="number of trainer nodes")
    parser.add_argument(
        "trainer_args", nargs="*", metavar="key=value", help="trainer arguments (tunepack args)"
    )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tunepack", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)

    sub.add_parser("runtimes", help="list tunepack runtimes").set_defaults(func=cmd_runtimes)
    sub.add_parser("args", help="list trainer arguments").set_defaults(func=cmd_args)

    p = sub.add_parser("tiny-model", help="write a tiny random Llama-3 model (offline)")
    p.add_argument("directory")
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(func=cmd_tiny_model)

    p = sub.add_parser("tiny-dataset", help="write a small instruction dataset (offline)")
    p.add_argument("file")
    p.add_argument("--rows", type=int, default=256)
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(func=cmd_tiny_dataset)

    p = sub.add_parser("train", help="fine-tune: run a TrainJob")
    _add_job_arguments(p)
    p.add_argument("--local", action="store_true", help="run on this machine (local backend)")
    p.add_argument("--workspace", help="local workspace dir (default: .tunepack/runs/<name>)")
    p.add_argument("--quiet", action="store_true", help="do not echo step output")
    p.set_defaults(func=cmd_train)

    p = sub.add_parser("render", help="print Kubernetes objects as YAML")
    render = p.add_subparsers(dest="kind", required=True)
    p = render.add_parser("trainjob", help="the TrainJob for `kubectl apply -f -`")
    _add_job_arguments(p)
    p.add_argument("--namespace", help="metadata.namespace of the TrainJob")
    p.set_defaults(func=cmd_render_trainjob)
    return parser


def main(argv: list[str] | None = None) -> int:
    ns = build_parser().parse_args(argv)
    try:
        return ns.func(ns)
    except TunepackError as err:
        print(f"tunepack: error: {err}", file=sys.stderr)
        return err.exit_code


if __name__ == "__main__":
    sys.exit(main())
