"""How many intra-op threads torch uses, chosen by one rule for the server, training and the benchmarks.

The rule: ``max(1, (usable cores - 1) // processes)``, where ``usable cores`` is the CPU affinity of this process
(capped by a container's CPU limit) and ``processes`` the number of processes sharing the host (torchrun's local world size for training). One core
is left to everything that is not a model call (the server's event loop and tokenizer, the trainer's data
generation, other processes), and the rest is split between the processes.

Why: torch's default is one thread per core, and its threads spin and wait for each other at every op. On a quiet
2-core machine 1 and 2 threads train equally fast (0.20 and 0.19 s per step of the README's parity LRNN run), but
as soon as anything else runs on the other core, 2 threads lose: 0.25 s against 0.35 s per training step, and a
(64, 256) x (256, 256) matmul takes 97 us on 1 thread against 265 us on 2 (docs/benchmarks.md, "Thread policy").
A server always has something else running (its event loop), as does a machine that trains and serves. On large
machines the rule keeps nearly every core. ``REGULARLM_TORCH_THREADS`` / ``--threads`` override it.
"""

from __future__ import annotations

import math
import os
from pathlib import Path

import torch


def usable_cores() -> int:
    """The cores this process may run on: its CPU affinity (where the OS reports one), capped by a cgroup CPU
    quota (a container's CPU limit, e.g. Kubernetes' ``resources.limits.cpu``), rounded up."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        cores = os.cpu_count() or 1
    quota = _cgroup_cpu_quota()
    return max(1, min(cores, math.ceil(quota))) if quota is not None else cores


def _cgroup_cpu_quota() -> float | None:
    """CPUs allowed by the cgroup (v2 ``cpu.max``, v1 ``cpu.cfs_quota_us`` / ``cpu.cfs_period_us``); None if
    unlimited or unknown."""
    try:
        quota, period = Path("/sys/fs/cgroup/cpu.max").read_text().split()
        return None if quota == "max" else int(quota) / int(period)
    except (OSError, ValueError):
        pass
    try:
        quota = int(Path("/sys/fs/cgroup/cpu/cpu.cfs_quota_us").read_text())
        period = int(Path("/sys/fs/cgroup/cpu/cpu.cfs_period_us").read_text())
        return None if quota <= 0 or period <= 0 else quota / period
    except (OSError, ValueError):
        return None


def default_threads(processes: int = 1) -> int:
    """The rule of this module: ``max(1, (usable cores - 1) // processes)``."""
    return max(1, (usable_cores() - 1) // max(1, processes))


def set_threads(threads: int | None = None, processes: int = 1) -> int:
    """Set torch's intra-op threads to ``threads``, or to the rule's count when None; returns the count set."""
    count = threads if threads is not None else default_threads(processes)
    if count < 1:
        raise ValueError(f"threads must be at least 1, got {count}")
    torch.set_num_threads(count)
    return count
