"""Python clients of the regularlm server over the protocol models: ``Client`` (sync) and ``AsyncClient``.

Both retry a request answered 429 or 503 (queue full, loading, draining) after the server's Retry-After,
or with exponential backoff when it gives none, ``max_retries`` times; then, like every other HTTP error,
it raises :class:`APIStatusError`. ``stream_generate`` yields the chunks of a streamed /v1/generate.

    with Client("http://127.0.0.1:8000") as client:
        client.transduce("parity_check-lrnn", ["0110"]).results[0].final
        for chunk in client.stream_generate("text-lrnn", "Once upon", max_tokens=32):
            print(chunk.text, end="")
"""

from __future__ import annotations

import asyncio
import itertools
import json
import time
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager, contextmanager
from dataclasses import dataclass
from typing import Any, Generic, Literal, Protocol, TypeVar

import httpx
from pydantic import BaseModel

from server.api import protocol

DEFAULT_URL = "http://127.0.0.1:8000"
RETRY_STATUSES = (429, 503)
R = TypeVar("R", bound=BaseModel)  # what an API call's answer parses to
HTTP = TypeVar("HTTP")  # httpx.Client or httpx.AsyncClient
Transport = TypeVar("Transport")  # the transport that client takes
_HTTP_co = TypeVar("_HTTP_co", covariant=True)
_Transport_contra = TypeVar("_Transport_contra", contravariant=True)


class APIStatusError(Exception):
    """An HTTP error answer; ``message`` and ``error_type`` come from the server's error body."""

    def __init__(self, status_code: int, message: str, error_type: str) -> None:
        super().__init__(f"HTTP {status_code} {error_type}: {message}")
        self.status_code, self.message, self.error_type = status_code, message, error_type


@dataclass(frozen=True)
class RetryPolicy:
    max_retries: int = 3
    backoff_s: float = 0.5  # first wait when the server gives no Retry-After; doubles each time
    max_backoff_s: float = 10.0

    def delay(self, response: httpx.Response, attempt: int) -> float | None:
        """Seconds to wait before retrying ``response`` (the attempt-th try, from 0), or None: do not retry."""
        if response.status_code not in RETRY_STATUSES or attempt >= self.max_retries:
            return None
        try:
            return min(float(response.headers["retry-after"]), self.max_backoff_s)
        except (KeyError, ValueError):
            backoff: float = self.backoff_s * 2**attempt  # int ** int is typed Any (a negative power is a float)
            return min(backoff, self.max_backoff_s)


@dataclass(frozen=True)
class Call(Generic[R]):
    """One API call: what to send and what the answer parses to."""

    method: str
    path: str
    response: type[R]
    body: BaseModel | None = None

    def json(self) -> dict[str, Any] | None:
        return None if self.body is None else self.body.model_dump(exclude_none=True, by_alias=True)  # e.g. "json"


def api_error(response: httpx.Response, body: bytes) -> APIStatusError:
    """The error that an error response with ``body`` stands for."""
    try:
        error = json.loads(body)["error"]
        message, error_type = str(error["message"]), str(error["type"])
    except (ValueError, KeyError, TypeError):
        message, error_type = body.decode(errors="replace") or response.reason_phrase, "http_error"
    return APIStatusError(response.status_code, message, error_type)


class EventStream:
    """Parses the lines of a Server-Sent Events stream into chunks, up to ``data: [DONE]``; an error event
    raises :class:`APIStatusError`."""

    def __init__(self) -> None:
        self.done = False

    def feed(self, line: str) -> list[protocol.GenerateChunk]:
        if self.done or not line.startswith("data: "):
            return []
        payload = line.removeprefix("data: ")
        if payload == "[DONE]":
            self.done = True
            return []
        event = json.loads(payload)
        if "error" in event:
            raise APIStatusError(500, event["error"]["message"], event["error"]["type"])
        return [protocol.GenerateChunk.model_validate(event)]


def _models() -> Call[protocol.ModelList]:
    return Call("GET", "/v1/models", protocol.ModelList)


def _health() -> Call[protocol.HealthResponse]:
    return Call("GET", "/health", protocol.HealthResponse)


def _transduce(model: str, inputs: list[str], outputs: Literal["final", "all"]) -> Call[protocol.TransduceResponse]:
    body = protocol.TransduceRequest(model=model, inputs=inputs, outputs=outputs)
    return Call("POST", "/v1/transduce", protocol.TransduceResponse, body)


def _generate(model: str, prompt: str, stream: bool, sampling: dict[str, Any]) -> Call[protocol.GenerateResponse]:
    body = protocol.GenerateRequest(model=model, prompt=prompt, stream=stream, **sampling)
    return Call("POST", "/v1/generate", protocol.GenerateResponse, body)


class _HTTPClass(Protocol[_HTTP_co, _Transport_contra]):
    """httpx.Client or httpx.AsyncClient, as ``_Base`` builds one."""

    def __call__(
        self, *, base_url: str, headers: dict[str, str], timeout: float, transport: _Transport_contra | None
    ) -> _HTTP_co: ...


class _Base(Generic[HTTP, Transport]):
    """Settings shared by both clients; ``transport`` replaces the network (tests use httpx.MockTransport)."""

    http_class: _HTTPClass[HTTP, Transport]

    def __init__(
        self,
        base_url: str = DEFAULT_URL,
        api_key: str | None = None,
        timeout: float = 60.0,
        retry: RetryPolicy = RetryPolicy(),
        transport: Transport | None = None,
    ) -> None:
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.base_url, self.retry = base_url.rstrip("/"), retry
        self._http = self.http_class(base_url=self.base_url, headers=headers, timeout=timeout, transport=transport)


class Client(_Base[httpx.Client, httpx.BaseTransport]):
    http_class = httpx.Client

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def close(self) -> None:
        self._http.close()

    def models(self) -> protocol.ModelList:
        return self._send(_models())

    def health(self) -> protocol.HealthResponse:
        return self._send(_health())

    def transduce(
        self, model: str, inputs: list[str], outputs: Literal["final", "all"] = "final"
    ) -> protocol.TransduceResponse:
        return self._send(_transduce(model, inputs, outputs))

    def generate(self, model: str, prompt: str, **sampling: Any) -> protocol.GenerateResponse:
        """``sampling``: max_tokens, temperature, top_p, top_k, seed, stop (see GenerateRequest)."""
        return self._send(_generate(model, prompt, False, sampling))

    def stream_generate(self, model: str, prompt: str, **sampling: Any) -> Iterator[protocol.GenerateChunk]:
        with self._open(_generate(model, prompt, True, sampling)) as response:
            stream = EventStream()
            for line in response.iter_lines():
                yield from stream.feed(line)

    def _send(self, call: Call[R]) -> R:
        with self._open(call) as response:
            response.read()
            return call.response.model_validate(response.json())

    @contextmanager
    def _open(self, call: Call[R]) -> Iterator[httpx.Response]:
        """The response to ``call`` after the retries, its status checked, its body not yet read."""
        for attempt in itertools.count():
            with self._http.stream(call.method, call.path, json=call.json()) as response:
                if (delay := self.retry.delay(response, attempt)) is None:
                    if not response.is_success:
                        raise api_error(response, response.read())
                    yield response
                    return
            time.sleep(delay)


class AsyncClient(_Base[httpx.AsyncClient, httpx.AsyncBaseTransport]):
    http_class = httpx.AsyncClient

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        await self._http.aclose()

    async def models(self) -> protocol.ModelList:
        return await self._send(_models())

    async def health(self) -> protocol.HealthResponse:
        return await self._send(_health())

    async def transduce(
        self, model: str, inputs: list[str], outputs: Literal["final", "all"] = "final"
    ) -> protocol.TransduceResponse:
        return await self._send(_transduce(model, inputs, outputs))

    async def generate(self, model: str, prompt: str, **sampling: Any) -> protocol.GenerateResponse:
        return await self._send(_generate(model, prompt, False, sampling))

    async def stream_generate(self, model: str, prompt: str, **sampling: Any) -> AsyncIterator[protocol.GenerateChunk]:
        async with self._open(_generate(model, prompt, True, sampling)) as response:
            stream = EventStream()
            async for line in response.aiter_lines():
                for chunk in stream.feed(line):
                    yield chunk

    async def _send(self, call: Call[R]) -> R:
        async with self._open(call) as response:
            await response.aread()
            return call.response.model_validate(response.json())

    @asynccontextmanager
    async def _open(self, call: Call[R]) -> AsyncIterator[httpx.Response]:
        for attempt in itertools.count():
            async with self._http.stream(call.method, call.path, json=call.json()) as response:
                if (delay := self.retry.delay(response, attempt)) is None:
                    if not response.is_success:
                        raise api_error(response, await response.aread())
                    yield response
                    return
            await asyncio.sleep(delay)
