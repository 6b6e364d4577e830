"""The engine's worker loop: what runs when, on the one thread that calls the models.

All work is cut into bounded units, so that no request holds the engine for long: transduce batches planned
to fit one slice (``settings.slice_ms`` of the model's measured speed) and long inputs run one slice per turn
(``server/sched/batching.py``), prefill chunks of at most one slice and ``prefill_chunk_tokens`` tokens per
iteration, and one decode step per model per iteration (``server/execution/generation.py``). Each iteration

1. takes new work from the inbox (blocking only when idle, or until the transduce gathering window ends);
2. sweeps: ends work whose client went away (a long transduce stops before its next slice), takes out what ended;
3. plans the whole iteration (``plan``), then runs and applies it phase by phase:
4. transduce units for about one slice in all, in fair order;
5. the waiting sequences admitted, in fair order, up to ``max_running`` and while their memory fits, start;
6. up to ``prefill_chunk_tokens`` prompt tokens prefilled for about one slice, in fair order, chunks of one model
   and length batched (the sequences just admitted among them, from where the state cache lets each begin);
7. one decode step per model and context class over its decoding sequences (continuous batching: a
   sequence joins the batch once its prefill has sampled its first token, or at once where its whole prompt runs
   there, a few tokens under batch invariance (``server.execution.generation.prompt_in_batch``), and leaves it when it
   finishes, whatever its length and architecture; a class holds the sequences whose prompt + max_tokens have one
   bit length, so that the padded caches of a batch hold at most 2x what their rows need, as
   ``ModelBudget.context_cost`` reserves);
8. sweeps again, and hands every event of the iteration to the event loop at once.

``plan`` decides what runs, in which order, from the scheduler's state alone (no model call, no change): one
:class:`server.execution.executor.Plan` of every phase, before any of them runs. The executor (``server/execution/executor.py``) runs each
phase of it (the model calls, their timing, the sampling), stopping when about one slice has been spent, and drops
only what running has made moot (a sequence that failed to start, one whose last chunk did not run yet); ``apply_*``
charges fairness and memory and moves the work's status (``server/sched/work.py``: waiting, prefilling, decoding, slicing,
finished with a reason), each phase's before the next phase runs (so that a sequence has left the queue before its
first chunk can end it). What the plan cannot know is left to the next iteration: memory that transduce work ending
in this one releases, and the service this one charges. The sweep (step 2 and last) is the only place work leaves
the scheduler and answers leave the work: there each request is handed what it was answered (its outbox), memory is
released, and a finished request leaves the queue that admission counts (``RequestQueue``: 429 when full), which the
scheduler owns; the metrics only observe.

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
within the budget of ``server/sched/costing.py``; work that does not fit now waits, and admission (the engine)
refuses with 413 what could never fit, or a request with more sequences than the queue can ever hold.

**Failures**: a model call that raises fails only what fails alone (``server/execution/executor.py``). A transduce batch's
inputs, and the sequences of a prefill chunk (whose stacked call works on a copy of their caches), run again one by
one, and only those that raise by themselves fail. A decode step advances its batch's stacked cache in place, so a
step that raises fails its batch; what one row could bring into it, a token outside the model's vocabulary, ends
that sequence when it is sampled (``server/execution/generation.py``).
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
    """Put into the inbox to end every request in flight with ``error`` (e.g. 503 past the drain timeout)."""

    error: APIError


@dataclass(frozen=True)
class OnWorker(Generic[T]):
    """Put into the inbox to run ``work`` on the worker thread between two iterations (e.g. installing a model
    compiled while serving); its result or exception goes to ``done``."""

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
        inbox: queue.SimpleQueue[object],
        postman: Courier,
        memory_budget: int,
        request_queue: RequestQueue | None = None,
        clock: Callable[[], float] = time.perf_counter,
        executor: Executor | None = None,
    ) -> None:
        """``request_queue``: what admission counts (the engine's; a new one by default). ``clock``: seconds, what model
        calls and slices are timed with (a test drives a fake one). ``executor``: what runs the plans (by default the
        models', on ``clock``; a test gives a fake one)."""
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

    @property
    def state_cache(self) -> StateCache:
        """The executor's prefix states (one cache: it takes from it what the plan found there)."""
        return self.executor.state_cache

    def loop(self) -> None:
        while self._receive():
            self.iteration()
        self._fail_all(Unavailable("the server is shutting down"))
        self.postman.flush()

    def iteration(self) -> None:
        """Steps 2-8 of the module docstring, on the work already received: the sweep, one plan, each of its phases
        run by the executor and its result applied, the sweep."""
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
        """More decode steps in this iteration (up to ``decode_steps`` in all, and about one slice of time since the
        first ``started``), while decoding is all there is to do: nothing prefills now (a prompt that yields to
        less-served sequences counts from when it may resume: :meth:`_prefills_now`) or transduces, nothing waits that
        ``max_running`` would let start (a row that ends makes room: the run stops there), and nothing
        new has come into the inbox (which is looked at before each step: a new request, or a stop string the engine
        process's API side found, ends the run of steps at once). The per-iteration work (planning every phase, the
        sweeps, the postman's flush: in the engine process, one message to the API process) is then shared by
        several steps, as vLLM's multi-step scheduling shares it; a sweep between two steps takes out what ended or
        whose client went away (a cancellation sets a flag, not an inbox entry), and the tokens leave together at the
        flush. So a short request beside a long prompt that yields to it takes its steps as it would alone, within the
        yield."""
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
        """The iteration's work, from the scheduler's state alone (no model call, no change): transduce units, the
        sequences to admit (within the memory the planned units leave), prefill chunks (the admitted sequences'
        first ones from where :func:`server.execution.generation.start_point` says each will begin), and one decode step per
        batch, joined by the sequences whose prompt the planned chunks complete and by the admitted ones whose
        prompt runs in the batch (:func:`server.execution.generation.prompt_in_batch`). ``now``: ``time.monotonic()``, what
        arrivals are stamped with; ``clock_now``: the scheduler's clock."""
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
        """Move new work from the inbox (blocking only when idle, or until the gathering window ends); False once
        asked to stop."""
        timeout: float | None = 0.0
        idle = not (self._busy() or self.short) and self.inbox.empty()  # new work will wake us
        if not self._busy():
            due = self.first_short_at + self.gather_window()
            timeout = None if not self.short else max(0.0, due - time.monotonic())
        received = []
        try:
            received.append(self.inbox.get(timeout=timeout) if timeout != 0.0 else self.inbox.get_nowait())
            while True:
                received.append(self.inbox.get_nowait())
        except queue.Empty:
            pass
        return self.take(received, idle)

    def take(self, received: list[object], idle: bool = False) -> bool:
        """New work, in order of arrival; ``idle``: it reached a worker with nothing else to do (blocked on the
        inbox). False once asked to stop."""
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
        """Seconds to gather short transduce inputs after the oldest arrived: ``batch_wait_ms``, or 0 when requests
        come one at a time: a single request is waiting, it reached a worker with nothing else to do, and the
        previous run served a single request. A request that arrives while other work runs (other clients are
        active), or after a run of several requests (their clients are about to send their next ones together),
        waits."""
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
        """The one pass over the work: ends the work whose client went away, hands each request what it was answered
        (``Work.emit``), takes out what has ended or been computed (its memory released, finished requests counted
        out of the queue), and forgets the flows that have nothing left."""
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
        if not self.short:
            self.jobs_waiting = 0

    def _schedule(self, work: Work, status: Status) -> None:
        """Move ``work`` on to ``status``; leaving ``WAITING``, it leaves the queue's waiting count."""
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
        """Batches (once the gathering window is over) and long-input slices, least-served flow first, then
        least-served request, then oldest; a unit whose memory does not fit now waits (a long input holds its
        memory from its first slice). ``now``: ``time.monotonic()``, what arrivals are stamped with."""
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
        """Hold the memory of the long inputs that started, charge each call's flows and requests (in proportion to
        their symbols), and answer the inputs computed or fail their requests."""
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
        """The waiting sequences to start, least-served flow first, while there is room (``max_running``) and
        their memory fits beside ``held`` bytes."""
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
        """The admitted sequences that started hold their memory and prefill (one that failed to start has ended:
        the sweep takes it out)."""
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
        """Chunks for the prefilling sequences and the ``admitted`` ones, each from its ``starts`` entry (prefilled,
        snapshot_at), in fair order, within the token budget (``prefill_chunk_tokens``), grouped by model, context
        class and chunk length. A sequence served more than a slice beyond the least-served running one (prefilling,
        decoding, or ``prompting``: admitted into its decode batch in this iteration) yields to it, so that a short
        request is prefilled and decoded beside a long prompt as if alone, once the slice in progress ends; but it waits
        no longer than its last round took (``prefill_resumes_at``), so that a long prompt keeps half the engine however
        many short requests come. The executor runs the groups for about one slice."""
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
        """Whether a prefilling sequence waits now (the scheduler's clock) for less-served ones (:meth:`_plan_prefill`):
        served more than a slice beyond the ``least_served``, until its ``prefill_resumes_at``."""
        return sequence.service > least_served + self.settings.slice_ms / 1000 and now < sequence.prefill_resumes_at

    def _prefills_now(self) -> bool:
        """Whether a prefilling sequence would have a chunk planned now: one that does not yield."""
        least_served = self._least_served(self.prefilling)
        return any(not self._yields(sequence, least_served, self.clock()) for sequence in self.prefilling)

    def apply_prefill(self, result: PrefillResult) -> None:
        """Charge each group's flows and sequences; a sequence prefilled now waits, if it must yield, no longer than
        this round took."""
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
        """One step per decode batch, joined by the sequences whose prompt the ``prefill`` chunks complete (the
        executor takes those whose first token it sampled: ``ready_work``) and by the ``prompting`` ones."""
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
        """The joined sequences decode (a prompting one from its prompt's first token); each stepped sequence is
        charged its share of its step."""
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
    """The sweep on each of ``works``, in one loop (it runs over every running sequence twice an iteration): end it if
    its client went away, emit its answers; those that ended go into ``finished``; returns the others, whose flows go
    into ``flows``."""
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
    """The decode batch of a sequence: its model and context class."""
    return sequence.served.id, context_class(len(sequence.request.prompt) + sequence.request.max_tokens)
