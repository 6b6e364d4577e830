"""The engine's executor: runs what the scheduler planned, on the worker thread, and reports what ran (model calls,
timing, sampling). It decides only what running tells: when about one slice has been spent (each phase runs at least one
unit), what fails, and so which planned work still runs. A call that raises fails only what fails alone: transduce
inputs and prefill sequences run again one by one; a decode step that raises fails its batch.
"""

from __future__ import annotations

import collections.abc
import functools
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TypeVar

from model.serving import Cost
from server.errors import APIError, ModelFailure
from server.execution.generation import DecodeBatch, Sequence, prefill, prefill_call_cost, prefill_calls, start
from server.metrics import ServerMetrics
from server.models.store import ServedModel
from server.sched.batching import LongTransduce, TransduceItem, TransduceOutput, batch_cost, run_batch
from server.sched.state_cache import StateCache

logger = logging.getLogger(__name__)
T = TypeVar("T")


# --- plans (made by Scheduler.plan: what to run, in order) ---------------------------------------------------


@dataclass(frozen=True)
class TransduceUnit:
    """A batch of short inputs (one call), or the next slice of a long input."""

    items: list[TransduceItem]
    cost: Cost  # the batch's call, or all the long input's slices
    long: LongTransduce | None = None
    holds: int = 0  # bytes held from now on if it runs: a long input's first slice


@dataclass(frozen=True)
class TransducePlan:
    units: list[TransduceUnit]  # in fair order
    batched_jobs: int | None = None  # the requests whose short inputs were planned into batches, if any were (the
    # gathering window's bookkeeping)


@dataclass(frozen=True)
class PrefillGroup:
    """The next ``length`` prompt tokens of each sequence (one model and context class), as one call."""

    sequences: list[Sequence]
    length: int


@dataclass(frozen=True)
class DecodeWork:
    """One decode step of a model's context class: its batch (None: new), joined by ``joining`` and ``prompting``."""

    key: tuple[str, int]
    batch: DecodeBatch | None
    joining: list[Sequence]  # planned: the sequences whose prompt the plan's chunks complete
    prompting: list[Sequence] = field(default_factory=list)  # admitted now, their prompts run in the batch
    # (``server.execution.generation.prompt_in_batch``)


@dataclass(frozen=True)
class Plan:
    """One iteration's work, decided before any of it runs: the phases in the order they run."""

    transduce: TransducePlan
    admitted: list[Sequence]  # the waiting sequences to start (their first chunks are among ``prefill``'s)
    prefill: list[PrefillGroup]
    decode: list[DecodeWork]


def live_groups(groups: list[PrefillGroup]) -> list[PrefillGroup]:
    """The planned chunks less the sequences that have ended since."""
    live = [
        PrefillGroup([sequence for sequence in group.sequences if not sequence.done], group.length) for group in groups
    ]
    return [group for group in live if group.sequences]


def ready_work(work: list[DecodeWork]) -> list[DecodeWork]:
    """The planned decode steps, joined only by sequences whose first token was sampled and prompting ones started."""
    ready = [
        DecodeWork(
            each.key,
            each.batch,
            [sequence for sequence in each.joining if sequence.ready_to_decode],
            [sequence for sequence in each.prompting if not sequence.done],
        )
        for each in work
    ]
    return [each for each in ready if each.batch is not None or each.joining or each.prompting]


# --- results -----------------------------------------------------------------------------------------------------


@dataclass
class Call:
    """One model call that ran for ``items``."""

    items: list[TransduceItem]
    seconds: float
    # per item; None: a long input goes on
    outputs: collections.abc.Sequence[TransduceOutput | None] = field(default_factory=list)
    error: APIError | None = None


@dataclass
class TransduceResult:
    ran: list[tuple[TransduceUnit, list[Call]]]  # the units run, in order, each with its calls


@dataclass
class PrefillResult:
    ran: list[tuple[PrefillGroup, float]]  # the groups run, in order, with their seconds
    started: float  # the clock when the first began and the last ended
    ended: float


@dataclass
class DecodeResult:
    ran: list[tuple[DecodeWork, DecodeBatch, list[Sequence], float]]  # (work, its batch, the rows stepped, seconds)


class Executor:
    def __init__(
        self, metrics: ServerMetrics, state_cache: StateCache, slice_ms: float, clock: Callable[[], float]
    ) -> None:
        self.metrics, self.state_cache, self.clock = metrics, state_cache, clock
        self.slice_seconds = slice_ms / 1000

    # --- transduce --------------------------------------------------------------------------------------------

    def transduce(self, plan: TransducePlan) -> TransduceResult:
        """The units in order until about one slice has run (one at least), skipping inputs of requests that failed
        meanwhile."""
        ran: list[tuple[TransduceUnit, list[Call]]] = []
        failed: set[int] = set()  # the requests that failed in this phase
        started = self.clock()
        for unit in plan.units:
            if ran and self.clock() - started >= self.slice_seconds:
                break  # a slice shorter than the loop's own time would otherwise run nothing
            items = [item for item in unit.items if id(item.job) not in failed]
            if not items:
                continue
            calls = self._slice(unit.long) if unit.long is not None else self._batch(items, unit.cost, failed)
            failed |= {id(item.job) for call in calls if call.error is not None for item in call.items}
            ran.append((unit, calls))
        return TransduceResult(ran)

    def _batch(self, batch: list[TransduceItem], cost: Cost, failed: set[int]) -> list[Call]:
        """One batch's call; if it raises, each input runs alone, and only those that fail alone fail."""
        served = batch[0].job.served
        try:
            seconds, outputs = self._timed(served, cost.flops, lambda: run_batch(batch))
        except Exception as error:
            if len(batch) > 1:
                logger.warning(
                    "a transduce batch of %d inputs failed (%s: %s); each runs alone",
                    len(batch),
                    type(error).__name__,
                    error,
                )
                calls: list[Call] = []
                for item in batch:
                    if id(item.job) not in failed:  # not failed meanwhile through another of its inputs
                        calls += self._batch([item], batch_cost(item, 1, item.length), failed)
                        if calls[-1].error is not None:
                            failed.add(id(item.job))
                return calls
            logger.exception("a transduce input of %d symbols failed", batch[0].length)
            return [Call(batch, 0.0, error=ModelFailure(f"the model failed on this input: {error}"))]
        return [Call(batch, seconds, outputs)]

    def _slice(self, long: LongTransduce) -> list[Call]:
        try:
            seconds, flops = self._clocked(long.advance)
        except Exception as error:
            logger.exception("a slice of a %d-symbol transduce input failed", long.item.length)
            return [Call([long.item], 0.0, error=ModelFailure(f"the model failed on this input: {error}"))]
        self._record(long.item.job.served, flops, seconds)  # the work this slice did: its size was fixed at its start
        return [Call([long.item], seconds, [long.output])]

    # --- generation -------------------------------------------------------------------------------------------

    def start(self, admitted: list[Sequence]) -> None:
        """Begin each admitted sequence (its cache, or a state-cache snapshot); one that fails ends."""
        for sequence in admitted:
            self._guarded([sequence], functools.partial(start, sequence, self.state_cache, self.metrics))

    def prefill(self, groups: list[PrefillGroup]) -> PrefillResult:
        """The groups in order until about one slice has run (one at least)."""
        ran: list[tuple[PrefillGroup, float]] = []
        started = self.clock()
        for group in live_groups(groups):
            if ran and self.clock() - started >= self.slice_seconds:
                break  # the rest next iteration (one group at least: a slice shorter than the loop's own time would
                # otherwise never prefill anything)
            length, seconds = group.length, 0.0
            for sequences in prefill_calls(group.sequences, length):  # one, but for batch invariance
                flops = prefill_call_cost(sequences, length).flops
                run = functools.partial(prefill, sequences, length, self.state_cache, self.metrics)
                alone = functools.partial(self._prefill_alone, length=length)
                seconds += self._guarded(sequences, run, flops, alone=alone)
            ran.append((group, seconds))
        return PrefillResult(ran, started, self.clock())

    def _prefill_alone(self, sequence: Sequence, length: int) -> None:
        prefill([sequence], length, self.state_cache, self.metrics)

    def decode(self, work: list[DecodeWork]) -> DecodeResult:
        """Each batch takes in its joining and prompting sequences and steps once."""
        ran = []
        for each in ready_work(work):
            batch = each.batch or DecodeBatch()
            if each.joining or each.prompting:
                batch.join(each.joining + each.prompting)
            sequences = list(batch.sequences)
            seconds = self._guarded(sequences, functools.partial(batch.step, self.metrics))
            ran.append((each, batch, sequences, seconds))
        return DecodeResult(ran)

    # --- calls ------------------------------------------------------------------------------------------------

    def _timed(self, served: ServedModel, flops: float, call: Callable[[], T]) -> tuple[float, T]:
        """Run and record a model call of about ``flops`` multiply-adds; returns (seconds, its result)."""
        seconds, result = self._clocked(call)
        self._record(served, flops, seconds)
        return seconds, result

    def _clocked(self, call: Callable[[], T]) -> tuple[float, T]:
        started = self.clock()
        result = call()
        return self.clock() - started, result

    def _record(self, served: ServedModel, flops: float, seconds: float) -> None:
        self.metrics.model_executed(served.id, seconds)
        assert served.budget is not None  # measured when the model was installed
        served.budget.speed.observe(flops, seconds)

    def _guarded(
        self,
        sequences: list[Sequence],
        call: Callable[[], object],
        flops: float = 0.0,
        alone: Callable[[Sequence], object] | None = None,
    ) -> float:
        """Run a model call for ``sequences``; if it raises only they fail, and given ``alone`` each sequence the call
        left unchanged runs again by itself. Returns the seconds spent."""
        state = [(sequence.cache, sequence.prefilled) for sequence in sequences]
        try:
            return self._timed(sequences[0].served, flops, call)[0]
        except Exception as error:
            retry = (
                []
                if alone is None or len(sequences) == 1
                else [
                    sequence
                    for sequence, (cache, prefilled) in zip(sequences, state)
                    if not sequence.done and sequence.cache is cache and sequence.prefilled == prefilled
                ]
            )
            if retry:
                logger.warning(
                    "a model call for %d sequences failed (%s: %s); %d run again alone",
                    len(sequences),
                    type(error).__name__,
                    error,
                    len(retry),
                )
            else:
                logger.exception("a model call failed for %d sequence(s)", len(sequences))
            for sequence in sequences:
                if sequence not in retry:
                    sequence.fail(ModelFailure(f"the model failed: {error}"), self.metrics)
        if alone is None:  # nothing runs again alone: retry is empty
            return 0
        return sum(self._guarded([sequence], functools.partial(alone, sequence)) for sequence in retry)
