"""Steps that start together hand their results over through the workspace.

The gang-scheduled runtimes drop ``dependsOn``, so a step that needs another's result waits here
for its ``<workspace>/.steps/<step>`` marker naming this very run (the JobSet's uid and restart
attempt): a result left by an earlier TrainJob or attempt never counts. Why and how:
docs/cluster.md, "Gang scheduling and queues". Waiting has no deadline of its own: a failed step
ends or restarts the JobSet, which deletes the waiting pods. Without ``TUNEPACK_WAIT_FOR`` (the
ordered runtimes, the local backend) nothing here does anything."""

from __future__ import annotations

import json
import os
import sys
import time
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

from tunepack.core import durable
from tunepack.core.errors import BadValueError
from tunepack.core.workspace import workspace_root

WAIT_FOR_ENV = "TUNEPACK_WAIT_FOR"  # comma-separated step names this step needs first
JOBSET_UID_ENV = "TUNEPACK_JOBSET_UID"  # from the pod label jobset.sigs.k8s.io/jobset-uid
RESTART_ATTEMPT_ENV = "TUNEPACK_RESTART_ATTEMPT"  # from jobset.sigs.k8s.io/restart-attempt
NODE_RANK_ENV = "PET_NODE_RANK"  # the trainer's node index: node 0 speaks for the trainer
STEPS_DIR = ".steps"
# The steps a marker can name: the runtime's programs (their PROGRAM names).
STEPS = ("dataset-initializer", "model-initializer", "trainer", "exporter")
POLL_SECONDS = 1.0
REPORT_SECONDS = 30.0


@dataclass(frozen=True)
class Run:
    """One attempt of one JobSet: what a marker must name to count."""

    jobset_uid: str
    restart_attempt: str

    def __str__(self) -> str:
        return f"{self.jobset_uid}/{self.restart_attempt}"


def current_run() -> Run | None:
    """This pod's run, or None where the runtime starts its steps in order."""
    uid = os.environ.get(JOBSET_UID_ENV, "")
    if not uid:
        return None
    return Run(uid, os.environ.get(RESTART_ATTEMPT_ENV, "") or "0")


def awaited_steps() -> tuple[str, ...]:
    """The steps ``TUNEPACK_WAIT_FOR`` names, checked: a misspelt one would wait forever."""
    names = tuple(s.strip() for s in os.environ.get(WAIT_FOR_ENV, "").split(",") if s.strip())
    unknown = [s for s in names if s not in STEPS]
    if unknown:
        raise BadValueError(
            f"{WAIT_FOR_ENV}={os.environ[WAIT_FOR_ENV]!r} names {', '.join(unknown)}: expected "
            f"steps among {', '.join(STEPS)}"
        )
    if names and current_run() is None:
        raise BadValueError(
            f"{WAIT_FOR_ENV} is set but {JOBSET_UID_ENV} is not: the runtime must give each "
            "step its JobSet's uid (see manifests/components/gang-coscheduling)"
        )
    return names


def marker(step: str, root: Path | None = None) -> Path:
    return (root or workspace_root()) / STEPS_DIR / step


def marked_run(step: str, root: Path | None = None) -> str | None:
    """The run the marker of ``step`` names, or None if there is none (or it is unreadable)."""
    try:
        return json.loads(marker(step, root).read_text())["run"]
    except (OSError, ValueError, KeyError, TypeError):
        return None


def mark_done(step: str) -> None:
    """Record that ``step`` ended well in this run (nothing where steps start in order). Only
    node 0 of the trainer does: it writes the result, the other nodes may end before it has."""
    run = current_run()
    if run is None or step not in STEPS or os.environ.get(NODE_RANK_ENV, "0") not in ("", "0"):
        return
    path = marker(step)
    path.parent.mkdir(parents=True, exist_ok=True)
    record = {"run": str(run), "at": datetime.now(UTC).isoformat(timespec="seconds")}
    durable.write_json(path, record)


def wait_for_steps(program: str) -> None:
    """Block until every step in ``TUNEPACK_WAIT_FOR`` has marked this run done, saying what
    it waits for on stderr when it starts and every half minute."""
    steps = awaited_steps()
    if not steps:
        return
    run = str(current_run())
    started = time.monotonic()
    reported = None
    while True:
        pending = [s for s in steps if marked_run(s) != run]
        if not pending:
            if reported is not None:
                waited = time.monotonic() - started
                print(f"{program}: {', '.join(steps)} done; waited {waited:.0f} s", file=sys.stderr)
            return
        now = time.monotonic()
        if reported is None or now - reported >= REPORT_SECONDS:
            print(
                f"{program}: waiting for {', '.join(pending)} to finish (the steps of this "
                f"gang-scheduled job start together; {now - started:.0f} s so far)",
                file=sys.stderr,
                flush=True,
            )
            reported = now
        time.sleep(POLL_SECONDS)
