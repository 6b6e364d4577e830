"""The engine: owns the served models and runs every model call on one worker thread, so that the event
loop (health, metrics, streaming) never waits on torch. No HTTP here.

Requests enter on the event loop through ``transduce`` and ``submit_generation``: a full queue
(``max_waiting`` requests not yet scheduled) is refused at once with :class:`Overloaded`, and nothing is
taken while loading or draining (:class:`Unavailable`). The worker thread loads the models, then runs the
scheduler loop (``server/scheduler.py``: batching and decoding policies).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import AsyncIterator, Callable
from typing import Literal

import torch

from server.batching import TransduceJob, TransduceOutput
from server.errors import APIError, Overloaded, Unavailable, UnknownModel
from server.generation import Finished, GenerationRequest, Sequence
from server.mailbox import Mailbox, Postman
from server.metrics import RequestTimes, ServerMetrics
from server.model_store import LoadReport, ServedModel, load_models
from server.scheduler import STOP, Scheduler
from server.settings import Settings
from server.state_cache import StateCache

logger = logging.getLogger(__name__)

EngineState = Literal["loading", "ready", "draining", "failed", "stopped"]


class GenerationHandle:
    """The sequences of one request; ``events`` yields (sequence index, event) until all have finished."""

    def __init__(self, sequences: list[Sequence], mailbox: Mailbox) -> None:
        self.sequences, self._mailbox = sequences, mailbox

    async def events(self) -> AsyncIterator[tuple[int, object]]:
        unfinished = len(self.sequences)
        try:
            while unfinished:
                index, event = await self._mailbox.get()
                if isinstance(event, APIError):
                    raise event
                unfinished -= isinstance(event, Finished)
                yield index, event
        finally:
            self.cancel()

    def cancel(self) -> None:
        """Stop generating (the client went away, or the answer is complete)."""
        for sequence in self.sequences:
            sequence.cancelled = True


class Engine:
    def __init__(
        self, settings: Settings, metrics: ServerMetrics, on_load_failed: Callable[[str], None] | None = None
    ) -> None:
        """``on_load_failed(message)`` is called on the worker thread if no model loads."""
        self.settings, self.metrics, self._on_load_failed = settings, metrics, on_load_failed
        self.state: EngineState = "loading"
        self.detail: str | None = None  # why the state is not "ok", for /health
        self.models: dict[str, ServedModel] = {}
        self.load_failures: list[str] = []
        self.state_cache = StateCache(
            settings.state_cache_entries, settings.state_cache_bytes, settings.state_cache_min_tokens
        )
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._postman = Postman()
        self._thread = threading.Thread(target=self._run, name="regularlm-engine", daemon=True)

    # --- lifecycle ----------------------------------------------------------------------------------------

    def start(self) -> None:
        """Load the models and start serving, on the worker thread (health says "loading" meanwhile)."""
        self._thread.start()

    def wait_loaded(self, timeout: float | None = None) -> None:
        """Block until loading has ended (ready or failed)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.state == "loading" and (deadline is None or time.monotonic() < deadline):
            time.sleep(0.01)

    def begin_drain(self) -> None:
        """Refuse new requests (503); requests in flight go on."""
        if self.state == "ready":
            self.state, self.detail = "draining", "shutting down"

    def stop(self, timeout: float = 10.0) -> None:
        """Stop the worker thread; requests still queued are answered 503."""
        self.begin_drain()
        if self._thread.is_alive():
            self._inbox.put(STOP)
            self._thread.join(timeout)
        if self.state != "failed":
            self.state = "stopped"

    # --- requests (event loop) ----------------------------------------------------------------------------

    def model(self, model_id: str) -> ServedModel:
        self.check_serving()
        try:
            return self.models[model_id]
        except KeyError:
            raise UnknownModel(model_id, sorted(self.models)) from None

    async def transduce(self, served: ServedModel, inputs: list[list[int]], all_outputs: bool) -> list[TransduceOutput]:
        """Token ids of each input -> its labels; batched with other requests' inputs."""
        job = TransduceJob(served, inputs, all_outputs, RequestTimes(served.id), Mailbox(self._postman))
        self._admit([job.times])
        self._inbox.put(job)
        try:
            result = await job.mailbox.get()
        finally:
            job.cancelled = True
        if isinstance(result, APIError):
            raise result
        return result

    def submit_generation(self, served: ServedModel, requests: list[GenerationRequest]) -> GenerationHandle:
        """Queue one sequence per request (all or none: a full queue raises :class:`Overloaded`)."""
        mailbox = Mailbox(self._postman)
        sequences = [Sequence(served, request, mailbox, index) for index, request in enumerate(requests)]
        self._admit([sequence.times for sequence in sequences])
        for sequence in sequences:
            self._inbox.put(sequence)
        return GenerationHandle(sequences, mailbox)

    def check_serving(self) -> None:
        if self.state != "ready":
            raise Unavailable(f"the server is {self.state}: {self.detail}", retry_after_s=self.settings.retry_after_s)

    def _admit(self, requests: list[RequestTimes]) -> None:
        self.check_serving()
        if not self.metrics.admit(requests, self.settings.max_waiting):
            raise Overloaded(
                f"the queue is full ({self.settings.max_waiting} requests waiting); retry later",
                retry_after_s=self.settings.retry_after_s,
            )

    # --- worker thread ------------------------------------------------------------------------------------

    def _run(self) -> None:
        try:
            report = load_models(self.settings.models, self.settings.device)
        except Exception as error:  # e.g. an unreadable folder: reported like a folder that failed
            report = LoadReport({}, [f"{self.settings.models}: {type(error).__name__}: {error}"])
        self.models, self.load_failures = report.models, report.failures
        if not self.models:
            self.state = "failed"
            self.detail = f"no model could be loaded from {self.settings.models}: " + "; ".join(report.failures)
            logger.error(self.detail)
            if self._on_load_failed is not None:
                self._on_load_failed(self.detail)
            return
        self.state, self.detail = "ready", None
        logger.info("serving %s", ", ".join(sorted(self.models)))
        threads = torch.get_num_threads()
        torch.set_num_threads(self.settings.torch_threads or threads)
        try:
            with torch.inference_mode():
                Scheduler(self.settings, self.metrics, self.state_cache, self._inbox, self._postman).loop()
        finally:
            torch.set_num_threads(threads)
