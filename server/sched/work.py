"""What the scheduler schedules, one status and one set of lifecycle verbs for both kinds (vLLM's ``RequestStatus``):
a /v1/transduce request (``server/sched/batching.py``'s :class:`TransduceJob`) and a generated sequence
(``server/execution/generation.py``'s :class:`Sequence`).

A request is admitted ``WAITING``. The scheduler moves it on: a sequence to ``PREFILLING`` when it is admitted
(its memory held), then to ``DECODING`` when its prompt is done and it joins its model's decode batch (a short
prompt that runs in the batch, ``server.execution.generation.prompt_in_batch``, joins it at once: its tokens are its first
steps); a transduce request to ``SLICING`` when its first batch or slice runs. It ends ``FINISHED`` with a reason:
"stop" or "length" (answered), "abort" (the client went away: no answer) or "error" (the answer is the error). The
request's side only sets ``cancelled``; the scheduler ends the work at its next pass. What a request is answered (a
transduce request's outputs or error, a sequence's events) waits in its ``outbox`` until the scheduler's sweep hands
it over (``emit``), once per step: the work never posts to its mailbox itself.

The queue that admission counts (:class:`RequestQueue`: 429 when full) belongs to the scheduler; the metrics only
observe the same transitions (``ServerMetrics.queued``, ``scheduled``, ``finished``).
"""

from __future__ import annotations

import enum
import threading
from typing import Literal, Protocol

from server.errors import APIError
from server.metrics import RequestTimes, ServerMetrics

FinishReason = Literal["stop", "length", "abort", "error"]


class Recipient(Protocol):
    """Where a request's answers go at ``emit``: its ``Mailbox`` (``server/engine/mailbox.py``), or in the engine
    process its ``RemoteMailbox`` (``server/engine/core.py``)."""

    def put_many(self, items: list[object]) -> None: ...


class Status(enum.Enum):
    WAITING = "waiting"  # admitted, not scheduled yet
    PREFILLING = "prefilling"  # a sequence whose prompt goes through the model, chunk by chunk
    DECODING = "decoding"  # a sequence in its model's decode batch
    SLICING = "slicing"  # a transduce request whose batches and slices run
    FINISHED = "finished"  # ended: ``finish_reason`` says how


class Work:
    """A request's status, its fairness (flow, service) and its timestamps. Subclasses say how an answer or an error
    reaches the request (``deliver``)."""

    def __init__(self, times: RequestTimes, flow: str, mailbox: Recipient) -> None:
        self.times, self.mailbox = times, mailbox
        self.flow = flow  # who asked (the scheduler's fairness key)
        self.service = 0.0  # model seconds spent on it so far (the scheduler's fairness)
        self.status = Status.WAITING
        self.done = False  # status is FINISHED (an attribute: read for every row of every step, ~6% of the engine's
        # thread as a property in a profile of 64 whole answers)
        self.finish_reason: FinishReason | None = None
        self.cancelled = False  # set by the request's side when the client goes away
        self.outbox: list[object] = []  # the mailbox's next items, in order, until ``emit``

    def schedule(self, status: Status, metrics: ServerMetrics) -> None:
        """Move on to ``status``; leaving ``WAITING`` is its first scheduling. Work that has finished stays finished
        (a sequence can end in the very call that its new status names: its first decode step)."""
        if self.done:
            return
        if self.status is Status.WAITING:
            metrics.scheduled(self.times)
        self.status = status

    def end(self, reason: FinishReason, metrics: ServerMetrics) -> bool:
        """Finish with ``reason``; False (and nothing) if it had finished already."""
        if self.done:
            return False
        self.status, self.finish_reason, self.done = Status.FINISHED, reason, True
        metrics.finished(self.times, reason)
        return True

    def abort(self, metrics: ServerMetrics) -> None:
        """End without an answer: the client went away."""
        self.end("abort", metrics)

    def fail(self, error: APIError, metrics: ServerMetrics) -> None:
        """End with ``error`` as the answer."""
        if self.end("error", metrics):
            self.deliver(error)

    def deliver(self, answer: object) -> None:
        """Answer the request (at the next ``emit``)."""
        self.outbox.append(answer)

    def emit(self) -> None:
        """Hand the request what it was answered since the last call, in one delivery."""
        if self.outbox:
            self.mailbox.put_many(self.outbox)
            self.outbox = []


class RequestQueue:
    """The requests admitted and not finished, and those of them not scheduled yet (``waiting``): the requests' side
    admits into it (the event loop), the scheduler takes out of it (the worker thread)."""

    def __init__(self, max_waiting: int) -> None:
        self.max_waiting = max_waiting
        self._lock = threading.Lock()
        self.waiting = 0
        self.in_flight = 0

    def admit(self, count: int) -> bool:
        """Count ``count`` new requests as waiting if the queue has room for all of them; False if it has not."""
        with self._lock:
            if self.waiting + count > self.max_waiting:
                return False
            self.waiting += count
            self.in_flight += count
            return True

    def scheduled(self) -> None:
        with self._lock:
            self.waiting -= 1

    def finished(self, was_scheduled: bool) -> None:
        with self._lock:
            self.waiting -= not was_scheduled
            self.in_flight -= 1

    def moved(self, scheduled: int, finished_waiting: int, finished_running: int) -> None:
        """The movements of the engine process's queue, on this copy (``server/engine/client.py``)."""
        with self._lock:
            self.waiting -= scheduled + finished_waiting
            self.in_flight -= finished_waiting + finished_running

    def clear(self) -> None:
        """Nothing is in flight any more (the engine process has gone)."""
        with self._lock:
            self.waiting = self.in_flight = 0
