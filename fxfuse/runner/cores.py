"""How many CPU cores this process may use, and how many threads each rank of a run should take.

`os.cpu_count()` counts the host's CPUs, not what a container or a CPU mask leaves this process: on a
2-core slice of a large host it says 64, and one rank with 64 threads on 2 cores ran a tiny model's step
60 times slower than with one. `available_cores()` takes the smallest of the CPU affinity mask
and the cgroup CPU quota (v2 `cpu.max`, v1 `cpu.cfs_quota_us` / `cpu.cfs_period_us`); `threads_per_rank`
divides it among the ranks of one machine, as torchrun sets OMP_NUM_THREADS for its workers.
"""

from __future__ import annotations

import math
import os
from pathlib import Path

CGROUP = Path("/sys/fs/cgroup")


def available_cores(cgroup: Path = CGROUP) -> int:
    """The CPU cores this process may use: its affinity mask, cut to its cgroup's CPU quota (at least 1)."""
    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # no affinity call on this platform
        cores = os.cpu_count() or 1
    quota = _cgroup_quota(cgroup)
    return max(1, min(cores, quota) if quota is not None else cores)


def threads_per_rank(ranks: int, cgroup: Path = CGROUP) -> int:
    """Threads for each of `ranks` ranks on this machine, so that together they use its cores once."""
    return max(1, available_cores(cgroup) // max(1, ranks))


def _cgroup_quota(cgroup: Path) -> int | None:
    """The cgroup's CPU quota in whole cores (rounded up), or None without one."""
    try:
        quota, period = (cgroup / "cpu.max").read_text().split()[:2]
        if quota != "max":
            return math.ceil(int(quota) / int(period))
        return None
    except (OSError, ValueError):
        pass
    try:
        quota = int((cgroup / "cpu" / "cpu.cfs_quota_us").read_text())
        period = int((cgroup / "cpu" / "cpu.cfs_period_us").read_text())
        return math.ceil(quota / period) if quota > 0 and period > 0 else None
    except (OSError, ValueError):
        return None
