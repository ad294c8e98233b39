"""How many CPUs this process may use, and the fill threads ``GRAMMAR_FILL_THREADS=0`` takes from them."""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Final

#: Most fill threads the automatic choice takes: at 64-256 rows a thread gets 8-32 rows, beyond which the
#: pool's per-step hand-off outweighs the rows it takes (the cap is a judgment: only 1 and 2 threads were
#: measured, on the 2-core development host; docs/benchmarks.md).
MAX_AUTO_FILL_THREADS: Final = 8

#: cgroup v2's CPU bandwidth limit of this process's group (``max`` or ``QUOTA PERIOD``).
_CPU_MAX: Final = Path("/sys/fs/cgroup/cpu.max")
#: cgroup v1's (nodes still on it, such as EKS's Amazon Linux 2): ``cpu.cfs_quota_us`` (-1: none) and its period.
_CFS: Final = Path("/sys/fs/cgroup/cpu")


def usable_cpus(cpu_max: Path = _CPU_MAX, cfs: Path = _CFS) -> int:
    """The CPUs this process may run on: its affinity mask, bounded by its cgroup quota where one is set.

    A Kubernetes container with ``resources.limits.cpu: 4`` on a 64-core node sees 64 CPUs in
    ``os.cpu_count()`` and its affinity, but a quota of 4 in cgroup v2's ``cpu.max`` (or v1's
    ``cpu.cfs_quota_us`` over ``cpu.cfs_period_us``); threads beyond the quota are throttled, not run.
    """
    cpus = len(os.sched_getaffinity(0))
    try:
        quota, period = cpu_max.read_text().split()[:2]
    except (OSError, ValueError):
        try:  # no cgroup v2 limit readable: cgroup v1's
            quota = (cfs / "cpu.cfs_quota_us").read_text().strip()
            period = (cfs / "cpu.cfs_period_us").read_text().strip()
        except OSError:
            return cpus  # neither: the affinity mask is the bound
    try:
        limit = int(quota) / int(period)
    except (ValueError, ZeroDivisionError):
        return cpus  # "max" (v2) or unreadable: no quota
    if limit <= 0:
        return cpus  # -1 (v1): no quota
    return max(1, min(cpus, math.ceil(limit)))


def auto_fill_threads(cpus: int) -> int:
    """The fill threads of ``GRAMMAR_FILL_THREADS=0`` on ``cpus`` usable CPUs: half of them, 1 to 8.

    The other half is left to what runs beside the fill in the same pod: the language model's own
    host threads (TensorRT-LLM's executor and sampler, or the torch engine's forward), the Python
    backend stubs, gRPC and tokenization.  On the 2-core development host this is 1; on a 16-core
    GPU node, 8.
    """
    return max(1, min(MAX_AUTO_FILL_THREADS, cpus // 2))
