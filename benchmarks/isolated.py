"""Measurements in a fresh interpreter each, with that child's own peak memory.

A benchmark module defines ``measure(case) -> dict`` (run in the child) and calls :func:`run_isolated` in the
parent. The child's peak memory is its maximum resident set size (ru_maxrss, read for that one child through
os.wait4: getrusage(RUSAGE_CHILDREN) folds all children into one running maximum), which includes the ~0.2 GiB
of the interpreter and torch. On the CPU the child runs under an address-space limit, so a case that does not
fit is reported as "OOM" instead of crowding a shared machine; on CUDA the peak is
torch.cuda.max_memory_allocated and no limit is set.
"""

from __future__ import annotations

import json
import os
import platform
import resource
import subprocess
import sys
import time
from collections.abc import Callable

import torch

from model.device import resolve_device

MEMORY_LIMIT_BYTES = 12 * 2**30


def run_isolated(module: str, case: dict) -> dict:
    """Run ``python -m module --child CASE`` and return its result plus ``peak_bytes``, or ``{"oom": True}``."""
    command = [sys.executable, "-m", module, "--child", json.dumps(case)]
    child = subprocess.Popen(command, stdout=subprocess.PIPE, text=True)
    output = child.stdout.read()
    _, status, usage = os.wait4(child.pid, 0)  # the rusage of this child alone
    returncode = os.waitstatus_to_exitcode(status)
    if returncode < 0:  # killed by a signal: the kernel's OOM killer
        return {"oom": True}
    if returncode > 0:
        raise RuntimeError(f"measurement {case} failed (its traceback is above)")
    result = json.loads(output.splitlines()[-1])
    if not result["oom"]:
        result["peak_bytes"] = result.pop("cuda_peak_bytes") or usage.ru_maxrss * 1024  # ru_maxrss is in KiB
    return result


def child_main(measure: Callable[[dict], dict], case_json: str) -> None:
    """In the child: run ``measure`` on the case under the memory limit and print its result as JSON."""
    case = json.loads(case_json)
    device = resolve_device(case["device"])
    if device.type == "cpu":
        resource.setrlimit(resource.RLIMIT_AS, (MEMORY_LIMIT_BYTES, MEMORY_LIMIT_BYTES))
    torch.set_num_threads(case.get("threads", torch.get_num_threads()))
    torch.manual_seed(0)
    try:
        with torch.no_grad():
            result = {"oom": False, **measure(case)}
    except (MemoryError, torch.OutOfMemoryError):
        result = {"oom": True}
    except RuntimeError as error:  # the CPU allocator reports an address-space refusal as a RuntimeError
        if "alloc" not in str(error):
            raise
        result = {"oom": True}
    if not result["oom"]:
        result["cuda_peak_bytes"] = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None
    print(json.dumps(result))


def time_calls(
    call: Callable[[], object], device: torch.device, repeats: int, budget_s: float
) -> tuple[list[float], bool]:
    """Seconds of one warm-up call then up to ``repeats`` timed calls, stopping once they pass ``budget_s``.
    Returns the timed calls and False, or the warm-up alone and True when it already spent the budget."""
    times: list[float] = []
    while len(times) <= repeats and (not times or sum(times[1:]) < budget_s):
        start = time.perf_counter()
        call()
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
        if len(times) == 1 and times[0] >= budget_s:
            break
    return (times[1:], False) if len(times) > 1 else (times, True)


def banner(device: torch.device, threads: int) -> str:
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or platform.machine()
    return f"device: {device} ({name}), torch {torch.__version__}, threads {threads}"
