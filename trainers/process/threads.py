"""How many CPU threads each trainer process uses, and how its idle threads wait.

The trainer program imports this module before torch: torch's OpenMP runtime (libgomp) reads
``OMP_WAIT_POLICY`` once, when torch is loaded.
"""

from __future__ import annotations

import math
import os
from pathlib import Path

# By default an OpenMP thread spins at every barrier while it waits for the others. When another
# process holds one of the cores, the thread on it is descheduled, the rest of the pool spins until
# it runs again, and the spinning takes CPU from it. The quickstart on a 2-core machine under a load
# of 4 to 5 trained its 96 steps in 60 to 80 s with 2 spinning threads, 15 to 18 s with 2 passive
# ones (10 s with one thread). Set by the user, it is left as it is.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

CGROUP_ROOT = Path("/sys/fs/cgroup")
PROC_CGROUP = Path("/proc/self/cgroup")


def cpu_budget(cgroup_root: Path = CGROUP_ROOT, proc_cgroup: Path = PROC_CGROUP) -> int:
    """The CPUs this process may use: its CPU affinity, capped by a cgroup CPU quota (a Pod's CPU
    limit, a container's ``--cpus``), which the affinity does not show."""
    cpus = len(os.sched_getaffinity(0))
    quota = _cgroup_quota(cgroup_root, proc_cgroup)
    if quota is not None:
        # Rounded down: a thread beyond the quota is throttled, and the pool waits for it.
        cpus = min(cpus, max(1, math.floor(quota)))
    return cpus


def threads_per_process(nproc: int, budget: int | None = None) -> int:
    """Intra-op threads for each of ``nproc`` processes on this node: the budget shared out."""
    return max(1, (cpu_budget() if budget is None else budget) // nproc)


def _cgroup_quota(root: Path, proc_cgroup: Path) -> float | None:
    """The smallest CPU quota (in CPUs) on this process's cgroup path; None when unlimited."""
    try:
        lines = proc_cgroup.read_text().splitlines()
    except OSError:
        return None
    quotas = []
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if controllers == "":  # cgroup v2: cpu.max ("max 100000" or "200000 100000")
            own = root / path.lstrip("/")
            for d in (own, *own.parents):  # a parent's limit binds too
                if not d.is_relative_to(root):
                    break
                quotas.append(_v2_quota(d / "cpu.max"))
        elif "cpu" in controllers.split(","):  # cgroup v1: in a container its mount is its own
            mount = root / controllers
            for d in (mount / path.lstrip("/"), mount):
                quotas.append(_v1_quota(d / "cpu.cfs_quota_us", d / "cpu.cfs_period_us"))
    known = [q for q in quotas if q is not None]
    return min(known) if known else None


def _v2_quota(path: Path) -> float | None:
    try:
        quota, period = path.read_text().split()
    except (OSError, ValueError):
        return None
    return None if quota == "max" else int(quota) / int(period)


def _v1_quota(quota_path: Path, period_path: Path) -> float | None:
    try:
        quota, period = int(quota_path.read_text()), int(period_path.read_text())
    except (OSError, ValueError):
        return None
    return None if quota <= 0 else quota / period
