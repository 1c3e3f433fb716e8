"""The workspace contract shared by the initializers, the trainer and the backends.

In a Pod the workspace is the volume mounted at ``/workspace``; the local backend points
``TUNEPACK_WORKSPACE`` at a local directory instead. Every program finds its paths here.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import socket
import sys
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

from tunepack.core import durable
from tunepack.core.errors import WorkspaceBusyError, WorkspaceClaimedError

WORKSPACE_ENV = "TUNEPACK_WORKSPACE"
DEFAULT_WORKSPACE = "/workspace"

# Environment the platform (Kubeflow Trainer) gives each step.
STORAGE_URI_ENV = "STORAGE_URI"  # initializers: where to fetch from
MODEL_ENV = "TUNEPACK_MODEL"  # every step: the catalog entry the runtime was generated for
# Initializers: the trainer's arguments (a JSON list of key=value strings), which tunepack's
# TrainJobs give them so that bad ones fail before any download (initializers/trainer_args.py).
TRAINER_ARGS_ENV = "TUNEPACK_TRAINER_ARGS"

# The workspace's layout: <workspace>/<name>.
DATASET_DIR = "dataset"  # the dataset initializer's output
MODEL_DIR = "model"  # the model initializer's output (the base model)
OUTPUT_DIR = "output"  # the trainer's result
CHECKPOINTS_DIR = "checkpoints"  # the trainer's resumable checkpoints
CACHE_DIR = ".cache"  # the trainer's caches (tokenized datasets)
LOGS_DIR = "logs"  # the local backend's step logs (a Pod's log is the container's)
MANIFEST_FILE = "tunepack-manifest.json"  # in dataset/ and model/: what was written, and from what
# The exporter's record of its latest upload (where, how many files, when), rewritten only when
# it sent files: a re-run whose trainer had nothing to do still did something if it changed.
EXPORT_RECORD_FILE = "export.json"

# The result: <workspace>/output/<name>.
RESULT_FILE = "result.json"  # written last: the run is finished, and what it made
METRICS_FILE = "metrics.jsonl"  # one JSON line per logging step and per evaluation
CONFIG_FILE = "config.yaml"  # the torchtune config the trainer derived from its arguments
ADAPTER_DIR = "adapter"  # the PEFT adapter (LoRA methods)
FULL_MODEL_DIR = "model"  # the fine-tuned model (method=full)
MERGED_DIR = "merged"  # the base with the adapter merged in (merge=true)


def workspace_root() -> Path:
    return Path(os.environ.get(WORKSPACE_ENV, DEFAULT_WORKSPACE))


def dataset_dir() -> Path:
    return workspace_root() / DATASET_DIR


def model_dir() -> Path:
    return workspace_root() / MODEL_DIR


def output_dir() -> Path:
    return workspace_root() / OUTPUT_DIR


def export_record_file(root: Path) -> Path:
    return root / EXPORT_RECORD_FILE


def result_file(root: Path) -> Path:
    """``result.json`` of the workspace at ``root``."""
    return Path(root) / OUTPUT_DIR / RESULT_FILE


def metrics_file(root: Path) -> Path:
    """``metrics.jsonl`` of the workspace at ``root``."""
    return Path(root) / OUTPUT_DIR / METRICS_FILE


def in_pod(*parts: str) -> str:
    """A path in the workspace as a Pod mounts it: ``in_pod(OUTPUT_DIR, ADAPTER_DIR)`` is
    ``/workspace/output/adapter``."""
    return "/".join([DEFAULT_WORKSPACE, *parts])


# --- the workspace lock --------------------------------------------------------------------------
#
# One run at a time per workspace: two runs on one workspace would delete each other's
# checkpoints and leave a result that belongs to whichever finished last. The lock is an
# ``flock`` on ``<workspace>/.tunepack.lock``, held for the whole job by the process that runs
# it (the local backend's runner or the CLI; a trainer started on its own takes it itself) and
# by every process of the job it starts: the open descriptor is inherited (its number in
# ``TUNEPACK_WORKSPACE_LOCK_FD``), so the lock is free only when the last of them has exited,
# however they end. The kernel releases it with the processes, so it never goes stale; on NFS
# (a ReadWriteMany volume) Linux maps ``flock`` to the server's byte-range locks, so a second
# node sees it too. The file also says who holds it, for the error message.

LOCK_FILE = ".tunepack.lock"
LOCK_FD_ENV = "TUNEPACK_WORKSPACE_LOCK_FD"


class WorkspaceLock:
    """A held workspace lock (see above). ``env()`` and ``fd`` hand it to child processes."""

    def __init__(self, path: Path, fd: int, owned: bool) -> None:
        self.path = path
        self.fd = fd
        self.owned = owned  # False: inherited from the process that started this one

    def env(self) -> dict[str, str]:
        return {LOCK_FD_ENV: str(self.fd)}

    def release(self) -> None:
        if self.owned and self.fd >= 0:
            os.close(self.fd)  # children that inherited it hold the lock until they exit
            self.fd = -1

    def __enter__(self) -> WorkspaceLock:
        return self

    def __exit__(self, *exc) -> None:
        self.release()


def lock_workspace(root: Path, holder: str) -> WorkspaceLock | None:
    """Take the lock on workspace ``root`` for ``holder`` (e.g. "local TrainJob 'x'"), or the
    one this process inherited for it. Raises ``WorkspaceBusyError`` naming the run that holds
    it. None where the file system cannot lock (a warning says so; the run goes on)."""
    path = Path(root) / LOCK_FILE
    inherited = _inherited_lock(path)
    if inherited is not None:
        return inherited
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    except OSError as err:
        if err.errno in (errno.EROFS, errno.EACCES, errno.EPERM):
            return None  # nothing can be written there: the run fails on its own, clearly
        raise
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as err:
        os.close(fd)
        if err.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
            raise WorkspaceBusyError(_busy_message(root, path)) from None
        print(
            f"tunepack: warning: cannot lock workspace {root} ({err.strerror}); nothing stops "
            "a second run on it at the same time",
            file=sys.stderr,
        )
        return None
    record = {
        "holder": holder,
        "pid": os.getpid(),
        "host": socket.gethostname(),
        "since": datetime.now(UTC).isoformat(timespec="seconds"),
    }
    os.ftruncate(fd, 0)
    os.pwrite(fd, (json.dumps(record) + "\n").encode(), 0)
    return WorkspaceLock(path, fd, owned=True)


def _inherited_lock(path: Path) -> WorkspaceLock | None:
    """The lock on ``path`` this process inherited, if it did (the descriptor in
    ``TUNEPACK_WORKSPACE_LOCK_FD`` is open on that very file)."""
    raw = os.environ.get(LOCK_FD_ENV, "")
    if not raw.isdigit():
        return None
    fd = int(raw)
    try:
        held, wanted = os.fstat(fd), os.stat(path)
    except OSError:
        return None
    if (held.st_dev, held.st_ino) != (wanted.st_dev, wanted.st_ino):
        return None
    return WorkspaceLock(path, fd, owned=False)


def _busy_message(root: Path, path: Path) -> str:
    try:
        record = json.loads(path.read_text())
        who = (
            f"{record['holder']} (pid {record['pid']} on host {record['host']}, since "
            f"{record['since']})"
        )
    except (OSError, ValueError, KeyError, TypeError):
        who = "another run"
    return (
        f"workspace {root} is in use by {who}: two runs on one workspace would overwrite each "
        "other's checkpoints and result; wait for that run to end (or stop it), or use another "
        "workspace"
    )


# --- the job that owns the workspace -------------------------------------------------------------
#
# A workspace holds one job's work: its dataset, base model, checkpoints and result. A second job
# run in it would replace all of them, and the first job's ``result``/``status`` would then report
# the second's run. So the first program of a job to touch a workspace records the job there
# (``tunepack-job.json``), and every program refuses to work in a workspace that holds another
# job's work. The job is named by the platform: on a cluster JobSet labels each pod with the
# JobSet's (= the TrainJob's) name and uid, which the runtimes hand to the programs through the
# downward API; the local backend sets the same variables. A program run on its own, without
# them, checks nothing.

JOB_FILE = "tunepack-job.json"
JOB_NAME_ENV = "TUNEPACK_JOB_NAME"
JOB_UID_ENV = "TUNEPACK_JOB_UID"  # on a cluster: tells a TrainJob from an earlier one of its name
# What a job makes in its workspace: a workspace holding none of these holds no job's work.
WORK_DIRS = (DATASET_DIR, MODEL_DIR, CHECKPOINTS_DIR, OUTPUT_DIR)


@dataclass(frozen=True)
class JobIdentity:
    name: str
    uid: str = ""

    @classmethod
    def from_env(cls) -> JobIdentity | None:
        """The job this program runs for, as the platform names it (None: run on its own)."""
        name = os.environ.get(JOB_NAME_ENV, "").strip()
        return cls(name, os.environ.get(JOB_UID_ENV, "").strip()) if name else None


def holds_work(root: Path) -> bool:
    """Whether the workspace at ``root`` holds anything a job made."""
    return any((Path(root) / part).exists() for part in WORK_DIRS)


def job_owner(root: Path) -> JobIdentity | None:
    """The job recorded as the owner of the workspace at ``root`` (None: none, or unreadable)."""
    try:
        record = json.loads((Path(root) / JOB_FILE).read_text())
        return JobIdentity(str(record["name"]), str(record.get("uid") or ""))
    except (OSError, ValueError, KeyError, TypeError):
        return None


def record_owner(root: Path, job: JobIdentity) -> None:
    """Record ``job`` as the owner of the workspace at ``root``."""
    Path(root).mkdir(parents=True, exist_ok=True)
    durable.write_json(Path(root) / JOB_FILE, {"name": job.name, "uid": job.uid})


def claim_workspace(root: Path, program: str) -> None:
    """Make sure the workspace at ``root`` is this job's (``JobIdentity.from_env``) before
    ``program`` changes anything in it, and record it as the job's. Raises
    ``WorkspaceClaimedError`` where it holds the work of a job of another name. A TrainJob of
    the same name but another uid (a TrainJob deleted and created again, its retained claim
    bound anew) takes the workspace over, which is said."""
    job = JobIdentity.from_env()
    if job is None:
        return
    owner = job_owner(root)
    if owner == job:
        return
    if owner is not None and holds_work(root):
        if owner.name != job.name:
            raise WorkspaceClaimedError(
                f"workspace {root} holds the work of job {owner.name!r} (its dataset, model, "
                f"checkpoints and result); job {job.name!r} would replace it: give each job a "
                f"workspace of its own (a runtime's volumeClaimPolicies make one per TrainJob; "
                f"a claim shared through runtimePatches does not), or delete {root}/{JOB_FILE} "
                f"once {owner.name!r}'s result is no longer needed",
                workspace=str(root),
                owner=owner.name,
                job=job.name,
            )
        print(
            f"{program}: workspace {root} holds the work of an earlier job named {job.name!r} "
            f"(uid {owner.uid or 'unknown'}); this one (uid {job.uid or 'unknown'}) takes it over",
            flush=True,
        )
    record_owner(root, job)
