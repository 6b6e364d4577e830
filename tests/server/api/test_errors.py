"""Every error path of docs/api.md (HTTP API, Errors and Limits): status, {"error": {"message", "type"}} body, and
no 5xx for bad input."""

from __future__ import annotations

import asyncio
import itertools
import json
import re
import threading
from collections.abc import Iterable

import pytest
from fastapi.testclient import TestClient

import server.engine.engine
from server.api.app import create_app
from tests.server.helpers import assert_error, make_settings


@pytest.fixture(scope="module")
def limited(checkpoints_dir):
    settings = make_settings(
        checkpoints_dir, max_input_symbols=50, max_request_symbols=80, max_inputs=4, max_tokens=40, max_waiting=1
    )
    app = create_app(settings)
    with TestClient(app) as test_client:
        app.state.engine.wait_loaded()
        yield test_client


@pytest.mark.parametrize(
    "path, body",
    [
        ("/v1/transduce", {"model": "nope", "inputs": ["0"]}),
        ("/v1/generate", {"model": "nope", "prompt": "x"}),
        ("/v1/completions", {"model": "nope", "prompt": "x"}),
    ],
)
def test_unknown_model_is_404(path: str, body: dict, limited) -> None:
    assert_error(limited.post(path, json=body), 404, "not_found_error", "'nope'", "parity-lrnn")


def test_symbol_outside_the_alphabet_names_position_and_character(limited) -> None:
    response = limited.post("/v1/transduce", json={"model": "parity-lrnn", "inputs": ["0101", "01a1"]})
    assert_error(response, 422, "invalid_request_error", "inputs[1]", "'a'", "position 2", "'01'")


@pytest.mark.parametrize(
    "body, fragment",
    [
        ({"model": "parity-lrnn"}, "body.inputs: Field required"),
        ({"model": "parity-lrnn", "inputs": "0101"}, "body.inputs"),
        ({"model": "parity-lrnn", "inputs": []}, "body.inputs"),
        ({"model": "parity-lrnn", "inputs": [1]}, "body.inputs.0"),
        ({"model": "parity-lrnn", "inputs": ["0"], "outputs": "some"}, "body.outputs"),
        ({"model": "parity-lrnn", "inputs": ["0"], "extra": 1}, "body.extra"),
        ({"model": "parity-lrnn", "inputs": [""]}, "inputs[0] is empty"),
    ],
)
def test_invalid_transduce_body_is_422(body: dict, fragment: str, limited) -> None:
    assert_error(limited.post("/v1/transduce", json=body), 422, "invalid_request_error", fragment)


@pytest.mark.parametrize(
    "path, body, fragment",
    [
        ("/v1/generate", {"model": "text-lrnn", "prompt": "x", "temperature": -1}, "body.temperature"),
        ("/v1/generate", {"model": "text-lrnn", "prompt": "x", "top_p": 0}, "body.top_p"),
        ("/v1/generate", {"model": "text-lrnn", "prompt": "x", "max_tokens": -1}, "body.max_tokens"),
        ("/v1/generate", {"model": "text-lrnn", "prompt": "x", "max_tokens": 41}, "limit is 40"),
        ("/v1/generate", {"model": "text-lrnn", "prompt": ""}, "body.prompt: String should have at least 1"),
        ("/v1/completions", {"model": "text-lrnn", "prompt": []}, "body.prompt"),
        ("/v1/completions", {"model": "text-lrnn", "prompt": "x", "best_of": 2}, "body.best_of"),
        ("/v1/completions", {"model": "text-lrnn", "prompt": "x", "presence_penalty": 3}, "body.presence_penalty"),
        ("/v1/completions", {"model": "text-lrnn", "prompt": "x", "repetition_penalty": 0}, "body.repetition_penalty"),
        ("/v1/completions", {"model": "text-lrnn", "prompt": "x", "logit_bias": {"5": 101}}, "body.logit_bias"),
        ("/v1/completions", {"model": "text-lrnn", "prompt": "x", "logit_bias": {"x": 1}}, "logit_bias key 'x'"),
        ("/v1/completions", {"model": "text-lrnn", "prompt": "x", "logit_bias": {"²": 1}}, "logit_bias key '²'"),
        ("/v1/completions", {"model": "text-lrnn", "prompt": "x", "logit_bias": {"٣": 1}}, "logit_bias key '٣'"),
        ("/v1/completions", {"model": "text-lrnn", "prompt": "x", "logit_bias": {"07": 1}}, "logit_bias key '07'"),
        ("/v1/completions", {"model": "text-lrnn", "prompt": "x", "logit_bias": {"9" * 5000: 1}}, "not a token id"),
        ("/v1/generate", {"model": "text-lrnn", "prompt": "x", "logit_bias": {"99999": 1}}, "not a token id"),
        ("/v1/completions", {"model": "text-lrnn", "prompt": "x", "suffix": "y"}, "body.suffix"),
        ("/v1/completions", {"model": "text-lrnn", "prompt": "x", "logprobs": 9}, "body.logprobs"),
    ],
)
def test_invalid_generation_body_is_422(path: str, body: dict, fragment: str, limited) -> None:
    assert_error(limited.post(path, json=body), 422, "invalid_request_error", fragment)


@pytest.mark.parametrize(
    "body, fragment",
    [
        (b"{not json", "Expecting property name"),
        (b'{"model": "\xff"}', "can't decode byte 0xff"),  # FastAPI alone answers these three 400
        (b'{"model": "text-lrnn", "prompt": "x", "seed": ' + b"9" * 5000 + b"}", "4300 digits"),
    ],
)
def test_a_body_that_is_not_json_is_422(body: bytes, fragment: str, limited) -> None:
    response = limited.post("/v1/generate", content=body, headers={"content-type": "application/json"})
    assert_error(response, 422, "invalid_request_error", "the body is not valid JSON", fragment)


def nested_schema(levels: int) -> str:
    """A JSON schema of objects ``levels`` deep (each level nests two JSON objects), as text: ``json.dumps``
    recurses as deeply as ``json.loads``."""
    return '{"type": "object", "properties": {"a": ' * levels + '{"type": "string"}' + "}}" * levels


def test_nesting_past_the_parser_is_refused_with_the_depth_it_reaches(limited) -> None:
    """A valid body (a 500-deep JSON schema) that nests past the parser is not called invalid JSON, and the
    depth the message names is the parser's real one: one level more fails as deep, that many parses."""
    body = f'{{"model": "text-lrnn", "prompt": "x", "structured_outputs": {{"json": {nested_schema(500)}}}}}'
    response = limited.post("/v1/completions", content=body, headers={"content-type": "application/json"})
    message = assert_error(response, 422, "invalid_request_error", "nests arrays and objects deeper")["error"][
        "message"
    ]
    assert "not valid JSON" not in message
    reached = int(re.search(r"reaches: (\d+) levels", message).group(1))
    assert 100 < reached < 1000
    for depth, deeper_than_the_parser in [(reached, False), (reached + 1, True)]:
        nested = b"[" * depth + b"]" * depth
        response = limited.post("/v1/completions", content=nested, headers={"content-type": "application/json"})
        assert response.status_code == 422
        assert ("nests arrays and objects deeper" in response.text) is deeper_than_the_parser, depth


@pytest.mark.parametrize("content_type", ["text/plain", "application/x-www-form-urlencoded", None])
@pytest.mark.parametrize("path", ["/v1/transduce", "/v1/generate", "/v1/completions", "/v1/chat/completions"])
def test_a_body_not_sent_as_json_is_415(path: str, content_type: str | None, limited) -> None:
    headers = {} if content_type is None else {"content-type": content_type}
    response = limited.post(path, content=b'{"model": "parity-lrnn", "inputs": ["0"]}', headers=headers)
    assert_error(response, 415, "invalid_request_error", "Content-Type: application/json", content_type or "no Content")


def test_json_content_types_with_parameters_or_a_suffix_are_json(limited) -> None:
    body = b'{"model": "parity-lrnn", "inputs": ["01"]}'
    for content_type in ["application/json; charset=utf-8", "Application/JSON", "application/vnd.api+json"]:
        assert limited.post("/v1/transduce", content=body, headers={"content-type": content_type}).status_code == 200


@pytest.mark.parametrize("number", ["NaN", "Infinity", "-Infinity", "1e999"])
@pytest.mark.parametrize("field", ["temperature", "top_p", "presence_penalty", "repetition_penalty"])
def test_numbers_must_be_finite(field: str, number: str, limited) -> None:
    body = f'{{"model": "text-lrnn", "prompt": "x", "{field}": {number}}}'.encode()
    response = limited.post("/v1/generate", content=body, headers={"content-type": "application/json"})
    assert_error(response, 422, "invalid_request_error", f"body.{field}: Input should be a finite number")


@pytest.mark.parametrize(
    "field, value", [("max_tokens", "8"), ("max_tokens", True), ("stream", 0), ("stream", "true"), ("temperature", "1")]
)
def test_values_of_another_json_type_are_not_converted(field: str, value, limited) -> None:
    response = limited.post("/v1/generate", json={"model": "text-lrnn", "prompt": "x", field: value})
    assert_error(response, 422, "invalid_request_error", f"body.{field}")


def test_an_integral_number_is_an_integer(limited) -> None:
    body = {"model": "text-lrnn", "prompt": [1.0, 2], "max_tokens": 2.0, "n": 1.0, "seed": 3.0, "logprobs": 0.0}
    assert limited.post("/v1/completions", json=body).status_code == 200
    assert_error(limited.post("/v1/completions", json={**body, "n": 1.5}), 422, "invalid_request_error", "body.n")


def test_max_tokens_left_out_is_the_limit_if_that_is_lower(limited) -> None:
    """/v1/generate's default of 64 is over this server's limit of 40: a request that leaves it out is not refused."""
    body = {"model": "text-lrnn", "prompt": "x", "seed": 0}  # bytes: no end-of-text token
    response = limited.post("/v1/generate", json=body)
    assert response.status_code == 200, response.text
    assert response.json()["usage"]["completion_tokens"] == 40


@pytest.mark.parametrize(
    "path, body, fragment",
    [
        ("/v1/transduce", {"model": "parity-lrnn", "inputs": ["0" * 51]}, "inputs[0] has 51 symbols"),
        ("/v1/transduce", {"model": "parity-lrnn", "inputs": ["0"] * 5}, "5 inputs"),
        ("/v1/transduce", {"model": "parity-lrnn", "inputs": ["0" * 40, "0" * 41]}, "81 symbols"),
        ("/v1/generate", {"model": "text-lrnn", "prompt": "x" * 51}, "51 tokens"),
        ("/v1/completions", {"model": "text-lrnn", "prompt": ["a", "b", "c"], "n": 2}, "limit is 4"),
    ],
)
def test_input_over_the_limit_is_413(path: str, body: dict, fragment: str, limited) -> None:
    assert_error(limited.post(path, json=body), 413, "request_too_large", fragment)


def test_wrong_kind_of_model_is_400(limited) -> None:
    assert_error(
        limited.post("/v1/transduce", json={"model": "text-lrnn", "inputs": ["0"]}), 400, "invalid_request_error"
    )
    assert_error(
        limited.post("/v1/generate", json={"model": "parity-lrnn", "prompt": "0"}), 400, "invalid_request_error"
    )


def test_more_choices_than_the_queue_holds_is_413(limited) -> None:
    """Never servable, so not 429 (a client honouring Retry-After would loop forever); a full queue is 429:
    tests/server/test_live.py."""
    response = limited.post("/v1/completions", json={"model": "text-lrnn", "prompt": "x", "n": 2})  # 2 > max_waiting
    assert_error(response, 413, "request_too_large", "the queue holds at most 1")
    assert "retry-after" not in response.headers


def test_unknown_route_and_method_have_the_error_shape(limited) -> None:
    assert_error(limited.get("/v1/nothing"), 404, "not_found_error")
    assert_error(limited.get("/v1/transduce"), 405, "invalid_request_error")


@pytest.mark.parametrize(
    "body",
    [
        b"",
        b"null",
        b"[]",
        b'"x"',
        b"1e999",
        b'{"model": null}',
        b'{"model": "parity-lrnn", "inputs": [null]}',
        b'{"model": "parity-lrnn", "inputs": ["\\ud800"]}',
        b'{"model": "text-lrnn", "prompt": "\\ud800"}',
        b'{"model": "text-lrnn", "prompt": "x", "seed": -1}',
        b'{"model": "text-lrnn", "prompt": "x", "stop": [1]}',
    ],
)
@pytest.mark.parametrize("path", ["/v1/transduce", "/v1/generate", "/v1/completions"])
def test_bad_input_never_gives_a_5xx(path: str, body: bytes, limited) -> None:
    response = limited.post(path, content=body, headers={"content-type": "application/json"})
    assert response.status_code < 500, response.text
    if response.status_code >= 400:
        assert set(response.json()["error"]) == {"message", "type"}


def test_a_failing_model_call_fails_only_its_requests(checkpoints_dir, monkeypatch) -> None:
    app = create_app(make_settings(checkpoints_dir))
    with TestClient(app) as client:
        app.state.engine.wait_loaded()
        broken = app.state.engine.models["parity-transformer"].model

        def fail(*args, **kwargs):
            raise RuntimeError("simulated device failure")

        monkeypatch.setattr(broken, "final_logits", fail)
        response = client.post("/v1/transduce", json={"model": "parity-transformer", "inputs": ["01"]})
        assert_error(response, 500, "internal_error", "simulated device failure")
        assert client.post("/v1/transduce", json={"model": "parity-lrnn", "inputs": ["01"]}).status_code == 200
        assert client.get("/health").json()["status"] == "degraded"  # the broken folder; the rest serve


def test_503_while_loading(checkpoints_dir, monkeypatch) -> None:
    release = threading.Event()
    load_models = server.engine.engine.load_models

    def slow_load(*args):
        release.wait(10)
        return load_models(*args)

    monkeypatch.setattr(server.engine.engine, "load_models", slow_load)
    app = create_app(make_settings(checkpoints_dir))
    with TestClient(app) as client:
        health = client.get("/health")
        assert health.status_code == 503 and health.json()["status"] == "loading"
        response = client.post("/v1/transduce", json={"model": "parity-lrnn", "inputs": ["0"]})
        assert_error(response, 503, "service_unavailable", "loading")
        assert response.headers["retry-after"] == "1"
        release.set()
        app.state.engine.wait_loaded()
        assert client.get("/health").json()["status"] == "degraded"  # serving, without the broken folder


def test_api_key_guards_v1_only(checkpoints_dir) -> None:
    app = create_app(make_settings(checkpoints_dir, api_key="s3cret"))
    with TestClient(app) as client:
        app.state.engine.wait_loaded()
        response = client.get("/v1/models")
        assert_error(response, 401, "authentication_error", "API key")
        assert response.headers["www-authenticate"] == "Bearer"
        assert_error(client.get("/v1/models", headers={"Authorization": "Bearer wrong"}), 401, "authentication_error")
        assert_error(client.get("/v1/nothing"), 401, "authentication_error")  # which routes exist is not told either
        assert client.get("/v1/models", headers={"Authorization": "Bearer s3cret"}).status_code == 200
        assert client.get("/health").status_code == 200
        assert client.get("/metrics").status_code == 200


@pytest.mark.parametrize(
    "settings, locked",
    [
        ({}, set()),
        ({"metrics_need_api_key": True}, {"/metrics", "/openapi.json", "/docs", "/redoc"}),  # docs follow metrics
        ({"docs_need_api_key": True}, {"/openapi.json", "/docs", "/redoc"}),
        ({"metrics_need_api_key": True, "docs_need_api_key": False}, {"/metrics"}),
    ],
)
def test_api_key_can_guard_metrics_and_the_api_docs(settings: dict, locked: set[str], checkpoints_dir) -> None:
    """/metrics and the schema (with its pages) name the served models: they can need the key too."""
    app = create_app(make_settings(checkpoints_dir, api_key="s3cret", **settings))
    with TestClient(app) as client:
        app.state.engine.wait_loaded()
        for path in ["/metrics", "/openapi.json", "/docs", "/redoc", "/health"]:
            anonymous = client.get(path)
            if path in locked:
                assert_error(anonymous, 401, "authentication_error", "API key")
            else:
                assert anonymous.status_code == 200, path
            assert client.get(path, headers={"Authorization": "Bearer s3cret"}).status_code == 200, path


# --- the body: refused from the headers before it is read, counted as it is read, timed ------------------


@pytest.fixture(scope="module")
def guarded(checkpoints_dir):
    """An app with an API key and a 1,000-byte body limit, called without its lifespan: all that is tested with it
    is decided before a model is needed."""
    return create_app(make_settings(checkpoints_dir, api_key="s3cret", max_body_bytes=1000, body_timeout_s=0.2))


AUTHORIZED = {"authorization": "Bearer s3cret", "content-type": "application/json"}


def post(app, headers: dict[str, str], chunks: Iterable[bytes], ends: bool = True) -> tuple[int, dict, int]:
    """POST /v1/transduce straight through the ASGI ``app``, the body sent as ``chunks`` and then its end (or, if not
    ``ends``, nothing more), the client leaving once the answer has started: the status, the JSON body, and how many
    chunks the app read before it answered."""
    chunks, pulled, sent = iter(chunks), 0, {}

    async def receive() -> dict:
        nonlocal pulled
        if "http.response.start" in sent:  # what the server reads now it discards (server/api/guard.py, Linger)
            return {"type": "http.disconnect"}
        chunk = next(chunks, None)
        if chunk is None and not ends:
            await asyncio.Event().wait()
        pulled += 1
        return {"type": "http.request", "body": chunk or b"", "more_body": chunk is not None}

    async def send(message: dict) -> None:
        sent.setdefault(message["type"], []).append(message)

    scope = {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": "POST",
        "scheme": "http",
        "path": "/v1/transduce",
        "raw_path": b"/v1/transduce",
        "query_string": b"",
        "root_path": "",
        "headers": [(name.encode(), value.encode()) for name, value in headers.items()],
        "client": ("127.0.0.1", 5000),
        "server": ("127.0.0.1", 8000),
    }
    asyncio.run(asyncio.wait_for(app(scope, receive, send), 10))
    body = b"".join(message.get("body", b"") for message in sent["http.response.body"])
    return sent["http.response.start"][0]["status"], json.loads(body), pulled


def test_a_missing_key_is_401_before_the_body_is_read(guarded) -> None:
    headers = {"content-type": "application/json", "content-length": str(100 * 2**20)}  # over the limit too
    status, body, pulled = post(guarded, headers, itertools.repeat(b"0" * 2**16))
    assert (status, body["error"]["type"], pulled) == (401, "authentication_error", 0)


def test_a_body_declared_over_the_limit_is_413_before_it_is_read(guarded) -> None:
    status, body, pulled = post(guarded, {**AUTHORIZED, "content-length": "1001"}, [b" " * 1001])
    assert (status, body["error"]["type"], pulled) == (413, "request_too_large", 0)
    assert body["error"]["message"] == "the body has 1001 bytes; the limit is 1000 (max_body_bytes)"


def test_a_streamed_body_is_refused_once_past_the_limit(guarded) -> None:
    status, body, pulled = post(guarded, AUTHORIZED, itertools.repeat(b" " * 100))  # chunked: no Content-Length
    assert (status, body["error"]["type"], pulled) == (413, "request_too_large", 11)  # 1,100 bytes > 1,000
    assert "the limit (max_body_bytes)" in body["error"]["message"]


def test_a_body_at_the_limit_is_read(guarded) -> None:
    status, body, pulled = post(guarded, {**AUTHORIZED, "content-length": "1000"}, [b"{" * 500, b"}" * 500])
    assert (status, pulled) == (422, 3)  # read to its end, then found not to be JSON
    assert "the body is not valid JSON" in body["error"]["message"]


def test_a_body_that_stops_arriving_is_408(guarded) -> None:
    status, body, pulled = post(guarded, {**AUTHORIZED, "content-length": "100"}, [b'{"model": '], ends=False)
    assert (status, body["error"]["type"], pulled) == (408, "request_timeout", 1)
    assert body["error"]["message"] == "the body took longer than 0.2 s to arrive (body_timeout_s)"


def test_cors_preflight(checkpoints_dir) -> None:
    app = create_app(make_settings(checkpoints_dir, cors_origins=["https://example.org"]))
    with TestClient(app) as client:
        response = client.options(
            "/v1/transduce",
            headers={"Origin": "https://example.org", "Access-Control-Request-Method": "POST"},
        )
        assert response.headers["access-control-allow-origin"] == "https://example.org"
