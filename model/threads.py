"""Torch's intra-op thread count, one rule for server, training and benchmarks: ``max(1, (usable cores - 1) //
processes)``, leaving a core to everything but model calls; ``REGULARLM_TORCH_THREADS`` / ``--threads`` override."""

from __future__ import annotations

import math
import os
from pathlib import Path

import torch


def usable_cores() -> int:
    """This process's CPU affinity, capped by a cgroup CPU quota rounded up."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        cores = os.cpu_count() or 1
    quota = _cgroup_cpu_quota()
    return max(1, min(cores, math.ceil(quota))) if quota is not None else cores


def _cgroup_cpu_quota() -> float | None:
    """CPUs the cgroup (v2 or v1) allows; None if unlimited or unknown."""
    try:
        quota, period = Path("/sys/fs/cgroup/cpu.max").read_text().split()
        return None if quota == "max" else int(quota) / int(period)
    except (OSError, ValueError):
        pass
    try:
        quota_us = int(Path("/sys/fs/cgroup/cpu/cpu.cfs_quota_us").read_text())
        period_us = int(Path("/sys/fs/cgroup/cpu/cpu.cfs_period_us").read_text())
        return None if quota_us <= 0 or period_us <= 0 else quota_us / period_us
    except (OSError, ValueError):
        return None


def default_threads(processes: int = 1) -> int:
    return max(1, (usable_cores() - 1) // max(1, processes))


def set_threads(threads: int | None = None, processes: int = 1) -> int:
    """Set torch's intra-op threads (the rule's count if None); returns it. ValueError below 1."""
    count = threads if threads is not None else default_threads(processes)
    if count < 1:
        raise ValueError(f"threads must be at least 1, got {count}")
    torch.set_num_threads(count)
    return count
