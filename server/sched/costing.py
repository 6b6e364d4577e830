"""Per-model speed, memory budget, limits and slices.

Each model declares its calls' cost (``model.serving.Cost``: multiply-adds, peak bytes); :class:`ModelSpeed` turns
multiply-adds into seconds at a rate calibrated at load and averaged over every compute-bound call. A slice is about
``settings.slice_ms`` of a model's work. A model's limits (:class:`ModelLimits`, enforced with 413) are the largest
inputs that fit the memory budget (what running work may hold at once) and its time limit.
"""

from __future__ import annotations

import functools
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from model.base import SequenceModel
from model.serving import Cost, largest_fitting

MIN_TIMED_FLOPS = 1e7  # smaller calls are dominated by per-call overhead and do not update the rate
CALIBRATION_FLOPS = 5e7  # the size of the calibration call at load
CALIBRATION_MAX_LENGTH = 4096
RATE_SMOOTHING = 0.2  # weight of a new observation in the average seconds per multiply-add
DEFAULT_MEMORY_FRACTION = 0.5
COST_CACHE_SIZE = 4096  # call shapes whose cost each model remembers
STATE_PROBE_LENGTH = 2**20  # the length at which has_constant_state compares a row's cache with its first token's


class ModelSpeed:
    """Seconds per multiply-add of one model on this machine, measured."""

    def __init__(self, seconds_per_flop: float) -> None:
        self.seconds_per_flop = seconds_per_flop

    def observe(self, flops: float, seconds: float) -> None:
        """Fold in one timed call (ignored below ``MIN_TIMED_FLOPS``)."""
        if flops >= MIN_TIMED_FLOPS and seconds > 0:
            rate = seconds / flops
            self.seconds_per_flop += RATE_SMOOTHING * (rate - self.seconds_per_flop)

    def seconds(self, flops: float) -> float:
        return flops * self.seconds_per_flop

    def flops(self, seconds: float) -> float:
        return seconds / self.seconds_per_flop


@torch.inference_mode()
def calibrate(model: SequenceModel) -> ModelSpeed:
    """Time ``final_logits`` on an input of about ``CALIBRATION_FLOPS`` multiply-adds, after a warm-up call and the
    model's ``measure_fixed_costs``."""
    model.measure_fixed_costs()
    length = largest_fitting(lambda n: model.cost("final", 1, n).flops <= CALIBRATION_FLOPS, CALIBRATION_MAX_LENGTH)
    tokens = torch.zeros(1, length, dtype=torch.long, device=model.device)  # (1, n): id 0 exists in every model
    model.final_logits(tokens)
    started = time.perf_counter()
    model.final_logits(tokens)
    _synchronize(model.device)
    seconds = time.perf_counter() - started
    return ModelSpeed(max(seconds, 1e-9) / max(model.cost("final", 1, length).flops, 1.0))


@dataclass(frozen=True)
class ModelLimits:
    """The largest inputs one model is ever given (0: none fits): per transduce input with outputs "final" or "all"
    (``max_all_outputs_symbols``), or prompt tokens and prompt + max_tokens (``max_context_tokens``)."""

    max_input_symbols: int
    max_all_outputs_symbols: int | None = None
    max_context_tokens: int | None = None

    def as_dict(self) -> dict[str, int]:
        return {name: value for name, value in vars(self).items() if value is not None}


@dataclass
class ModelBudget:
    """One served model's speed, its slice of work in multiply-adds, and its limits."""

    model: SequenceModel
    speed: ModelSpeed
    slice_seconds: float
    memory_budget: int
    max_job_seconds: float

    def __post_init__(self) -> None:
        # A call's cost depends on its shape only and is asked for every planned input and batch: remembered per shape.
        self.cost: Callable[..., Cost] = functools.lru_cache(maxsize=COST_CACHE_SIZE)(self.model.cost)

    @functools.cached_property
    def constant_state(self) -> bool:
        return has_constant_state(self.model)

    @property
    def slice_flops(self) -> float:
        return self.speed.flops(self.slice_seconds)

    def fits_one_slice(self, cost: Cost) -> bool:
        return self.speed.seconds(cost.flops) <= self.slice_seconds

    def fits_ever(self, cost: Cost) -> bool:
        """Within the memory budget alone and within ``max_job_seconds``."""
        return cost.nbytes <= self.memory_budget and self.speed.seconds(cost.flops) <= self.max_job_seconds

    def transduce_cost(self, length: int, all_outputs: bool) -> tuple[Cost, bool]:
        """One input's cost, and whether it runs in slices (its whole call would not fit one)."""
        whole = self.cost("forward" if all_outputs else "final", 1, length)
        if self.fits_one_slice(whole):
            return whole, False
        return self.model.slices_cost(length, all_outputs, self.slice_flops, self.cost), True

    def context_cost(self, length: int) -> Cost:
        """A sequence that may reach ``length`` tokens: its prefill's multiply-adds and its cache's bytes padded to its
        context class, plus one chunk's activations (a constant-size cache: its own length's multiply-adds)."""
        # Through the memo of the cost formulas: the bisection over chunk lengths asks for many shapes.
        padded = self.model.cached_slices_cost(class_length(context_class(length)), self.slice_flops, self.cost)
        if self.constant_state:
            return Cost(flops=self.cost("cached", 1, length).flops, nbytes=padded.nbytes)
        return padded

    def limits(self, kind: str, max_input_symbols: int, max_tokens: int) -> ModelLimits:
        """The largest inputs, searched up to the server-wide limits."""

        def largest(fits: Callable[[int], bool], high: int) -> int:
            return largest_fitting(fits, high) if high > 0 and fits(1) else 0

        if kind == "transduce":
            final = largest(lambda n: self.fits_ever(self.transduce_cost(n, False)[0]), max_input_symbols)
            all_high = min(max_input_symbols, self.model.max_all_outputs_symbols or max_input_symbols)
            every = largest(lambda n: self.fits_ever(self.transduce_cost(n, True)[0]), all_high)
            return ModelLimits(max_input_symbols=final, max_all_outputs_symbols=every)
        context = largest(lambda n: self.fits_ever(self.context_cost(n)), max_input_symbols + max_tokens)
        return ModelLimits(max_input_symbols=min(max_input_symbols, context), max_context_tokens=context)


def has_constant_state(model: SequenceModel) -> bool:
    """Whether one row's cache has one size at every length (LRNN, LSTM)."""
    return model.cache_nbytes(1) == model.cache_nbytes(STATE_PROBE_LENGTH)


def context_class(length: int) -> int:
    """The decode batch class of a sequence that may reach ``length`` tokens: its bit length (rows differ by less than
    2x)."""
    return length.bit_length()


def class_length(context_class: int) -> int:
    """The longest final length in a context class."""
    return (1 << context_class) - 1


def available_memory(device: torch.device) -> int:
    """Bytes this process could still allocate: free GPU memory, or on the CPU the lesser of MemAvailable and the
    cgroup's room."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(free)
    available = _meminfo_available()
    limit, usage = _read_int("/sys/fs/cgroup/memory.max"), _read_int("/sys/fs/cgroup/memory.current")
    if limit is not None and usage is not None:
        available = min(available, max(0, limit - usage))
    return available


def _meminfo_available() -> int:
    """The kernel's MemAvailable; where there is no /proc/meminfo, the free pages (sysconf)."""
    try:
        lines = Path("/proc/meminfo").read_text().splitlines()
    except OSError:
        lines = []
    for line in lines:
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError):
        raise RuntimeError("cannot tell how much memory is available; set REGULARLM_MEMORY_BUDGET_BYTES") from None


def _read_int(path: str) -> int | None:
    """The integer in a cgroup file, or None when absent or "max"."""
    try:
        text = Path(path).read_text().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
