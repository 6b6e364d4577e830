"""The engine's worker loop (:class:`Scheduler`): what runs when, on the one thread that calls the models.

Each iteration takes new work from the inbox, sweeps, makes one pure :class:`~server.execution.executor.Plan`, has the
executor run it phase by phase (transduce, admissions, prefill, decode), applies each result before the next phase,
sweeps and flushes. Guarantees: each unit of work is about one slice (``settings.slice_ms``); transduce, admission and
prefill go least-served flow first (:class:`FairShare`); running work holds its memory within the budget
(:class:`MemoryLedger`); only the sweep takes work out and hands answers over. Policy and reasons: ``docs/serving.md``,
"The engine: slices, fairness, limits".
"""

from __future__ import annotations

import concurrent.futures
import queue
import time
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Generic, TypeVar

from server.engine.mailbox import Courier
from server.errors import APIError, Unavailable
from server.execution.executor import (
    DecodeResult,
    DecodeWork,
    Executor,
    Plan,
    PrefillGroup,
    PrefillResult,
    TransducePlan,
    TransduceResult,
    TransduceUnit,
)
from server.execution.generation import DecodeBatch, Sequence, prefill_length, prompt_in_batch, start_point
from server.metrics import ServerMetrics
from server.sched.batching import LongTransduce, TransduceItem, TransduceJob, batch_cost, plan_batches
from server.sched.costing import context_class
from server.sched.state_cache import StateCache
from server.sched.work import RequestQueue, Status, Work
from server.settings import Settings

STOP = object()  # put into the inbox to end the loop
T = TypeVar("T")
W = TypeVar("W", bound=Work)


@dataclass(frozen=True)
class AbortAll:
    """Put into the inbox to end every request in flight with ``error``."""

    error: APIError


@dataclass(frozen=True)
class OnWorker(Generic[T]):
    """Put into the inbox to run ``work`` on the worker thread between two iterations; its result or exception goes to
    ``done``."""

    work: Callable[[], T]
    done: concurrent.futures.Future[T]

    def run(self) -> None:
        try:
            self.done.set_result(self.work())
        except Exception as error:  # the caller re-raises it on the event loop
            self.done.set_exception(error)


class FairShare:
    """Model seconds of service per flow, while the flow has work queued."""

    def __init__(self) -> None:
        self.service: dict[str, float] = {}

    def charge(self, flows: dict[str, float], seconds: float) -> None:
        """Charge a call of ``seconds`` to ``flows`` in proportion to their weights."""
        total = sum(flows.values()) or 1.0
        for flow, weight in flows.items():
            self.service[flow] = self.service.get(flow, 0.0) + seconds * weight / total

    def priority(self, flows: Iterable[str]) -> float:
        """Lower goes first: the least service among ``flows``."""
        return min((self.service.get(flow, 0.0) for flow in flows), default=0.0)

    def keep_only(self, active: set[str]) -> None:
        self.service = {flow: seconds for flow, seconds in self.service.items() if flow in active}


class MemoryLedger:
    """Bytes held by running work against the budget."""

    def __init__(self, budget: int) -> None:
        self.budget, self.held = budget, 0

    def fits(self, nbytes: int) -> bool:
        return self.held + nbytes <= self.budget

    def hold(self, nbytes: int) -> None:
        self.held += nbytes

    def release(self, nbytes: int) -> None:
        self.held -= nbytes


class Scheduler:
    """The loop of the module docstring. Only the worker thread touches its state."""

    def __init__(
        self,
        settings: Settings,
        metrics: ServerMetrics,
        state_cache: StateCache,
        inbox: queue.SimpleQueue[object],
        postman: Courier,
        memory_budget: int,
        request_queue: RequestQueue | None = None,
        clock: Callable[[], float] = time.perf_counter,
        executor: Executor | None = None,
    ) -> None:
        """``request_queue``: what admission counts; ``clock``: what calls and slices are timed with; ``executor``: what
        runs the plans (by default the models')."""
        self.settings, self.metrics, self.inbox, self.postman = settings, metrics, inbox, postman
        self.queue = request_queue or RequestQueue(settings.max_waiting)
        self.clock = clock
        self.executor = executor or Executor(metrics, state_cache, settings.slice_ms, clock)
        self.fair = FairShare()
        self.memory = MemoryLedger(memory_budget)
        self.short: list[TransduceItem] = []  # short transduce inputs being gathered
        self.first_short_at = 0.0
        self.jobs_waiting = 0  # transduce requests among ``short``
        self.first_job_found_idle = False  # the oldest of them woke an idle worker
        self.last_run_jobs = 0  # transduce requests served by the previous batch run
        self.long: list[LongTransduce] = []  # long transduce inputs, started or not
        self.waiting: deque[Sequence] = deque()
        self.prefilling: list[Sequence] = []
        self.decoding: dict[tuple[str, int], DecodeBatch] = {}  # (model id, context class) -> its decode batch
        self.anticipating: set[int] = set()  # the prompts (ids) that yielded to a request just ended: _anticipate
        self.anticipate_until = 0.0  # the scheduler's clock until which they keep yielding

    @property
    def state_cache(self) -> StateCache:
        """The executor's prompt-state cache."""
        return self.executor.state_cache

    def loop(self) -> None:
        while self._receive():
            self.iteration()
        self._fail_all(Unavailable("the server is shutting down"))
        self.postman.flush()

    def iteration(self) -> None:
        """One iteration on the work already received: sweep, plan, run and apply each phase, sweep, flush."""
        self.sweep()
        plan = self.plan(time.monotonic(), self.clock())
        self.apply_transduce(plan.transduce, self.executor.transduce(plan.transduce))
        self.executor.start(plan.admitted)
        self.apply_admissions(plan.admitted)
        self.apply_prefill(self.executor.prefill(plan.prefill))
        started = self.clock()
        self.apply_decode(self.executor.decode(plan.decode))
        self._decode_on(started)
        self.sweep()
        self.postman.flush()

    def _decode_on(self, started: float) -> None:
        """Further decode steps (up to ``decode_steps``, within one slice since ``started``) while decoding is all there
        is to do and the inbox stays empty."""
        slice_seconds = self.settings.slice_ms / 1000
        for _ in range(self.settings.decode_steps - 1):
            if self.clock() - started >= slice_seconds:
                return
            self.sweep()
            admissible = self.waiting and self._running() < self.settings.max_running  # one may start now
            busy = self.short or self.long or admissible or self._prefills_now()
            if busy or not self.inbox.empty() or not self.decoding:
                return
            self.apply_decode(self.executor.decode(self._plan_decode([], {})))

    def plan(self, now: float, clock_now: float) -> Plan:
        """The iteration's work from the scheduler's state alone (no model call, no change): transduce units, admissions
        within the memory left, prefill chunks, one decode step per batch with the sequences joining it. ``now``:
        ``time.monotonic()``; ``clock_now``: the scheduler's clock."""
        transduce = self._plan_transduce(now)
        admitted = self._plan_admissions(self.memory.held + sum(unit.holds for unit in transduce.units))
        starts = {id(sequence): (sequence.prefilled, sequence.snapshot_at) for sequence in self.prefilling}
        starts |= {id(sequence): start_point(sequence, self.state_cache) for sequence in admitted}
        prompting = [
            sequence for sequence in admitted if prompt_in_batch(sequence, starts[id(sequence)], self.state_cache)
        ]
        in_batch = {id(sequence) for sequence in prompting}
        prefill = self._plan_prefill(
            clock_now, [sequence for sequence in admitted if id(sequence) not in in_batch], starts, prompting
        )
        return Plan(transduce, admitted, prefill, self._plan_decode(prefill, starts, prompting))

    # --- intake -------------------------------------------------------------------------------------------

    def _busy(self) -> bool:
        return bool(self.waiting or self.prefilling or self.decoding or self.long)

    def _receive(self) -> bool:
        """Move new work from the inbox (blocking only when idle or gathering); False once asked to stop."""
        timeout: float | None = 0.0
        idle = not (self._busy() or self.short) and self.inbox.empty()  # new work will wake us
        if not self._busy():
            due = self.first_short_at + self.gather_window()
            timeout = None if not self.short else max(0.0, due - time.monotonic())
        elif self._only_yielding():  # wait for new work until a prompt resumes, not in a busy loop
            resumes = min(sequence.prefill_resumes_at for sequence in self.prefilling)
            timeout = min(max(0.0, min(resumes, self.anticipate_until) - self.clock()), self.settings.slice_ms / 1000)
        received = []
        try:
            received.append(self.inbox.get(timeout=timeout) if timeout != 0.0 else self.inbox.get_nowait())
            while True:
                received.append(self.inbox.get_nowait())
        except queue.Empty:
            pass
        return self.take(received, idle)

    def take(self, received: list[object], idle: bool = False) -> bool:
        """New work, in order of arrival; ``idle``: it found the worker idle. False once asked to stop."""
        for work in received:
            if work is STOP:
                return False
            if isinstance(work, AbortAll):
                self._fail_all(work.error)
            elif isinstance(work, OnWorker):
                work.run()
            elif isinstance(work, TransduceJob):
                self._take_job(work, idle)
            else:
                assert isinstance(work, Sequence)  # the rest of what the engine puts into the inbox
                self.waiting.append(work)
        return True

    def _take_job(self, job: TransduceJob, idle: bool) -> None:
        items = job.items()
        self.long += [LongTransduce(item) for item in items if item.sliced]
        short = [item for item in items if not item.sliced]
        if short:
            if not self.short:  # the window counts from its arrival: one that came during a slice waited through it
                self.first_short_at, self.first_job_found_idle = job.times.arrival, idle
            self.short += short
            self.jobs_waiting += 1

    def gather_window(self) -> float:
        """Seconds to gather short transduce inputs after the oldest arrived: ``batch_wait_ms``, or 0 when requests come
        one at a time."""
        if self.jobs_waiting == 1 and self.first_job_found_idle and self.last_run_jobs <= 1:
            return 0.0
        return self.settings.batch_wait_ms / 1000

    def _short_due(self, now: float) -> bool:
        symbols = sum(item.length for item in self.short)
        return bool(self.short) and (
            symbols >= self.settings.max_batch_symbols or now >= self.first_short_at + self.gather_window()
        )

    # --- the sweep ----------------------------------------------------------------------------------------

    def sweep(self) -> None:
        """End the work whose client went away, emit answers, take out what ended (releasing its memory and queue
        place), forget idle flows."""
        flows: set[str] = set()
        finished: dict[int, Work] = {}

        def keep(job: TransduceJob) -> bool:
            return bool(_settle([job], self.metrics, flows, finished))

        self.short = [item for item in self.short if keep(item.job) and item.job.outputs[item.index] is None]
        kept = []
        for long in self.long:
            if keep(long.item.job) and long.output is None:
                kept.append(long)
                continue
            if long.started:
                self.memory.release(long.item.cost.nbytes)
            long.close()
        self.long = kept
        self.waiting = deque(_settle(self.waiting, self.metrics, flows, finished))
        self.prefilling = _settle(self.prefilling, self.metrics, flows, finished)
        for key, batch in list(self.decoding.items()):
            if len(_settle(batch.sequences, self.metrics, flows, finished)) < len(batch.sequences):
                batch.drop_finished()
            if not batch.sequences:
                del self.decoding[key]
        self.fair.keep_only(flows)
        for work in finished.values():
            if isinstance(work, Sequence) and work.reserved_bytes:
                self.memory.release(work.reserved_bytes)
                work.reserved_bytes = 0
            self.queue.finished(was_scheduled=work.times.scheduled is not None)
        ended = [work for work in finished.values() if isinstance(work, Sequence)]
        if ended:
            self._anticipate(min(sequence.service for sequence in ended))
        if not self.short:
            self.jobs_waiting = 0

    def _schedule(self, work: Work, status: Status) -> None:
        """Move ``work`` on to ``status``, keeping the queue's waiting count."""
        if work.status is Status.WAITING:
            self.queue.scheduled()
        work.schedule(status, self.metrics)

    def _fail_all(self, error: APIError) -> None:
        """End every request in flight with ``error``; running slices stop here."""
        for job in [item.job for item in self.short] + [long.item.job for long in self.long]:
            job.fail(error, self.metrics)
        for sequence in [*self.waiting, *self.prefilling, *self._decoding_sequences()]:
            sequence.fail(error, self.metrics)
        self.sweep()

    # --- transduce ----------------------------------------------------------------------------------------

    def _plan_transduce(self, now: float) -> TransducePlan:
        """Batches (once the gathering window is over) and long-input slices in fair order, each only while its memory
        fits."""
        units: list[tuple[tuple[float, float, float], TransduceUnit]] = []  # (flow's, job's service, arrival), unit
        batched_jobs = None
        if self._short_due(now):
            batched_jobs = self.jobs_waiting
            for batch in plan_batches(self.short, self.settings.max_batch_size, self.settings.max_batch_symbols):
                jobs = [item.job for item in batch]
                order = (
                    self.fair.priority({job.flow for job in jobs}),
                    min(job.service for job in jobs),
                    min(job.times.arrival for job in jobs),
                )
                cost = batch_cost(batch[0], len(batch), max(item.length for item in batch))
                units.append((order, TransduceUnit(batch, cost)))
        for long in self.long:
            job = long.item.job
            order = (self.fair.priority([job.flow]), job.service, job.times.arrival)
            holds = 0 if long.started else long.item.cost.nbytes
            units.append((order, TransduceUnit([long.item], long.item.cost, long, holds)))
        planned, held = [], self.memory.held
        for _, unit in sorted(units, key=lambda unit: unit[0]):
            needs = unit.holds if unit.long is not None else unit.cost.nbytes  # a batch: its call's activations
            if held + needs > self.memory.budget:
                continue
            held += unit.holds
            planned.append(unit)
        return TransducePlan(planned, batched_jobs)

    def apply_transduce(self, plan: TransducePlan, result: TransduceResult) -> None:
        """Hold the memory of long inputs that started, charge each call's flows and requests by symbols, answer or
        fail."""
        if plan.batched_jobs is not None:
            self.last_run_jobs, self.jobs_waiting = plan.batched_jobs, 0
        for unit, calls in result.ran:
            self.memory.hold(unit.holds)
            for call in calls:
                for item in call.items:
                    self._schedule(item.job, Status.SLICING)
                if call.error is not None:
                    for item in call.items:
                        item.job.fail(call.error, self.metrics)
                    continue
                flows: dict[str, float] = {}
                symbols = sum(item.length for item in call.items)
                for item, output in zip(call.items, call.outputs):
                    flows[item.job.flow] = flows.get(item.job.flow, 0.0) + item.length
                    item.job.service += call.seconds * item.length / symbols
                    if output is not None:
                        item.job.complete(item.index, output, self.metrics)
                self.fair.charge(flows, call.seconds)

    # --- generation -----------------------------------------------------------------------------------------

    def _decoding_sequences(self) -> list[Sequence]:
        return [sequence for batch in self.decoding.values() for sequence in batch.sequences]

    def _running(self) -> int:
        return len(self.prefilling) + sum(map(len, self.decoding.values()))

    def _fair_order(self, sequences: Iterable[Sequence]) -> list[Sequence]:
        """Least-served flow first, then least-served sequence, then oldest."""
        return sorted(
            sequences,
            key=lambda sequence: (self.fair.priority([sequence.flow]), sequence.service, sequence.times.arrival),
        )

    def _plan_admissions(self, held: int) -> list[Sequence]:
        """The waiting sequences to start, in fair order, within ``max_running`` and the memory left beside ``held``
        bytes."""
        room = self.settings.max_running - self._running()
        if room <= 0:
            return []  # nothing to order while no sequence can start
        admitted: list[Sequence] = []
        for sequence in self._fair_order(self.waiting):
            if len(admitted) >= room:
                break
            if held + sequence.cache_bytes > self.memory.budget:
                continue
            held += sequence.cache_bytes
            admitted.append(sequence)
        return admitted

    def apply_admissions(self, admitted: list[Sequence]) -> None:
        """The admitted sequences that started hold their memory and prefill."""
        started = {id(sequence) for sequence in admitted if not sequence.done}
        for sequence in admitted:
            if id(sequence) in started:
                self.memory.hold(sequence.cache_bytes)
                sequence.reserved_bytes = sequence.cache_bytes
                self._schedule(sequence, Status.PREFILLING)
                self.prefilling.append(sequence)
        self.waiting = deque(sequence for sequence in self.waiting if id(sequence) not in started)

    def _plan_prefill(
        self,
        now: float,
        admitted: list[Sequence],
        starts: dict[int, tuple[int, int | None]],
        prompting: Iterable[Sequence] = (),
    ) -> list[PrefillGroup]:
        """Chunks for the prefilling and ``admitted`` sequences from their ``starts``, in fair order, within
        ``prefill_chunk_tokens``, grouped by model, context class and length; a sequence that :meth:`_yields` gets none.
        """
        prefilling = [*self.prefilling, *admitted]
        least_served = self._least_served([*prefilling, *prompting])
        budget = self.settings.prefill_chunk_tokens
        groups: dict[tuple[str, int, int], list[Sequence]] = {}  # (model, context class, chunk length)
        for sequence in self._fair_order(prefilling):
            at = starts[id(sequence)]
            if budget <= 0 and at[0] < len(sequence.request.prompt):
                break
            if self._yields(sequence, least_served, now):
                continue
            length = prefill_length(sequence, budget, at)
            budget -= length
            groups.setdefault((*_decode_key(sequence), length), []).append(sequence)
        return [PrefillGroup(sequences, length) for (*_, length), sequences in groups.items()]

    def _least_served(self, running: list[Sequence]) -> float:
        """The least service among ``running`` and the decoding sequences."""
        return min((sequence.service for sequence in [*running, *self._decoding_sequences()]), default=0.0)

    def _yields(self, sequence: Sequence, least_served: float, now: float) -> bool:
        """Whether a prefilling sequence waits for less-served ones (served more than a slice beyond ``least_served``)
        or for a request anticipated (:meth:`_anticipate`), until its ``prefill_resumes_at`` (the scheduler's clock)."""
        anticipated = id(sequence) in self.anticipating and now < self.anticipate_until
        return (self._served_beyond(sequence, least_served) or anticipated) and now < sequence.prefill_resumes_at

    def _served_beyond(self, sequence: Sequence, served: float) -> bool:
        """Whether ``sequence`` has been served more than a slice beyond ``served`` seconds."""
        return sequence.service > served + self.settings.slice_ms / 1000

    def _anticipate(self, served: float) -> None:
        """A generate request that was served ``served`` seconds has ended: the prompts that yielded to it (served more
        than a slice beyond it, within their ``prefill_resumes_at``) keep yielding for ``anticipate_ms``, bounded by
        their ``prefill_resumes_at`` as any yield is (each keeps half the engine). A client often sends its next
        request as soon as the answer arrives; without this the prompt's next round has begun by then and the request
        waits a whole slice behind it (Iyer and Druschel's "deceptive idleness"). Prompts served about as much as it
        was do not wait: many clients' prompts go on as before."""
        now = self.clock()
        self.anticipating = {
            id(sequence)
            for sequence in self.prefilling
            if self._served_beyond(sequence, served) and now < sequence.prefill_resumes_at
        }
        if self.anticipating:
            self.anticipate_until = now + self.settings.anticipate_ms / 1000

    def _only_yielding(self) -> bool:
        """Whether the only work held is prompts that all yield now (nothing runs until one resumes or work arrives)."""
        idle = not (self.short or self.long or self.waiting or self.decoding)
        return idle and bool(self.prefilling) and not self._prefills_now()

    def _prefills_now(self) -> bool:
        """Whether some prefilling sequence does not yield now."""
        least_served = self._least_served(self.prefilling)
        return any(not self._yields(sequence, least_served, self.clock()) for sequence in self.prefilling)

    def apply_prefill(self, result: PrefillResult) -> None:
        """Charge each group's flows and sequences; a sequence that must yield waits no longer than this round took."""
        for group, seconds in result.ran:
            self.fair.charge({sequence.flow: 1.0 for sequence in group.sequences}, seconds)
            for sequence in group.sequences:
                sequence.service += seconds / len(group.sequences)
                sequence.prefill_resumes_at = result.ended + (result.ended - result.started)

    def _plan_decode(
        self,
        prefill: list[PrefillGroup],
        starts: dict[int, tuple[int, int | None]],
        prompting: Iterable[Sequence] = (),
    ) -> list[DecodeWork]:
        """One step per decode batch, joined by the sequences whose prompt the ``prefill`` chunks complete and the
        ``prompting`` ones."""
        joining: dict[tuple[str, int], list[Sequence]] = {}
        for group in prefill:
            for sequence in group.sequences:
                if starts[id(sequence)][0] + group.length == len(sequence.request.prompt):
                    joining.setdefault(_decode_key(sequence), []).append(sequence)
        in_prompt: dict[tuple[str, int], list[Sequence]] = {}
        for sequence in prompting:
            in_prompt.setdefault(_decode_key(sequence), []).append(sequence)
        keys = [*self.decoding, *(key for key in {**joining, **in_prompt} if key not in self.decoding)]
        return [DecodeWork(key, self.decoding.get(key), joining.get(key, []), in_prompt.get(key, [])) for key in keys]

    def apply_decode(self, result: DecodeResult) -> None:
        """The joined sequences decode; each stepped sequence is charged its share of its step."""
        joined = set()
        for work, batch, sequences, seconds in result.ran:
            self.decoding[work.key] = batch
            for sequence in [*work.joining, *work.prompting]:
                self._schedule(sequence, Status.DECODING)
                joined.add(id(sequence))
            for sequence in sequences:
                sequence.service += seconds / len(sequences)
        self.prefilling = [sequence for sequence in self.prefilling if id(sequence) not in joined]


def _settle(works: Iterable[W], metrics: ServerMetrics, flows: set[str], finished: dict[int, Work]) -> list[W]:
    """The sweep over ``works``: end those whose client went away, emit answers; the ended go into ``finished``, the
    rest are returned and their flows added to ``flows``."""
    kept = []
    for work in works:
        if work.cancelled and not work.done:
            work.abort(metrics)
        if work.outbox:
            work.emit()
        if work.done:
            finished[id(work)] = work
        else:
            kept.append(work)
            flows.add(work.flow)
    return kept


def _decode_key(sequence: Sequence) -> tuple[str, int]:
    """A sequence's decode batch: its model and context class (padded caches hold at most 2x their rows' need)."""
    return sequence.served.id, context_class(len(sequence.request.prompt) + sequence.request.max_tokens)
