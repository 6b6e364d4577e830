"""The scheduler driven by hand, one iteration at a time, on a fake clock that the model calls advance by the work
they do: what runs when is then decided by the scheduler's rules alone, whatever the machine (no sleeps, no timing).
"""

from __future__ import annotations

import queue
from array import array
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace

import torch

from model.cuda_graphs import decoder_for
from model.serving import Cost
from server.engine.mailbox import Postman
from server.execution.generation import Finished, GenerationRequest, Sequence
from server.execution.sampling import SamplingParams
from server.metrics import RequestTimes, ServerMetrics
from server.models.store import ServedModel, load_served_model
from server.sched.batching import TransduceJob
from server.sched.costing import ModelBudget, ModelSpeed
from server.sched.scheduler import Scheduler
from server.sched.state_cache import StateCache
from server.settings import Settings


@dataclass
class FakeClock:
    now: float = 0.0

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


@dataclass
class Recorder:
    """A mailbox that keeps what is put into it, with the clock's time."""

    clock: FakeClock
    items: list[tuple[float, object]] = field(default_factory=list)

    def put(self, item: object) -> None:
        self.items.append((self.clock.now, item))

    def put_many(self, items: list[object]) -> None:
        for item in items:
            self.put(item)


class FakeTransducer:
    """A transducer whose calls cost ``FLOPS_PER_SYMBOL`` multiply-adds and one byte per symbol and take
    ``seconds_per_flop`` each on ``clock``: really that fast, whatever the speed the server measured at load. Its long
    inputs run in slices as ``SequenceModel.run_in_slices`` says (the slice fixed when the input starts; each slice
    reports the work it did)."""

    FLOPS_PER_SYMBOL = 1000
    device = torch.device("cpu")

    def __init__(self, clock: FakeClock, seconds_per_flop: float) -> None:
        self.clock, self.seconds_per_flop = clock, seconds_per_flop
        self.slices: list[float] = []  # the multiply-adds of every slice run

    def cost(self, path: str, rows: int, length: int, context: int = 0) -> Cost:
        return Cost(flops=rows * length * self.FLOPS_PER_SYMBOL, nbytes=rows * length)

    def slices_cost(self, length: int, all_outputs: bool, slice_flops: float, cost=None) -> Cost:
        return self.cost("final", 1, length)

    def final_logits(self, tokens: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        self.clock.advance(self.cost("final", *tokens.shape).flops * self.seconds_per_flop)
        return torch.zeros(tokens.shape[0], 2)  # (B, L)

    def run_in_slices(self, tokens: torch.Tensor, all_outputs: bool, slice_flops: float):
        done, length = 0, tokens.shape[1]
        while done < length:
            symbols = min(max(1, int(slice_flops) // self.FLOPS_PER_SYMBOL), length - done)
            flops = self.cost("final", 1, symbols).flops
            self.clock.advance(flops * self.seconds_per_flop)
            self.slices.append(flops)
            done += symbols
            yield float(flops)
        return torch.zeros(2), None


def transducer(model_id: str, model, measured_seconds_per_flop: float, slice_s: float = 0.05) -> SimpleNamespace:
    """A served transducer whose speed was measured (at load) as ``measured_seconds_per_flop``."""
    speed = ModelSpeed(measured_seconds_per_flop)
    budget = ModelBudget(model, speed, slice_s, memory_budget=2**40, max_job_seconds=1e9)
    return SimpleNamespace(id=model_id, model=model, budget=budget)


def transduce_job(served, length: int, clock: FakeClock, flow: str = "client") -> TransduceJob:
    inputs = [array("i", [position % 2 for position in range(length)])]
    return TransduceJob(served, inputs, False, RequestTimes(served.id), Recorder(clock), flow)


def language_model(folder: Path, clock: FakeClock, tokens_per_slice: int, slice_s: float = 0.05) -> ServedModel:
    """A served language model (eager decode steps) whose every call, prefill chunk or decode step, takes on
    ``clock`` the time its cost formula gives at the speed measured for it: a chunk of ``tokens_per_slice`` tokens
    at context 0 takes one slice."""
    served = load_served_model(folder, "cpu")
    model = served.model
    seconds_per_flop = slice_s / model.cost("cached", 1, tokens_per_slice).flops
    served.budget = ModelBudget(model, ModelSpeed(seconds_per_flop), slice_s, memory_budget=2**40, max_job_seconds=1e9)
    served.decoder = ClockedDecoder(decoder_for(model, [1], enabled=False), clock, seconds_per_flop)
    forward = model.forward

    def clocked_forward(tokens: torch.Tensor, cache=None, **options) -> torch.Tensor:
        if not served.decoder.stepping:  # a step that runs as a chunk of one token is counted once, as a step
            clock.advance(_call_seconds(model, tokens.shape, cache, seconds_per_flop))
        return forward(tokens, cache, **options)

    model.forward = clocked_forward
    return served


@dataclass
class ClockedDecoder:
    decoder: object
    clock: FakeClock
    seconds_per_flop: float
    stepping: bool = False

    @property
    def path(self):
        return self.decoder.path

    def step(self, tokens: torch.Tensor, cache) -> torch.Tensor:
        return self._clocked(self.decoder.step, tokens, cache)

    def greedy_step(self, tokens: torch.Tensor, cache) -> tuple[torch.Tensor, torch.Tensor]:
        return self._clocked(self.decoder.greedy_step, tokens, cache)

    def advance(self, tokens: torch.Tensor, cache) -> None:
        self._clocked(self.decoder.advance, tokens, cache)

    def _clocked(self, step, tokens: torch.Tensor, cache):
        self.clock.advance(_call_seconds(self.decoder.model, (tokens.shape[0], 1), cache, self.seconds_per_flop))
        self.stepping = True
        try:
            return step(tokens, cache)
        finally:
            self.stepping = False


def _call_seconds(model, shape: tuple[int, int], cache, seconds_per_flop: float) -> float:
    """A cached call over ``shape`` (rows, tokens) after the cache's longest row."""
    context = 0 if cache is None else int(cache.lengths.max())
    return model.cost("cached", shape[0], shape[1], context).flops * seconds_per_flop


def generation(
    served: ServedModel, prompt: str | list[int], max_tokens: int, clock: FakeClock, flow: str = "client", **sampling
) -> Sequence:
    """A sequence of a byte-level model (a text's bytes, or token ids); greedy unless ``sampling`` says otherwise."""
    ids = list(prompt.encode()) if isinstance(prompt, str) else prompt
    request = GenerationRequest(ids, max_tokens, SamplingParams(**{"temperature": 0.0, **sampling}))
    return Sequence(served, request, Recorder(clock), flow=flow)


def events(sequence: Sequence) -> list[object]:
    return [event for _, (_, event) in sequence.mailbox.items]


def run_until_done(worker: Scheduler, sequences: list[Sequence], iterations: int = 500) -> None:
    """Iterations until ``sequences`` are done; one that runs nothing (every prompt yields) lets 1 ms pass on the fake
    clock, as the real loop waits on its inbox meanwhile."""
    for _ in range(iterations):
        if all(sequence.done for sequence in sequences):
            return
        before = worker.clock()
        worker.iteration()
        if worker.clock() == before and isinstance(worker.clock, FakeClock):
            worker.clock.advance(0.001)
    raise AssertionError(f"not done after {iterations} iterations")


def finished_at(sequence: Sequence) -> float | None:
    """The clock's time at its Finished event, or None."""
    return next((when for when, (_, event) in sequence.mailbox.items if isinstance(event, Finished)), None)


def scheduler(clock: FakeClock, state_cache: StateCache | None = None, **settings) -> Scheduler:
    """A scheduler on ``clock`` (its state cache off unless given); transduce inputs are batched at once (no gathering
    window)."""
    settings = Settings(models=Path("unused"), **{"batch_wait_ms": 0.0, **settings})
    state_cache = StateCache(0, 0, 0) if state_cache is None else state_cache
    return Scheduler(settings, ServerMetrics(), state_cache, queue.SimpleQueue(), Postman(), 2**40, clock=clock)


def receive(worker: Scheduler, *work: object) -> None:
    """Hand ``work`` to the worker as if it had just arrived while it was busy (the worker does not run)."""
    worker.take(list(work))
