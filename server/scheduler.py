"""The engine's worker loop: what runs when, on the one thread that calls the models.

All work is cut into bounded units, so that no request holds the engine for long: transduce batches planned
to fit one slice (``settings.slice_ms`` of the model's measured speed) and long inputs run one slice per turn
(``server/batching.py``), prefill chunks of at most one slice and ``prefill_chunk_tokens`` tokens per
iteration, and one decode step per model per iteration (``server/generation.py``). Each iteration

1. takes new work from the inbox (blocking only when idle, or until the transduce gathering window ends);
2. drops work whose client went away (a long transduce stops before its next slice);
3. runs transduce units for about one slice in all, in fair order;
4. admits waiting sequences, in fair order, up to ``max_running`` and while their memory fits;
5. prefills up to ``prefill_chunk_tokens`` prompt tokens for about one slice, in fair order, chunks of one model
   and length batched;
6. runs one decode step per model and context class over its decoding sequences (continuous batching: a
   sequence joins the batch after its prefill and leaves it when it finishes, whatever its length and
   architecture; a class holds the sequences whose prompt + max_tokens have one bit length, so that the
   padded caches of a batch hold at most 2x what their rows need, as ``ModelBudget.context_cost`` reserves);
7. hands every event of the iteration to the event loop at once.

**Fairness** (``FairShare``): every request belongs to a flow, its client (the peer address). Transduce work
is taken least-served flow first, then, within a flow, least-served request first, then oldest: a flow's
service is the model seconds spent on its work while it had work queued (a batch charges its flows and
requests in proportion to their symbols); a flow with nothing queued is forgotten. So a short request goes
ahead of a 100k-symbol input that is running, whoever sent them, and two heavy clients alternate. Admission
and prefill take the least-served flow first, then the least-served sequence (its prefill chunks and its share
of the decode steps), then the oldest; and a prefilling sequence served more than a slice beyond the least-served
running sequence yields to it, so that a short request beside a long prompt is prefilled and decoded as if alone
once the slice in progress ends, but for no longer than the prompt's last round took: a long prompt keeps half
the engine however many short requests come. Decode is not rationed: every running sequence steps every
iteration.

**Memory** (``MemoryLedger``): running work holds its cache (a sequence: the cache at prompt + max_tokens,
padded to its context class; a long transduce: what its slices keep) and the call in progress its activations,
within the budget of ``server/costing.py``; work that does not fit now waits, and admission (the engine)
refuses with 413 what could never fit.

**Failures**: a model call that raises fails only what fails alone. A transduce batch's inputs, and the
sequences of a prefill chunk (whose stacked call works on a copy of their caches), run again one by one, and only
those that raise by themselves fail. A decode step advances its batch's stacked cache in place, so a step that
raises fails its batch; what one row could bring into it, a token outside the model's vocabulary, ends that
sequence when it is sampled (``server/generation.py``).
"""

from __future__ import annotations

import concurrent.futures
import logging
import queue
import time
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import TypeVar

from model.base import Cost
from server.batching import LongTransduce, TransduceItem, TransduceJob, batch_cost, plan_batches, run_batch
from server.costing import context_class
from server.errors import APIError, ModelFailure, Unavailable
from server.generation import DecodeBatch, Sequence, prefill, prefill_length, start
from server.mailbox import Postman
from server.metrics import ServerMetrics
from server.model_store import ServedModel
from server.settings import Settings
from server.state_cache import StateCache
from server.work import RequestQueue, Status, Work

logger = logging.getLogger(__name__)

STOP = object()  # put into the inbox to end the loop
T = TypeVar("T")


@dataclass(frozen=True)
class AbortAll:
    """Put into the inbox to end every request in flight with ``error`` (e.g. 503 past the drain timeout)."""

    error: APIError


@dataclass(frozen=True)
class OnWorker:
    """Put into the inbox to run ``work`` on the worker thread between two iterations (e.g. installing a model
    compiled while serving); its result or exception goes to ``done``."""

    work: Callable[[], object]
    done: concurrent.futures.Future

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
        """``flows``: flow -> its share (weights, summing to anything positive) of a call of ``seconds``."""
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
        inbox: queue.SimpleQueue,
        postman: Postman,
        memory_budget: int,
        queue: RequestQueue | None = None,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        """``queue``: what admission counts (the engine's; a new one by default). ``clock``: seconds, what model calls
        and slices are timed with (a test drives a fake one)."""
        self.settings, self.metrics, self.state_cache, self.inbox, self.postman = (
            settings,
            metrics,
            state_cache,
            inbox,
            postman,
        )
        self.queue = queue or RequestQueue(settings.max_waiting)
        self.clock = clock
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

    def loop(self) -> None:
        while self._receive():
            self.iteration()
        self._fail_all(Unavailable("the server is shutting down"))
        self.postman.flush()

    def iteration(self) -> None:
        """Steps 2-7 of the module docstring, on the work already received."""
        self._sweep()
        self._run_transduce()
        self._sweep()
        self._schedule()
        self._prefill()
        self._sweep()
        self._join_decode_batches()
        self._decode()
        self._sweep()
        self.postman.flush()

    # --- intake -------------------------------------------------------------------------------------------

    def _busy(self) -> bool:
        return bool(self.waiting or self.prefilling or self.decoding or self.long)

    def _receive(self) -> bool:
        """Move new work from the inbox; False once asked to stop."""
        timeout: float | None = 0.0
        idle = not (self._busy() or self.short) and self.inbox.empty()  # new work will wake us
        if not self._busy():
            due = self.first_short_at + self.gather_window()
            timeout = None if not self.short else max(0.0, due - time.monotonic())
        try:
            work = self.inbox.get(timeout=timeout) if timeout != 0.0 else self.inbox.get_nowait()
            while True:
                if work is STOP:
                    return False
                if isinstance(work, AbortAll):
                    self._fail_all(work.error)
                elif isinstance(work, OnWorker):
                    work.run()
                elif isinstance(work, TransduceJob):
                    self._take_job(work, idle)
                else:
                    self.waiting.append(work)
                work = self.inbox.get_nowait()
        except queue.Empty:
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
        """Seconds to gather short transduce inputs after the oldest arrived: ``batch_wait_ms``, or 0 when requests
        come one at a time: a single request is waiting, it reached a worker with nothing else to do, and the
        previous run served a single request. A request that arrives while other work runs (other clients are
        active), or after a run of several requests (their clients are about to send their next ones together),
        waits."""
        if self.jobs_waiting == 1 and self.first_job_found_idle and self.last_run_jobs <= 1:
            return 0.0
        return self.settings.batch_wait_ms / 1000

    def _short_due(self) -> bool:
        symbols = sum(item.length for item in self.short)
        return bool(self.short) and (
            symbols >= self.settings.max_batch_symbols
            or time.monotonic() >= self.first_short_at + self.gather_window()
        )

    def _sweep(self) -> None:
        """The one pass over all work: ends the work whose client went away, takes finished work out (its memory
        released, counted out of the queue), and forgets the flows that have nothing left."""
        flows: set[str] = set()
        finished: dict[int, Work] = {}

        def keep(work: Work) -> bool:
            if work.cancelled and not work.done:
                work.abort(self.metrics)
            if work.done:
                finished[id(work)] = work
                return False
            flows.add(work.flow)
            return True

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
        self.waiting = deque(sequence for sequence in self.waiting if keep(sequence))
        self.prefilling = [sequence for sequence in self.prefilling if keep(sequence)]
        for key, batch in list(self.decoding.items()):
            if not all([keep(sequence) for sequence in batch.sequences]):
                batch.drop_finished()
            if not batch.sequences:
                del self.decoding[key]
        for work in finished.values():
            if isinstance(work, Sequence) and work.reserved_bytes:
                self.memory.release(work.reserved_bytes)
                work.reserved_bytes = 0
            self.queue.finished(was_scheduled=work.times.scheduled is not None)
        self.fair.keep_only(flows)
        if not self.short:
            self.jobs_waiting = 0

    # --- transduce ----------------------------------------------------------------------------------------

    def _run_transduce(self) -> None:
        """Batches and long-input slices, least-served flow first, until about one slice has run."""
        units: list[tuple[float, float, float, Callable[[], None]]] = []  # (flow's, job's service, arrival, run)
        if self._short_due():
            batches = plan_batches(self.short, self.settings.max_batch_size, self.settings.max_batch_symbols)
            self.last_run_jobs, self.jobs_waiting = self.jobs_waiting, 0
            for batch in batches:
                jobs = [item.job for item in batch]
                order = (
                    self.fair.priority({job.flow for job in jobs}),
                    min(job.service for job in jobs),
                    min(job.times.arrival for job in jobs),
                )
                units.append((*order, lambda batch=batch: self._run_batch(batch)))
        for long in self.long:
            job = long.item.job
            order = (self.fair.priority([job.flow]), job.service, job.times.arrival)
            units.append((*order, lambda long=long: self._run_slice(long)))
        started = self.clock()
        for index, (*_, run) in enumerate(sorted(units, key=lambda unit: unit[:3])):
            if index and self.clock() - started >= self.settings.slice_ms / 1000:
                break  # one unit at least: a slice shorter than the loop's own time would otherwise run nothing
            run()

    def _run_batch(self, batch: list[TransduceItem]) -> None:
        """Run one batch now if its call fits in memory now; else it waits (its items stay in ``short``; the sweep
        takes out those computed)."""
        batch = [item for item in batch if not item.job.done]
        if not batch:
            return
        cost = batch_cost(batch[0], len(batch), max(item.length for item in batch))
        if not self.memory.fits(cost.nbytes):
            return
        for item in batch:
            self._start_transduce(item.job)
        self._compute_batch(batch, cost)

    def _start_transduce(self, job: TransduceJob) -> None:
        if job.status is Status.WAITING:
            job.schedule(Status.SLICING, self.metrics)
            self.queue.scheduled()

    def _compute_batch(self, batch: list[TransduceItem], cost: Cost) -> None:
        """Run one batch's call (``cost``) and answer its items; if it raises, each item runs alone, and only those
        that fail alone fail (a batch has no state to roll back)."""
        served = batch[0].job.served
        try:
            seconds, outputs = self._timed(served, cost.flops, lambda: run_batch(batch))
        except Exception as error:
            if len(batch) > 1:
                logger.warning("a transduce batch of %d inputs failed (%s: %s); each runs alone", len(batch),
                               type(error).__name__, error)  # fmt: skip
                for item in batch:
                    if not item.job.done:  # not failed meanwhile through another of its inputs
                        self._compute_batch([item], batch_cost(item, 1, item.length))
                return
            logger.exception("a transduce input of %d symbols failed", batch[0].length)
            batch[0].job.fail(ModelFailure(f"the model failed on this input: {error}"), self.metrics)
            return
        flows: dict[str, float] = {}
        symbols = sum(item.length for item in batch)
        for item, output in zip(batch, outputs):
            flows[item.job.flow] = flows.get(item.job.flow, 0.0) + item.length
            item.job.service += seconds * item.length / symbols
            item.job.complete(item.index, output, self.metrics)
        self.fair.charge(flows, seconds)

    def _run_slice(self, long: LongTransduce) -> None:
        """One slice of a long input; its memory is held from the first slice, which waits until it fits."""
        job = long.item.job
        if job.done:
            return
        if not long.started:
            if not self.memory.fits(long.item.cost.nbytes):
                return
            self.memory.hold(long.item.cost.nbytes)
            self._start_transduce(job)
        try:
            seconds, flops = self._clocked(long.advance)
        except Exception as error:
            logger.exception("a slice of a %d-symbol transduce input failed", long.item.length)
            job.fail(ModelFailure(f"the model failed on this input: {error}"), self.metrics)
            return
        self._record(job.served, flops, seconds)  # the work this slice did: the slice's size was fixed at its start
        self.fair.charge({job.flow: 1.0}, seconds)
        job.service += seconds
        if long.output is not None:
            job.complete(long.item.index, long.output, self.metrics)

    # --- generation -----------------------------------------------------------------------------------------

    def _decoding_sequences(self) -> list[Sequence]:
        return [sequence for batch in self.decoding.values() for sequence in batch.sequences]

    def _sequences_running(self) -> list[Sequence]:
        return [*self.prefilling, *self._decoding_sequences()]

    def _running(self) -> int:
        return len(self.prefilling) + sum(map(len, self.decoding.values()))

    def _fair_order(self, sequences: Iterable[Sequence]) -> list[Sequence]:
        """Least-served flow first, then least-served sequence, then oldest."""
        return sorted(
            sequences,
            key=lambda sequence: (self.fair.priority([sequence.flow]), sequence.service, sequence.times.arrival),
        )

    def _schedule(self) -> None:
        """Admit waiting sequences, least-served flow first, while there is room and memory."""
        if self._running() >= self.settings.max_running:
            return  # nothing to order while no sequence can start
        admitted = set()
        for sequence in self._fair_order(self.waiting):
            if self._running() >= self.settings.max_running:
                break
            if not self.memory.fits(sequence.cache_bytes):
                continue
            self.memory.hold(sequence.cache_bytes)
            sequence.reserved_bytes = sequence.cache_bytes
            admitted.add(id(sequence))
            sequence.schedule(Status.PREFILLING, self.metrics)
            self.queue.scheduled()
            self._guarded([sequence], lambda sequence=sequence: start(sequence, self.state_cache, self.metrics))
            self.prefilling.append(sequence)  # released by the sweep if start failed
        self.waiting = deque(sequence for sequence in self.waiting if id(sequence) not in admitted)

    def _prefill(self) -> None:
        """Chunks for the prefilling sequences in fair order, within the token budget and about one slice of time,
        batched by model, context class and chunk length. A sequence served more than a slice beyond the
        least-served running one (prefilling or decoding) yields to it, so that a short request is prefilled and
        decoded beside a long prompt as if alone, once the slice in progress ends; but it waits no longer than its
        last round took, so that a long prompt keeps half the engine however many short requests come."""
        slice_seconds = self.settings.slice_ms / 1000
        now = self.clock()
        least_served = min((sequence.service for sequence in self._sequences_running()), default=0.0)
        budget = self.settings.prefill_chunk_tokens
        groups: dict[tuple[str, int, int], list[Sequence]] = {}  # (model, context class, chunk length)
        for sequence in self._fair_order(self.prefilling):
            if budget <= 0 and sequence.prefilling:
                break
            if sequence.service > least_served + slice_seconds and now < sequence.prefill_resumes_at:
                continue
            length = prefill_length(sequence, budget)
            budget -= length
            groups.setdefault((*_decode_key(sequence), length), []).append(sequence)
        prefilled = []
        for (*_, length), group in groups.items():
            if prefilled and self.clock() - now >= slice_seconds:
                break  # the rest next iteration (one group at least: a slice shorter than the loop's own time would
                # otherwise never prefill anything)
            model = group[0].served.model
            flops = model.cost("cached", len(group), length, context=min(s.prefilled for s in group)).flops
            seconds = self._guarded(
                group,
                lambda group=group, length=length: prefill(group, length, self.state_cache, self.metrics),
                flops,
                alone=lambda sequence, length=length: prefill([sequence], length, self.state_cache, self.metrics),
            )
            self.fair.charge({sequence.flow: 1.0 for sequence in group}, seconds)
            for sequence in group:
                sequence.service += seconds / len(group)
            prefilled += group
        ended = self.clock()
        for sequence in prefilled:
            sequence.prefill_resumes_at = ended + (ended - now)

    def _join_decode_batches(self) -> None:
        """Sequences whose prompt is done join their decode batch (after a sweep: none of them has finished)."""
        joining: dict[tuple[str, int], list[Sequence]] = {}
        for sequence in self.prefilling:
            if not sequence.prefilling:
                joining.setdefault(_decode_key(sequence), []).append(sequence)
                sequence.schedule(Status.DECODING, self.metrics)
        self.prefilling = [sequence for sequence in self.prefilling if sequence.prefilling]
        for key, sequences in joining.items():
            self.decoding.setdefault(key, DecodeBatch()).join(sequences)

    def _decode(self) -> None:
        for batch in self.decoding.values():
            sequences = list(batch.sequences)
            seconds = self._guarded(sequences, lambda batch=batch: batch.step(self.metrics))
            for sequence in sequences:
                sequence.service += seconds / len(sequences)

    # --- helpers ------------------------------------------------------------------------------------------

    def _timed(self, served: ServedModel, flops: float, call: Callable[[], T]) -> tuple[float, T]:
        """Run a model call of about ``flops`` multiply-adds; record its time (metrics and the model's measured
        speed). Returns (seconds, its result)."""
        seconds, result = self._clocked(call)
        self._record(served, flops, seconds)
        return seconds, result

    def _clocked(self, call: Callable[[], T]) -> tuple[float, T]:
        started = self.clock()
        result = call()
        return self.clock() - started, result

    def _record(self, served: ServedModel, flops: float, seconds: float) -> None:
        """A model call of ``flops`` multiply-adds took ``seconds``: metrics and the model's measured speed."""
        self.metrics.model_executed(served.id, seconds)
        served.budget.speed.observe(flops, seconds)

    def _guarded(
        self,
        sequences: list[Sequence],
        call: Callable[[], object],
        flops: float = 0.0,
        alone: Callable[[Sequence], object] | None = None,
    ) -> float:
        """Run a model call for ``sequences``; if it raises, only they fail, and given ``alone`` (the call for one
        of them) only those that fail alone: a sequence the failed call left as it found it (same cache, same
        position: e.g. a prefill whose stacked call raised works on a copy of the rows) runs again by itself.
        Returns the seconds spent."""
        state = [(sequence.cache, sequence.prefilled) for sequence in sequences]
        try:
            return self._timed(sequences[0].served, flops, call)[0]
        except Exception as error:
            retry = [] if alone is None or len(sequences) == 1 else [
                sequence for sequence, (cache, prefilled) in zip(sequences, state)
                if not sequence.done and sequence.cache is cache and sequence.prefilled == prefilled
            ]  # fmt: skip
            if retry:
                logger.warning("a model call for %d sequences failed (%s: %s); %d run again alone", len(sequences),
                               type(error).__name__, error, len(retry))  # fmt: skip
            else:
                logger.exception("a model call failed for %d sequence(s)", len(sequences))
            for sequence in sequences:
                if not sequence.done and sequence not in retry:
                    sequence.fail(ModelFailure(f"the model failed: {error}"), self.metrics)
        return sum(self._guarded([sequence], lambda sequence=sequence: alone(sequence)) for sequence in retry)

    def _fail_all(self, error: APIError) -> None:
        """End every request in flight with ``error``; running slices stop here."""
        for job in [item.job for item in self.short] + [long.item.job for long in self.long]:
            job.fail(error, self.metrics)
        for sequence in [*self.waiting, *self.prefilling, *self._decoding_sequences()]:
            sequence.fail(error, self.metrics)
        self._sweep()


def _decode_key(sequence: Sequence) -> tuple[str, int]:
    """The decode batch of a sequence: its model and context class."""
    return sequence.served.id, context_class(len(sequence.request.prompt) + sequence.request.max_tokens)
