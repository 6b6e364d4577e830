"""The OpenAPI schema (/openapi.json): every error status a route answers, with the error body, the settings' limits,
and once the models are loaded what each served model accepts. Limits that depend on measured speed and memory are in
each model's ``limits`` in /v1/models.
"""

from __future__ import annotations

import copy
import re
from collections.abc import Callable, Iterable
from typing import Any

from fastapi import FastAPI

from server.api.protocol import SETTING, ErrorResponse
from server.models.store import ServedModel
from server.settings import Settings

ERROR_RESPONSES: dict[int | str, dict[str, Any]] = {
    status: {"model": ErrorResponse, "description": description}
    for status, description in {
        400: "the request cannot be served as asked (e.g. a model of the other kind)",
        401: "a valid API key is needed",
        404: "unknown model",
        408: "the body took longer than body_timeout_s to arrive",
        409: "conflicts with what is served (a model id taken; a shipped model cannot be deleted)",
        413: "over a server or model limit, or a body over max_body_bytes (the message names it)",
        415: "the body is not sent as JSON (Content-Type: application/json)",
        422: "invalid body or value (the message names the field, position or character)",
        429: "the queue is full now; retry after Retry-After seconds",
        500: "a model call failed (only the requests of that call)",
        503: "loading, draining, or shutting down past the drain timeout",
    }.items()
}


def errors(*statuses: int) -> dict[int | str, dict[str, Any]]:
    """The OpenAPI ``responses`` entries of these error statuses."""
    return {status: ERROR_RESPONSES[status] for status in statuses}


GENERATION_RESPONSES = {
    200: {"content": {"text/event-stream": {}}, "description": "the answer; with stream: Server-Sent Events"},
    **errors(400, 401, 404, 408, 413, 415, 422, 429, 500, 503),
}


def schema_for(app: FastAPI, settings: Settings) -> Callable[[], dict[str, Any]]:
    """``app.openapi``: FastAPI's schema with the settings' limits written in and the served models' constraints,
    rebuilt when the set of served models changes."""
    built: dict[tuple[str, ...], dict[str, Any]] = {}

    def openapi() -> dict[str, Any]:
        engine = getattr(app.state, "engine", None)
        models = engine.models if engine is not None and engine.state == "ready" else {}
        key = tuple(sorted(models))
        if key not in built:
            schema = copy.deepcopy(FastAPI.openapi(app))
            _write_settings(schema, settings)
            if models:
                _describe_models(schema, list(models.values()))
            built.clear()
            built[key] = schema
        return built[key]

    return openapi


def _write_settings(node: Any, settings: Settings) -> None:
    """Replace each ``SETTING`` marker (``server/api/protocol.py``) by its keywords with the settings' values."""
    children: Iterable[Any]
    if isinstance(node, dict):
        for keyword, name in node.pop(SETTING, {}).items():
            node[keyword] = getattr(settings, name)
        children = node.values()
    elif isinstance(node, list):
        children = node
    else:
        return
    for child in children:
        _write_settings(child, settings)


def _describe_models(schema: dict[str, Any], models: list[ServedModel]) -> None:
    """Each request's ``model`` lists the served ids of its kind, with one ``anyOf`` branch per model stating what it
    accepts."""
    components = schema["components"]["schemas"]
    transducers = [served for served in models if served.kind == "transduce"]
    language_models = [served for served in models if served.kind == "generate"]
    _per_model(components["TransduceRequest"], transducers, _accepts_symbols)
    _per_model(components["GenerateRequest"], language_models, _accepts_bias)
    _per_model(components["CompletionRequest"], language_models, _accepts_token_ids)
    _per_model(components["ChatRequest"], language_models, lambda served: {})
    ids = sorted(served.id for served in models)
    for parameter in schema["paths"]["/v1/models/{model_id}"]["get"]["parameters"]:
        if parameter["name"] == "model_id":
            parameter["schema"]["enum"] = ids


def _per_model(
    request: dict[str, Any], models: list[ServedModel], accepts: Callable[[ServedModel], dict[str, Any]]
) -> None:
    if not models:  # none of this kind: the route answers 400 or 404 to any model
        return
    request["properties"]["model"]["enum"] = sorted(served.id for served in models)
    request["anyOf"] = [
        {"properties": {"model": {"const": served.id}, **accepts(served)}, "required": ["model"]}
        for served in sorted(models, key=lambda served: served.id)
    ]


def _accepts_symbols(served: ServedModel) -> dict[str, Any]:
    assert served.config.alphabet is not None  # a transducer's config has its alphabet
    alphabet = "".join(re.sub(r"([\\\]\[^-])", r"\\\1", symbol) for symbol in served.config.alphabet)
    return {"inputs": {"items": {"pattern": f"^[{alphabet}]*$"}}}


def _accepts_bias(served: ServedModel) -> dict[str, Any]:
    assert served.tokenizer is not None  # a language model is served with its tokenizer
    return {"logit_bias": {"propertyNames": {"pattern": decimals_below(served.tokenizer.vocab_size)}}}


def _accepts_token_ids(served: ServedModel) -> dict[str, Any]:
    """``maximum`` binds numbers only and ``items`` arrays only, so one overlay bounds a token-id list and a
    batch of them, and leaves text prompts alone."""
    assert served.tokenizer is not None  # a language model is served with its tokenizer
    top = served.tokenizer.vocab_size - 1
    return {**_accepts_bias(served), "prompt": {"items": {"maximum": top, "items": {"maximum": top}}}}


def decimals_below(bound: int) -> str:
    """A pattern matching the decimals 0 .. bound - 1 without leading zeros."""
    top = str(bound - 1)
    branches = ["0"]
    if len(top) > 1:
        branches.append(f"[1-9][0-9]{{0,{len(top) - 2}}}")
    for position, digit in enumerate(top):
        lowest = 1 if position == 0 else 0
        if int(digit) > lowest:
            rest = len(top) - position - 1
            branches.append(f"{top[:position]}[{lowest}-{int(digit) - 1}]" + (f"[0-9]{{{rest}}}" if rest else ""))
    branches.append(top)
    return "^(" + "|".join(dict.fromkeys(branches)) + ")$"
