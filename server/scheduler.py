"""The engine's worker loop: what runs when, on the one thread that calls the models.

Each iteration

1. takes new work from the inbox (blocking only when idle, or until the transduce gathering window ends);
2. runs the transduce batches once the oldest waiting input is ``batch_wait_ms`` old or ``max_batch_symbols``
   are waiting (policy: ``server/batching.py``); a batch runs to its end before decoding goes on, so a
   large transduce batch lengthens the inter-token latency of the sequences being decoded meanwhile. The
   window is skipped while requests come one at a time (``gather_window``);
3. drops sequences whose client went away, and schedules waiting ones, oldest first, up to ``max_running``;
4. prefills up to ``prefill_chunk_tokens`` prompt tokens, oldest sequence first (``server/generation.py``);
5. runs one decode step for every running sequence: one batched step per model when the caches stack (the
   LRNNs and the LSTM: O(1) states, any mix of lengths, ``server/cache_stacking.py``), one step per
   sequence otherwise (the transformer's KV cache and RegularGPT's windows depend on the length);
6. hands every event of the iteration to the event loop at once.

So decode steps are batched continuously: a sequence joins the batch the iteration after its prefill ends
and leaves it when it finishes. A model call that raises fails only the requests in that call.
"""

from __future__ import annotations

import logging
import queue
import time
from collections import deque

from server.batching import TransduceItem, TransduceJob, plan_batches, run_batch
from server.cache_stacking import can_stack
from server.errors import ModelFailure, Unavailable
from server.generation import Sequence, decode_step, prefill, prefill_length, start
from server.mailbox import Postman
from server.metrics import ServerMetrics
from server.settings import Settings
from server.state_cache import StateCache

logger = logging.getLogger(__name__)

STOP = object()  # put into the inbox to end the loop


class Scheduler:
    """The loop of the module docstring. Only the worker thread touches its state."""

    def __init__(
        self,
        settings: Settings,
        metrics: ServerMetrics,
        state_cache: StateCache,
        inbox: queue.SimpleQueue,
        postman: Postman,
    ) -> None:
        self.settings, self.metrics, self.state_cache, self.inbox, self.postman = (
            settings,
            metrics,
            state_cache,
            inbox,
            postman,
        )
        self.items: list[TransduceItem] = []
        self.first_item_at = 0.0
        self.jobs_waiting = 0  # transduce requests among ``items``
        self.first_job_found_idle = False  # the oldest of them woke an idle worker
        self.last_run_jobs = 0  # transduce requests served by the previous run
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []

    def loop(self) -> None:
        while self._receive():
            if self.items and self._transduce_due():
                self._run_transduce()
            self._schedule()
            self._prefill()
            self._decode()
            self.postman.flush()
        self._refuse_remaining()
        self.postman.flush()

    def _receive(self) -> bool:
        """Move new work from the inbox; False once asked to stop."""
        timeout: float | None = 0.0
        idle = not (self.running or self.waiting or self.items) and self.inbox.empty()  # new work will wake us
        if not (self.running or self.waiting):
            timeout = None if not self.items else max(0.0, self.first_item_at + self.gather_window() - time.monotonic())
        try:
            work = self.inbox.get(timeout=timeout) if timeout != 0.0 else self.inbox.get_nowait()
            while True:
                if work is STOP:
                    return False
                if isinstance(work, TransduceJob):
                    if not self.items:
                        self.first_item_at, self.first_job_found_idle = time.monotonic(), idle
                    self.items += work.items()
                    self.jobs_waiting += 1
                else:
                    self.waiting.append(work)
                work = self.inbox.get_nowait()
        except queue.Empty:
            return True

    def gather_window(self) -> float:
        """Seconds to gather transduce inputs after the oldest arrived: ``batch_wait_ms``, or 0 when requests come
        one at a time: a single request is waiting, it reached a worker with nothing else to do, and the previous
        run served a single request. A request that arrives while a batch runs (other clients are active), or
        after a run of several requests (their clients are about to send their next ones together), waits."""
        if self.jobs_waiting == 1 and self.first_job_found_idle and self.last_run_jobs <= 1:
            return 0.0
        return self.settings.batch_wait_ms / 1000

    def _transduce_due(self) -> bool:
        symbols = sum(len(item.tokens) for item in self.items)
        return (
            symbols >= self.settings.max_batch_symbols or time.monotonic() >= self.first_item_at + self.gather_window()
        )

    def _run_transduce(self) -> None:
        for item in self.items:
            if item.job.cancelled:
                item.job.abort(self.metrics)
        items = [item for item in self.items if not item.job.done]
        self.items, self.last_run_jobs, self.jobs_waiting = [], self.jobs_waiting, 0
        for item in items:
            if item.job.times.scheduled is None:
                self.metrics.scheduled(item.job.times)
        for batch in plan_batches(items, self.settings.max_batch_size, self.settings.max_batch_symbols):
            started = time.perf_counter()
            try:
                outputs = run_batch(batch)
                self.metrics.model_executed(batch[0].job.served.id, time.perf_counter() - started)
            except Exception as error:
                logger.exception("transduce batch of %d inputs failed", len(batch))
                for item in batch:
                    item.job.fail(ModelFailure(f"the model failed on this batch: {error}"), self.metrics)
                continue
            for item, output in zip(batch, outputs):
                item.job.complete(item.index, output, self.metrics)

    def _schedule(self) -> None:
        for sequence in [*self.waiting, *self.running]:
            if sequence.cancelled and not sequence.done:
                sequence.abort(self.metrics)
        self.waiting = deque(sequence for sequence in self.waiting if not sequence.done)
        self.running = [sequence for sequence in self.running if not sequence.done]
        while self.waiting and len(self.running) < self.settings.max_running:
            sequence = self.waiting.popleft()
            self._guarded([sequence], start, sequence, self.state_cache, self.metrics)
            self.running.append(sequence)

    def _prefill(self) -> None:
        """Chunks for the oldest prefilling sequences within the token budget, batched by equal length."""
        budget = self.settings.prefill_chunk_tokens
        groups: dict[tuple, list[Sequence]] = {}
        for sequence in [s for s in self.running if not s.generated and not s.done]:
            if budget <= 0:
                break
            length = prefill_length(sequence, budget)
            budget -= length
            groups.setdefault((*_batch_key(sequence), length), []).append(sequence)
        for (*_, length), group in groups.items():
            self._guarded(group, prefill, group, length, self.state_cache, self.metrics)

    def _decode(self) -> None:
        groups: dict[tuple, list[Sequence]] = {}
        for sequence in self.running:
            if sequence.generated and not sequence.done:
                groups.setdefault(_batch_key(sequence), []).append(sequence)
        for group in groups.values():
            self._guarded(group, decode_step, group, self.metrics)
        self.running = [sequence for sequence in self.running if not sequence.done]

    def _guarded(self, sequences: list[Sequence], call, *args) -> None:
        """Run a model call for ``sequences``; if it raises, only they fail."""
        started = time.perf_counter()
        try:
            call(*args)
            self.metrics.model_executed(sequences[0].served.id, time.perf_counter() - started)
        except Exception as error:
            logger.exception("a model call failed for %d sequence(s)", len(sequences))
            for sequence in sequences:
                if not sequence.done:
                    sequence.abort(self.metrics, ModelFailure(f"the model failed: {error}"))

    def _refuse_remaining(self) -> None:
        stopping = Unavailable("the server is shutting down")
        for item in self.items:
            item.job.fail(stopping, self.metrics)
        for sequence in [*self.waiting, *self.running]:
            if not sequence.done:
                sequence.abort(self.metrics, stopping)


def _batch_key(sequence: Sequence) -> tuple:
    """Sequences with equal keys run as one batch: one per model when their caches stack, else each alone."""
    return (sequence.served.id,) if can_stack(sequence.cache) else (sequence.served.id, id(sequence))
