"""What the scheduler schedules (a :class:`TransduceJob` or a :class:`Sequence`): one status and one set of lifecycle
verbs (vLLM's ``RequestStatus``).

Admitted ``WAITING``; a sequence goes ``PREFILLING`` then ``DECODING``, a transduce request ``SLICING``; it ends
``FINISHED`` with "stop", "length", "abort" (no answer) or "error". The request's side only sets ``cancelled``; answers
wait in ``outbox`` until the scheduler's sweep hands them over (``emit``).
"""

from __future__ import annotations

import enum
import threading
from typing import Literal, Protocol

from server.errors import APIError
from server.metrics import RequestTimes, ServerMetrics

FinishReason = Literal["stop", "length", "abort", "error"]


class Recipient(Protocol):
    """Where a request's answers go at ``emit``: its ``Mailbox``, or in the engine process its ``RemoteMailbox``."""

    def put_many(self, items: list[object]) -> None: ...


class Status(enum.Enum):
    WAITING = "waiting"  # admitted, not scheduled yet
    PREFILLING = "prefilling"  # a sequence whose prompt goes through the model, chunk by chunk
    DECODING = "decoding"  # a sequence in its model's decode batch
    SLICING = "slicing"  # a transduce request whose batches and slices run
    FINISHED = "finished"  # ended: ``finish_reason`` says how


class Work:
    """A request's status, fairness (flow, service) and timestamps; subclasses say how an answer reaches the request
    (``deliver``)."""

    def __init__(self, times: RequestTimes, flow: str, mailbox: Recipient) -> None:
        self.times, self.mailbox = times, mailbox
        self.flow = flow  # who asked (the scheduler's fairness key)
        self.service = 0.0  # model seconds spent on it so far (the scheduler's fairness)
        self.status = Status.WAITING
        self.done = False  # status is FINISHED (an attribute, not a property: read for every row of every step)
        self.finish_reason: FinishReason | None = None
        self.cancelled = False  # set by the request's side when the client goes away
        self.outbox: list[object] = []  # the mailbox's next items, in order, until ``emit``

    def schedule(self, status: Status, metrics: ServerMetrics) -> None:
        """Move on to ``status``; leaving ``WAITING`` is its first scheduling. Finished work stays finished."""
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
    """The requests admitted and not finished, and those not scheduled yet (``waiting``); thread-safe."""

    def __init__(self, max_waiting: int) -> None:
        self.max_waiting = max_waiting
        self._lock = threading.Lock()
        self.waiting = 0
        self.in_flight = 0

    def admit(self, count: int) -> bool:
        """Count ``count`` new requests as waiting if all fit; False if not."""
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
        """Apply the engine process's queue movements to this copy."""
        with self._lock:
            self.waiting -= scheduled + finished_waiting
            self.in_flight -= finished_waiting + finished_running

    def clear(self) -> None:
        """Nothing is in flight any more (the engine process has gone)."""
        with self._lock:
            self.waiting = self.in_flight = 0
