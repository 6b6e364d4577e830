"""Routes that read a JSON body (FastAPI's "custom Request and APIRoute class"): a body sent as anything but
JSON is refused with 415, and a body that is not JSON with 422 and the usual error body, whatever the parser
fails on (FastAPI answers 400 to invalid UTF-8, nesting too deep or an integer of more than 4,300 digits).
NaN and Infinity parse; the request models refuse them by field ("Input should be a finite number")."""

from __future__ import annotations

import json
from collections.abc import Callable, Coroutine
from typing import Any

from fastapi import Request, Response
from fastapi.routing import APIRoute

from server.errors import UnsupportedMediaType


class JSONBodyRequest(Request):
    async def json(self) -> Any:
        body = await self.body()
        try:
            return json.loads(body)
        except json.JSONDecodeError:
            raise
        except (ValueError, RecursionError) as error:  # FastAPI turns only JSONDecodeError into a 422
            start = getattr(error, "start", 0)  # a UnicodeDecodeError's byte offset
            raise json.JSONDecodeError(str(error), body.decode("utf-8", "replace"), start) from error


class JSONBodyRoute(APIRoute):
    """A route whose body, if it has one, is JSON."""

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handler = super().get_route_handler()
        if self.body_field is None:
            return handler

        async def json_body_handler(request: Request) -> Response:
            if not is_json(request.headers.get("content-type", "")):
                raise UnsupportedMediaType(
                    f"the body must be JSON, sent with Content-Type: application/json (got "
                    f"{request.headers.get('content-type') or 'no Content-Type'})"
                )
            return await handler(JSONBodyRequest(request.scope, request.receive))

        return json_body_handler


def is_json(content_type: str) -> bool:
    """application/json or application/<anything>+json, with any parameters (FastAPI's rule)."""
    media_type = content_type.partition(";")[0].strip().lower()
    return media_type == "application/json" or (media_type.startswith("application/") and media_type.endswith("+json"))
