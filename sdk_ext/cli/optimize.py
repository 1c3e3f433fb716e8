"""``tunepack optimize``: a hyperparameter search through ``tunepack.OptimizerClient``, as a
notebook runs one: a Katib Experiment on the cluster, followed until it ends (Ctrl-C leaves it
running there), or with ``--local`` a study run in the foreground on this machine. ``tunepack
optimize jobs|status|best|logs|delete`` look at searches (docs/optimize.md)."""

from __future__ import annotations

import argparse
import signal
import sys
import threading

ACTIONS = ("jobs", "status", "best", "logs", "delete")


def cmd_optimize(ns: argparse.Namespace) -> int:
    from kubeflow.optimizer.types.optimization_types import TrialConfig
    from kubeflow.trainer.types.types import TrainJobTemplate

    from tunepack.core.errors import BadValueError
    from tunepack.optimizer import space as spaces
    from tunepack.optimizer.local.record import COMPLETE, STOPPED

    # Job flags a search cannot honour, said rather than dropped.
    if ns.name:
        raise BadValueError(
            f"--name {ns.name}: a search names its trials itself (<search>-<n> on this machine, "
            "by Katib on a cluster); leave --name out"
        )
    if ns.queue:
        raise BadValueError(
            f"--queue {ns.queue}: a search's trials are not put in a Kueue queue in this version "
            "of tunepack; leave --queue out"
        )
    backend = _backend(ns)
    if not ns.search:
        raise BadValueError(
            "give what to search: --search NAME=loguniform:MIN:MAX, NAME=uniform:MIN:MAX or "
            "NAME=choice:A,B,... (e.g. --search lr=loguniform:1e-5:1e-3), once per argument"
        )
    search_space = dict(spaces.parse_search_flag(flag) for flag in ns.search)
    if len(search_space) != len(ns.search):
        raise BadValueError("--search names an argument twice; give each argument once")
    from tunepack.cli.train import _finetune, _initializer

    template = TrainJobTemplate(
        runtime=ns.runtime, trainer=_finetune(ns), initializer=_initializer(ns)
    )
    stopping = None
    if ns.early_stop is not None:
        stopping = _median_stop(ns.early_stop)
    template, space = backend.prepare(
        template,
        search_space=search_space,
        trial_config=TrialConfig(
            num_trials=ns.trials, parallel_trials=ns.parallel, max_failed_trials=ns.max_failed
        ),
        objectives=[spaces.parse_objective_flag(ns.objective)] if ns.objective else None,
        algorithm=spaces.algorithm_from_flag(ns.algorithm, ns.seed),
        early_stopping=stopping,
        spelling=spaces.CLI,
    )
    searched = " ".join(p.describe() for p in space.parameters)
    if not ns.local:
        return _on_cluster(backend, template, space, searched)
    record = backend.create(template, space)
    name = record.name
    print(
        f"tunepack: optimization {name}: {space.num_trials} trials of {template.runtime}, "
        f"{space.goal.metric} ({space.goal.arrow}) by {space.algorithm.name} search over "
        f"{searched}",
        flush=True,
    )
    if record.status()[0] == COMPLETE:
        print(f"tunepack: optimization {name} is complete; nothing to do", flush=True)
        return _print_best(backend, name)
    stop = threading.Event()
    presses = []

    def on_signal(signum, _frame):
        presses.append(signum)
        if len(presses) == 1:
            print(
                f"tunepack: interrupted: stopping optimization {name} (each running trial saves "
                "a checkpoint first; the same command resumes it)",
                file=sys.stderr,
                flush=True,
            )
            stop.set()

    previous = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    try:

        def echo(line: str) -> None:
            # --quiet: the search's own lines (trials started and ended), not the steps' output
            if not ns.quiet or line.startswith("tunepack: "):
                print(line, flush=True)

        outcome = backend.run(record, echo, stop)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    if outcome.status == STOPPED:
        print(
            f"tunepack: optimization {name} stopped; run the same command again to resume it "
            "(no finished trial runs again)",
            file=sys.stderr,
        )
        return 128 + (presses[0] if presses else signal.SIGINT)
    job = backend.get_job(name)
    print(job.table())
    if outcome.status != COMPLETE:
        print(f"tunepack: optimization {name} failed: {outcome.message}", file=sys.stderr)
        return 1
    return _print_best(backend, name)


def _on_cluster(backend, template, space, searched: str) -> int:
    """The Experiment made, then its trials followed as they end (Ctrl-C stops following only)."""
    from tunepack.optimizer.kubernetes.backend import katib_metric

    name = backend.submit(template, space)
    print(
        f"tunepack: optimization {name} (Katib Experiment in namespace {backend.namespace}): "
        f"{space.num_trials} trials of {template.runtime}, {space.parallel_trials} at once, "
        f"{katib_metric(space.goal.metric)} ({space.goal.arrow}) by {space.algorithm.name} "
        f"search over {searched}",
        flush=True,
    )
    said: set[str] = set()

    def on_change(job) -> None:
        for trial in job.trials:
            if trial.state in ("Complete", "Failed", "EarlyStopped") and trial.name not in said:
                said.add(trial.name)
                values = " ".join(f"{k}={v}" for k, v in trial.parameters.items())
                figure = "" if trial.objective is None else f": {trial.objective:.4f}"
                why = f" ({trial.message})" if trial.message and trial.state == "Failed" else ""
                print(f"tunepack: trial {trial.name} {trial.state}{figure}: {values}{why}")

    try:
        job = backend.wait_for_job_status(
            name, {"Complete", "Failed"}, timeout=7 * 24 * 3600, callbacks=[on_change]
        )
    except KeyboardInterrupt:
        print(
            f"tunepack: stopped following {name}; it runs on in the cluster (`tunepack optimize "
            f"status {name}`, `tunepack optimize delete {name}` stops it)",
            file=sys.stderr,
        )
        return 130
    print(job.table())
    if job.status != "Complete":
        print(f"tunepack: optimization {name} failed: {job.message}", file=sys.stderr)
        return 1
    return _print_best(backend, name)


def _median_stop(raw: str):
    from tunepack.core.errors import BadValueError
    from tunepack.optimizer.space import MedianStop

    parts = raw.split(":") if raw else []
    try:
        numbers = [int(p) for p in parts]
    except ValueError:
        numbers = None
    if numbers is None or len(numbers) > 2 or any(n < 0 for n in numbers):
        raise BadValueError(
            f"--early-stop {raw!r} is not valid: expected MIN_TRIALS[:START_STEP] (e.g. 3:10), "
            "or nothing for the defaults"
        )
    return MedianStop(*numbers)


def _print_best(backend, name: str) -> int:
    best = backend.get_best_results(name)
    job = backend.get_job(name)
    if best is None:
        print(f"tunepack: optimization {name} has no finished trial ({job.status})")
        return 0
    trial = next(t for t in job.trials if t.name == best.trial)
    values = " ".join(f"{k}={v}" for k, v in best.parameters.items())
    where = "--local" if getattr(backend, "is_local", False) else f"--namespace {backend.namespace}"
    print(
        f"tunepack: best trial {best.trial}: {values}: {job.objectives[0].metric} "
        f"{trial.objective:.4f}; its result: tunepack result {best.trial} {where}"
    )
    return 0


def _backend(ns: argparse.Namespace):
    """The search's backend: this machine's (``--local``) or the cluster's (Katib)."""
    if ns.local:
        from tunepack.cli.clients import local_client
        from tunepack.optimizer.local import LocalOptimizerBackend

        return LocalOptimizerBackend(local_client(ns).backend.cfg)
    from tunepack.cli.cluster import backend_config, check_cluster
    from tunepack.optimizer.kubernetes import KubernetesOptimizerBackend
    from tunepack.runtimes.planner import DEFAULT_GPU, DEFAULT_MEMORY_CHECK

    check_cluster(ns.context)
    return KubernetesOptimizerBackend(
        backend_config(ns),
        getattr(ns, "gpu", DEFAULT_GPU),
        getattr(ns, "memory_check", DEFAULT_MEMORY_CHECK),
    )


# --- jobs, status, best, logs, delete --------------------------------------------------------


def cmd_jobs(ns: argparse.Namespace) -> int:
    jobs = _backend(ns).list_jobs()
    rows = [["NAME", "STATUS", "TRIALS", "BEST", "CREATED"]]
    for job in jobs:
        best = next((t for t in job.trials if t.name == job.best_trial), None)
        rows.append(
            [
                job.name,
                job.status,
                f"{sum(t.state not in ('Running', 'Stopped') for t in job.trials)}/"
                f"{job.trial_config.num_trials}",
                f"{job.objectives[0].metric} {best.objective:.4f}" if best else "-",
                job.creation_timestamp.strftime("%Y-%m-%d %H:%M:%S"),
            ]
        )
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    for row in rows:
        print("  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip())
    return 0


def cmd_status(ns: argparse.Namespace) -> int:
    job = _backend(ns).get_job(ns.name)
    print(
        f"{job.name}  {job.status}"
        + (f": {job.message}" if job.message else "")
        + f"  ({len(job.trials)} of {job.trial_config.num_trials} trials)"
    )
    print(job.table())
    for trial in job.trials:
        if trial.message:
            print(f"  {trial.name}: {trial.message}")
    return 0


def cmd_best(ns: argparse.Namespace) -> int:
    backend = _backend(ns)
    backend.get_job(ns.name)  # NotFoundError first
    return _print_best(backend, ns.name)


def cmd_logs(ns: argparse.Namespace) -> int:
    for line in _backend(ns).get_job_logs(ns.name, trial_name=ns.trial, follow=ns.follow):
        print(line)
    return 0


def cmd_delete(ns: argparse.Namespace) -> int:
    _backend(ns).delete_job(ns.name)
    print(f"tunepack: deleted optimization {ns.name} and its trials")
    return 0


def add_parsers(sub, parser_class, add_job_arguments, add_memory_arguments, jobs_dir_help) -> None:
    """``optimize`` among the CLI's commands (``sub``: build_parser's subparsers action)."""
    p = sub.add_parser(
        "optimize",
        help="hyperparameter search: trials of a TrainJob over searched trainer arguments",
        description="Run a hyperparameter search (tunepack.OptimizerClient). Also: `tunepack "
        "optimize jobs|status NAME|best NAME|logs NAME [--trial T]|delete NAME [--local]`.",
    )
    add_job_arguments(p)
    p.add_argument(
        "--local",
        action="store_true",
        help="run the trials on this machine (default: a Katib Experiment on the cluster)",
    )
    p.add_argument("--namespace", help="cluster namespace (default: the kubeconfig's)")
    p.add_argument("--context", help="kubeconfig context")
    p.add_argument(
        "--search",
        action="append",
        default=[],
        metavar="NAME=KIND:...",
        help="a searched trainer argument: NAME=loguniform:MIN:MAX, NAME=uniform:MIN:MAX or "
        "NAME=choice:A,B,... (repeat for each)",
    )
    p.add_argument("--trials", type=int, default=10, help="trials in all (default 10)")
    p.add_argument(
        "--parallel",
        type=int,
        default=1,
        help="trials at once (default 1; one at a time on a machine without GPUs)",
    )
    p.add_argument("--max-failed", type=int, help="failed trials that fail the search")
    p.add_argument(
        "--objective",
        metavar="METRIC[:min|:max]",
        help="the metric to optimise (default: val_loss:min where val_fraction holds out rows, "
        "else loss:min)",
    )
    p.add_argument(
        "--algorithm",
        choices=("random", "grid", "tpe"),
        default="random",
        help="how points are drawn: random (default), grid (every --search a choice: each point "
        "once, in order) or tpe (where earlier trials did well)",
    )
    p.add_argument("--seed", type=int, help="the search's seed (random, tpe)")
    p.add_argument(
        "--early-stop",
        nargs="?",
        const="",
        metavar="MIN_TRIALS[:START_STEP]",
        help="stop trials worse than the median of earlier ones at the same step (defaults 3:0)",
    )
    add_memory_arguments(p)
    p.add_argument("--jobs-dir", help=jobs_dir_help)
    p.add_argument(
        "--quiet",
        action="store_true",
        help="print the trials and the best, not the initializers' output",
    )
    p.set_defaults(func=cmd_optimize)


def action_parser(parser_class, jobs_dir_help) -> argparse.ArgumentParser:
    """The parser of ``tunepack optimize ACTION ...``."""
    p = parser_class(prog="tunepack optimize")
    sub = p.add_subparsers(dest="action", required=True)
    for action, func, helptext in (
        ("jobs", cmd_jobs, "list the searches"),
        ("status", cmd_status, "a search's status and trials"),
        ("best", cmd_best, "the best trial's values and result"),
        ("logs", cmd_logs, "a trial's trainer log (default: the best trial's)"),
        ("delete", cmd_delete, "delete a search and its trials"),
    ):
        a = sub.add_parser(action, help=helptext)
        if action != "jobs":
            a.add_argument("name", help="the search's name (hpo-...)")
        if action == "logs":
            a.add_argument("--trial", help="a trial's TrainJob name")
            a.add_argument("--follow", "-f", action="store_true", help="follow a running trial")
        a.add_argument("--local", action="store_true", help="searches of the local backend")
        a.add_argument("--namespace", help="cluster namespace (default: the kubeconfig's)")
        a.add_argument("--context", help="kubeconfig context")
        a.add_argument("--jobs-dir", help=jobs_dir_help)
        a.set_defaults(func=func)
    return p
