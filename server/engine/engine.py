"""The engine: owns the served models and runs every model call on one worker thread, so that the event loop never waits
on torch. No HTTP here.

Admission (:class:`EngineFront`, on the event loop): 413 for more sequences than the queue can ever hold, 429 when
``max_waiting`` requests wait or arrive (counted from their headers), 503 while loading or draining. The worker thread
loads and measures the models, then runs the scheduler.
"""

from __future__ import annotations

import abc
import asyncio
import concurrent.futures
import contextvars
import logging
import queue
import threading
import time
from array import array
from collections.abc import AsyncIterator, Callable
from typing import Literal, TypeVar

import torch

from model.cuda_graphs import Decoder, capture_sizes, decoder_for
from model.ops.cpu import cpu_decode
from model.threads import set_threads
from server.engine.mailbox import Courier, Mailbox, Postman
from server.errors import APIError, Conflict, InputTooLarge, Overloaded, Unavailable, UnknownModel
from server.execution.generation import Finished, GenerationRequest, PromptScored, Sequence, TokenGenerated
from server.metrics import RequestTimes, ServerMetrics
from server.models.runtime import check_new_id
from server.models.store import LoadReport, ServedModel, failed_folder, load_models
from server.sched.batching import TransduceJob, TransduceOutput
from server.sched.costing import (
    DEFAULT_MEMORY_FRACTION,
    ModelBudget,
    ModelSpeed,
    available_memory,
    calibrate,
    has_constant_state,
)
from server.sched.scheduler import STOP, AbortAll, OnWorker, Scheduler
from server.sched.state_cache import StateCache
from server.sched.work import RequestQueue, Work
from server.settings import SHIPPED_CHECKPOINTS, Settings

logger = logging.getLogger(__name__)
T = TypeVar("T")

STOP_TIMEOUT_S = 1.0  # how long stopping waits for the worker to end its slice

EngineState = Literal["loading", "ready", "draining", "failed", "stopped", "unresponsive"]


class GenerationHandle:
    """The sequences of one request: ``events`` yields (sequence index, event) until all have finished, raising the
    :class:`APIError` that ends them; ``cancel`` stops them."""

    def __init__(self, count: int, mailbox: Mailbox, cancel: Callable[[], None]) -> None:
        self._mailbox, self._cancel = mailbox, cancel
        self._unfinished = count

    async def events(self) -> AsyncIterator[tuple[int, PromptScored | TokenGenerated | Finished]]:
        try:
            while self._unfinished:
                index, event = await self._mailbox.get()
                if isinstance(event, APIError):
                    self._unfinished = 0
                    raise event
                self._unfinished -= isinstance(event, Finished)
                yield index, event
        finally:
            self.cancel()

    def ready(self) -> bool:
        """Whether ``events`` would go on without waiting: an event is queued, or every sequence has finished."""
        return not self._unfinished or self._mailbox.pending()

    def cancel(self) -> None:
        """Stop generating (the client went away, or the answer is complete)."""
        self._cancel()


def _cancel_all(sequences: list[Sequence]) -> Callable[[], None]:
    def cancel() -> None:
        for sequence in sequences:
            sequence.cancelled = True

    return cancel


class Arrival:
    """A request counted in ``arriving`` from its headers; ``leave`` counts it out once, however often called."""

    def __init__(self, engine: EngineFront) -> None:
        self._engine: EngineFront | None = engine
        engine.arriving += 1

    def leave(self) -> None:
        if self._engine is not None:
            self._engine.arriving -= 1
            self._engine = None


_ARRIVAL: contextvars.ContextVar[Arrival | None] = contextvars.ContextVar("regularlm_arrival", default=None)


class EngineFront(abc.ABC):
    """What the API side asks of an engine, in process (:class:`Engine`) or in a child (``EngineClient``). Called on the
    event loop unless said otherwise."""

    def __init__(self, settings: Settings, metrics: ServerMetrics) -> None:
        self.settings, self.metrics = settings, metrics
        self.state: EngineState = "loading"
        self.detail: str | None = None  # why the state is not "ok", for /health
        self.models: dict[str, ServedModel] = {}  # replaced, never changed in place: readers need no lock
        self.runtime_ids: set[str] = set()  # the models added by POST /v1/models
        self.load_failures: list[str] = []  # "<path>: <reason>" per checkpoint folder skipped (model_store.LoadReport)
        self.queue = RequestQueue(settings.max_waiting)  # the scheduler's: what admission counts
        self.arriving = 0  # requests past their headers, not yet admitted or refused (``arrive``; the event loop's)

    def wait_loaded(self, timeout: float | None = None) -> None:
        """Block until loading has ended (ready or failed)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.state == "loading" and (deadline is None or time.monotonic() < deadline):
            time.sleep(0.01)

    def begin_drain(self) -> None:
        """Refuse new requests (503); requests in flight go on."""
        if self.state == "ready":
            self.state, self.detail = "draining", "shutting down"

    @property
    def in_flight(self) -> int:
        """Requests admitted and not finished."""
        return self.queue.in_flight

    def model(self, model_id: str) -> ServedModel:
        self.check_serving()
        try:
            return self.models[model_id]
        except KeyError:
            raise UnknownModel(model_id, sorted(self.models)) from None

    def check_serving(self) -> None:
        if self.state != "ready":
            why = f": {self.detail}" if self.detail else ""  # none while loading
            raise Unavailable(f"the server is {self.state}{why}", retry_after_s=self.settings.retry_after_s)

    @property
    def skipped_folders(self) -> list[str]:
        """The names (not paths) of the checkpoint folders skipped at load."""
        return [failed_folder(failure, self.settings.model_folders) for failure in self.load_failures]

    def arrive(self) -> Arrival:
        """Count a request to a queued endpoint from its headers until ``_admit`` or its end; raises :class:`Overloaded`
        (429) at once if the queue is full with the arriving ones. Event loop, in the request's context."""
        if self.queue.waiting + self.arriving >= self.queue.max_waiting:
            raise self._overloaded()
        arrival = Arrival(self)
        _ARRIVAL.set(arrival)
        return arrival

    def _admit(self, requests: list[RequestTimes]) -> None:
        arrival = _ARRIVAL.get()
        if arrival is not None:  # admitted or refused below: from here the queue counts it, or nothing does
            arrival.leave()
        self.check_serving()
        if len(requests) > self.settings.max_waiting:
            raise InputTooLarge(
                f"the request needs {len(requests)} sequences; the queue holds at most {self.settings.max_waiting} "
                "(REGULARLM_MAX_WAITING), so it could never be scheduled"
            )
        if not self.queue.admit(len(requests)):
            raise self._overloaded()
        self.metrics.queued(requests)

    def _overloaded(self) -> Overloaded:
        return Overloaded(
            f"the queue is full ({self.settings.max_waiting} requests waiting); retry later",
            retry_after_s=self.settings.retry_after_s,
        )

    @abc.abstractmethod
    def start(self) -> None:
        """Load the models and start serving (health says "loading" meanwhile)."""

    @abc.abstractmethod
    def add_warm_up(self, prepare: Callable[[ServedModel], None]) -> None:
        """Call ``prepare(served)`` for each loaded language model before the server reports ready. Before ``start``."""

    @abc.abstractmethod
    def abort_in_flight(self, message: str) -> None:
        """End every request in flight with a 503 carrying ``message``; running work stops at its next slice."""

    @abc.abstractmethod
    def stop(self, timeout: float = STOP_TIMEOUT_S) -> bool:
        """Stop serving; requests still queued are answered 503. Returns whether the engine ended within ``timeout``."""

    @abc.abstractmethod
    async def transduce(
        self, served: ServedModel, inputs: list[array[int]], all_outputs: bool, flow: str = ""
    ) -> list[TransduceOutput]:
        """Token ids of each input -> its labels. ``flow``: who asks (the scheduler's fairness key)."""

    @abc.abstractmethod
    def submit_generation(
        self, served: ServedModel, requests: list[GenerationRequest], flow: str = ""
    ) -> GenerationHandle:
        """Queue one sequence per request, all or none: 413, 429 or 503 raised at once."""

    @abc.abstractmethod
    async def add_model(self, served: ServedModel) -> ServedModel:
        """Serve a model compiled while serving (409 if the id is taken, 413 past ``runtime_models_max``, 503 unless
        ready)."""

    @abc.abstractmethod
    async def remove_model(self, model_id: str) -> None:
        """Stop serving a runtime model (404 unknown, 409 shipped); requests already running on it finish."""


class Engine(EngineFront):
    def __init__(
        self,
        settings: Settings,
        metrics: ServerMetrics,
        on_load_failed: Callable[[str], None] | None = None,
        on_ready: Callable[[], None] | None = None,
        postman: Courier | None = None,
        on_died: Callable[[str], None] | None = None,
    ) -> None:
        """``on_load_failed(message)``: called on the worker thread if no model loads; ``on_ready()``: on it once the
        models are measured, before any request is scheduled. ``postman``: what hands each iteration's answers over.
        ``on_died(message)``: on the worker thread if it ends on an exception while serving (nothing is scheduled
        after it)."""
        super().__init__(settings, metrics)
        self._on_load_failed, self._on_ready, self._on_died = on_load_failed, on_ready, on_died
        self.memory_budget = 0  # bytes running work may hold (server/sched/costing.py)
        self.state_cache = StateCache(
            settings.state_cache_entries,
            settings.state_cache_bytes,
            settings.state_cache_min_tokens,
            settings.state_cache_tail_tokens,
        )
        self._warm_ups: list[Callable[[ServedModel], None]] = []
        self._inbox: queue.SimpleQueue[object] = queue.SimpleQueue()
        self._postman: Courier = postman or Postman()
        self._thread = threading.Thread(target=self._run, name="regularlm-engine", daemon=True)

    # --- lifecycle ----------------------------------------------------------------------------------------

    def start(self) -> None:
        self._thread.start()

    def add_warm_up(self, prepare: Callable[[ServedModel], None]) -> None:
        self._warm_ups.append(prepare)

    def abort_in_flight(self, message: str) -> None:
        self._inbox.put(AbortAll(Unavailable(message, retry_after_s=self.settings.retry_after_s)))

    def stop(self, timeout: float = STOP_TIMEOUT_S) -> bool:
        self.begin_drain()
        if self._thread.is_alive():
            self._inbox.put(STOP)
            self._thread.join(timeout)
        if self.state != "failed":
            self.state = "stopped"
        return not self._thread.is_alive()

    # --- requests (event loop) ----------------------------------------------------------------------------

    async def transduce(
        self, served: ServedModel, inputs: list[array[int]], all_outputs: bool, flow: str = ""
    ) -> list[TransduceOutput]:
        mailbox = self._mailbox()
        job = TransduceJob(served, inputs, all_outputs, RequestTimes(served.id), mailbox, flow)
        self._admit([job.times])
        self._inbox.put(job)
        try:
            result = await mailbox.get()
        finally:
            job.cancelled = True
        if isinstance(result, APIError):
            raise result
        outputs: list[TransduceOutput] = result  # the job's answer: every input's output
        return outputs

    def submit_generation(
        self, served: ServedModel, requests: list[GenerationRequest], flow: str = ""
    ) -> GenerationHandle:
        mailbox = self._mailbox()
        sequences = [Sequence(served, request, mailbox, index, flow) for index, request in enumerate(requests)]
        self._admit([sequence.times for sequence in sequences])
        for sequence in sequences:
            self._inbox.put(sequence)
        return GenerationHandle(len(sequences), mailbox, _cancel_all(sequences))

    def _mailbox(self) -> Mailbox:
        assert isinstance(self._postman, Postman)
        return Mailbox(self._postman)

    async def add_model(self, served: ServedModel) -> ServedModel:
        """The worker thread measures and adds it between two iterations."""
        self.check_serving()
        return await self._on_worker(lambda: self.install(served))

    async def remove_model(self, model_id: str) -> None:
        self.check_serving()
        await self._on_worker(lambda: self.uninstall(model_id))

    async def _on_worker(self, work: Callable[[], T]) -> T:
        return await asyncio.wrap_future(self.call_on_worker(work))

    def call_on_worker(self, work: Callable[[], T]) -> concurrent.futures.Future[T]:
        """Run ``work`` on the worker thread between two iterations; its result or exception goes to the future."""
        done: concurrent.futures.Future[T] = concurrent.futures.Future()
        self._inbox.put(OnWorker(work, done))
        return done

    def put(self, work: Work) -> None:
        """Hand admitted work to the scheduler (in the engine process: what the API process admitted)."""
        self._inbox.put(work)

    # --- worker thread ------------------------------------------------------------------------------------

    def _run(self) -> None:
        """Worker thread: load, measure and warm up the models, then schedule until stopped; ``state`` becomes "ready"
        or "failed"."""
        started = time.monotonic()
        folders = self.settings.model_folders
        if not folders:
            self._fail(
                f"no model to serve: the shipped checkpoints are not at {SHIPPED_CHECKPOINTS} (the package is "
                "installed without them) and no folder was named (--models, REGULARLM_MODELS)"
            )
            return
        try:
            report = load_models(folders, self.settings.device)
        except Exception as error:  # e.g. an unreadable folder: reported like a folder that failed
            report = LoadReport({}, [f"{', '.join(map(str, folders))}: {type(error).__name__}: {error}"])
            logger.warning("skipped %s", report.failures[-1])
        self.models, self.load_failures = report.models, report.failures
        threads = torch.get_num_threads()
        torch_threads = set_threads(self.settings.torch_threads)
        logger.debug("model calls on %d torch thread(s)", torch_threads)
        serving = False
        try:
            obstacle = _batch_invariance_obstacle(self.models)
            if self.settings.batch_invariant is True and obstacle:
                raise ValueError(obstacle)
            # auto: on where it holds; true or false as asked (true where it cannot hold was refused above)
            invariant = obstacle is None if self.settings.batch_invariant == "auto" else self.settings.batch_invariant
            if self.settings.batch_invariant == "auto" and not invariant:
                logger.info("batch invariance: off: %s", obstacle)
            cpu_decode.set_row_invariant(invariant)  # before for_serving lays the weights out
            if self.models:
                self._measure()
            if not self.models:
                self._fail(
                    f"no model could be loaded from {', '.join(map(str, folders))}: " + "; ".join(self.load_failures)
                )
                return
            self.metrics.register_models(sorted(self.models))
            if self._on_ready is not None:
                self._on_ready()
            logger.debug("serving %s", ", ".join(sorted(self.models)))
            skipped = len(self.load_failures)
            logger.info(
                "%d models ready in %.0f s (%s, %d torch thread%s, batch invariance %s, %.0f MiB for running work)%s",
                len(self.models),
                time.monotonic() - started,
                next(iter(self.models.values())).model.device,
                torch_threads,
                "" if torch_threads == 1 else "s",
                "on" if invariant else "off",
                self.memory_budget / 2**20,
                f"; {skipped} skipped (the warnings above say why)" if skipped else "",
            )
            self.state, self.detail = "ready", None
            serving = True
            with torch.inference_mode():
                scheduler = Scheduler(
                    self.settings,
                    self.metrics,
                    self.state_cache,
                    self._inbox,
                    self._postman,
                    self.memory_budget,
                    self.queue,
                )
                scheduler.loop()
        except Exception as error:
            if serving:  # a fault of the engine's own code: the engine has died
                self._fail(f"the engine failed while serving: {type(error).__name__}: {error}", died=True)
            else:  # measuring the machine failed: nothing can be served safely
                self._fail(f"the server could not start: {type(error).__name__}: {error}")
        finally:
            torch.set_num_threads(threads)

    def _fail(self, detail: str, died: bool = False) -> None:
        """The engine fails with ``detail``: it could not start (``on_load_failed``), or (``died``) its worker ended on
        an exception while serving, logged with its traceback (``on_died``)."""
        logger.error(detail, exc_info=died)
        self.state, self.detail = "failed", detail
        notify = self._on_died if died else self._on_load_failed
        if notify is not None:
            notify(detail)

    def install(self, served: ServedModel) -> ServedModel:
        """Measure and serve a runtime model (on the worker thread: ``add_model``)."""
        check_new_id(served.id, self.models)
        if len(self.runtime_ids) >= self.settings.runtime_models_max:
            raise InputTooLarge(
                f"{len(self.runtime_ids)} runtime models are served, the most runtime_models_max allows; DELETE one "
                "first"
            )
        served.notes = served.model.for_serving()
        self._set_limits(served, calibrate(served.model))
        self.metrics.register_models([served.id])
        self.models = {**self.models, served.id: served}
        self.runtime_ids.add(served.id)
        logger.info("serving runtime model %s (%s)", served.id, served.config.architecture)
        return served

    def uninstall(self, model_id: str) -> None:
        """Stop serving a runtime model (on the worker thread: ``remove_model``)."""
        if model_id not in self.models:
            raise UnknownModel(model_id, sorted(self.models))
        if model_id not in self.runtime_ids:
            raise Conflict(
                f"model {model_id!r} is a shipped model, loaded when the server started; only models added "
                "with POST /v1/models can be deleted"
            )
        self.models = {key: served for key, served in self.models.items() if key != model_id}
        self.runtime_ids.discard(model_id)
        self.metrics.unregister_model(model_id)
        logger.info("stopped serving runtime model %s", model_id)

    def _decoder(self, served: ServedModel) -> Decoder:
        """Its decode step: CUDA graphs where they can be captured, else eager."""
        settings = self.settings
        decoder = decoder_for(served.model, capture_sizes(settings.max_running), settings.cuda_graphs)
        path = decoder.path
        if path.mode == "cuda_graphs":
            logger.debug("%s: decode step through CUDA graphs at batch sizes %s", served.id, list(path.batch_sizes))
        else:
            logger.debug("%s: eager decode step (%s)", served.id, path.reason)
        return decoder

    def _set_limits(self, served: ServedModel, speed: ModelSpeed) -> None:
        settings = self.settings
        max_job_seconds = settings.max_job_seconds
        if has_constant_state(served.model):
            max_job_seconds = settings.max_constant_state_job_seconds
        served.budget = ModelBudget(served.model, speed, settings.slice_ms / 1000, self.memory_budget, max_job_seconds)
        served.limits = served.budget.limits(served.kind, settings.max_input_symbols, settings.max_tokens)

    def _measure(self) -> None:
        """Measure each model (one that fails is dropped as a load failure), then set the memory budget and limits."""
        speeds = {}
        for served in list(self.models.values()):
            try:
                served.notes = served.model.for_serving()
                speeds[served.id] = calibrate(served.model)
                if served.kind == "generate":
                    served.decoder = self._decoder(served)
                    _warm_up(served)
                    for prepare in self._warm_ups:
                        prepare(served)
            except Exception as error:
                self.load_failures.append(f"{served.path}: measuring its speed failed: {type(error).__name__}: {error}")
                logger.warning("skipped %s", self.load_failures[-1])
                del self.models[served.id]
                continue
            for note in served.notes:
                logger.debug("%s: %s", served.id, note)
        if not self.models:
            return
        settings = self.settings
        device = next(iter(self.models.values())).model.device
        budget = settings.memory_budget_bytes
        if budget is None:
            budget = int(DEFAULT_MEMORY_FRACTION * available_memory(device)) - settings.state_cache_bytes
        self.memory_budget = max(0, budget)
        logger.debug("memory budget for running work: %.1f MiB", self.memory_budget / 2**20)
        for served in self.models.values():
            self._set_limits(served, speeds[served.id])


def _warm_up(served: ServedModel) -> None:
    """Run one prefill and one decode step and build the tokenizer's byte table, so that what is built on first use is
    built before the server is ready."""
    model = served.model
    with torch.inference_mode():
        cache = model.new_cache(batch_size=1)
        tokens = torch.zeros(1, 1, dtype=torch.long, device=model.device)  # (1, 1): id 0 exists in every model
        model(tokens, cache=cache)
        assert served.decoder is not None  # set just before (``_measure``)
        served.decoder.step(tokens[:, 0], cache)
    assert served.tokenizer is not None  # a language model is served with its tokenizer
    served.tokenizer.token_bytes(0)


# Language models whose decode step is row-wise through model/ops/cpu/cpu_decode.py's kernels where batch_invariant is
# on (tests/server/execution/test_sampling.py). The LSTM (nn.LSTM's products), the transformer (nn.Linear's, and attention over
# keys padded to the batch's longest row) and the diagonal LRNN are not.
ROW_INVARIANT_ARCHITECTURES = frozenset({"lrnn", "regulargpt"})


def _batch_invariance_obstacle(models: dict[str, ServedModel]) -> str | None:
    """Why ``batch_invariant`` cannot hold for these models, or None."""
    elsewhere = sorted(model_id for model_id, served in models.items() if served.model.device.type != "cpu")
    if elsewhere:
        return f"batch_invariant holds on the CPU only, and {', '.join(elsewhere)} run on another device"
    if not cpu_decode.kernel_available():
        return "batch_invariant needs the CPU kernels, and numba is not importable"
    others = sorted(
        f"{model_id} ({served.config.architecture}, {str(served.model.dtype).removeprefix('torch.')})"
        for model_id, served in models.items()
        if served.kind == "generate"
        and (served.config.architecture not in ROW_INVARIANT_ARCHITECTURES or served.model.dtype != torch.float32)
    )
    if others:
        return f"batch_invariant holds for float32 LRNN and RegularGPT language models only, not {', '.join(others)}"
    return None
