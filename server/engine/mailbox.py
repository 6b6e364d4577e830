"""Delivery from the engine's worker thread to requests waiting on the event loop: the sweep posts each request's
answers into its :class:`Mailbox`, and ``Postman.flush`` hands everything posted to each event loop in one call per
scheduler iteration.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from typing import Any, Protocol


class Courier(Protocol):
    """What the scheduler hands the answers over with, once per iteration: a :class:`Postman`, or in the engine
    process its ``StepWriter`` (``server/engine/core.py``)."""

    def flush(self) -> None: ...


class Postman:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._pending: list[tuple[Mailbox, Any]] = []

    def post_many(self, mailbox: Mailbox, items: list[Any]) -> None:
        """Post the items, in order, under one lock (what the scheduler's sweep hands a request at once)."""
        with self._lock:
            self._pending.extend((mailbox, item) for item in items)

    def flush(self) -> None:
        """Deliver what was posted, one event-loop call per loop; a closed loop has nobody left to read."""
        with self._lock:
            pending, self._pending = self._pending, []
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[Mailbox, Any]]] = {}
        for mailbox, item in pending:
            by_loop.setdefault(mailbox.loop, []).append((mailbox, item))
        for loop, deliveries in by_loop.items():
            with contextlib.suppress(RuntimeError):
                loop.call_soon_threadsafe(_deliver, deliveries)


def _deliver(deliveries: list[tuple[Mailbox, Any]]) -> None:
    for mailbox, item in deliveries:
        mailbox.queue.put_nowait(item)


class Mailbox:
    """A request's queue on its event loop; the worker thread puts into it through the postman."""

    def __init__(self, postman: Postman | None) -> None:
        """``postman``: None for a mailbox that is put into directly (``server/engine/client.py``)."""
        self.loop = asyncio.get_running_loop()
        self.queue: asyncio.Queue[Any] = asyncio.Queue()
        self._postman = postman

    def put_many(self, items: list[Any]) -> None:
        """Thread-safe; delivered, in order, at the postman's next flush."""
        assert self._postman is not None  # a mailbox without one is put into directly, never through here
        self._postman.post_many(self, items)

    async def get(self) -> Any:
        return await self.queue.get()

    def pending(self) -> bool:
        """Whether ``get`` would return at once (on the event loop's thread)."""
        return not self.queue.empty()
