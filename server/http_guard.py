"""What a request must pass before the app reads its body, and the time a client may take to send it.

``RequestGuard`` (ASGI middleware) decides from the headers alone, before a byte of the body is read: the API key
where a path needs one (401), then the body's declared size (413, ``max_body_bytes``). A body without a
``Content-Length`` (chunked) is counted as it is read and refused once it passes the limit, and a body that takes
longer than ``body_timeout_s`` to arrive gets 408. Either way the server holds at most the limit plus one chunk.

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
from collections.abc import Callable

from pydantic import SecretStr
from starlette.datastructures import Headers
from starlette.responses import Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from server.errors import APIError, InputTooLarge, RequestTimeout, Unauthorized
from server.json_body import BodyRefused


class RequestGuard:
    def __init__(
        self,
        app: ASGIApp,
        api_key: SecretStr | None,
        needs_key: Callable[[str], bool],
        max_body_bytes: int,
        body_timeout_s: float,
        refuse: Callable[[APIError], Response],
    ) -> None:
        """``needs_key(path)``: whether that path needs the API key (when one is set); ``refuse(error)``: the
        response to an error found here, the app's own error body."""
        self.app, self.needs_key, self.refuse = app, needs_key, refuse
        self.api_key = None if api_key is None else api_key.get_secret_value().encode()
        self.max_body_bytes, self.body_timeout_s = max_body_bytes, body_timeout_s

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = Headers(scope=scope)
        error = self._refusal(scope["path"], headers)
        if error is not None:  # the body is not read: the connection closes rather than read it as the next request
            return await closing(self.refuse(error))(scope, receive, send)
        await self.app(scope, LimitedBody(receive, self.max_body_bytes, self.body_timeout_s), send)

    def _refusal(self, path: str, headers: Headers) -> APIError | None:
        if self.api_key is not None and self.needs_key(path):
            scheme, _, token = headers.get("authorization", "").partition(" ")
            if scheme.lower() != "bearer" or not secrets.compare_digest(token.encode(), self.api_key):
                return Unauthorized("a valid API key is needed: 'Authorization: Bearer <key>'")
        declared = headers.get("content-length", "")
        if declared.isdigit() and int(declared) > self.max_body_bytes:
            return InputTooLarge(f"the body has {declared} bytes; the limit is {self.max_body_bytes} (max_body_bytes)")
        return None


def closing(response: Response) -> Response:
    """``response`` with ``Connection: close``: for an answer given before its request's body was read to the end
    (a refusal from the headers, a body too large or too slow), whose connection holds the rest of that body where
    the next request would begin. uvicorn closes the connection once the response is sent (RFC 9110 section 15.5.9:
    a 408's server "SHOULD send the close connection option")."""
    response.headers["Connection"] = "close"
    return response


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
