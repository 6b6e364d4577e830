"""Routes that read a JSON body: a body sent as anything but JSON is 415; one that is not JSON, whatever the parser
fails on, or that nests deeper than the parser reaches, is 422 with the usual error body. NaN and Infinity parse; the
request models refuse them by field.
"""

from __future__ import annotations

import asyncio
import json
import sys
from collections.abc import Callable, Coroutine
from typing import Any

import orjson
from fastapi import Request, Response
from fastapi.routing import APIRoute
from starlette.exceptions import HTTPException
from starlette.types import Receive, Scope

from server.api.limits import BODY_CHECKS, BodyCheck, check_body_values
from server.errors import APIError, InvalidInput, UnsupportedMediaType


class BodyRefused(HTTPException):
    """An ``APIError`` met while FastAPI reads a body, raised as the one exception FastAPI passes on from there; the app
    answers ``error``, closing the connection where ``body_unread``."""

    def __init__(self, error: APIError, body_unread: bool = False) -> None:
        super().__init__(error.status_code, error.message)
        self.error, self.body_unread = error, body_unread


# Bodies of at least this many bytes are parsed on a thread by orjson (smaller: inline, by json, whose errors and
# depth message the 422s quote), so that a large body does not hold the event loop.
THREADED_PARSE_BYTES = 256 * 1024


class JSONBodyRequest(Request):
    """A request whose JSON body is bounded in values before it is parsed (413), and whose fields ``check`` refuses past
    their limits before the request model validates them."""

    def __init__(self, scope: Scope, receive: Receive, check: BodyCheck | None = None) -> None:
        super().__init__(scope, receive)
        self.check = check

    async def json(self) -> Any:
        if not hasattr(self, "_json"):
            body = await self.body()
            settings = self.app.state.settings
            try:
                await check_body_values(body, settings)
                self._json = await parse_large_json(body) if len(body) >= THREADED_PARSE_BYTES else parse_json(body)
                if self.check is not None:
                    self.check(self._json, settings)
            except APIError as error:
                raise BodyRefused(error) from None
        return self._json


async def parse_large_json(body: bytes) -> Any:
    """``parse_json`` of a large body, on a thread by orjson; what orjson refuses goes to ``parse_json`` (on the thread)
    for its semantics and messages."""
    try:
        return await asyncio.to_thread(orjson.loads, body)
    except orjson.JSONDecodeError:
        return await asyncio.to_thread(parse_json, body)


def parse_json(body: bytes) -> Any:
    """``json.loads``, its ValueErrors raised as JSONDecodeError (which FastAPI answers 422), and nesting past its reach
    refused (:class:`BodyRefused`, 422) naming the depth reachable from this frame."""
    try:
        return json.loads(body)
    except json.JSONDecodeError:
        raise
    except RecursionError:
        reachable, unreachable = 0, sys.getrecursionlimit()
        while unreachable - reachable > 1:
            depth = (reachable + unreachable) // 2
            try:
                json.loads("[" * depth + "]" * depth)
                reachable = depth
            except RecursionError:
                unreachable = depth
        raise BodyRefused(
            InvalidInput(
                f"the body nests arrays and objects deeper than this server's JSON parser reaches: {reachable} "
                f"levels (Python's recursion limit, {sys.getrecursionlimit()} calls, less those that lead to it)"
            )
        ) from None
    except ValueError as error:
        start = getattr(error, "start", 0)  # a UnicodeDecodeError's byte offset
        raise json.JSONDecodeError(str(error), body.decode("utf-8", "replace"), start) from error


class JSONBodyRoute(APIRoute):
    """A route whose body, if it has one, is JSON."""

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handler = super().get_route_handler()
        if self.body_field is None:
            return handler
        annotation = self.body_field.field_info.annotation
        check = BODY_CHECKS.get(annotation) if isinstance(annotation, type) else None

        async def json_body_handler(request: Request) -> Response:
            if not is_json(request.headers.get("content-type", "")):
                raise UnsupportedMediaType(
                    f"the body must be JSON, sent with Content-Type: application/json (got "
                    f"{request.headers.get('content-type') or 'no Content-Type'})"
                )
            return await handler(JSONBodyRequest(request.scope, request.receive, check))

        return json_body_handler


def is_json(content_type: str) -> bool:
    """application/json or application/<anything>+json, with any parameters (FastAPI's rule)."""
    media_type = content_type.partition(";")[0].strip().lower()
    return media_type == "application/json" or (media_type.startswith("application/") and media_type.endswith("+json"))
