"""The transduce batching policy (buckets, caps, slices), and batched results equal to one input at a time."""

from __future__ import annotations

import queue
import time
from array import array
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from model.checkpoint import load_checkpoint
from model.regulargpt.model import RegularGPT
from model.serving import Cost
from server.engine.mailbox import Postman
from server.errors import ModelFailure
from server.metrics import RequestTimes, ServerMetrics
from server.sched.batching import LongTransduce, TransduceJob, plan_batches, run_batch
from server.sched.costing import ModelBudget, ModelSpeed
from server.sched.scheduler import Scheduler
from server.sched.state_cache import StateCache
from server.settings import Settings
from tests.model.tiny_models import build_tiny
from tests.server.checkpoints import TRANSDUCERS
from tests.server.driven import FakeClock, FakeTransducer, receive, transduce_job, transducer
from tests.server.driven import scheduler as driven_scheduler


class CountingModel:
    """Costs one multiply-add per padded symbol."""

    def cost(self, path: str, rows: int, length: int, context: int = 0) -> Cost:
        return Cost(flops=rows * length, nbytes=0)

    def slices_cost(self, length: int, all_outputs: bool, slice_flops: float, cost=None) -> Cost:
        return self.cost("cached", 1, length)


def budget(model, slice_flops: float = 1e12) -> ModelBudget:
    """A budget whose slice is ``slice_flops`` multiply-adds (one second at a rate of 1 per second)."""
    return ModelBudget(model, ModelSpeed(1 / slice_flops), 1.0, memory_budget=2**40, max_job_seconds=1e9)


def job(model_id: str, lengths: list[int], all_outputs: bool = False, served=None) -> TransduceJob:
    served = served or SimpleNamespace(id=model_id, model=CountingModel(), budget=budget(CountingModel()))
    inputs = [array("i", [i % 2 for i in range(length)]) for length in lengths]
    return TransduceJob(served, inputs, all_outputs, RequestTimes(model_id), mailbox=None)


def shape(batches) -> list[list[int]]:
    return [[len(item.tokens) for item in batch] for batch in batches]


def test_buckets_by_power_of_two_length() -> None:
    items = job("m", [1, 3, 2, 9, 15, 4, 7, 8, 16]).items()
    assert shape(plan_batches(items, max_batch_size=64, max_batch_symbols=10_000)) == [
        [1],
        [2, 3],
        [4, 7],
        [8, 9, 15],
        [16],
    ]


def test_caps_on_rows_and_padded_symbols() -> None:
    items = job("m", [8] * 5 + [12, 15]).items()
    assert shape(plan_batches(items, max_batch_size=3, max_batch_symbols=10_000)) == [[8, 8, 8], [8, 8, 12], [15]]
    assert shape(plan_batches(items, max_batch_size=64, max_batch_symbols=30)) == [[8, 8, 8], [8, 8], [12, 15]]
    assert shape(plan_batches(job("m", [100]).items(), max_batch_size=64, max_batch_symbols=30)) == [[100]]


def test_a_batch_is_cut_where_its_call_would_outgrow_one_slice() -> None:
    served = SimpleNamespace(id="m", model=CountingModel(), budget=budget(CountingModel(), slice_flops=20))
    items = job("m", [4] * 6 + [30], served=served).items()
    assert [item.sliced for item in items] == [False] * 6 + [True]  # 30 symbols outgrow a slice of 20
    assert shape(plan_batches(items[:6], max_batch_size=64, max_batch_symbols=10_000)) == [[4] * 5, [4]]


def test_models_and_output_modes_never_share_a_batch() -> None:
    items = job("a", [5, 5]).items() + job("b", [5]).items() + job("a", [5], all_outputs=True).items()
    batches = plan_batches(items, max_batch_size=64, max_batch_symbols=10_000)
    assert sorted(len(batch) for batch in batches) == [1, 1, 2]
    for batch in batches:
        assert len({(item.job.served.id, item.job.all_outputs) for item in batch}) == 1


@pytest.mark.parametrize("model_id", sorted(TRANSDUCERS))
@pytest.mark.parametrize("all_outputs", [False, True])
def test_batched_results_equal_single_inputs(model_id: str, all_outputs: bool, checkpoints_dir: Path) -> None:
    loaded = load_checkpoint(checkpoints_dir / model_id, device="cpu")
    served = SimpleNamespace(id=model_id, model=loaded.model, budget=budget(loaded.model))
    lengths = [1, 2, 3, 5, 8, 13, 21, 34]
    batch = job(model_id, lengths, all_outputs, served).items()
    outputs = run_batch(batch)
    with torch.no_grad():
        for item, output in zip(batch, outputs):
            logits = loaded.model(torch.tensor([item.tokens.tolist()]))[0]  # (T, L)
            probs = logits.softmax(-1)
            assert output.final == int(probs[-1].argmax())
            assert output.confidence == pytest.approx(float(probs[-1].max()), abs=1e-5)
            assert output.labels == (logits.argmax(-1).tolist() if all_outputs else None)


@pytest.mark.parametrize("model_id", sorted(TRANSDUCERS))
def test_a_long_input_reports_the_work_of_each_slice(model_id: str, checkpoints_dir: Path) -> None:
    """Each slice of a causal model's long input returns the multiply-adds of its chunk (what the scheduler times
    it against), the last included; the call after it does no work and sets the output, the batched path's."""
    loaded = load_checkpoint(checkpoints_dir / model_id, device="cpu")
    model = loaded.model
    slice_flops = model.cost("cached", 1, 10).flops  # chunks of about ten symbols
    served = SimpleNamespace(id=model_id, model=model, budget=budget(model, slice_flops=slice_flops))
    (item,) = job(model_id, [95], served=served).items()
    long, reported = LongTransduce(item), []
    while long.output is None:
        reported.append(long.advance())
    assert reported[-1] == 0.0
    # outputs "final": the shrinking path's pieces (tests/model/regulargpt/test_regulargpt.py)
    if isinstance(model, RegularGPT):
        whole = model.cost("final", 1, 95).flops
        assert len(reported) > 3 and whole <= sum(reported) <= 2 * whole
        assert all(flops <= slice_flops * (1 + 1e-9) for flops in reported)
    else:
        chunks, position = [], 0
        while position < 95:
            chunks.append(model.chunk_length(slice_flops, position, 95 - position))
            position += chunks[-1]
        assert len(chunks) > 5
        assert reported[:-1] == [
            model.cost("cached", 1, chunk, start).flops
            for chunk, start in zip(chunks, [sum(chunks[:index]) for index in range(len(chunks))])
        ]
    (whole,) = run_batch(job(model_id, [95], served=served).items())
    assert long.output.final == whole.final and long.output.confidence == pytest.approx(whole.confidence, abs=1e-5)


class ArrivingWhileBlocked(queue.SimpleQueue):
    """An inbox that is empty when the worker looks at it and gets ``jobs``, together, as the worker blocks on it:
    requests that reach an idle server (no thread, no timer)."""

    def __init__(self, *jobs: TransduceJob) -> None:
        super().__init__()
        self.arriving = list(jobs)

    def get(self, block: bool = True, timeout: float | None = None) -> object:
        for arriving in self.arriving:
            self.put(arriving)
        self.arriving = []
        return super().get(block, timeout)


def scheduler(*arriving: TransduceJob) -> Scheduler:
    """A scheduler with a 50 ms gathering window, idle, to which ``arriving`` will come."""
    settings = Settings(models=Path("unused"), batch_wait_ms=50.0)
    inbox = ArrivingWhileBlocked(*arriving)
    return Scheduler(settings, ServerMetrics(), StateCache(0, 0, 0), inbox, Postman(), 2**30)


def test_a_lone_request_at_an_idle_server_runs_without_waiting() -> None:
    worker = scheduler(job("m", [5]))
    assert worker._receive() and worker.jobs_waiting == 1
    assert worker.gather_window() == 0.0


def test_the_window_is_kept_under_concurrent_load() -> None:
    together = scheduler(job("m", [5]), job("m", [6]))  # two requests at once
    together._receive()
    assert together.gather_window() == 0.05
    while_busy = scheduler()
    while_busy.inbox.put(job("m", [5]))  # it arrived while the previous batch ran
    while_busy._receive()
    assert while_busy.gather_window() == 0.05
    after_a_shared_run = scheduler(job("m", [5]))
    after_a_shared_run.last_run_jobs = 3  # their clients are about to send their next requests
    after_a_shared_run._receive()
    assert after_a_shared_run.gather_window() == 0.05


def test_context_costs_go_through_the_budgets_memo_as_the_speed_moves() -> None:
    """``context_cost`` is asked once per generated sequence, while the measured speed (and so the slice) moves with
    every timed call: its bisection goes through the budget's memo of the cost formulas, and answers as the
    formulas do."""
    model = build_tiny("lrnn-spectral-b2", 7, 0)
    formulas, calls = model.cost, []

    def counted(*args, **kwargs) -> Cost:
        calls.append(args)
        return formulas(*args, **kwargs)

    model.cost = counted
    model_budget = ModelBudget(model, ModelSpeed(1e-9), 0.05, memory_budget=2**40, max_job_seconds=1e9)
    model_budget.context_cost(1000)
    first = len(calls)
    for step in range(50):
        model_budget.speed.observe(1e8, 0.1 * (1 + step / 50))  # a timed call: the slice shrinks a little each time
        answer = model_budget.context_cost(1000 - step)
        # an O(1)-state model: its own length's multiply-adds, its context class's bytes (1023: the memo's key)
        assert answer.flops == formulas("cached", 1, 1000 - step).flops
        assert answer.nbytes == model.slices_cost(1023, False, model_budget.slice_flops, formulas).nbytes
    # 12 and 12 + one per new length here; through the formulas themselves 612
    assert first > 5 and len(calls) < 2 * first + 50


def test_long_inputs_in_turn_each_run_in_slices_beside_a_short_request() -> None:
    """Three long inputs in turn, each sent with a short request, on a model 4x faster than the speed measured at
    load. Each long input runs in slices and the short request waits for at most one of them; once
    each ends, the ledger holds nothing, no flow keeps a share, and the measured speed is the model's true one.
    (Timing each slice against the slice the speed gives now, not the work the slice did, sent the speed to 0:
    the second input then looked short and ran whole, 1 s, before the short request.)"""
    clock = FakeClock()
    model = FakeTransducer(clock, seconds_per_flop=1e-9)
    served = transducer("m", model, measured_seconds_per_flop=4e-9)  # a 50 ms slice: 12,500 symbols at first
    worker = driven_scheduler(clock)
    for turn in range(3):
        long, short = transduce_job(served, 1_000_000, clock), transduce_job(served, 4, clock)  # 1 s and 4 us
        sent, slices_before = clock.now, len(model.slices)
        receive(worker, long, short)
        assert [long_input.item.job for long_input in worker.long] == [long]  # sliced, not batched
        while not short.done:
            worker.iteration()
        answered_at = clock.now  # the end of the iteration that answered it: when its answer is handed over
        assert answered_at - sent <= 0.05 + 1e-3  # one slice of the long input at most
        assert not long.done and worker.memory.held == 1_000_000  # the long input's bytes, held while it runs
        while not long.done:
            worker.iteration()
        assert len(model.slices) - slices_before >= 20
        assert worker.memory.held == 0 and worker.fair.service == {} and not worker.long
        assert served.budget.speed.seconds_per_flop == pytest.approx(1e-9, rel=1e-3)


class RefusingLength7(FakeTransducer):
    """Fails any call that holds an input of 7 symbols."""

    def __init__(self, clock: FakeClock) -> None:
        super().__init__(clock, seconds_per_flop=1e-9)
        self.calls: list[int] = []  # rows of each call

    def final_logits(self, tokens: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        self.calls.append(tokens.shape[0])
        if bool((lengths == 7).any()):
            raise RuntimeError("7 symbols refused")
        return super().final_logits(tokens, lengths)


def test_a_batch_that_fails_fails_only_the_inputs_that_fail_alone() -> None:
    """Three requests batched together, one of which the model refuses: each input then runs
    alone, and the other two are answered."""
    clock = FakeClock()
    model = RefusingLength7(clock)
    served = transducer("m", model, measured_seconds_per_flop=1e-9)
    jobs = [transduce_job(served, length, clock) for length in (5, 7, 6)]  # one bucket, [4, 7]: one batch
    worker = driven_scheduler(clock)
    receive(worker, *jobs)
    worker.iteration()
    assert model.calls == [3, 1, 1, 1] and all(job.done for job in jobs)
    answers = [job.mailbox.items[0][1] for job in jobs]
    assert isinstance(answers[1], ModelFailure)
    assert answers[1].message == "the model failed on this input: 7 symbols refused"
    assert [len(answer) for answer in (answers[0], answers[2])] == [1, 1]  # the outputs of their one input


def test_a_request_that_came_during_a_slice_is_not_held_for_the_gathering_window() -> None:
    """The transduce gathering window counts from a request's arrival: one that came while a slice of a long input
    ran has waited that long already, and runs at the next iteration, ahead of the next slice (it waited two slices
    before)."""
    clock = FakeClock()
    served = transducer("m", FakeTransducer(clock, seconds_per_flop=1e-9), measured_seconds_per_flop=1e-9)
    worker = driven_scheduler(clock, batch_wait_ms=3.0)
    receive(worker, transduce_job(served, 1_000_000, clock))
    worker.iteration()  # the long input's first slice
    short = transduce_job(served, 4, clock)
    short.times.arrival -= 0.05  # it came during that slice
    sent = clock.now
    receive(worker, short)
    assert worker.plan(time.monotonic(), worker.clock()).transduce.units[0].items[0].job is short
    worker.iteration()
    assert short.done and clock.now - sent <= 0.05 + 1e-3


def test_a_slice_shorter_than_the_loop_itself_still_runs_one_unit_per_iteration() -> None:
    """With a slice shorter than the time the loop takes to order its units, each iteration still runs one (the
    transduce twin of prefill's rule of one group at least per iteration): here the clock moves by a slice at every
    reading."""
    clock = FakeClock()
    served = transducer("m", FakeTransducer(clock, seconds_per_flop=1e-9), measured_seconds_per_flop=1e-9)
    worker = driven_scheduler(clock, slice_ms=0.001)
    worker.clock = lambda: clock.advance(1e-6) or clock.now
    job = transduce_job(served, 4, clock)
    receive(worker, job)
    worker.iteration()
    assert job.done
