"""The trainer program: the ``node`` container command of every tunepack runtime.

    python -m tunepack.trainers.launch method=lora lora_rank=16 epochs=3 ...

It parses the arguments, writes the run's config.yaml and trains: in this process when the run
has one process in all, else under torchrun with every flag explicit and a static rendezvous
(gang-scheduled Pods have fixed ranks; ``tune run`` would force ``--standalone``, and two nodes
would wait for each other forever). The ``PET_*`` variables, signals and exit codes it honours:
docs/trainer.md, "Processes and nodes", "Checkpoints and resume" and "Exit codes".
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from omegaconf import OmegaConf

from tunepack.core import durable, lifetime, program, workspace
from tunepack.core.errors import EXIT_BAD_INPUT, EXIT_TRANSIENT, BadValueError, DoesNotFitError
from tunepack.runtimes import catalog, custom, methods
from tunepack.trainers.process import noise, threads  # threads: before torch (OMP_WAIT_POLICY)

program.defer_collection(__name__)  # until torch and the recipe are imported

# (config imports torch: the lines above must stay first whatever the modules' names.)
from tunepack.runtimes.args import parse_args, resolve_args  # noqa: E402
from tunepack.trainers.config import (  # noqa: E402
    build_config,
    identity_changes,
    result_digest,
    result_identity,
)

PROGRAM = "trainer"
WORKER_MODULE = "tunepack.trainers.worker"


@dataclass(frozen=True)
class Layout:
    nnodes: int
    nproc_per_node: int
    node_rank: int
    master_addr: str
    master_port: int

    @property
    def world_size(self) -> int:
        return self.nnodes * self.nproc_per_node


def _positive_int(name: str, raw: str) -> int:
    try:
        value = int(raw)
    except ValueError:
        value = 0
    if value < 1:
        raise BadValueError(f"{name}={raw!r} is not valid: expected a positive integer")
    return value


def _gpu_count() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def layout_from_env(device: str) -> Layout:
    """The process layout from the ``PET_*`` variables (absent: one process on this machine)."""
    env = os.environ
    nnodes = _positive_int("PET_NNODES", env.get("PET_NNODES") or "1")
    raw_nproc = env.get("PET_NPROC_PER_NODE") or "1"
    if raw_nproc == "auto":
        nproc = max(_gpu_count(), 1) if device == "cuda" else 1
    else:
        nproc = _positive_int("PET_NPROC_PER_NODE", raw_nproc)
    if device == "cuda" and nproc > _gpu_count():
        raise DoesNotFitError(
            f"PET_NPROC_PER_NODE={raw_nproc} asks for {nproc} processes, one per GPU, but this "
            f"node has {_gpu_count()} GPUs; set numProcPerNode to at most that (or auto)",
            gpu="cuda",
            need_gpus=nproc,
            have_gpus=_gpu_count(),
        )
    try:
        node_rank = int(env.get("PET_NODE_RANK") or "0")
    except ValueError:
        node_rank = -1
    if not 0 <= node_rank < nnodes:
        raise BadValueError(
            f"PET_NODE_RANK={env.get('PET_NODE_RANK')!r} is not valid: expected 0 to {nnodes - 1}"
        )
    addr = env.get("PET_MASTER_ADDR") or "127.0.0.1"
    port = _positive_int("PET_MASTER_PORT", env.get("PET_MASTER_PORT") or "29500")
    if nnodes > 1 and not env.get("PET_MASTER_ADDR"):
        raise BadValueError(f"PET_NNODES={nnodes} but PET_MASTER_ADDR is not set")
    return Layout(nnodes, nproc, node_rank, addr, port)


def torchrun_command(layout: Layout, config_path: Path, digest: str) -> list[str]:
    # torchrun also reads PET_* as defaults for its flags; every flag here is explicit, so
    # PET_NPROC_PER_NODE=auto (one process per CPU core, to torchrun) never reaches it.
    return [
        sys.executable,
        "-m",
        "tunepack.trainers.process.torchrun",  # torch.distributed.run, quieter
        f"--nnodes={layout.nnodes}",
        f"--nproc-per-node={layout.nproc_per_node}",
        f"--node-rank={layout.node_rank}",
        "--rdzv-backend=static",
        f"--rdzv-endpoint={layout.master_addr}:{layout.master_port}",
        "--max-restarts=0",  # the JobSet restarts the whole gang; resume does the rest
        "-m",
        WORKER_MODULE,
        "--config",
        str(config_path),
        "--digest",
        digest,
    ]


def run(argv: list[str]) -> int:
    model_name = os.environ.get(workspace.MODEL_ENV)
    if not model_name:
        raise BadValueError(
            f"{workspace.MODEL_ENV} is not set: the runtime must name its catalog model"
        )
    # A bring-your-own runtime's model is the one the checkpoint's config.json describes.
    entry = custom.resolve(catalog.get(model_name), workspace.model_dir())
    args = resolve_args(parse_args(argv), entry)  # the launcher's one parse, then its resolve

    root = workspace.workspace_root()
    output = workspace.output_dir()
    cfg = build_config(
        entry,
        args,
        model_dir=workspace.model_dir(),
        dataset_dir=workspace.dataset_dir(),
        output_dir=output,
        cache_dir=root / workspace.CACHE_DIR / "datasets",
        checkpoint_dir=root / workspace.CHECKPOINTS_DIR,
    )
    layout = layout_from_env(cfg.device)
    if layout.node_rank == 0:  # the other nodes share node 0's workspace and its run
        workspace.claim_workspace(root, PROGRAM)
    digest = result_digest(cfg)
    result_path = output / workspace.RESULT_FILE
    if result_path.exists():
        try:
            previous = json.loads(result_path.read_text())
        except ValueError:
            previous = {}
        if previous.get("config_digest") == digest:
            print(f"{PROGRAM}: {result_path} is complete for this configuration; nothing to do")
            return 0
        why = identity_changes(previous.get("identity"), result_identity(cfg), "result")
        print(f"{PROGRAM}: {result_path} is from another run ({why}): training", flush=True)

    # One run per workspace: node 0 holds the lock (the local backend's runner already holds it
    # for the whole job and hands it down); the other nodes share node 0's run.
    lock = None
    if layout.node_rank == 0:
        lock = workspace.lock_workspace(root, f"trainer of {entry.runtime_name}")
        # A run killed while publishing left its staging directory: the lock says it is gone.
        for left in durable.remove_staging_leftovers(output):
            print(f"{PROGRAM}: removed {left}, left by an interrupted run", flush=True)
    output.mkdir(parents=True, exist_ok=True)
    config_text = OmegaConf.to_yaml(cfg)
    if layout.node_rank == 0:  # every node derives the same config; one records it
        durable.write_text(output / workspace.CONFIG_FILE, config_text)
    cpu_threads = _set_cpu_threads(layout.nproc_per_node)
    print(
        f"{PROGRAM}: {entry.runtime_name} method={args.method} device={cfg.device} "
        f"dtype={cfg.dtype} nodes={layout.nnodes} processes/node={layout.nproc_per_node} "
        f"threads/process={cpu_threads}; config written to {output / workspace.CONFIG_FILE}",
        flush=True,
    )
    # tiktoken caches even local tokenizer files, keyed by path: a new model at the same
    # /workspace path would silently get the old vocabulary. Read the file itself.
    os.environ["TIKTOKEN_CACHE_DIR"] = ""

    if layout.world_size == 1:
        from tunepack.trainers import recipe  # heavy imports only once the input is valid

        program.imports_done()
        noise.quiet()  # the handlers torch attached while being imported
        result = recipe.run(cfg, extra={"config_digest": digest})
        _print_done(result)
        return 0
    program.imports_done()
    code = run_torchrun(layout, config_text, digest, lock)
    if code == 0 and layout.node_rank == 0 and result_path.exists():
        _print_done(json.loads(result_path.read_text()))
    return code


def _set_cpu_threads(nproc: int) -> str:
    """Each process on this node gets its share of the node's CPUs (``threads``); torch alone
    would run a thread per core it sees in every process, a Pod's CPU limit notwithstanding.
    ``OMP_NUM_THREADS``, when set, decides instead. Returns the count, as the workers get it."""
    if "OMP_NUM_THREADS" not in os.environ:
        count = threads.threads_per_process(nproc)
        os.environ["OMP_NUM_THREADS"] = str(count)  # torchrun's workers read it at start
        import torch

        torch.set_num_threads(count)  # this process loaded torch already
    return os.environ["OMP_NUM_THREADS"]


def _print_done(result: dict) -> None:
    print(
        f"{PROGRAM}: done: {result['steps']} steps, loss {result['first_loss']:.4f} -> "
        f"{result['final_loss']:.4f}; result at {result['artifact']}",
        flush=True,
    )
    # Last, so that a Katib trial's latest value of each metric is result.json's own figure (the
    # console of a local run leaves "metrics:" lines in the step's log: steps.progress_line).
    print(f"metrics: {methods.stdout_metrics(methods.result_metrics(result))}", flush=True)


def run_torchrun(
    layout: Layout, config_text: str, digest: str, lock: workspace.WorkspaceLock | None = None
) -> int:
    """Run torchrun over the recipe on this node; forward stop signals; leave no worker behind.

    torchrun and its workers stay in this process's group (``tunepack.trainers.process.
    torchrun``), so a SIGKILL to the group (``kill -9 -- -PGID``, ``timeout -s KILL``) reaches
    each of them in the same ``kill``, and none writes anything after it. This process forwards
    every stop request (the kubelet signals only a container's first process) and torchrun relays
    it to its workers, checkpoint first; a stop signal sent to the whole group also reaches each
    of them directly, and each takes that burst as one request (``lifetime.StopRequests``).
    torchrun runs through ``tunepack.core.lifetime``'s shim with SIGKILL: this process dies only
    when killed outright, and when it is killed alone, torchrun and its workers die at once too.
    torchrun inherits the workspace lock, so the workspace stays locked until it has ended too.
    A worker that died of a signal is named, and the node exits 128 + N (``_exit_code``).
    """
    scratch = Path(tempfile.mkdtemp(prefix="tunepack-launch-"))
    try:
        # Node-local: no race with other nodes' writes.
        config_path = scratch / workspace.CONFIG_FILE
        config_path.write_text(config_text)
        exit_dir = scratch / "exit"
        exit_dir.mkdir()
        env = {**os.environ, program.EXIT_DIR_ENV: str(exit_dir), **(lock.env() if lock else {})}
        # run() sets each worker's share; torchrun would set 1 where unset, with a banner.
        env.setdefault("OMP_NUM_THREADS", "1")
        proc = subprocess.Popen(
            lifetime.shim(torchrun_command(layout, config_path, digest), sig=signal.SIGKILL),
            env=env,
            pass_fds=(lock.fd,) if lock else (),
        )
        requests = lifetime.StopRequests()

        def forward(signum, _frame):
            if not requests.add(signum):
                return  # a group signal and its copy from our parent: one request
            try:
                # torchrun's agent stops its workers on SIGTERM (they checkpoint first); a
                # second request is forwarded too, and the agent then stops at once.
                os.kill(proc.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass

        previous = {sig: signal.signal(sig, forward) for sig in lifetime.STOP_SIGNALS}
        try:
            returncode = proc.wait()
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)
        _kill_leftovers(exit_dir)
        killed = _killed_workers(exit_dir)
        for rank, pid, signum in killed:
            print(
                program.error_line(
                    PROGRAM, f"rank {rank} (pid {pid}) was killed by {lifetime.signal_name(signum)}"
                ),
                file=sys.stderr,
                flush=True,
            )
        signals = [signum for _, _, signum in killed]
        return _exit_code(returncode, _worker_codes(exit_dir), requests.count > 0, signals)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def _worker_codes(exit_dir: Path) -> list[int]:
    codes = []
    for path in exit_dir.glob("rank-*"):
        try:
            codes.append(int(path.read_text()))
        except ValueError:
            continue
    return codes


def _killed_workers(exit_dir: Path) -> list[tuple[int, int, int]]:
    """(rank, pid, signal) of each worker that died of a signal torchrun did not send it, by
    rank (``killed-<rank>``, written by ``tunepack.trainers.process.torchrun``)."""
    killed = []
    for path in exit_dir.glob("killed-*"):
        try:
            pid, signum = (int(word) for word in path.read_text().split())
            killed.append((int(path.name.removeprefix("killed-")), pid, signum))
        except ValueError:
            continue
    return sorted(killed)


def _exit_code(
    torchrun_code: int, worker_codes: list[int], signalled: bool, killed: list[int] | None = None
) -> int:
    """One exit code for the node from torchrun's (which only says "failed") and the workers';
    ``killed``: the signals that killed workers (the first decides: 128 + N, as for a one-process
    run killed so, whatever the others did once torchrun stopped them)."""
    if EXIT_BAD_INPUT in worker_codes:
        return EXIT_BAD_INPUT
    if torchrun_code == 0:
        return 0
    if signalled:
        return EXIT_TRANSIENT
    if killed:
        return 128 + killed[0]
    if EXIT_TRANSIENT in worker_codes:
        return EXIT_TRANSIENT
    return torchrun_code


def _kill_leftovers(exit_dir: Path) -> None:
    """SIGKILL every worker still running once torchrun has ended. (Not by process group:
    torchrun and its workers are in this process's.)"""
    pids = []
    for path in exit_dir.glob("pid-*"):
        try:
            pids.append(int(path.read_text()))
        except ValueError:
            continue
    for pid in pids:
        if _is_worker(pid):
            _kill(lambda p=pid: os.kill(p, signal.SIGKILL))
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline and any(_is_worker(pid) for pid in pids):
        time.sleep(0.05)


def _is_worker(pid: int) -> bool:
    """A live (not zombie) process running the recipe, so a reused pid is left alone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return False
    return stat.rsplit(")", 1)[-1].split()[0] != "Z" and WORKER_MODULE.encode() in cmdline


def _kill(action) -> None:
    try:
        action()
    except (ProcessLookupError, PermissionError):
        pass


def main(argv: list[str] | None = None) -> int:
    noise.quiet()
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    # The recipe handles stop signals itself (checkpoint first), and so does run_torchrun.
    return program.run(
        PROGRAM,
        lambda: run(sys.argv[1:] if argv is None else argv),
        stop_signals=False,
        disk_full_at=workspace.workspace_root,
    )


if __name__ == "__main__":
    program.leave(main())
