"""OpenAI-compatible /v1/completions on top of ``Serving``: several prompts and ``n`` choices each, echo,
log-probabilities (of the prompt too: ``echo: true, logprobs: 0, max_tokens: 0`` scores any text), and streaming with
``stream_options.include_usage``. Each engine event of a choice becomes a delta; a whole answer merges each choice's
deltas.
"""

from __future__ import annotations

import os
import random
import time
from collections.abc import AsyncGenerator, AsyncIterator

from model.tokenizer import Tokenizer
from server.api.protocol import CompletionChoice, CompletionLogprobs, CompletionRequest, CompletionResponse, Usage
from server.api.serving import SSE_DONE, Serving, coalesced, sse, sse_error
from server.engine.engine import GenerationHandle
from server.errors import APIError, InputTooLarge
from server.execution.generation import Finished, GenerationRequest, PromptScored, TokenGenerated
from server.execution.sampling import TokenLogprob

# Completion ids: 128 random bits from a generator seeded once from the OS (again in a forked child), not uuid4, whose
# os.urandom releases the GIL on the event loop, which then waits for the engine's thread to give it back.
_ids = random.Random()
os.register_at_fork(after_in_child=_ids.seed)


def completion_id() -> str:
    """``cmpl-`` and 32 hex digits, as ``uuid4().hex`` gave."""
    return f"cmpl-{_ids.getrandbits(128):032x}"


class ChoiceState:
    """One choice: turns its events into deltas; tracks text offsets for the log-probabilities."""

    def __init__(
        self, index: int, prompt: str, prompt_tokens: list[int], echo: bool, tokenizer: Tokenizer, logprobs: int | None
    ) -> None:
        self.index, self.prompt, self.prompt_tokens = index, prompt, prompt_tokens
        self.echo_pending = echo
        self.tokenizer, self.logprobs = tokenizer, logprobs
        self.offsets = tokenizer.stream_decoder()
        self.offset = 0
        self.completion_tokens = 0

    def delta(self, event: PromptScored | TokenGenerated | Finished) -> CompletionChoice:
        text, logprobs, finish_reason = "", None, None
        if self.echo_pending:
            text, self.echo_pending = self.prompt, False
            if isinstance(event, PromptScored):
                logprobs = self._logprobs(self.prompt_tokens, event.logprobs)
            else:
                self._advance(self.prompt_tokens)
        if isinstance(event, TokenGenerated):
            text += event.text
            if self.logprobs is not None:
                logprobs = self._logprobs([event.token], [event.logprob])
        elif isinstance(event, Finished):
            text += event.text
            finish_reason = event.reason
            self.completion_tokens = event.completion_tokens
        return CompletionChoice(index=self.index, text=text, logprobs=logprobs, finish_reason=finish_reason)

    def _advance(self, tokens: list[int]) -> list[int]:
        """Text offsets of the tokens, moving the offset past them."""
        offsets = []
        for token in tokens:
            offsets.append(self.offset)
            self.offset += len(self.offsets.push(token))
        return offsets

    def _logprobs(self, tokens: list[int], entries: list[TokenLogprob | None]) -> CompletionLogprobs:
        decode = self.tokenizer.decode
        top = [None if entry is None else {decode([t]): lp for t, lp in entry.top} for entry in entries]
        return CompletionLogprobs(
            tokens=[decode([token]) for token in tokens],
            token_logprobs=[None if entry is None else entry.logprob for entry in entries],
            top_logprobs=top if self.logprobs else None,
            text_offset=self._advance(tokens),
        )


class CompletionServing:
    def __init__(self, serving: Serving) -> None:
        self.serving = serving

    async def create(self, body: CompletionRequest, flow: str = "") -> CompletionResponse | AsyncIterator[str]:
        """The response, or (``stream``) an SSE stream's events; refusals raise before either starts. ``flow``: the
        fairness key."""
        served = self.serving.generation_model(body)
        limit = self.serving.settings.max_inputs
        if len(body.prompts) * body.n > limit:
            raise InputTooLarge(f"{len(body.prompts)} prompts x n={body.n} choices; the limit is {limit}")
        constraint = await self.serving.constraint(served, body)
        requests: list[GenerationRequest] = []
        choices: list[ChoiceState] = []
        max_tokens = self.serving.max_tokens(body)
        assert served.tokenizer is not None  # a language model is served with its tokenizer
        for prompt in body.prompts:
            tokens = await self.serving.prompt_tokens(served, prompt)
            for sample in range(body.n):
                request = self.serving.generation_request(
                    served,
                    tokens,
                    body,
                    max_tokens,
                    seed_offset=sample,
                    logprobs=body.logprobs,
                    prompt_logprobs=body.echo and body.logprobs is not None,
                    constraint=constraint,
                )
                requests.append(request)
                text = prompt if isinstance(prompt, str) else served.tokenizer.decode(prompt)
                choices.append(
                    ChoiceState(len(choices), text, request.prompt, body.echo, served.tokenizer, body.logprobs)
                )
        handle = self.serving.engine.submit_generation(served, requests, flow)
        response = CompletionResponse(id=completion_id(), created=int(time.time()), model=body.model, choices=[])
        prompt_tokens = sum(len(request.prompt) for request in requests[:: body.n])
        if body.stream:
            include_usage = body.stream_options is not None and body.stream_options.include_usage
            return coalesced(self._events(handle, choices, response, prompt_tokens if include_usage else None), handle)
        merged = [CompletionChoice(index=choice.index, text="") for choice in choices]
        async for index, event in handle.events():
            _merge(merged[index], choices[index].delta(event))
        response.choices = merged
        response.usage = _usage(prompt_tokens, choices)
        return response

    async def _events(
        self,
        handle: GenerationHandle,
        choices: list[ChoiceState],
        response: CompletionResponse,
        prompt_tokens: int | None,
    ) -> AsyncGenerator[str, None]:
        try:
            async for index, event in handle.events():  # one yield per event (``coalesced``)
                delta = choices[index].delta(event)
                if delta.text or delta.logprobs or delta.finish_reason:
                    yield sse(response.model_copy(update={"choices": [delta]}))
                else:
                    yield ""
            if prompt_tokens is not None:
                yield sse(response.model_copy(update={"usage": _usage(prompt_tokens, choices)}))
        except APIError as error:
            yield sse_error(error)
        yield SSE_DONE


def _merge(choice: CompletionChoice, delta: CompletionChoice) -> None:
    choice.text += delta.text
    choice.finish_reason = delta.finish_reason or choice.finish_reason
    if delta.logprobs is None:
        return
    if choice.logprobs is None:
        choice.logprobs = CompletionLogprobs(top_logprobs=None if delta.logprobs.top_logprobs is None else [])
    for name in ("tokens", "token_logprobs", "top_logprobs", "text_offset"):
        merged = getattr(choice.logprobs, name)
        if merged is not None:
            merged.extend(getattr(delta.logprobs, name))


def _usage(prompt_tokens: int, choices: list[ChoiceState]) -> Usage:
    completion_tokens = sum(choice.completion_tokens for choice in choices)
    return Usage(
        prompt_tokens=prompt_tokens, completion_tokens=completion_tokens, total_tokens=prompt_tokens + completion_tokens
    )
