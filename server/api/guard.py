"""What a request must pass before the app reads its body, the time a client may take to send it, and what is done
with a body the app answered without reading.

``RequestGuard`` (ASGI middleware) decides from the headers alone, before a byte of the body is read: the API key
where a path needs one (401), then the body's declared size (413, ``max_body_bytes``), then, for a POST to an endpoint
that queues work (/v1/generate, /v1/completions, /v1/transduce), whether the engine's queue has room for it with the
requests already arriving (429, ``EngineFront.arrive``): a refusal under a burst costs no parsing or tokenizing, and
the requests let through go on into the app one per turn of the event loop (:class:`Turnstile`), so that the
refusals are not held up behind their work. A body without a ``Content-Length`` (chunked) is counted as it is read
and refused once it passes the limit, and a body that takes longer than ``body_timeout_s`` to arrive gets 408.
Either way the server holds at most the limit plus one chunk.

Each such answer closes the connection (the rest of the body is on it), but not at once: a client that sends its
body without waiting for ``Expect: 100-continue`` (urllib, requests) is still sending it, and a close under it makes
the client's next send fail with "connection reset" before it reads the answer. Like nginx's lingering close, the
guard reads and discards what is left of the body (:class:`Linger`: a bounded number of bytes, for a bounded time)
after the answer is written and before the connection closes.

``with_header_timeout`` gives uvicorn's HTTP protocol a deadline for a request's headers, which uvicorn does not
have: a connection whose headers are not complete ``header_timeout_s`` after it opened, or after the first byte of
a later request, is closed (without a response: a client reusing an idle connection would read an unasked-for 408 as
the answer to its next request). An idle kept-alive connection, between a response and the next request, is
uvicorn's keep-alive timeout's (``keep_alive_s``), not this one's: a deadline counted from the end of a response
closed connections that a slow reader was about to reuse (below).
"""

from __future__ import annotations

import asyncio
import secrets
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from pydantic import SecretStr
from starlette.datastructures import Headers
from starlette.responses import Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from server.api.json_body import BodyRefused
from server.errors import APIError, InputTooLarge, RequestTimeout, Unauthorized

QUEUED_PATHS = frozenset({"/v1/generate", "/v1/completions", "/v1/transduce"})  # POSTs that take a place in the queue


@dataclass(frozen=True)
class Linger:
    """How much of a body the app answered without reading is read and discarded before its connection closes: at
    most ``max_bytes``, for at most ``timeout_s`` in all and ``read_timeout_s`` without a byte arriving. A client
    still sending past these bounds meets the close (a reset), as it would without lingering."""

    max_bytes: int = 64 * 2**20
    timeout_s: float = 10.0
    read_timeout_s: float = 2.0


class RequestGuard:
    def __init__(
        self,
        app: ASGIApp,
        api_key: SecretStr | None,
        needs_key: Callable[[str], bool],
        max_body_bytes: int,
        body_timeout_s: float,
        refuse: Callable[[APIError], Response],
        arrive: Callable[[], Callable[[], None]] | None = None,
        linger: Linger = Linger(),
    ) -> None:
        """``needs_key(path)``: whether that path needs the API key (when one is set); ``refuse(error)``: the
        response to an error found here, the app's own error body. ``arrive()``: called for a POST to a queued path
        once its headers have passed; it raises an ``APIError`` to refuse the request at once (429), or returns the
        function that ends its arrival, which the guard calls when the request ends if nothing has before."""
        self.app, self.needs_key, self.refuse, self.arrive = app, needs_key, refuse, arrive
        self.api_key = None if api_key is None else api_key.get_secret_value().encode()
        self.max_body_bytes, self.body_timeout_s, self.linger = max_body_bytes, body_timeout_s, linger
        self.turnstile = Turnstile()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = Headers(scope=scope)
        body = RequestBody(receive, headers)
        send = LingeringSend(send, body, self.linger)
        error = self._refusal(scope["path"], headers)
        leave = None
        if error is None and self.arrive is not None and scope["method"] == "POST" and scope["path"] in QUEUED_PATHS:
            try:
                leave = self.arrive()
            except APIError as full:
                error = full
        if error is not None:  # the body is not read: the connection closes rather than read it as the next request
            return await closing(self.refuse(error))(scope, body, send)
        try:
            if leave is not None:
                await self.turnstile.enter()
            await self.app(scope, LimitedBody(body, self.max_body_bytes, self.body_timeout_s), send)
        finally:
            if leave is not None:
                leave()

    def _refusal(self, path: str, headers: Headers) -> APIError | None:
        if self.api_key is not None and self.needs_key(path):
            scheme, _, token = headers.get("authorization", "").partition(" ")
            if scheme.lower() != "bearer" or not secrets.compare_digest(token.encode(), self.api_key):
                return Unauthorized("a valid API key is needed: 'Authorization: Bearer <key>'")
        declared = headers.get("content-length", "")
        if declared.isdigit() and int(declared) > self.max_body_bytes:
            return InputTooLarge(f"the body has {declared} bytes; the limit is {self.max_body_bytes} (max_body_bytes)")
        return None


class Turnstile:
    """Lets requests on into the app one per turn of the event loop, in the order they came. A request's first steps
    in the app (reading, parsing, validating and tokenizing its body) run without a break, and a burst of admitted
    requests let on together would run all of theirs before the loop reads the next connections' headers: the cheap
    refusals from the headers (429) would wait behind all that work. One per turn, each is followed by the loop's I/O,
    where uvicorn reads the headers that have come meanwhile. Each request waits at least one turn, so the requests
    whose headers came with its own are checked first."""

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
        """Let the first request waiting on, and come back on the loop's next turn for the next one."""
        while self._waiting:
            turn = self._waiting.popleft()
            if not turn.done():  # done: its request was cancelled while it waited
                turn.set_result(None)
                assert self._loop is not None  # set by the request that queued this turn
                self._loop.call_soon(self._turn)
                return
        self._turning = False


def closing(response: Response) -> Response:
    """``response`` with ``Connection: close``: for an answer given before its request's body was read to the end
    (a refusal from the headers, a body too large or too slow), whose connection holds the rest of that body where
    the next request would begin. The connection closes once the response is sent and what is left of the body has
    been discarded (:class:`LingeringSend`); RFC 9110 section 15.5.9: a 408's server "SHOULD send the close
    connection option"."""
    response.headers["Connection"] = "close"
    return response


class RequestBody:
    """The request's ``receive``, noting when the body has been read to its end or the client has gone
    (``complete``). A request that declares no body (no ``Content-Length`` or 0, not chunked) is complete at once."""

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
                message = await asyncio.wait_for(self(), min(linger.read_timeout_s, left))
            except asyncio.TimeoutError:
                return
            discarded += len(message.get("body", b""))


class LingeringSend:
    """An ASGI ``send`` that holds a ``Connection: close`` response (but a 408) open after its last byte while the
    request's body, unread, is discarded (``RequestBody.discard``): its last body message goes out with ``more_body`` (uvicorn
    writes the bytes and waits), then an empty last one ends the response and uvicorn closes the connection."""

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
    """An ASGI ``receive`` that refuses (``BodyRefused``, which FastAPI lets through its body reading) a body over
    ``max_bytes`` (413) or one still arriving ``timeout_s`` after it was first asked for (408). Once the body is
    complete it passes messages through untimed: a response watches for the client's disconnect with it."""

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
            message = await asyncio.wait_for(self.receive(), self.deadline - loop.time())
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


def with_header_timeout(protocol: type[asyncio.Protocol], timeout_s: float) -> type[asyncio.Protocol]:
    """uvicorn's HTTP ``protocol`` (its httptools or h11 one: both keep the request in progress as ``cycle``)
    closing a connection whose request headers are not complete ``timeout_s`` after the connection opened or after
    the first byte of a later request arrived.

    Not from the end of the previous response, as before: a client that reads a response late (a loaded load
    generator was ~5 s behind its 64 streams) sends its next request on the connection about when such a deadline
    closes it, and a request that meets the close is reset (httpx ``ReadError``; 1 run in 8 of 384 streams at 64).
    The idle time between requests is bounded by uvicorn's keep-alive timeout instead, which the server sets longer
    than clients keep idle connections (``Settings.keep_alive_s``)."""

    class HeaderTimeoutProtocol(protocol):  # type: ignore[valid-type, misc]
        header_timer: asyncio.TimerHandle | None = None

        def connection_made(self, transport: asyncio.BaseTransport) -> None:
            super().connection_made(transport)
            self._await_headers()

        def data_received(self, data: bytes) -> None:
            if self.header_timer is None and self._between_requests():
                self._await_headers()  # a kept-alive connection's next request: its deadline from its first byte
            super().data_received(data)

        def on_response_complete(self) -> None:
            self._stop_header_timer()
            super().on_response_complete()

        def connection_lost(self, exc: Exception | None) -> None:
            self._stop_header_timer()
            super().connection_lost(exc)

        def _between_requests(self) -> bool:
            return self.cycle is None or self.cycle.response_complete

        def _await_headers(self) -> None:
            self.header_timer = self.loop.call_later(timeout_s, self._headers_late)

        def _stop_header_timer(self) -> None:
            if self.header_timer is not None:
                self.header_timer.cancel()
                self.header_timer = None

        def _headers_late(self) -> None:
            if self._between_requests() and not self.transport.is_closing():
                self.transport.close()

    HeaderTimeoutProtocol.__name__ = HeaderTimeoutProtocol.__qualname__ = f"HeaderTimeout{protocol.__name__}"
    return HeaderTimeoutProtocol
