"""The engine core in a process of its own (vLLM's EngineCoreProc): the in-process
:class:`~server.engine.engine.Engine`, run by :func:`main` in the child ``server/engine/client.py`` starts. Its main
thread (:class:`EngineCore`) turns the API process's messages into work, compiling constraints on a pool of their own so
that reading goes on; the worker's postman (:class:`StepWriter`) sends one :class:`~server.engine.wire.Step` per
iteration that answered anything. Sequences here carry token ids only.
"""

from __future__ import annotations

import collections.abc
import concurrent.futures
import functools
import json
import logging
import os
import pickle
import signal
import threading
import time
from array import array
from collections.abc import Callable
from dataclasses import replace
from multiprocessing.connection import Connection
from typing import Any

import safetensors.torch

from model.config import CheckpointConfig
from model.device import resolve_device
from model.registry import build_model
from server.api.protocol import StructuredOutputs
from server.engine.engine import Engine
from server.engine.wire import CONTROL, STEP, Finish, Step, StepColumns, encode_step, error_to_wire
from server.errors import ModelFailure
from server.execution.generation import Finished, GenerationRequest, PromptScored, Sequence, TokenGenerated
from server.metrics import RecordingMetrics, RequestTimes
from server.models.runtime import RUNTIME_PATH
from server.models.store import ServedModel, served_transducer
from server.sched.batching import TransduceJob
from server.sched.work import RequestQueue, Work
from server.settings import Settings
from server.structured.outputs import MAX_COMPILING, ConstraintCompiler, MaskBudget

logger = logging.getLogger(__name__)

HEARTBEAT_INTERVAL_S = 1.0
EXIT_DIED = 3  # the engine process's exit code when its worker ended on an exception while serving


class IdsOnly:
    """A sequence's text in the engine process: none (the API process makes it)."""

    def push(self, token: int) -> tuple[str, bool]:
        return "", False

    def whole_answer(self, tokens: list[int]) -> str:
        return ""

    def finish(self) -> str:
        return ""


class CoreSequence(Sequence):
    """A sequence of the engine process, whose tokens leave as ids."""

    def __init__(
        self, served: ServedModel, request: GenerationRequest, mailbox: RemoteMailbox, index: int, flow: str
    ) -> None:
        super().__init__(served, request, mailbox, index, flow)
        self.assembler = IdsOnly()


class RemoteMailbox:
    """A request's mailbox in the engine process: what its work emits goes into the current step."""

    def __init__(self, request: int, writer: StepWriter) -> None:
        self.request, self.writer = request, writer
        self.sequences: list[Sequence] = []  # a generation request's, for the ids of a whole answer's Finish

    def put_many(self, items: list[object]) -> None:
        self.writer.post_many(self, items)


class ReportingQueue(RequestQueue):
    """The engine's queue, whose movements the steps carry to the API process's copy."""

    def __init__(self, max_waiting: int) -> None:
        super().__init__(max_waiting)
        self._moved = [0, 0, 0]  # scheduled, finished while waiting, finished after being scheduled

    def scheduled(self) -> None:
        super().scheduled()
        self._moved[0] += 1

    def finished(self, was_scheduled: bool) -> None:
        super().finished(was_scheduled)
        self._moved[2 if was_scheduled else 1] += 1

    def add(self, count: int) -> None:
        """Count requests the API process admitted (no check: its copy counts at least as many)."""
        with self._lock:
            self.waiting += count
            self.in_flight += count

    def take(self) -> tuple[int, ...]:
        with self._lock:
            moved, self._moved = tuple(self._moved), [0, 0, 0]
        return moved


class StepWriter:
    """The engine process's postman: ``post_many`` (worker thread) fills the step, ``flush`` sends it if not empty."""

    def __init__(
        self, send: Connection, send_lock: threading.Lock, metrics: RecordingMetrics, request_queue: ReportingQueue
    ) -> None:
        self.send, self.send_lock, self.metrics, self.queue = send, send_lock, metrics, request_queue
        self._lock = threading.Lock()
        self._columns, self._step = StepColumns(), Step()

    def post_many(self, mailbox: RemoteMailbox, items: list[object]) -> None:
        with self._lock:
            columns, step = self._columns, self._step
            for item in items:
                if not isinstance(item, tuple):  # a transduce request's answer: its outputs or an error
                    if isinstance(item, Exception):
                        step.errors.append((mailbox.request, -1, item))
                    else:
                        assert isinstance(item, list)  # ``TransduceJob.deliver``: its outputs
                        step.transduced.append((mailbox.request, item))
                    continue
                index, event = item
                if type(event) is TokenGenerated:
                    columns.add(mailbox.request, index, event.token, event.logprob)
                elif isinstance(event, Finished):
                    sequence = mailbox.sequences[index]
                    tokens = list(sequence.generated) if sequence.plain else None
                    step.finished.append(
                        Finish(
                            mailbox.request,
                            index,
                            event.reason,
                            event.prompt_tokens,
                            event.completion_tokens,
                            event.cached_tokens,
                            tokens,
                        )
                    )
                elif isinstance(event, PromptScored):
                    step.scored.append((mailbox.request, index, event.logprobs))
                else:
                    step.errors.append((mailbox.request, index, event))

    def flush(self) -> None:
        figures = self.metrics.take()
        scheduled, finished_waiting, finished_running = self.queue.take()
        with self._lock:
            columns, step = self._columns, self._step
            self._columns, self._step = StepColumns(), Step()
        step.figures = figures
        step.scheduled, step.finished_waiting, step.finished_running = scheduled, finished_waiting, finished_running
        if not (
            len(columns)
            or step.scored
            or step.finished
            or step.errors
            or step.transduced
            or figures
            or scheduled
            or finished_waiting
            or finished_running
        ):
            return
        message = STEP + encode_step(columns, step)
        with self.send_lock:
            self.send.send_bytes(message)


class EngineCore:
    """The engine process's main thread: starts the engine, reports it ready, then reads messages until stopped or the
    API process is gone."""

    def __init__(self, settings: Settings, connection: Connection) -> None:
        self.settings, self.connection = settings, connection
        self.send_lock = threading.Lock()
        self.metrics = RecordingMetrics()
        self.queue = ReportingQueue(settings.max_waiting)
        self.writer = StepWriter(connection, self.send_lock, self.metrics, self.queue)
        self.engine = Engine(
            settings, self.metrics, on_ready=_freeze_startup_heap, postman=self.writer, on_died=_exit_died
        )
        self.engine.queue = self.queue
        self.constraints = ConstraintCompiler(
            settings.structured_max_chars, settings.structured_compile_timeout_s, MaskBudget.of(settings)
        )
        self.engine.add_warm_up(self._warm_up)
        # request id -> its work, until it ends or is cancelled
        self.requests: dict[int, collections.abc.Sequence[Work]] = {}
        self._cancelled: set[int] = set()  # requests cancelled while their constraint compiled
        self._lock = threading.Lock()  # ``requests`` and ``_cancelled``: this thread and the compile pool's
        self._compiles = concurrent.futures.ThreadPoolExecutor(MAX_COMPILING, thread_name_prefix="regularlm-compile")

    def _warm_up(self, served: ServedModel) -> None:
        assert served.tokenizer is not None  # warm-ups run for language models, which have their tokenizer
        self.constraints.vocabulary(served.tokenizer)

    def send(self, message: tuple[Any, ...]) -> None:
        data = CONTROL + pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
        with self.send_lock:
            self.connection.send_bytes(data)

    def run(self) -> None:
        self.engine.start()
        self.engine.wait_loaded()
        if self.engine.state != "ready":
            self.send(("failed", self.engine.detail, self.engine.load_failures))
            return
        self.send(("ready", [describe(served) for served in self.engine.models.values()], self.engine.load_failures))
        threading.Thread(target=self._beat, name="regularlm-heartbeat", daemon=True).start()
        while True:
            try:
                message = self.connection.recv()
            except (EOFError, OSError):  # the API process has gone
                break
            if message[0] == "stop":
                break
            self._guarded(message, functools.partial(self.handle, message))
        self.engine.stop()

    def _beat(self) -> None:
        """Send ("heartbeat", seconds the worker thread has not answered a no-op) every ``HEARTBEAT_INTERVAL_S``."""
        ping: concurrent.futures.Future[None] | None = None
        asked = time.monotonic()
        while True:
            time.sleep(HEARTBEAT_INTERVAL_S)
            if ping is None or ping.done():
                ping, asked = self.engine.call_on_worker(lambda: None), time.monotonic()
                concurrent.futures.wait([ping], timeout=HEARTBEAT_INTERVAL_S / 2)
            waited = 0.0 if ping.done() else time.monotonic() - asked
            try:
                self.send(("heartbeat", waited))
            except OSError:  # the API process has gone
                return

    def handle(self, message: tuple[Any, ...]) -> None:
        kind = message[0]
        if kind == "generate":
            self.generate(*message[1:])
        elif kind == "transduce":
            self.transduce(*message[1:])
        elif kind == "cancel":
            self.cancel(message[1])
        elif kind == "stop_sequence":
            _, request, index = message
            works = self.requests.get(request)
            if works:
                sequence = works[index]
                self.engine.call_on_worker(lambda: sequence.finish("stop", self.metrics))
        elif kind == "add_model":
            self.add_model(*message[1:])
        elif kind == "remove_model":
            _, call, model_id = message
            self.reply(call, self.engine.call_on_worker(lambda: self.engine.uninstall(model_id)))
        elif kind == "abort_all":
            self.engine.abort_in_flight(message[1])

    def generate(
        self,
        request: int,
        model_id: str,
        requests: list[GenerationRequest],
        specs: list[str | None],
        flow: str,
        arrival: float,
    ) -> None:
        """A generation request's sequences; constraints are compiled on the compile pool, so that reading goes on
        meanwhile."""
        if all(spec is None for spec in specs):
            self._generate(request, model_id, requests, specs, flow, arrival)
            return
        with self._lock:
            self.requests[request] = []  # compiling: a cancellation meanwhile is remembered (``cancel``)
        message = ("generate", request, model_id, requests, specs, flow, arrival)
        self._compiles.submit(self._guarded, message, lambda: self._generate(*message[1:]))

    def _guarded(self, message: tuple[Any, ...], call: Callable[[], None]) -> None:
        """Handle ``message`` by ``call``: a request that cannot be handled fails (500), never the engine."""
        try:
            call()
        except Exception as error:
            logger.exception("the engine process could not handle a %r message", message[0])
            if message[0] in ("generate", "transduce"):
                self._refuse(message, error)

    def cancel(self, request: int) -> None:
        with self._lock:
            works = self.requests.pop(request, None)
            if works == []:  # still compiling: ``_admit`` cancels its work
                self._cancelled.add(request)
        for work in works or []:
            work.cancelled = True

    def _generate(
        self,
        request: int,
        model_id: str,
        requests: list[GenerationRequest],
        specs: list[str | None],
        flow: str,
        arrival: float,
    ) -> None:
        served = self.engine.models[model_id]
        mailbox = RemoteMailbox(request, self.writer)
        sequences: list[Sequence] = []
        for index, (each, spec) in enumerate(zip(requests, specs)):
            if spec is not None:
                assert served.tokenizer is not None  # a language model is served with its tokenizer
                constraint = self.constraints.compile_checked(
                    StructuredOutputs.model_validate_json(spec), served.tokenizer
                )
                each = replace(each, constraint=constraint)
            sequence = CoreSequence(served, each, mailbox, index, flow)
            sequence.times.arrival = arrival
            sequences.append(sequence)
        mailbox.sequences = sequences
        self._admit(request, sequences)

    def transduce(
        self, request: int, model_id: str, inputs: list[bytes], all_outputs: bool, flow: str, arrival: float
    ) -> None:
        served = self.engine.models[model_id]
        ids = []
        for data in inputs:
            tokens = array("i")
            tokens.frombytes(data)
            ids.append(tokens)
        times = RequestTimes(served.id, arrival)
        job = TransduceJob(served, ids, all_outputs, times, RemoteMailbox(request, self.writer), flow)
        self._admit(request, [job])

    def _refuse(self, message: tuple[Any, ...], error: Exception) -> None:
        """Answer a request that could not become work with a 500, counting it in and out of the queue."""
        _, request, model_id, payload = message[:4]
        count = len(payload) if message[0] == "generate" else 1
        with self._lock:
            self.requests.pop(request, None)
            self._cancelled.discard(request)
        failure = ModelFailure(f"the engine failed: {type(error).__name__}: {error}")

        def refuse() -> None:  # on the worker thread, whose step carries it (the metrics are recorded there)
            self.queue.add(count)
            for _ in range(count):
                self.queue.finished(was_scheduled=False)
                self.metrics.finished(RequestTimes(model_id, message[-1]), "error")
            self.writer.post_many(
                RemoteMailbox(request, self.writer), [(0, failure)] if message[0] == "generate" else [failure]
            )

        self.engine.call_on_worker(refuse)

    def _admit(self, request: int, works: collections.abc.Sequence[Work]) -> None:
        """Count the work into the queue and hand it to the worker."""
        self.queue.add(len(works))
        with self._lock:
            if request in self._cancelled:  # cancelled while its constraint compiled: the sweep ends it
                self._cancelled.discard(request)
                for work in works:
                    work.cancelled = True
            else:
                self.requests[request] = works
            if len(self.requests) > 2 * self.settings.max_waiting + self.settings.max_running:
                self._forget_finished()
        for work in works:
            self.engine.put(work)

    def _forget_finished(self) -> None:
        """Drop the requests whose work has all ended."""
        self.requests = {
            key: works for key, works in self.requests.items() if not works or not all(work.done for work in works)
        }

    def add_model(self, call: int, model_id: str, config_text: str, weights: bytes) -> None:
        config = CheckpointConfig.from_dict(json.loads(config_text))
        model = build_model(config.architecture, config.model)
        model.load_state_dict(safetensors.torch.load(weights), strict=True)
        model = model.to(resolve_device(self.settings.device)).eval()
        served = served_transducer(model_id, model, config, RUNTIME_PATH / model_id)
        self.reply(call, self.engine.call_on_worker(lambda: describe(self.engine.install(served))))

    def reply(self, call: int, done: concurrent.futures.Future[Any]) -> None:
        def answer(future: concurrent.futures.Future[Any]) -> None:
            error = future.exception()
            if error is None:
                self.send(("reply", call, True, future.result()))
            else:
                self.send(("reply", call, False, error_to_wire(error)))

        done.add_done_callback(answer)


def describe(served: ServedModel) -> dict[str, Any]:
    """What the API process needs of a served model: card, limits, notes, ``max_job_seconds``."""
    assert served.limits is not None and served.budget is not None  # set by the engine when it measured the model
    return {
        "id": served.id,
        "path": str(served.path),
        "card": served.card().model_dump(),
        "notes": list(served.notes),
        "limits": served.limits.as_dict(),
        "max_job_seconds": served.budget.max_job_seconds,
    }


def _freeze_startup_heap() -> None:
    from server.heap import freeze_startup_heap, tune_garbage_collector

    tune_garbage_collector()
    freeze_startup_heap()


def main(settings: Settings, connection: Connection) -> None:
    """The engine process's entry (spawned); it ignores Ctrl-C, which the API process handles, and runs
    ``settings.engine_niceness`` nicer than the API process."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    logging.basicConfig(
        level=settings.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s [engine]: %(message)s"
    )
    if settings.engine_niceness:
        niceness = os.nice(settings.engine_niceness)
        logger.debug("engine process at niceness %d", niceness)
    EngineCore(settings, connection).run()
    logging.shutdown()
    os._exit(0)  # not the interpreter's shutdown: a worker still in a model call would abort it


def _exit_died(detail: str) -> None:
    """The engine's worker ended on an exception while serving (logged): end the process, which the API process
    answers as any death of its engine (every request 503, ``python -m server`` exit code 3)."""
    logging.shutdown()
    os._exit(EXIT_DIED)
