"""The API process's side of an engine core in a child process (vLLM's EngineCoreClient): :class:`EngineClient`, an
``EngineFront`` like the in-process ``Engine``.

It starts the child, learns the served models from it (configs and tokenizers here, never weights), admits requests
against its copy of the queue and sends them from a writer thread through a queue bounded in bytes, so that the event
loop never blocks on the pipe. A reader thread hands each step message to the event loop, where token ids become text
and stop strings are found. A late heartbeat makes the engine "unresponsive" (503); a dead child answers everything in
flight 503 and calls ``on_engine_died``. Why: ``docs/serving.md``, "The engine in its own process".
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import logging
import multiprocessing
import pickle
import queue
import threading
import time
from array import array
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Literal, cast

import safetensors.torch

from model.base import SequenceModel
from model.checkpoint import read_config
from model.tokenizer import load_tokenizer
from server.api.protocol import ModelCard
from server.engine import core as engine_core
from server.engine.engine import STOP_TIMEOUT_S, EngineFront, GenerationHandle
from server.engine.mailbox import Mailbox
from server.engine.wire import CONTROL, STEP, Step, decode_step, error_from_wire
from server.errors import APIError, Unavailable
from server.execution.detokenize import TextAssembler
from server.execution.generation import Finished, GenerationRequest, PromptScored, TokenGenerated
from server.execution.sampling import TokenLogprob
from server.metrics import RequestTimes, ServerMetrics
from server.models.store import ServedModel, served_transducer
from server.sched.batching import TransduceOutput
from server.sched.costing import ModelBudget, ModelLimits
from server.settings import Settings
from server.structured.outputs import CompiledConstraint

logger = logging.getLogger(__name__)

SEND_BUFFER_BYTES = 256 * 2**20  # messages waiting for the writer thread; past it new requests get 503
WATCH_INTERVAL_S = 0.25  # how often the watcher thread looks at the engine's heartbeat
# The model of this process's copy of a model the engine process serves: none (no weights here; its card is the
# engine's, ``ServedModel.engine_card``, and nothing here calls the model). Typed as one: the copy is a ``ServedModel``.
NO_WEIGHTS = cast(SequenceModel, None)


@dataclass(frozen=True)
class EngineBudget:
    """What the API process knows of a model's budget: the longest computation one input may take."""

    max_job_seconds: float


class SequenceText:
    """One sequence's text in the API process: token ids decoded as they arrive, stop strings found."""

    def __init__(self, request: GenerationRequest, served: ServedModel) -> None:
        assert served.tokenizer is not None  # a language model is served with its tokenizer
        self.assembler = TextAssembler(served.tokenizer, request.stop)
        self.prompt_tokens = len(request.prompt)
        self.plain = request.whole_answer
        self.generated = 0
        self.stopped = False  # a stop string was found here: what the engine still sends is dropped

    def token(self, token: int, logprob: TokenLogprob | None) -> tuple[TokenGenerated, Finished | None]:
        """The token's event, and the sequence's Finished if the token completed a stop string."""
        self.generated += 1
        text, stopped = self.assembler.push(token)
        event = TokenGenerated(token, text, logprob)
        if not stopped:
            return event, None
        self.stopped = True
        return event, Finished("stop", self.assembler.finish(), self.prompt_tokens, self.generated, 0)

    def finished(
        self, reason: Literal["stop", "length"], completion_tokens: int, cached_tokens: int, tokens: list[int] | None
    ) -> Finished:
        text = self.assembler.whole_answer(tokens) if self.plain and tokens else self.assembler.finish()
        return Finished(reason, text, self.prompt_tokens, completion_tokens, cached_tokens)


class RemoteGeneration:
    """A generation request in flight: its handle's mailbox and its sequences' text."""

    def __init__(self, mailbox: Mailbox, sequences: list[SequenceText]) -> None:
        self.mailbox, self.sequences = mailbox, sequences
        self.unfinished = len(sequences)

    def put(self, index: int, event: object) -> None:
        self.mailbox.queue.put_nowait((index, event))


class EngineClient(EngineFront):
    def __init__(
        self,
        settings: Settings,
        metrics: ServerMetrics,
        on_load_failed: Callable[[str], None] | None = None,
        on_ready: Callable[[], None] | None = None,
        on_engine_died: Callable[[str], None] | None = None,
    ) -> None:
        """``on_load_failed(message)``: no model loaded; ``on_ready()``: the engine reported its models;
        ``on_engine_died(message)``: the engine process ended while serving. All called on the reader thread."""
        super().__init__(settings, metrics)
        self._on_load_failed, self._on_ready, self._on_engine_died = on_load_failed, on_ready, on_engine_died
        self._warm_ups: list[Callable[[ServedModel], None]] = []
        self._ids = itertools.count(1)
        self._generations: dict[int, RemoteGeneration] = {}
        self._transductions: dict[int, asyncio.Future[list[TransduceOutput]]] = {}
        self._calls: dict[int, asyncio.Future[object]] = {}
        self._outbox: queue.SimpleQueue[bytes | None] = queue.SimpleQueue()
        self._outbox_bytes = 0  # pickled bytes queued and not yet written
        self._outbox_lock = threading.Lock()
        self._last_heard = time.monotonic()  # when the engine process last sent anything
        self._worker_wait = 0.0  # the last heartbeat's wait for the engine's worker thread, seconds
        self._timed_out = False  # the requests in flight were answered 503 for the engine's silence
        self._stopping = False
        self._loop: asyncio.AbstractEventLoop | None = None
        context = multiprocessing.get_context("spawn")
        self._connection, child_connection = context.Pipe()
        self.process = context.Process(
            target=engine_core.main, args=(settings, child_connection), name="regularlm-engine-core", daemon=True
        )
        self._child_connection = child_connection
        self._reader = threading.Thread(target=self._read, name="regularlm-engine-reader", daemon=True)
        self._writer = threading.Thread(target=self._write, name="regularlm-engine-writer", daemon=True)
        self._watcher = threading.Thread(target=self._watch, name="regularlm-engine-watcher", daemon=True)

    # --- lifecycle ----------------------------------------------------------------------------------------

    def start(self) -> None:
        """Start the engine process (health says "loading" until it reports); on the event loop."""
        self._loop = asyncio.get_running_loop()
        self.process.start()
        self._child_connection.close()  # the child holds its end: its death closes the pipe
        self._reader.start()
        self._writer.start()
        self._watcher.start()

    @property
    def _running_loop(self) -> asyncio.AbstractEventLoop:
        """The event loop ``start`` ran on."""
        assert self._loop is not None  # set by start(), before any request or message
        return self._loop

    def add_warm_up(self, prepare: Callable[[ServedModel], None]) -> None:
        """Call ``prepare(served)`` for each language model here once the engine has reported them, before ready."""
        self._warm_ups.append(prepare)

    def abort_in_flight(self, message: str) -> None:
        self._send(("abort_all", message))

    def stop(self, timeout: float = STOP_TIMEOUT_S) -> bool:
        """Stop the engine process (it answers what is queued 503), terminating it past ``timeout``; returns whether it
        ended in time."""
        self.begin_drain()
        self._stopping = True
        if self.process.is_alive():
            self._send_quietly(("stop",))
            self.process.join(timeout)
        ended = not self.process.is_alive()
        if not ended:
            self.process.terminate()
            self.process.join(timeout)
        self._reader.join(timeout)
        self._outbox.put(None)
        if self.state != "failed":
            self.state = "stopped"
        return ended

    # --- requests (event loop) ----------------------------------------------------------------------------

    async def transduce(
        self, served: ServedModel, inputs: list[array[int]], all_outputs: bool, flow: str = ""
    ) -> list[TransduceOutput]:
        times = RequestTimes(served.id)
        self._admit([times])
        request = next(self._ids)
        answer: asyncio.Future[list[TransduceOutput]] = self._running_loop.create_future()
        self._transductions[request] = answer
        self._send(
            ("transduce", request, served.id, [tokens.tobytes() for tokens in inputs], all_outputs, flow, times.arrival)
        )
        try:
            return await answer
        finally:
            if self._transductions.pop(request, None) is not None:  # not answered: the client went away
                self._send_quietly(("cancel", request))

    def submit_generation(
        self, served: ServedModel, requests: list[GenerationRequest], flow: str = ""
    ) -> GenerationHandle:
        times = [RequestTimes(served.id) for _ in requests]
        self._admit(times)
        request = next(self._ids)
        mailbox = Mailbox(None)
        self._generations[request] = RemoteGeneration(mailbox, [SequenceText(each, served) for each in requests])
        specs = [_spec_json(each.constraint) for each in requests]
        # a request with stop strings gets its token ids as they come, streamed or not: the stop is found here
        sent = [replace(each, constraint=None, stream=each.stream or bool(each.stop)) for each in requests]
        self._send(("generate", request, served.id, sent, specs, flow, times[0].arrival))

        def cancel() -> None:
            if self._generations.pop(request, None) is not None:
                self._send_quietly(("cancel", request))

        return GenerationHandle(len(requests), mailbox, cancel)

    async def add_model(self, served: ServedModel) -> ServedModel:
        """Serve a runtime model: its config and safetensors weights go to the engine process."""
        self.check_serving()
        weights = safetensors.torch.save(
            {name: tensor.detach().cpu().contiguous().clone() for name, tensor in served.model.state_dict().items()}
        )
        description = await self._call("add_model", served.id, json.dumps(served.config.to_dict()), weights)
        assert isinstance(description, dict)  # the engine process's ``describe``
        _describe(served, description)
        self.metrics.register_models([served.id])
        self.models = {**self.models, served.id: served}
        self.runtime_ids.add(served.id)
        return served

    async def remove_model(self, model_id: str) -> None:
        self.check_serving()
        await self._call("remove_model", model_id)
        self.models = {key: served for key, served in self.models.items() if key != model_id}
        self.runtime_ids.discard(model_id)
        self.metrics.unregister_model(model_id)

    async def _call(self, kind: str, *arguments: object) -> object:
        call = next(self._ids)
        self._calls[call] = answer = self._running_loop.create_future()
        self._send((kind, call, *arguments))
        return await answer

    def _send(self, message: tuple[Any, ...], bounded: bool = True) -> None:
        """Queue ``message`` for the writer thread; 503 if the engine has failed or (``bounded``) ``SEND_BUFFER_BYTES``
        wait already."""
        if self.state == "failed":
            raise Unavailable(f"the server is failed: {self.detail}", retry_after_s=self.settings.retry_after_s)
        data = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
        with self._outbox_lock:
            if bounded and self._outbox_bytes + len(data) > SEND_BUFFER_BYTES:
                raise Unavailable(
                    f"the engine process is not reading its requests ({self._outbox_bytes} bytes wait to be sent)",
                    retry_after_s=self.settings.retry_after_s,
                )
            self._outbox_bytes += len(data)
        self._outbox.put(data)

    def _write(self) -> None:
        """The writer thread: sends the queued messages in order until stopped or the pipe closes."""
        while (data := self._outbox.get()) is not None:
            try:
                self._connection.send_bytes(data)
            except OSError:  # the engine process has gone: the reader thread reports it
                return
            with self._outbox_lock:
                self._outbox_bytes -= len(data)

    def _send_quietly(self, message: tuple[Any, ...]) -> None:
        """Send a cancellation or stop, ignoring a gone engine."""
        with contextlib.suppress(OSError, APIError):
            self._send(message, bounded=False)

    # --- the engine's messages (reader thread, then the event loop) -----------------------------------------

    def _read(self) -> None:
        try:
            while True:
                data = self._connection.recv_bytes()
                self._last_heard = time.monotonic()
                if data[:1] == STEP:
                    step = decode_step(data[1:])
                    self._running_loop.call_soon_threadsafe(self._apply_step, step)
                elif data[:1] == CONTROL:
                    self._control(pickle.loads(data[1:]))
        except (EOFError, OSError):  # the engine process has ended
            pass
        except RuntimeError:  # the event loop has closed: nobody is left to answer
            return
        if not self._stopping and self.state != "failed":  # not stopped, nor ended for want of a model
            self.process.join(1.0)
            self._died(f"the engine process exited (exit code {self.process.exitcode})")

    def _control(self, message: tuple[Any, ...]) -> None:
        kind = message[0]
        if kind == "heartbeat":
            self._worker_wait = message[1]
            if self.state == "unresponsive" and message[1] < self.settings.engine_timeout_s:
                logger.warning("the engine process responds again")
                self.state, self.detail, self._timed_out = "ready", None, False
        elif kind == "ready":
            self._ready(message[1], message[2])
        elif kind == "failed":
            self.load_failures = message[2]
            self.state, self.detail = "failed", message[1]
            if self._on_load_failed is not None:
                self._on_load_failed(message[1])
        elif kind == "reply":
            _, call, ok, payload = message
            self._running_loop.call_soon_threadsafe(_settle, self._calls.pop(call), ok, payload)

    def _ready(self, descriptions: list[dict[str, Any]], load_failures: list[str]) -> None:
        models = {}
        for description in descriptions:
            path = Path(description["path"])
            config = read_config(path)
            if config.kind == "transduce":
                served = served_transducer(description["id"], NO_WEIGHTS, config, path)
            else:
                assert config.tokenizer is not None  # a language model's config names its tokenizer
                tokenizer = load_tokenizer(config.tokenizer, path)
                served = ServedModel(description["id"], NO_WEIGHTS, config, path, tokenizer)
                for prepare in self._warm_ups:
                    prepare(served)
            _describe(served, description)
            models[served.id] = served
        self.models, self.load_failures = models, load_failures
        self.metrics.register_models(sorted(models))
        if self._on_ready is not None:
            self._on_ready()
        self.state, self.detail = "ready", None
        logger.debug("the engine process serves %s", ", ".join(sorted(models)))

    def _apply_step(self, step: Step) -> None:
        """One engine step's answers, on the event loop: prompt scores, tokens, finishes, errors, in that order."""
        self.metrics.replay(step.figures)
        self.queue.moved(step.scheduled, step.finished_waiting, step.finished_running)
        generations = self._generations
        for request, index, scores in step.scored:
            if (generation := generations.get(request)) is not None:
                generation.put(index, PromptScored(scores))
        logprobs = step.logprobs
        for row, (request, index, token) in enumerate(
            zip(step.token_requests.tolist(), step.token_indexes.tolist(), step.token_ids.tolist())
        ):
            generation = generations.get(request)
            if generation is None or generation.sequences[index].stopped:
                continue
            event, finished = generation.sequences[index].token(token, logprobs.get(row))
            generation.put(index, event)
            if finished is not None:
                self._finish(request, generation, index, finished)
                self._send_quietly(("stop_sequence", request, index))
        for finish in step.finished:
            generation = generations.get(finish.request)
            if generation is None or generation.sequences[finish.index].stopped:
                continue
            sequence = generation.sequences[finish.index]
            event = sequence.finished(finish.reason, finish.completion_tokens, finish.cached_tokens, finish.tokens)
            self._finish(finish.request, generation, finish.index, event)
        for request, index, error in step.errors:
            if index < 0:
                if (answer := self._transductions.pop(request, None)) is not None and not answer.done():
                    answer.set_exception(error)
            elif (generation := generations.get(request)) is not None:
                generation.put(index, error)  # its handle ends, and cancels the request's other sequences
        for request, outputs in step.transduced:
            if (answer := self._transductions.pop(request, None)) is not None and not answer.done():
                answer.set_result(outputs)

    def _finish(self, request: int, generation: RemoteGeneration, index: int, event: Finished) -> None:
        generation.put(index, event)
        generation.unfinished -= 1
        if not generation.unfinished:
            del self._generations[request]

    def _watch(self) -> None:
        """The watcher thread: :meth:`check_engine` every ``WATCH_INTERVAL_S`` until stopped."""
        while not self._stopping and self.state != "failed":
            time.sleep(WATCH_INTERVAL_S)
            self.check_engine(time.monotonic())

    def check_engine(self, now: float) -> None:
        """Watcher thread: "unresponsive" once the heartbeat is later than ``engine_heartbeat_timeout_s``; past
        ``engine_timeout_s`` of silence or a stuck worker, 503 for the requests in flight."""
        settings = self.settings
        if self.state not in ("ready", "unresponsive"):
            return
        silence = now - self._last_heard
        stuck = self._worker_wait + silence  # its worker has not turned for at least this long
        late = silence > settings.engine_heartbeat_timeout_s
        if self.state == "ready" and (late or stuck > settings.engine_timeout_s):
            why = f"no heartbeat for {silence:.1f} s" if late else f"its worker has not turned for {stuck:.0f} s"
            logger.error("engine not responding: %s", why)
            self.state, self.detail = "unresponsive", f"engine not responding: {why}"
        if stuck > settings.engine_timeout_s and not self._timed_out:
            self._timed_out = True
            limit = f"engine_timeout_s = {settings.engine_timeout_s:g}"
            message = f"the engine process has not responded for {stuck:.0f} s ({limit})"
            self._answer_all(Unavailable(message, retry_after_s=settings.retry_after_s), cancel=True)

    def _answer_all(self, error: APIError, cancel: bool = False) -> None:
        """Answer every request in flight ``error`` on the event loop, forgetting it (``cancel``: in the engine too).
        Any thread."""

        def answer_all() -> None:
            for request, generation in self._generations.items():
                generation.put(0, error)
                if cancel:
                    self._send_quietly(("cancel", request))
            answers: list[tuple[int, asyncio.Future[Any]]] = [*self._transductions.items(), *self._calls.items()]
            for request, answer in answers:
                if not answer.done():
                    answer.set_exception(error)
                if cancel and request in self._transductions:
                    self._send_quietly(("cancel", request))
            self._generations, self._transductions, self._calls = {}, {}, {}

        with contextlib.suppress(RuntimeError):  # the event loop has closed: nobody is left to answer
            self._running_loop.call_soon_threadsafe(answer_all)

    def _died(self, detail: str) -> None:
        """The engine process has gone: 503 for everything in flight and /health, then ``on_engine_died``."""
        logger.error("%s: answering the requests in flight 503", detail)
        self.state, self.detail = "failed", detail
        self._answer_all(Unavailable(f"the server failed: {detail}", retry_after_s=self.settings.retry_after_s))
        self.queue.clear()
        if self._on_engine_died is not None:
            self._on_engine_died(detail)


def _describe(served: ServedModel, description: dict[str, Any]) -> None:
    served.engine_card = ModelCard(**description["card"])
    served.notes = list(description.get("notes", []))  # for_serving's, logged at DEBUG by the engine process
    served.limits = ModelLimits(**description["limits"])
    # all this process reads of its budget (error messages); the rest is the engine process's
    served.budget = cast(ModelBudget, EngineBudget(description["max_job_seconds"]))


def _settle(answer: asyncio.Future[object], ok: bool, payload: object) -> None:
    if answer.done():
        return
    if ok:
        answer.set_result(payload)
    else:
        assert isinstance(payload, tuple)  # ``error_to_wire``'s
        answer.set_exception(error_from_wire(payload))


def _spec_json(constraint: CompiledConstraint | None) -> str | None:
    """The constraint's spec as JSON for the engine process, or None."""
    if constraint is None:
        return None
    assert constraint.spec is not None  # compiled here from the request's structured_outputs
    return constraint.spec.model_dump_json(by_alias=True, exclude_none=True)
