"""Routes that read a JSON body (FastAPI's "custom Request and APIRoute class"): a body sent as anything but
JSON is refused with 415, and a body that is not JSON with 422 and the usual error body, whatever the parser
fails on (FastAPI answers 400 to invalid UTF-8 or an integer of more than 4,300 digits). A body that nests arrays
and objects deeper than the parser can follow is 422 too, with a message that says so and names the depth it
reaches. NaN and Infinity parse; the request models refuse them by field ("Input should be a finite number")."""

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
    """An ``APIError`` met while FastAPI reads a body (too large, too slow, nested too deeply), raised as the one
    kind of exception FastAPI passes on from there (it answers 400 to any other); the app answers ``error``, and closes
    the connection where ``body_unread`` (the rest of the body is still on it)."""

    def __init__(self, error: APIError, body_unread: bool = False) -> None:
        super().__init__(error.status_code, error.message)
        self.error, self.body_unread = error, body_unread


# Bodies of at least this many bytes are parsed on a thread by orjson (smaller: inline, by json, whose errors and
# depth message the 422s quote): a body at the limits (2^20 token ids) takes ~90 ms of orjson and ~200 ms of json.
THREADED_PARSE_BYTES = 256 * 1024


class JSONBodyRequest(Request):
    """A request whose body is JSON: its size in JSON values is bounded before it is parsed (413), and ``check``
    refuses fields past their limits before the request model validates them (``server/api/limits.py``)."""

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
    """``parse_json`` of a large body, on a thread by orjson; a body orjson refuses (NaN, integers past 64 bits, a
    parse error) goes to ``parse_json`` on the thread, for its semantics and messages."""
    try:
        return await asyncio.to_thread(orjson.loads, body)
    except orjson.JSONDecodeError:
        return await asyncio.to_thread(parse_json, body)


def parse_json(body: bytes) -> Any:
    """``json.loads``, with its ValueErrors as JSONDecodeError (FastAPI turns only that into a 422) and nesting
    past its reach refused with the depth it reaches from here. The parser recurses once per level of arrays and
    objects within Python's recursion limit, so that depth is the limit less the calls that lead here; it is
    measured in this frame, where the body was parsed, by parsing nested arrays."""
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
