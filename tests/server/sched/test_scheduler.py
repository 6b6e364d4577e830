"""The scheduler's policy against a fake executor (as vLLM's tests/v1/core/test_scheduler.py): no model, no thread,
no HTTP, a fake clock. Its plans are read directly; the executor runs them as the real one would, each call taking a
fixed time on the clock, so that what runs when is decided by the scheduler's rules alone."""

from __future__ import annotations

import queue
import time
from array import array
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from model.config import RegularGPTConfig
from model.ops.cpu import cpu_decode
from model.regulargpt.cost import FixedCosts
from model.regulargpt.model import RegularGPT
from model.serving import Cost
from model.tokenizer import BYTES_TOKENIZER, load_tokenizer
from server.engine.engine import Engine
from server.engine.mailbox import Postman
from server.errors import InputTooLarge, Overloaded, Unavailable
from server.execution.executor import Call, DecodeResult, PrefillResult, TransduceResult, live_groups, ready_work
from server.execution.generation import (
    STEPPED_PREFILL_TOKENS,
    DecodeBatch,
    Finished,
    GenerationRequest,
    Sequence,
    prefill_call_cost,
)
from server.execution.sampling import SamplingParams
from server.metrics import RequestTimes, ServerMetrics
from server.sched.batching import TransduceJob, TransduceOutput
from server.sched.costing import ModelBudget, ModelSpeed
from server.sched.scheduler import STOP, AbortAll, Scheduler
from server.sched.state_cache import StateCache
from server.sched.work import RequestQueue, Status
from server.settings import Settings
from tests.server.driven import FakeClock, FakeTransducer, Recorder, transducer

SLICE_S = 0.05  # the default slice_ms
CALL_S = 0.01  # what each fake model call takes


class FakeLanguageModel:
    """Costs: a token one multiply-add, a cached token one byte (a cache that grows with its context); a prefill chunk
    is at most ``tokens_per_slice`` tokens."""

    def __init__(self, tokens_per_slice: int = 1000) -> None:
        self.tokens_per_slice = tokens_per_slice

    def cost(self, path: str, rows: int, length: int, context: int = 0) -> Cost:
        return Cost(flops=rows * length, nbytes=rows * (context + length))

    def cached_slices_cost(self, length: int, slice_flops: float, cost=None) -> Cost:
        return Cost(flops=length, nbytes=length)

    def cache_nbytes(self, length: int) -> int:
        return length

    def chunk_length(self, slice_flops: float, prefilled: int, remaining: int, cost=None, scored=True) -> int:
        return min(remaining, self.tokens_per_slice)


class FakeCache:
    """Rows of a stacked cache, and nothing in them."""

    def __init__(self, rows: int = 1) -> None:
        self.rows = rows

    @classmethod
    def stack(cls, caches: list[FakeCache]) -> FakeCache:
        return cls(sum(cache.rows for cache in caches))

    def select(self, rows: list[int]) -> FakeCache:
        return FakeCache(len(rows))

    @property
    def nbytes(self) -> int:
        return self.rows

    def clone(self) -> FakeCache:
        return FakeCache(self.rows)


class FakeExecutor:
    """Runs a plan as ``server/execution/executor.py`` does, in order until a slice has been spent (one unit at least), each
    call taking ``CALL_S``; logs what ran. A prefill chunk samples token 1 at a prompt's end, a decode step token 1
    for each row past its prompt; a sequence ends at its max_tokens."""

    def __init__(self, clock: FakeClock, metrics: ServerMetrics, slice_s: float) -> None:
        self.clock, self.metrics, self.slice_s = clock, metrics, slice_s
        self.state_cache = StateCache(0, 0, 0)  # what the scheduler plans admissions with (starts ignore it)
        self.log: list[tuple[str, object]] = []  # ("batch", job ids) | ("slice", job) | ("prefill", ...) | ...

    def _call(self) -> float:
        self.clock.advance(CALL_S)
        return CALL_S

    def _within_a_slice(self, units: list) -> list:
        started, ran = self.clock.now, []
        for unit in units:
            if ran and self.clock.now - started >= self.slice_s:
                break
            ran.append(unit)
            yield unit

    def transduce(self, plan) -> TransduceResult:
        ran = []
        for unit in self._within_a_slice(plan.units):
            if unit.long is not None:
                unit.long.advance()  # the fake transducer's slices: no model
                self.log.append(("slice", unit.long.item.job))
                ran.append((unit, [Call(unit.items, self._call(), [unit.long.output])]))
            else:
                self.log.append(("batch", [item.job for item in unit.items]))
                outputs = [TransduceOutput(0, 1.0, None) for _ in unit.items]
                ran.append((unit, [Call(unit.items, self._call(), outputs)]))
        return TransduceResult(ran)

    def start(self, admitted: list[Sequence]) -> None:
        for sequence in admitted:
            sequence.cache = FakeCache()
            self.log.append(("start", sequence))

    def prefill(self, groups) -> PrefillResult:
        started, ran = self.clock.now, []
        for group in self._within_a_slice(live_groups(groups)):
            self.log.append(("prefill", [(sequence, group.length) for sequence in group.sequences]))
            for sequence in group.sequences:
                sequence.prefilled += group.length
                if not sequence.prefilling:
                    self._sample(sequence)
            ran.append((group, self._call()))
        return PrefillResult(ran, started, self.clock.now)

    def decode(self, work) -> DecodeResult:
        ran = []
        for each in ready_work(work):
            batch = each.batch or DecodeBatch()
            batch.join(each.joining + each.prompting)
            self.log.append(("decode", list(batch.sequences)))
            for sequence in batch.sequences:
                if sequence.prefilling:  # a prompt in the batch: its next token
                    sequence.prefilled += 1
                    if sequence.prefilling:
                        continue
                self._sample(sequence)
            ran.append((each, batch, list(batch.sequences), self._call()))
        return DecodeResult(ran)

    def _sample(self, sequence: Sequence) -> None:
        sequence.generated.append(1)
        if len(sequence.generated) >= sequence.request.max_tokens:
            sequence.finish("length", self.metrics)


@pytest.fixture()
def clock() -> FakeClock:
    return FakeClock()


def make_scheduler(clock: FakeClock, memory_budget: int = 2**40, **settings) -> Scheduler:
    """One decode step per iteration unless ``decode_steps`` says otherwise (what most tests here follow step by
    step; the runs of several steps have their own tests, below)."""
    metrics = ServerMetrics()
    settings = Settings(models=Path("unused"), **{"batch_wait_ms": 0.0, "decode_steps": 1, **settings})
    executor = FakeExecutor(clock, metrics, settings.slice_ms / 1000)
    return Scheduler(
        settings,
        metrics,
        executor.state_cache,
        queue.SimpleQueue(),
        Postman(),
        memory_budget,
        RequestQueue(settings.max_waiting),
        clock,
        executor,
    )


def language_model(model_id: str = "lm", tokens_per_slice: int = 1000) -> SimpleNamespace:
    model = FakeLanguageModel(tokens_per_slice)
    budget = ModelBudget(model, ModelSpeed(1e-6), SLICE_S, memory_budget=2**40, max_job_seconds=1e9)
    return SimpleNamespace(id=model_id, model=model, budget=budget, tokenizer=load_tokenizer(BYTES_TOKENIZER, "."))


def sequence(served, prompt_tokens: int, max_tokens: int, clock: FakeClock, flow: str = "client") -> Sequence:
    request = GenerationRequest([65] * prompt_tokens, max_tokens, SamplingParams(temperature=0.0))
    return Sequence(served, request, Recorder(clock), flow=flow)


def admitted(worker: Scheduler, *work) -> None:
    """``work`` admitted by the engine (the queue counts it) and received by the worker."""
    assert worker.queue.admit(len(work))
    worker.take(list(work))


def transducer_of(clock: FakeClock) -> SimpleNamespace:
    """A transducer whose slice is 1,000 symbols (1 ms): inputs of 10,000 run in ten slices."""
    return transducer("t", FakeTransducer(clock, seconds_per_flop=1e-9), measured_seconds_per_flop=1e-9, slice_s=1e-3)


def job(served, length: int, clock: FakeClock, flow: str = "client") -> TransduceJob:
    inputs = [array("i", [position % 2 for position in range(length)])]
    return TransduceJob(served, inputs, False, RequestTimes(served.id), Recorder(clock), flow)


def ran(worker: Scheduler, kind: str) -> list[object]:
    return [what for logged, what in worker.executor.log if logged == kind]


# --- short prompts in the decode batch ----------------------------------------------------------------------


def test_under_batch_invariance_a_short_prompt_is_planned_into_its_decode_batch(clock) -> None:
    """Admitted under batch invariance, a prompt of at most STEPPED_PREFILL_TOKENS unscored tokens joins its decode
    batch in the plan (``DecodeWork.prompting``), not a prefill group, and decodes from the same iteration; a longer
    one, a scored one, and any the state cache would keep are prefilled; without invariance every prompt is."""
    served = language_model()
    scored = GenerationRequest([65] * 3, 9, SamplingParams(temperature=0.0), prompt_logprobs=True)  # 12 tokens of
    # context, as the others: one decode batch

    def planned(worker: Scheduler) -> tuple[list[list[Sequence]], list[Sequence]]:
        plan = worker.plan(time.monotonic(), clock.now)
        return [group.sequences for group in plan.prefill], [row for each in plan.decode for row in each.prompting]

    short, long, asks = (
        sequence(served, 8, 4, clock),
        sequence(served, 9, 4, clock),
        Sequence(served, scored, Recorder(clock)),
    )
    worker = make_scheduler(clock)
    admitted(worker, short, long, asks)
    assert planned(worker) == ([[short], [long], [asks]], [])
    cpu_decode.set_row_invariant(True)
    try:
        assert planned(worker) == ([[long], [asks]], [short])
        worker.executor.state_cache = StateCache(4, 2**30, 8)  # keeps prompts of 8 tokens
        assert planned(worker)[1] == []
        worker.executor.state_cache = StateCache(4, 2**30, 9)
        worker.iteration()
    finally:
        cpu_decode.set_row_invariant(False)
    assert short.status is Status.DECODING and short.prefilled == 1 and not short.generated
    assert long.status is Status.DECODING and len(long.generated) == 2  # its chunk's token and a step's
    for _ in range(20):
        worker.iteration()
    assert [len(each.generated) for each in (short, long, asks)] == [4, 4, 9]
    assert ran(worker, "decode")[0] == [long, asks, short]
    assert all(sequence is not short for chunks in ran(worker, "prefill") for sequence, _ in chunks)


# --- fairness ------------------------------------------------------------------------------------------------


def test_transduce_takes_the_least_served_flow_first_and_two_heavy_flows_alternate(clock) -> None:
    """Two long inputs from two clients, then a short request from a third: each iteration plans the least-served
    flow first, so the slices alternate and the newcomer goes first."""
    served = transducer_of(clock)
    worker = make_scheduler(clock, slice_ms=1.0)
    first, second = job(served, 10_000, clock, "a"), job(served, 10_000, clock, "b")
    admitted(worker, first, second)
    for _ in range(4):
        worker.iteration()  # a call takes longer than a slice: one unit an iteration
    assert ran(worker, "slice") == [first, second, first, second]
    newcomer = job(served, 4, clock, "c")
    admitted(worker, newcomer)
    plan = worker.plan(time.monotonic(), clock.now)  # what arrivals are stamped with, the scheduler's clock
    assert [unit.items[0].job for unit in plan.transduce.units] == [newcomer, first, second]
    worker.iteration()
    assert newcomer.done and newcomer.finish_reason == "stop"


def test_a_short_request_to_another_model_is_answered_while_a_long_input_runs(clock) -> None:
    """A long input does not hold the engine: a short request sent while it runs is answered at the next iteration,
    and the long one goes on in slices. (Was a live-server test with 0.01 ms slices and pauses between them.)"""
    long_model, short_model = transducer_of(clock), transducer_of(clock)
    short_model.id = "other"
    worker = make_scheduler(clock, slice_ms=1.0)
    long = job(long_model, 10_000, clock)
    admitted(worker, long)
    for _ in range(3):
        worker.iteration()
    short = job(short_model, 4, clock)
    admitted(worker, short)
    worker.iteration()
    assert short.done and short.finish_reason == "stop" and not long.done
    assert ran(worker, "batch") == [[short]] and ran(worker, "slice") == [long] * 3  # it went first
    while not long.done:
        worker.iteration()
    assert len(ran(worker, "slice")) == 11 and long.finish_reason == "stop"  # ten slices and the call that ends it


def test_admission_and_prefill_take_the_least_served_flow_first(clock) -> None:
    served = language_model()
    worker = make_scheduler(clock, max_running=1)
    heavy, light = sequence(served, 10, 4, clock, "heavy"), sequence(served, 10, 4, clock, "light")
    admitted(worker, heavy, light)
    worker.fair.charge({"heavy": 1.0}, 1.0)  # the heavy client has been served a second already
    plan = worker.plan(time.monotonic(), clock.now)
    assert plan.admitted == [light] and [group.sequences for group in plan.prefill] == [[light]]


# --- memory, and the 413 / 429 rules ---------------------------------------------------------------------------


def test_a_sequence_whose_cache_does_not_fit_now_waits_until_memory_is_released(clock) -> None:
    served = language_model()
    one, two = sequence(served, 100, 4, clock), sequence(served, 100, 4, clock)
    worker = make_scheduler(clock, memory_budget=one.cache_bytes + one.cache_bytes // 2)  # room for one
    admitted(worker, one, two)
    worker.iteration()
    assert one.status is Status.DECODING and two.status is Status.WAITING
    assert worker.memory.held == one.cache_bytes
    while not one.done:
        worker.iteration()
    assert two.status is Status.WAITING and worker.memory.held == 0  # released by the sweep that took one out
    worker.iteration()
    assert two.status is Status.DECODING and worker.memory.held == two.cache_bytes
    while not two.done:
        worker.iteration()
    assert worker.memory.held == 0 and worker.queue.in_flight == 0 and worker.queue.waiting == 0


def test_a_long_input_holds_its_memory_from_its_first_slice_and_waits_while_it_does_not_fit(clock) -> None:
    served = transducer_of(clock)
    worker = make_scheduler(clock, memory_budget=15_000, slice_ms=1.0)  # a long input's bytes: its symbols
    first, second = job(served, 10_000, clock), job(served, 10_000, clock)
    admitted(worker, first, second)
    worker.iteration()
    assert ran(worker, "slice") == [first] and worker.memory.held == 10_000  # the second does not fit beside it
    assert first.status is Status.SLICING and second.status is Status.WAITING
    while not first.done:
        worker.iteration()
    assert second not in ran(worker, "slice")
    worker.iteration()
    assert ran(worker, "slice")[-1] is second and worker.memory.held == 10_000


def test_the_queue_refuses_with_429_when_full_and_413_what_it_could_never_hold(tmp_path) -> None:
    engine = Engine(Settings(models=tmp_path, max_waiting=2), ServerMetrics())  # not started: admission alone
    engine.state = "ready"
    times = [RequestTimes("m") for _ in range(3)]
    with pytest.raises(InputTooLarge, match="holds at most 2"):
        engine._admit(times)  # three sequences: never
    engine._admit(times[:2])
    with pytest.raises(Overloaded, match="the queue is full"):
        engine._admit(times[2:])  # one more: not now
    engine.queue.scheduled()  # one leaves the queue for the engine
    engine._admit(times[2:])
    assert (engine.queue.waiting, engine.in_flight) == (2, 3)


# --- prefill ---------------------------------------------------------------------------------------------------


def test_the_prefill_token_budget_is_split_in_fair_order_and_a_cut_chunk_is_rounded_down(clock) -> None:
    """100 tokens an iteration for two 80-token prompts: the first takes its whole prompt, the second what is left,
    20, rounded down to a power of two (a chunk cut short of its prompt's end: ``PREFILL_QUANTUM``)."""
    served = language_model()
    worker = make_scheduler(clock, prefill_chunk_tokens=100)
    first, second = sequence(served, 80, 4, clock), sequence(served, 80, 4, clock)
    admitted(worker, first, second)
    plan = worker.plan(time.monotonic(), clock.now)  # they are admitted and prefilled in the same iteration
    assert plan.admitted == [first, second]
    assert [(group.sequences, group.length) for group in plan.prefill] == [([first], 80), ([second], 16)]
    assert [each.joining for each in plan.decode] == [[first]]  # the chunk that completes its prompt


def short_beside_long(clock) -> tuple[Scheduler, Sequence, Sequence]:
    """A scheduler that has prefilled a 2,000-token prompt for 8 iterations, and a short one just admitted beside it."""
    served = language_model(tokens_per_slice=64)
    worker = make_scheduler(clock)
    long = sequence(served, 2000, 1, clock)
    admitted(worker, long)
    for _ in range(8):
        worker.iteration()
    short = sequence(served, 8, 4, clock)
    admitted(worker, short)
    return worker, long, short


def test_a_long_prompt_yields_to_a_short_one_for_no_longer_than_its_last_round(clock) -> None:
    worker, long, short = short_beside_long(clock)
    groups = worker.plan(time.monotonic(), clock.now).prefill
    assert [group.sequences for group in groups] == [[short]]  # served 8 rounds more than the short one: it yields
    clock.advance(long.prefill_resumes_at - clock.now)
    assert [group.sequences for group in worker.plan(time.monotonic(), clock.now).prefill] == [[short], [long]]


def test_a_long_prompt_yields_to_a_short_one_admitted_into_its_decode_batch(clock) -> None:
    """Under batch invariance a short prompt runs in its decode batch from the iteration that admits it: it is running
    then, so the long prompt yields to it in that iteration already, not after one more round of its own."""
    worker, _long, short = short_beside_long(clock)
    with cpu_decode.row_invariance():
        plan = worker.plan(time.monotonic(), clock.now)
    assert plan.admitted == [short] and [row for each in plan.decode for row in each.prompting] == [short]
    assert plan.prefill == []


def longs_prefilling(clock, **settings) -> tuple[Scheduler, list[Sequence]]:
    """Five long prompts, each its own chunk call of 10 ms (five context classes: a round of one slice, 50 ms), 20
    iterations into their prefill, ``decode_steps`` 8."""
    served = language_model(tokens_per_slice=64)
    worker = make_scheduler(clock, **{"decode_steps": 8, **settings})
    longs = [sequence(served, 3000 << index, 1, clock) for index in range(5)]
    admitted(worker, *longs)
    for _ in range(20):
        worker.iteration()
    return worker, longs


def test_while_long_prompts_yield_a_short_request_decodes_several_steps_an_iteration(clock) -> None:
    """Five long prompts (each its own chunk call of 10 ms: a round of one slice, 50 ms) yield to a short request for
    as long as their last round took. Meanwhile decoding is all there is to do, so the short request runs up to
    ``decode_steps`` steps an iteration, as alone (with one step an iteration, its steps outlasted the yield); the
    run ends when the long prompts may resume, and the next iteration has their round, then the short one's steps
    while they yield again: each keeps half the engine."""
    worker, longs = longs_prefilling(clock)
    short = sequence(longs[0].served, 8, 20, clock)
    admitted(worker, short)
    counts = []
    for _ in range(2):
        prefilled, decoded, started = len(ran(worker, "prefill")), len(ran(worker, "decode")), clock.now
        worker.iteration()
        counts.append((len(ran(worker, "prefill")) - prefilled, len(ran(worker, "decode")) - decoded))
        assert clock.now == pytest.approx(started + SLICE_S + (0 if len(counts) == 1 else SLICE_S))
    assert counts == [(1, 4), (5, 5)]  # the short prompt's chunk and 4 steps; a round of the long ones and 5 steps
    assert clock.now == pytest.approx(min(long.prefill_resumes_at for long in longs))


def short_ends_beside_longs(clock, **settings) -> tuple[Scheduler, list[Sequence]]:
    """:func:`longs_prefilling`, yielding to a short request that ends 30 ms into their yield: its prompt's chunk and
    two steps."""
    worker, longs = longs_prefilling(clock, **settings)
    short = sequence(longs[0].served, 8, 3, clock)
    admitted(worker, short)
    worker.iteration()
    assert short.done and clock.now < min(long.prefill_resumes_at for long in longs)
    return worker, longs


def planned(worker: Scheduler) -> list[list[Sequence]]:
    return [group.sequences for group in worker.plan(time.monotonic(), worker.clock()).prefill]


def test_after_a_short_request_ends_long_prompts_keep_yielding_for_anticipate_ms(clock) -> None:
    """The client's next request, sent as the answer arrives, finds the engine free rather than a round begun; with no
    request the long prompts resume after ``anticipate_ms`` (10 ms)."""
    worker, longs = short_ends_beside_longs(clock)
    assert planned(worker) == []
    following = sequence(longs[0].served, 8, 3, clock)
    admitted(worker, following)
    assert planned(worker) == [[following]]
    worker, longs = short_ends_beside_longs(clock)
    clock.advance(0.01)
    assert planned(worker) == [[long] for long in longs]


def test_without_anticipation_long_prompts_resume_as_soon_as_the_short_request_ends(clock) -> None:
    worker, longs = short_ends_beside_longs(clock, anticipate_ms=0.0)
    assert planned(worker) == [[long] for long in longs]


def test_anticipation_never_outlasts_a_long_prompt_s_yield(clock) -> None:
    """However long ``anticipate_ms``, each long prompt keeps half the engine: it yields no longer than its last
    round."""
    worker, longs = short_ends_beside_longs(clock, anticipate_ms=1000.0)
    assert planned(worker) == []
    clock.advance(min(long.prefill_resumes_at for long in longs) - clock.now)
    assert planned(worker) == [[long] for long in longs]


def test_prompts_served_about_as_much_as_the_request_that_ended_do_not_wait_for_its_client(clock) -> None:
    """Many clients' prompts: one request ends that was served as much as the prompts were; they did not yield to
    it, and go on at once."""
    worker, longs = longs_prefilling(clock)
    other = sequence(longs[0].served, 8, 3, clock)
    other.service = max(long.service for long in longs)
    admitted(worker, other)
    for _ in range(10):
        worker.iteration()
        if other.done:
            break
    assert other.done and sorted(id(group[0]) for group in planned(worker)) == sorted(map(id, longs))


def test_while_every_prompt_yields_and_nothing_else_runs_the_worker_waits_for_work_not_in_a_busy_loop(clock) -> None:
    worker, _longs = short_ends_beside_longs(clock)
    started = time.monotonic()
    assert worker._receive()  # no work arrives: it returns when the anticipation ends (10 ms on the fake clock)
    assert time.monotonic() - started >= 0.009
    worker.inbox.put(STOP)
    assert not worker._receive()  # what arrives is taken


# --- prefill chunks at their depth (RegularGPT) --------------------------------------------------------------------

# text-regulargpt's shape (random weights: only its costs are read): C = 64, K = 4, so a chunk runs K blocks at each of
# 1 thick layer up to 64 positions, 2 up to 4,096, 3 up to 262,144.
TEXT_REGULARGPT = RegularGPTConfig(vocab_size=8192, d_model=128, n_heads=4, d_ff=512, chunk_size=64, thickness=4)
# Its cached path's fixed work as measured on a 2-core CPU (``measure_fixed_costs``: 18-29 and 13-27 million
# multiply-add equivalents), and a speed its chunks ran at there under load.
FIXED_COSTS = FixedCosts(block=2e7, layer_step=1.5e7)
SECONDS_PER_FLOP = 1.5e-10


def regulargpt(fixed: FixedCosts, seconds_per_flop: float = SECONDS_PER_FLOP) -> SimpleNamespace:
    """A served RegularGPT whose cached path does ``fixed`` work beyond its multiply-adds, at a measured speed."""
    model = RegularGPT(TEXT_REGULARGPT)
    model.fixed_costs = fixed
    budget = ModelBudget(model, ModelSpeed(seconds_per_flop), SLICE_S, memory_budget=2**40, max_job_seconds=1e9)
    tokenizer = load_tokenizer(BYTES_TOKENIZER, ".")
    return SimpleNamespace(id="text-regulargpt", model=model, budget=budget, tokenizer=tokenizer)


def first_chunks(served, at: int, prompt_tokens: int = 60_000) -> tuple[int, int]:
    """The planned first chunks of a prompt just admitted and of one prefilled up to ``at`` (``prefill_chunk_tokens``
    is the default 2,048: room for both), as (at its start, deep)."""
    worker = make_scheduler(FakeClock())
    start, deep = sequence(served, prompt_tokens, 1, worker.clock), sequence(served, prompt_tokens, 1, worker.clock)
    deep.prefilled, deep.cache = at, FakeCache()
    worker.prefilling.append(deep)
    admitted(worker, start)
    groups = worker.plan(time.monotonic(), 0.0).prefill
    lengths = {id(sequence): group.length for group in groups for sequence in group.sequences}
    return lengths[id(start)], lengths[id(deep)]


def test_a_regulargpt_chunk_deep_in_a_long_prompt_is_planned_shorter_and_within_its_slice() -> None:
    """A chunk's fixed work grows with the thick layers it reaches (3 from 4,096 tokens, against 1 for a first chunk
    of 64), so a chunk 50,000 tokens into a prompt is planned shorter than its first chunk, and both are estimated
    within one slice with that work counted. Sized from multiply-adds alone (what the plan knew before), the deep
    chunk was as long as the first one, and its work overran the slice by 40%."""
    served = regulargpt(FIXED_COSTS)
    at_start, deep = first_chunks(served, at=50_000)
    assert deep < at_start
    seconds = served.budget.speed.seconds
    assert seconds(served.model.prefill_cost(1, at_start, 0).flops) <= SLICE_S
    assert seconds(served.model.prefill_cost(1, deep, 50_000).flops) <= SLICE_S

    at_start, deep = first_chunks(regulargpt(FixedCosts()), at=50_000)
    assert deep == at_start
    assert seconds(served.model.prefill_cost(1, deep, 50_000).flops) > 1.3 * SLICE_S


def test_where_a_pass_s_fixed_work_fills_the_slice_a_deep_chunk_runs_as_the_decode_steps_that_fit() -> None:
    """Twice as slow, a pass 50,000 tokens deep does more fixed work (12 block passes) than a slice holds; under batch
    invariance a chunk of up to 8 tokens runs as decode steps, whose fixed work is a layer step per thick layer, and
    the plan takes as many steps as fit, which is what its call is charged (``prefill_call_cost``)."""
    served = regulargpt(FIXED_COSTS, seconds_per_flop=2 * SECONDS_PER_FLOP)
    seconds = served.budget.speed.seconds
    assert seconds(served.model.prefill_cost(1, 2, 50_000).flops) > SLICE_S
    with cpu_decode.row_invariance():
        _, deep = first_chunks(served, at=50_000)
        chunk = sequence(served, 60_000, 1, FakeClock())
        chunk.prefilled = 50_000
        assert 1 < deep <= STEPPED_PREFILL_TOKENS
        charged = [seconds(prefill_call_cost([chunk], steps).flops) for steps in (deep, deep + 1)]
        assert charged[0] <= SLICE_S < charged[1]


# --- cancellation and drain -------------------------------------------------------------------------------------


def test_a_request_cancelled_mid_slice_runs_no_further_slice_and_releases_its_memory(clock) -> None:
    served = transducer_of(clock)
    worker = make_scheduler(clock, slice_ms=1.0)
    long = job(served, 10_000, clock)
    admitted(worker, long)
    worker.iteration()
    assert ran(worker, "slice") == [long] and worker.memory.held == 10_000
    long.cancelled = True  # the client went away during that slice
    worker.iteration()
    assert ran(worker, "slice") == [long] and long.finish_reason == "abort" and long.mailbox.items == []
    assert worker.memory.held == 0 and not worker.long and worker.queue.in_flight == 0 and worker.fair.service == {}


def test_a_cancelled_sequence_leaves_its_decode_batch(clock) -> None:
    served = language_model()
    worker = make_scheduler(clock)
    leaving, staying = sequence(served, 10, 100, clock), sequence(served, 10, 100, clock)
    admitted(worker, leaving, staying)
    worker.iteration()
    assert ran(worker, "decode")[-1] == [leaving, staying]
    leaving.cancelled = True
    worker.iteration()
    assert ran(worker, "decode")[-1] == [staying] and leaving.finish_reason == "abort"
    assert worker.memory.held == staying.cache_bytes and worker.queue.in_flight == 1


def test_drain_fails_everything_in_flight_and_stop_ends_the_loop(clock) -> None:
    """Past the drain timeout the engine posts AbortAll: every request, waiting or running, of either kind, ends with
    its error; the memory and the queue are empty after."""
    lm = language_model()
    transduce = transducer_of(clock)
    worker = make_scheduler(clock, max_running=1, slice_ms=1.0)
    running, waiting, long = sequence(lm, 10, 100, clock), sequence(lm, 10, 100, clock), job(transduce, 10_000, clock)
    admitted(worker, running, waiting, long)
    worker.iteration()
    assert (running.status, waiting.status, long.status) == (Status.DECODING, Status.WAITING, Status.SLICING)
    error = Unavailable("draining took too long")
    assert worker.take([AbortAll(error)])
    for work in (running, waiting, long):
        assert work.finish_reason == "error"
    assert running.mailbox.items[-1][1] == (0, error) and long.mailbox.items[-1][1] is error
    assert worker.memory.held == 0 and worker.queue.in_flight == 0 and worker.queue.waiting == 0
    assert not worker.take([STOP])


def test_a_sequence_that_ends_at_its_first_decode_step_stays_finished(clock) -> None:
    """It joins its decode batch and ends in the same step: joining must not bring it back (it was stepped again and
    finished twice, and its request stopped reading before its other sequences' answers)."""
    served = language_model()
    worker = make_scheduler(clock)
    short, other = sequence(served, 10, 2, clock), sequence(served, 10, 5, clock)
    admitted(worker, short, other)
    worker.iteration()
    assert short.status is Status.FINISHED and short.finish_reason == "length"
    worker.iteration()
    assert ran(worker, "decode") == [[short, other], [other]]
    assert [type(event).__name__ for _, (_, event) in short.mailbox.items] == ["Finished"]


def test_planning_changes_nothing(clock) -> None:
    """``plan`` decides the whole iteration from the scheduler's state alone: asked twice, it answers the same, and
    nothing moved (not the state cache's order either)."""
    lm, transduce = language_model(), transducer_of(clock)
    worker = make_scheduler(clock, max_running=2, slice_ms=1.0)
    work = [sequence(lm, 10, 100, clock), sequence(lm, 3000, 4, clock), sequence(lm, 10, 4, clock, "other")]
    admitted(worker, *work, job(transduce, 10_000, clock), job(transduce, 4, clock))
    worker.iteration()

    def state() -> tuple:
        return (
            worker.memory.held,
            dict(worker.fair.service),
            worker.queue.waiting,
            worker.jobs_waiting,
            worker.last_run_jobs,
            len(worker.short),
            len(worker.long),
            list(worker.waiting),
            list(worker.prefilling),
            dict(worker.decoding),
            [(each.status, each.service, each.prefilled, each.snapshot_at) for each in work],
        )

    def shape(plan) -> tuple:
        return (
            [(unit.items, unit.holds) for unit in plan.transduce.units],
            plan.admitted,
            [(group.sequences, group.length) for group in plan.prefill],
            [(each.key, each.batch, each.joining) for each in plan.decode],
        )

    before = state()
    plans = [shape(worker.plan(time.monotonic(), clock.now)) for _ in range(2)]
    assert plans[0] == plans[1] and state() == before
    # After one iteration of 1 ms slices (each fake call takes 10): the long input had a slice, and the short one comes
    # first now; the first two sequences were admitted (in arrival order: nothing had been charged yet), the first's
    # prompt prefilled and it decodes; there is no room for the third, and the second's prompt is next (1,000 tokens
    # a slice, rounded down to PREFILL_QUANTUM).
    transduce_units, admissions, prefill_groups, decode_work = plans[0]
    assert [len(items[0].tokens) for items, _ in transduce_units] == [4, 10_000]
    assert admissions == [] and prefill_groups == [([work[1]], 960)] and [each[2] for each in decode_work] == [[]]
    assert [each.status for each in work] == [Status.DECODING, Status.PREFILLING, Status.WAITING]


def test_an_admitted_sequence_is_planned_from_where_the_state_cache_lets_it_begin(clock) -> None:
    """A prompt whose first 60 tokens are in the state cache: its first chunk, planned before it starts, is the 40
    tokens after them (``start_point``), and that chunk completes its prompt, so it joins its decode step; the cache
    is only looked at (its entries' order kept) until the sequence starts."""
    served = language_model()
    worker = make_scheduler(clock)
    cache = StateCache(max_entries=4, max_bytes=2**20, min_tokens=8)
    cache.store(served.id, [65] * 60, FakeCache(), torch.zeros(4))
    cache.store(served.id, [66] * 60, FakeCache(), torch.zeros(4))
    worker.executor.state_cache = cache
    asked = sequence(served, 100, 4, clock)
    admitted(worker, asked)
    plan = worker.plan(time.monotonic(), clock.now)
    assert plan.admitted == [asked] and [(group.sequences, group.length) for group in plan.prefill] == [([asked], 40)]
    assert [each.joining for each in plan.decode] == [[asked]]
    assert [key[1][:8] for key in cache._entries] == [bytes(array("q", [65])), bytes(array("q", [66]))]
    assert cache.peek(served.id, [65] * 100) == 60 and cache.peek(served.id, [67] * 100) == 0
    assert cache.stats.queries == 0


# --- several decode steps an iteration ----------------------------------------------------------------------------


def decode_steps_by_iteration(worker: Scheduler, sequences: list[Sequence]) -> list[int]:
    """Iterate until ``sequences`` are done; the decode steps each iteration ran."""
    counts = []
    while not all(each.done for each in sequences):
        before = len(ran(worker, "decode"))
        worker.iteration()
        counts.append(len(ran(worker, "decode")) - before)
    return counts


def test_decoding_alone_runs_up_to_decode_steps_an_iteration_within_a_slice(clock) -> None:
    """While decoding is all there is to do, an iteration runs several steps: up to ``decode_steps``, and no more than
    about one slice of time (the fake steps take 10 ms; a slice is 50 ms)."""
    served = language_model()
    one = sequence(served, 10, 21, clock)
    worker = make_scheduler(clock, decode_steps=3)
    admitted(worker, one)
    assert decode_steps_by_iteration(worker, [one]) == [3] * 6 + [2]  # the prefill samples the first token
    two = sequence(served, 10, 21, clock)
    worker = make_scheduler(clock, decode_steps=100)
    admitted(worker, two)
    assert decode_steps_by_iteration(worker, [two]) == [5] * 4
    assert two.generated == [1] * 21 and [type(event) for _, (_, event) in two.mailbox.items] == [Finished]


def test_a_run_of_decode_steps_ends_when_anything_else_is_to_do(clock) -> None:
    """Work that arrives (in the inbox: a request, a cancellation, a stop string from the API process), or that
    waits or prefills, ends the run of steps at once: the next iteration admits and prefills it, as with one step an
    iteration."""
    served = language_model()
    decoding = sequence(served, 10, 40, clock)
    worker = make_scheduler(clock, decode_steps=8)
    admitted(worker, decoding)
    worker.iteration()
    late = sequence(served, 10, 40, clock)
    worker.queue.admit(1)
    step, calls = worker.executor.decode, []

    def arriving_during_the_second_step(work):
        calls.append(work)
        if len(calls) == 2:
            worker.inbox.put(late)
        return step(work)

    worker.executor.decode = arriving_during_the_second_step
    before = len(ran(worker, "decode"))
    assert worker._receive()
    worker.iteration()
    assert len(ran(worker, "decode")) - before == 2  # the step during which it came, then no more
    assert worker._receive()
    worker.iteration()
    assert ran(worker, "start")[-1] is late
    assert late.status is Status.DECODING  # prefilled (one chunk) and joined the batch in that iteration


def test_a_sequence_that_ends_or_is_cancelled_leaves_the_batch_between_two_steps_of_a_run(clock) -> None:
    """Between two steps of a run the sweep takes out what finished or whose client went away: the next step has
    one row fewer, its memory is released and it leaves the queue, before the iteration ends."""
    served = language_model()
    short, cancelled, long = (sequence(served, 30, tokens, clock) for tokens in (3, 30, 30))  # one context class
    worker = make_scheduler(clock, decode_steps=5)
    admitted(worker, short, cancelled, long)
    worker.iteration()  # prefill: each has its first token; then a run of steps
    rows = [len(batch) for _, batch in worker.executor.log if _ == "decode"]
    assert rows == [3, 3, 2, 2, 2]  # short ends at its third token, at the second step
    assert short.done and worker.queue.in_flight == 2 and worker.memory.held == 2 * short.cache_bytes
    step = worker.executor.decode

    def cancelling_after_one_step(work):
        result = step(work)
        cancelled.cancelled = True
        return result

    worker.executor.decode = cancelling_after_one_step
    worker.iteration()
    rows = [len(batch) for _, batch in worker.executor.log if _ == "decode"]
    assert rows[5:] == [2, 1, 1, 1, 1]
    assert cancelled.done and cancelled.status is Status.FINISHED and worker.queue.in_flight == 1


def test_a_sequence_waiting_for_room_does_not_end_a_run_until_a_row_ends(clock) -> None:
    """Waiting work that ``max_running`` keeps from starting leaves the run of steps going; a row that ends makes
    room, and the run stops there so that the next iteration admits it."""
    served = language_model()
    running, waiting = sequence(served, 10, 12, clock), sequence(served, 10, 4, clock)
    worker = make_scheduler(clock, decode_steps=8, max_running=1, slice_ms=1000.0)
    admitted(worker, running, waiting)
    steps = decode_steps_by_iteration(worker, [running])
    assert steps == [8, 3] and waiting.status is Status.WAITING  # 11 steps after the prefill's token, then room
    worker.iteration()
    assert waiting.status in (Status.DECODING, Status.FINISHED) and ran(worker, "start")[-1] is waiting
