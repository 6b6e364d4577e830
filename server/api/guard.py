"""What a request must pass before the app reads its body, and what is done with a body answered unread.

:class:`HeaderChecks` decides from the headers alone: 401 (API key), 413 (declared size over ``max_body_bytes``), 429
(no room in the queue for a POST to a queued path). :class:`RequestGuard` (ASGI middleware) applies them and takes the
request's place in the queue; while reading, a body over the limit gets 413 and one slower than ``body_timeout_s`` 408.
Each such answer closes its connection after discarding the rest of the body within :class:`Linger`'s bounds.
``guarded_protocol`` is uvicorn's HTTP protocol closing connections whose headers are late, and answering a request
the checks refuse as soon as its headers are parsed, without a task or the app (a burst's refusals cost a fraction of a
request each). Why: ``docs/architecture.md``, "Design notes".
"""

from __future__ import annotations

import asyncio
import contextvars
import secrets
import sys
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from http import HTTPStatus
from typing import Any, TypeVar

from pydantic import SecretStr
from starlette.datastructures import Headers
from starlette.responses import Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send
from uvicorn.protocols.utils import get_client_addr, get_path_with_query_string

from server.api.json_body import BodyRefused
from server.errors import APIError, InputTooLarge, RequestTimeout, Unauthorized

QUEUED_PATHS = frozenset({"/v1/generate", "/v1/completions", "/v1/transduce"})  # POSTs that take a place in the queue
CHECKED, LEAVE = "regularlm.checked", "regularlm.leave"  # scope keys: HeaderChecks.check ran; how its arrival ends
T = TypeVar("T")


async def within(call: Awaitable[T], seconds: float) -> T:
    """``asyncio.wait_for(call, seconds)`` for a coroutine, without the task that ``wait_for`` starts for it before
    Python 3.12 (each body read, each refusal's linger): ``TimeoutError`` past ``seconds``, and at once, the coroutine
    not started, if ``seconds`` <= 0."""
    if sys.version_info < (3, 11):
        return await asyncio.wait_for(call, seconds)
    if seconds <= 0:
        if asyncio.iscoroutine(call):
            call.close()
        raise TimeoutError
    async with asyncio.timeout(seconds):
        return await call


@dataclass(frozen=True)
class Linger:
    """Bounds on discarding an unread body before its connection closes: ``max_bytes``, ``timeout_s`` in all,
    ``read_timeout_s`` between bytes."""

    max_bytes: int = 64 * 2**20
    timeout_s: float = 10.0
    read_timeout_s: float = 2.0


class HeaderChecks:
    """The refusals decided from a request's headers, each error's response rendered once (:class:`Refusals`)."""

    def __init__(
        self,
        api_key: SecretStr | None,
        needs_key: Callable[[str], bool],
        max_body_bytes: int,
        refuse: Callable[[APIError], Response],
        arrive: Callable[[], Callable[[], None]] | None = None,
    ) -> None:
        """``needs_key(path)``: whether the path needs the API key (when set); ``refuse(error)``: the response to an
        error found here, which must depend on the error's class, message and ``retry_after_s`` alone; ``arrive()``:
        for a POST to a queued path, raises an ``APIError`` (429) or returns the function that ends its arrival, which
        may be called more than once (its first call counts)."""
        self.needs_key, self.max_body_bytes, self.arrive = needs_key, max_body_bytes, arrive
        self.api_key = None if api_key is None else api_key.get_secret_value().encode()
        self.refusals = Refusals(refuse)

    def check(self, scope: Scope) -> APIError | None:
        """401 (API key) or 413 (declared size); then, for a POST to a queued path, its arrival, ended by
        ``scope[LEAVE]()``, or the 429 of a full queue. Once per request: a scope already checked passes."""
        if scope.get(CHECKED):
            return None
        scope[CHECKED] = True
        headers = Headers(scope=scope)
        if self.api_key is not None and self.needs_key(scope["path"]):
            scheme, _, token = headers.get("authorization", "").partition(" ")
            if scheme.lower() != "bearer" or not secrets.compare_digest(token.encode(), self.api_key):
                return Unauthorized("a valid API key is needed: 'Authorization: Bearer <key>'")
        declared = headers.get("content-length", "")
        if declared.isdigit() and int(declared) > self.max_body_bytes:
            return InputTooLarge(f"the body has {declared} bytes; the limit is {self.max_body_bytes} (max_body_bytes)")
        if self.arrive is not None and scope["method"] == "POST" and scope["path"] in QUEUED_PATHS:
            try:
                scope[LEAVE] = self.arrive()
            except APIError as full:
                return full
        return None


class RequestGuard:
    def __init__(self, app: ASGIApp, checks: HeaderChecks, body_timeout_s: float, linger: Linger = Linger()) -> None:
        self.app, self.checks, self.body_timeout_s, self.linger = app, checks, body_timeout_s, linger
        self.turnstile = Turnstile()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        body = RequestBody(receive, Headers(scope=scope))
        send = LingeringSend(send, body, self.linger)
        error = self.checks.check(scope)  # None at once where the HTTP protocol has checked it (guarded_protocol)
        if error is not None:  # the body is not read: the connection closes rather than read it as the next request
            return await self.checks.refusals.send(error, send)
        leave = scope.get(LEAVE)
        try:
            if leave is not None:
                await self.turnstile.enter()
            await self.app(scope, LimitedBody(body, self.checks.max_body_bytes, self.body_timeout_s), send)
        finally:
            if leave is not None:
                leave()


class Refusals:
    """The guard's answers (``refuse(error)`` with ``Connection: close``) rendered once per distinct error and sent
    again as bytes: a burst refused 429 then costs no model, JSON or header building per request, on the event loop
    that reads the rest of the burst. At most ``max_kept`` are kept (a 413 names its request's size)."""

    def __init__(self, refuse: Callable[[APIError], Response], max_kept: int = 64) -> None:
        self.refuse, self.max_kept = refuse, max_kept
        self.rendered: dict[tuple[type[APIError], str, int | None], tuple[int, list[tuple[bytes, bytes]], bytes]] = {}

    def rendered_for(self, error: APIError) -> tuple[int, list[tuple[bytes, bytes]], bytes]:
        """The status, headers and body of ``closing(refuse(error))``, rendered once."""
        key = (type(error), error.message, error.retry_after_s)
        rendered = self.rendered.get(key)
        if rendered is None:
            response = closing(self.refuse(error))
            rendered = response.status_code, list(response.raw_headers), bytes(response.body)
            if len(self.rendered) >= self.max_kept:
                self.rendered.clear()
            self.rendered[key] = rendered
        return rendered

    async def send(self, error: APIError, send: Send) -> None:
        """Send ``error``'s response as ``closing(refuse(error))`` would."""
        status, headers, content = self.rendered_for(error)
        # a list of its own per response: a middleware outside this one (CORS) may add to it
        await send({"type": "http.response.start", "status": status, "headers": list(headers)})
        await send({"type": "http.response.body", "body": content})

    def http_bytes(self, error: APIError, default_headers: list[tuple[bytes, bytes]]) -> bytes:
        """``error``'s response as HTTP/1.1 bytes, after uvicorn's ``default_headers`` (server, date) as it writes
        them."""
        status, headers, content = self.rendered_for(error)
        lines = [b"HTTP/1.1 %d %s\r\n" % (status, HTTPStatus(status).phrase.encode())]
        for name, value in (*default_headers, *headers):
            lines += [name, b": ", value, b"\r\n"]
        return b"".join([*lines, b"\r\n", content])


class Turnstile:
    """Lets requests on into the app one per turn of the event loop, in arrival order. Event loop only."""

    def __init__(self) -> None:
        self._loop: asyncio.AbstractEventLoop | None = None
        self._waiting: deque[asyncio.Future[None]] = deque()
        self._turning = False

    async def enter(self) -> None:
        loop = asyncio.get_running_loop()
        if loop is not self._loop:  # a new event loop (an app run again, as tests do): nothing waits on the old one
            self._loop, self._waiting, self._turning = loop, deque(), False
        turn = loop.create_future()
        self._waiting.append(turn)
        if not self._turning:
            self._turning = True
            loop.call_soon(self._turn)
        await turn

    def _turn(self) -> None:
        while self._waiting:
            turn = self._waiting.popleft()
            if not turn.done():  # done: its request was cancelled while it waited
                turn.set_result(None)
                assert self._loop is not None  # set by the request that queued this turn
                self._loop.call_soon(self._turn)
                return
        self._turning = False


def closing(response: Response) -> Response:
    """``response`` with ``Connection: close``, for an answer given before its request's body was read to the end."""
    response.headers["Connection"] = "close"
    return response


class RequestBody:
    """The request's ``receive``, noting in ``complete`` when the body has been read or the client has gone."""

    def __init__(self, receive: Receive, headers: Headers) -> None:
        self.receive = receive
        self.complete = "transfer-encoding" not in headers and headers.get("content-length", "0") in ("", "0")

    async def __call__(self) -> Message:
        message = await self.receive()
        if message["type"] != "http.request" or not message.get("more_body", False):
            self.complete = True
        return message

    async def discard(self, linger: Linger) -> None:
        """Read what is left of the body and drop it, within ``linger``'s bounds."""
        loop = asyncio.get_running_loop()
        deadline, discarded = loop.time() + linger.timeout_s, 0
        while not self.complete and discarded <= linger.max_bytes:
            left = deadline - loop.time()
            if left <= 0:
                return
            try:
                message = await within(self(), min(linger.read_timeout_s, left))
            except asyncio.TimeoutError:
                return
            discarded += len(message.get("body", b""))


class LingeringSend:
    """An ASGI ``send`` holding a ``Connection: close`` response (but a 408) open after its last byte while the unread
    body is discarded."""

    def __init__(self, send: Send, body: RequestBody, linger: Linger) -> None:
        self.send, self.body, self.linger = send, body, linger
        self.closes = False

    async def __call__(self, message: Message) -> None:
        if message["type"] == "http.response.start":
            headers = message.get("headers", ())
            closes = any(name.lower() == b"connection" and b"close" in value.lower() for name, value in headers)
            self.closes = closes and message["status"] != 408  # a 408's client is not sending: nothing to wait for
        last = message["type"] == "http.response.body" and not message.get("more_body", False)
        if last and self.closes and not self.body.complete:
            await self.send({**message, "more_body": True})
            await self.body.discard(self.linger)
            message = {"type": "http.response.body", "body": b"", "more_body": False}
        await self.send(message)


class LimitedBody:
    """An ASGI ``receive`` raising ``BodyRefused`` for a body over ``max_bytes`` (413) or still arriving ``timeout_s``
    after first asked for (408)."""

    def __init__(self, receive: Receive, max_bytes: int, timeout_s: float) -> None:
        self.receive, self.max_bytes, self.timeout_s = receive, max_bytes, timeout_s
        self.received = 0
        self.complete = False
        self.deadline: float | None = None

    async def __call__(self) -> Message:
        if self.complete:
            return await self.receive()
        loop = asyncio.get_running_loop()
        if self.deadline is None:
            self.deadline = loop.time() + self.timeout_s
        try:
            message = await within(self.receive(), self.deadline - loop.time())
        except asyncio.TimeoutError:
            late = RequestTimeout(f"the body took longer than {self.timeout_s:g} s to arrive (body_timeout_s)")
            raise BodyRefused(late, body_unread=True) from None
        if message["type"] != "http.request" or not message.get("more_body", False):
            self.complete = True
        self.received += len(message.get("body", b""))
        if self.received > self.max_bytes:
            raise BodyRefused(
                InputTooLarge(f"the body is over {self.max_bytes} bytes, the limit (max_body_bytes)"), body_unread=True
            )
        return message


def guarded_protocol(
    protocol: type[asyncio.Protocol],
    header_timeout_s: float,
    checks: HeaderChecks | None = None,
    linger: Linger = Linger(),
) -> type[asyncio.Protocol]:
    """uvicorn's HTTP ``protocol`` closing, without a response, a connection whose request headers are not complete
    ``header_timeout_s`` after it opened or after a later request's first byte. With ``checks``, on uvicorn's httptools
    protocol (the h11 one leaves them to :class:`RequestGuard`), each request but a HEAD is checked as its headers are
    parsed, so that an arrival counts at once; a refusal is answered there, with the bytes :class:`RequestGuard` would
    send, and the body is discarded within ``linger``'s bounds before the connection closes."""

    class GuardedProtocol(protocol):  # type: ignore[valid-type, misc]
        header_timer: asyncio.TimerHandle | None = None
        refused_at: float | None = None  # when the request was answered from its headers: discard its body, then close
        discarded = 0
        linger_timer: asyncio.TimerHandle | None = None

        def connection_made(self, transport: asyncio.BaseTransport) -> None:
            super().connection_made(transport)
            self._await_headers()

        def data_received(self, data: bytes) -> None:
            if self.refused_at is not None:
                self._linger()  # the read timeout counts from the latest bytes
            elif self.header_timer is None and self._between_requests():
                self._await_headers()  # a kept-alive connection's next request: its deadline from its first byte
            super().data_received(data)

        def on_response_complete(self) -> None:
            self._stop_header_timer()
            self._end_arrival()
            super().on_response_complete()

        def connection_lost(self, exc: Exception | None) -> None:
            self._stop_header_timer()
            self._stop_linger()
            self._end_arrival()
            super().connection_lost(exc)

        def _end_arrival(self) -> None:
            """End the arrival taken with the current request's headers by its response or its connection's end at the
            latest, whether or not the request reached :class:`RequestGuard` (which ends it sooner; ending is
            idempotent)."""
            leave = None if self.cycle is None else self.cycle.scope.get(LEAVE)
            if leave is not None:
                leave()

        def _start_asgi_task(self, cycle: Any, app: Any) -> None:  # httptools: the request's headers are parsed
            if self.refused_at is not None:  # a request pipelined behind the refused one: the connection is closing
                return
            scope = cycle.scope
            if checks is None or scope["method"] == "HEAD":
                super()._start_asgi_task(cycle, app)
                return
            # what the arrival sets in the context is the request task's, not the protocol's
            context = contextvars.copy_context()
            error = context.run(checks.check, scope)
            if error is None:
                context.run(super()._start_asgi_task, cycle, app)  # the task runs in (a copy of) ``context``
                return
            content = checks.refusals.http_bytes(error, self.server_state.default_headers)
            self.transport.write(content)
            if self.access_log:  # the line uvicorn writes for a response
                self.access_logger.info(
                    '%s - "%s %s HTTP/%s" %d',
                    get_client_addr(scope),
                    scope["method"],
                    get_path_with_query_string(scope),
                    scope["http_version"],
                    error.status_code,
                )
            cycle.response_started = cycle.response_complete = True  # the parser's body callbacks come to us
            self._stop_header_timer()
            self.refused_at = self.loop.time()
            self._linger()

        def on_body(self, body: bytes) -> None:
            if self.refused_at is None:
                super().on_body(body)
                return
            self.discarded += len(body)
            if self.discarded > linger.max_bytes:
                self._close()

        def on_message_complete(self) -> None:
            if self.refused_at is None:
                super().on_message_complete()
                return
            self._close()  # the body is read: closing now loses nothing the client sent

        def _linger(self) -> None:
            assert self.refused_at is not None
            self._stop_linger()
            left = self.refused_at + linger.timeout_s - self.loop.time()
            self.linger_timer = self.loop.call_later(max(0.0, min(linger.read_timeout_s, left)), self._close)

        def _stop_linger(self) -> None:
            if self.linger_timer is not None:
                self.linger_timer.cancel()
                self.linger_timer = None

        def _close(self) -> None:
            self._stop_linger()
            if not self.transport.is_closing():
                self.transport.close()

        def _between_requests(self) -> bool:
            return self.cycle is None or self.cycle.response_complete

        def _await_headers(self) -> None:
            self.header_timer = self.loop.call_later(header_timeout_s, self._headers_late)

        def _stop_header_timer(self) -> None:
            if self.header_timer is not None:
                self.header_timer.cancel()
                self.header_timer = None

        def _headers_late(self) -> None:
            if self._between_requests() and not self.transport.is_closing():
                self.transport.close()

    GuardedProtocol.__name__ = GuardedProtocol.__qualname__ = f"Guarded{protocol.__name__}"
    return GuardedProtocol
