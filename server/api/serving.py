"""Serving of /v1/models, /v1/transduce and /v1/generate: request validation and limits, calls into the
engine, response bodies and Server-Sent Events. No routing here (``server/api/app.py``); the OpenAI
completions endpoint is ``server/api/completions.py``.
"""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import AsyncGenerator, AsyncIterator
from typing import Any

from pydantic import BaseModel

from server.api.protocol import (
    TOKEN_ID_PATTERN,
    CompletionRequest,
    DeletedModel,
    GenerateChunk,
    GenerateRequest,
    GenerateResponse,
    ModelCard,
    ModelList,
    RuntimeModelRequest,
    SamplingFields,
    TransduceRequest,
    TransduceResponse,
    TransduceResult,
    TransduceUsage,
    Usage,
)
from server.engine.engine import EngineFront, GenerationHandle
from server.errors import APIError, BadRequest, InputTooLarge, InvalidInput
from server.execution.generation import Finished, GenerationRequest, TokenGenerated
from server.execution.sampling import SamplingParams
from server.models.runtime import RuntimeCompiler, check_new_id
from server.models.store import ServedModel
from server.settings import Settings
from server.structured.outputs import CompiledConstraint, ConstraintCompiler, MaskBudget

SSE_DONE = "data: [DONE]\n\n"
# Text prompts of at least this many characters are tokenized on a thread (shorter: inline, where a hop to a thread
# would cost more than it frees the event loop).
THREADED_TOKENIZE_CHARS = 65_536
TOKEN_ID = re.compile(TOKEN_ID_PATTERN)


def sse(body: BaseModel | dict[str, Any]) -> str:
    """One Server-Sent Event carrying a JSON body, on one line for any line splitter (the line breaks of
    ``str.splitlines`` that JSON leaves unescaped are escaped)."""
    payload = body.model_dump_json() if isinstance(body, BaseModel) else json.dumps(body)
    payload = payload.replace("\u2028", "\\u2028").replace("\u2029", "\\u2029").replace("\x85", "\\u0085")
    return f"data: {payload}\n\n"


def sse_error(error: APIError) -> str:
    return sse({"error": {"message": error.message, "type": error.error_type}})


async def coalesced(chunks: AsyncGenerator[str, None], handle: GenerationHandle) -> AsyncIterator[str]:
    """``handle``'s SSE ``chunks``, those ready without waiting joined into one write, nothing held back. ``chunks``
    must yield once per event it takes ("" for one it writes nothing for)."""
    pending: list[str] = []
    try:
        async for chunk in chunks:
            pending.append(chunk)
            if not handle.ready():
                text = "".join(pending)
                pending.clear()
                if text:
                    yield text
        if any(pending):
            yield "".join(pending)
    finally:
        await chunks.aclose()  # at once, not when collected: its handle then cancels the sequences left


class Serving:
    def __init__(self, engine: EngineFront, settings: Settings) -> None:
        self.engine, self.settings = engine, settings
        self.constraints = ConstraintCompiler(
            settings.structured_max_chars, settings.structured_compile_timeout_s, MaskBudget.of(settings)
        )
        self.runtime = RuntimeCompiler(settings)
        # each language model's structured-output vocabulary is built while the engine loads, not by the first request
        # that asks for structured_outputs
        engine.add_warm_up(self._warm_up)

    def _warm_up(self, served: ServedModel) -> None:
        assert served.tokenizer is not None  # warm-ups run for language models, which have their tokenizer
        self.constraints.vocabulary(served.tokenizer)

    def models(self) -> ModelList:
        self.engine.check_serving()
        return ModelList(data=[served.card() for served in self.engine.models.values()])

    def model(self, model_id: str) -> ModelCard:
        """One model's entry (404 if it is not served)."""
        return self.engine.model(model_id).card()

    async def add_model(self, body: RuntimeModelRequest) -> ModelCard:
        """POST /v1/models: compile the request's regular expression or DFA and serve it (server/models/runtime.py)."""
        self.engine.check_serving()
        if self.settings.runtime_models_max == 0:
            raise InputTooLarge("runtime models are turned off on this server (runtime_models_max = 0)")
        check_new_id(body.id, self.engine.models)
        served = await self.runtime.compile(body, self.settings.device)
        return (await self.engine.add_model(served)).card()

    async def delete_model(self, model_id: str) -> DeletedModel:
        await self.engine.remove_model(model_id)
        return DeletedModel(id=model_id)

    def served(self, model_id: str, kind: str) -> ServedModel:
        served = self.engine.model(model_id)
        if served.kind != kind:
            raise BadRequest(f"model {model_id!r} is a {served.kind} model; this endpoint serves {kind} models")
        return served

    # --- /v1/transduce --------------------------------------------------------------------------------

    async def transduce(self, body: TransduceRequest, flow: str = "") -> TransduceResponse:
        """``flow``: who asks (the scheduler's fairness key)."""
        served, all_outputs = self.served(body.model, "transduce"), body.outputs == "all"
        self._check_transduce_size(served, body.inputs, all_outputs)
        inputs = [served.encode_symbols(text, f"inputs[{i}]") for i, text in enumerate(body.inputs)]
        outputs = await self.engine.transduce(served, inputs, all_outputs, flow)
        labels = served.config.labels
        assert labels is not None  # a transducer's config has its labels
        results = [
            TransduceResult(
                final=labels[output.final],
                all=None if output.labels is None else [labels[label] for label in output.labels],
                confidence=output.confidence,
            )
            for output in outputs
        ]
        return TransduceResponse(model=body.model, results=results, usage=TransduceUsage(symbols=sum(map(len, inputs))))

    def _check_transduce_size(self, served: ServedModel, inputs: list[str], all_outputs: bool) -> None:
        """The server's limits, and the model's own (``ServedModel.limits``, listed in /v1/models)."""
        limits = self.settings
        if len(inputs) > limits.max_inputs:
            raise InputTooLarge(f"{len(inputs)} inputs; the limit is {limits.max_inputs} per request")
        assert served.limits is not None and served.budget is not None  # set by the engine when it installed the model
        if all_outputs:
            model_limit, name = served.limits.max_all_outputs_symbols, "max_all_outputs_symbols"
            assert model_limit is not None  # a transducer's limits have it
        else:
            model_limit, name = served.limits.max_input_symbols, "max_input_symbols"
        for i, text in enumerate(inputs):
            if not text:
                raise InvalidInput(f"inputs[{i}] is empty; an input needs at least one symbol")
            if len(text) > limits.max_input_symbols:
                raise InputTooLarge(f"inputs[{i}] has {len(text)} symbols; the limit is {limits.max_input_symbols}")
            if len(text) > model_limit:
                hint = ""
                if all_outputs and len(text) <= served.limits.max_input_symbols:
                    hint = f'; outputs "final" admits up to {served.limits.max_input_symbols}'
                raise InputTooLarge(
                    f"inputs[{i}] has {len(text)} symbols; model {served.id!r} admits at most {model_limit} with "
                    f'outputs "{"all" if all_outputs else "final"}" on this server (limits.{name} in /v1/models: '
                    f"the path it runs must fit the memory budget and {served.budget.max_job_seconds:g} s){hint}"
                )
        total = sum(map(len, inputs))
        if total > limits.max_request_symbols:
            raise InputTooLarge(f"{total} symbols in all; the limit is {limits.max_request_symbols} per request")

    # --- generation, shared with /v1/completions ---------------------------------------------------------

    def generation_model(self, body: GenerateRequest | CompletionRequest) -> ServedModel:
        """The language model asked for (structured_outputs on a transducer: 422, as it has no text to constrain)."""
        if body.structured_outputs is not None and self.engine.model(body.model).kind != "generate":
            raise InvalidInput(f"structured_outputs applies to language models; {body.model!r} is a transduce model")
        return self.served(body.model, "generate")

    async def constraint(self, served: ServedModel, fields: SamplingFields) -> CompiledConstraint | None:
        """The request's structured_outputs compiled for the model's vocabulary off the engine thread (None without
        one); 422 if invalid, 413 over a size or time limit."""
        if fields.structured_outputs is None:
            return None
        assert served.tokenizer is not None  # a language model is served with its tokenizer
        return await self.constraints.compile(fields.structured_outputs, served.tokenizer)

    async def prompt_tokens(self, served: ServedModel, prompt: str | list[int]) -> list[int]:
        """A text prompt's token ids (a long one tokenized off the event loop), or token ids checked against the
        vocabulary."""
        assert served.tokenizer is not None  # a language model is served with its tokenizer
        if isinstance(prompt, str):
            if len(prompt) < THREADED_TOKENIZE_CHARS:
                return served.tokenizer.encode(prompt)
            return await asyncio.to_thread(served.tokenizer.encode, prompt)
        vocabulary = served.tokenizer.vocab_size
        if min(prompt) >= 0 and max(prompt) < vocabulary:  # min and max run at C speed
            return prompt
        position, token = next((i, token) for i, token in enumerate(prompt) if not 0 <= token < vocabulary)
        raise InvalidInput(
            f"prompt token {position} is id {token}; model {served.id!r} has token ids 0..{vocabulary - 1}"
        )

    def generation_request(
        self,
        served: ServedModel,
        tokens: list[int],
        fields: GenerateRequest | CompletionRequest,
        max_tokens: int,
        seed_offset: int = 0,
        logprobs: int | None = None,
        prompt_logprobs: bool = False,
        constraint: CompiledConstraint | None = None,
    ) -> GenerationRequest:
        """Validate one prompt's tokens and the sampling fields against the limits."""
        if max_tokens > self.settings.max_tokens:
            raise InvalidInput(f"max_tokens is {max_tokens}; the limit is {self.settings.max_tokens}")
        assert served.tokenizer is not None  # a language model is served with its tokenizer
        vocabulary = served.tokenizer.vocab_size
        if not tokens:
            raise InvalidInput("the prompt is empty; it needs at least one token")
        if len(tokens) > self.settings.max_input_symbols:
            raise InputTooLarge(f"the prompt has {len(tokens)} tokens; the limit is {self.settings.max_input_symbols}")
        assert served.limits is not None and served.budget is not None  # set by the engine when it installed the model
        context_limit = served.limits.max_context_tokens
        assert context_limit is not None  # a language model's limits have it
        if len(tokens) + max_tokens > context_limit:
            raise InputTooLarge(
                f"the prompt has {len(tokens)} tokens and max_tokens is {max_tokens}; model {served.id!r} holds at "
                f"most {context_limit} tokens of context on this server (limits.max_context_tokens in /v1/models: "
                f"its cache must fit the memory budget and its computation {served.budget.max_job_seconds:g} s)"
            )
        seed = None if fields.seed is None else (fields.seed + seed_offset) % 2**63
        sampling = SamplingParams(
            fields.temperature,
            fields.top_p,
            fields.top_k,
            seed,
            fields.presence_penalty,
            fields.frequency_penalty,
            fields.repetition_penalty,
            _logit_bias(fields.logit_bias or {}, vocabulary, served.id),
        )
        return GenerationRequest(
            tokens, max_tokens, sampling, fields.stop_strings, logprobs, prompt_logprobs, constraint, fields.stream
        )

    def max_tokens(self, body: GenerateRequest | CompletionRequest) -> int:
        """max_tokens as asked; null: the server's limit; left out: the field's default or the limit, whichever is
        lower."""
        if "max_tokens" not in body.model_fields_set:
            assert body.max_tokens is not None  # the field's default
            return min(body.max_tokens, self.settings.max_tokens)
        return self.settings.max_tokens if body.max_tokens is None else body.max_tokens

    # --- /v1/generate -------------------------------------------------------------------------------------

    async def generate(self, body: GenerateRequest, flow: str = "") -> GenerateResponse | AsyncIterator[str]:
        """The response, or (``stream``) the events of an SSE stream; refusals raise before either starts."""
        served = self.generation_model(body)
        constraint = await self.constraint(served, body)
        tokens = await self.prompt_tokens(served, body.prompt)
        request = self.generation_request(served, tokens, body, self.max_tokens(body), constraint=constraint)
        handle = self.engine.submit_generation(served, [request], flow)
        if body.stream:
            return coalesced(self._generate_events(body.model, handle), handle)
        text, finished = [], None
        async for _, event in handle.events():  # ends with the Finished event
            if isinstance(event, (TokenGenerated, Finished)):
                text.append(event.text)
            finished = event
        assert isinstance(finished, Finished)  # the last event
        return GenerateResponse(
            model=body.model, text="".join(text), finish_reason=finished.reason, usage=usage(finished)
        )

    async def _generate_events(self, model_id: str, handle: GenerationHandle) -> AsyncGenerator[str, None]:
        try:
            async for _, event in handle.events():  # one yield per event (``coalesced``)
                if isinstance(event, TokenGenerated) and event.text:
                    yield sse(GenerateChunk(model=model_id, text=event.text))
                elif isinstance(event, Finished):
                    yield sse(
                        GenerateChunk(model=model_id, text=event.text, finish_reason=event.reason, usage=usage(event))
                    )
                else:
                    yield ""
        except APIError as error:
            yield sse_error(error)
        yield SSE_DONE


def _logit_bias(biases: dict[str, float], vocabulary: int, model_id: str) -> tuple[tuple[int, float], ...]:
    """OpenAI's logit_bias (token ids as decimal strings, ``TOKEN_ID_PATTERN``) checked against the vocabulary."""
    checked = []
    for key, bias in biases.items():
        # ASCII digits only (isdecimal() passes '٣'); the length first (int() refuses more than 4,300 digits)
        if not (TOKEN_ID.fullmatch(key) and len(key) <= len(str(vocabulary)) and int(key) < vocabulary):
            raise InvalidInput(f"logit_bias key {key!r} is not a token id of model {model_id!r} (0..{vocabulary - 1})")
        checked.append((int(key), bias))
    return tuple(checked)


def usage(finished: Finished) -> Usage:
    return Usage(
        prompt_tokens=finished.prompt_tokens,
        completion_tokens=finished.completion_tokens,
        total_tokens=finished.prompt_tokens + finished.completion_tokens,
    )
