"""The errors a request can meet, each with the HTTP status and error type the API reports (docs/api.md, Errors).

The engine raises them without knowing about HTTP; the app turns them into ``{"error": {...}}`` bodies.
"""

from __future__ import annotations

from typing import Any


class APIError(Exception):
    status_code = 500
    error_type = "internal_error"

    def __init__(self, message: str, retry_after_s: int | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.retry_after_s = retry_after_s

    def __init_subclass__(cls, status: int, error_type: str, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        cls.status_code, cls.error_type = status, error_type


class BadRequest(APIError, status=400, error_type="invalid_request_error"):
    """A well-formed request that cannot be served as asked (e.g. a generate model on /v1/transduce)."""


class Unauthorized(APIError, status=401, error_type="authentication_error"):
    """No API key, or a wrong one, where one is configured."""


class UnknownModel(APIError, status=404, error_type="not_found_error"):
    def __init__(self, model: str, known: list[str]) -> None:
        super().__init__(f"model {model!r} does not exist; served models: {known}")


class Conflict(APIError, status=409, error_type="conflict_error"):
    """The request conflicts with what the server holds (a model id taken, a shipped model to delete)."""


class InputTooLarge(APIError, status=413, error_type="request_too_large"):
    """More symbols, inputs or prompt tokens than the configured limits, or a body of more bytes."""


class RequestTimeout(APIError, status=408, error_type="request_timeout"):
    """The request's body took longer than ``body_timeout_s`` to arrive."""


class InvalidInput(APIError, status=422, error_type="invalid_request_error"):
    """An invalid body or value, e.g. a symbol outside the alphabet (the message names position and character)."""


class UnsupportedMediaType(APIError, status=415, error_type="invalid_request_error"):
    """A body sent with a Content-Type other than JSON to a route that reads JSON."""


class Overloaded(APIError, status=429, error_type="overloaded_error"):
    """The waiting queue is full: come back after ``retry_after_s``."""


class Unavailable(APIError, status=503, error_type="service_unavailable"):
    """Loading, draining or failed: nothing is served now."""


class ModelFailure(APIError, status=500, error_type="internal_error"):
    """A model call failed inside the engine; only the requests of that call see it."""
