"""Bounds on what one request may hold (stop strings, logit_bias, prompts, token ids, JSON values): each a setting,
refused with a 413 naming it before the request model validates the body; and large bodies parse as small ones do."""

from __future__ import annotations

import json

import pytest
from fastapi.testclient import TestClient

from server.api.app import create_app
from server.api.limits import count_values, values_outside_strings
from server.settings import Settings
from tests.server.helpers import assert_error, make_settings

LIMITS = {
    "max_stop_strings": 3,
    "max_stop_chars": 10,
    "max_logit_bias": 2,
    "max_inputs": 4,
    "max_input_symbols": 50,
    "max_request_symbols": 80,
    "max_body_values": 200,
}


@pytest.fixture(scope="module")
def bounded(checkpoints_dir):
    app = create_app(make_settings(checkpoints_dir, **LIMITS))
    with TestClient(app) as test_client:
        app.state.engine.wait_loaded()
        yield test_client


@pytest.mark.parametrize(
    "path, fields, fragment",
    [
        ("/v1/generate", {"stop": ["a", "b", "c", "d"]}, "(max_stop_strings)"),
        ("/v1/completions", {"stop": ["abcdef", "ghijkl"]}, "12 characters together; the limit is 10 (max_stop_chars)"),
        ("/v1/generate", {"stop": "x" * 11}, "(max_stop_chars)"),
        ("/v1/completions", {"logit_bias": {"1": 1, "2": 1, "3": 1}}, "logit_bias has 3 entries"),
        ("/v1/completions", {"n": 5}, "n is 5; the limit is 4 (max_inputs)"),
        ("/v1/completions", {"prompt": ["a"] * 5}, "lists 5 prompts"),
        ("/v1/completions", {"prompt": [1] * 51}, "prompt 0 has 51 token ids; the limit is 50"),
        ("/v1/completions", {"prompt": [[1] * 45, [1] * 45]}, "90 token ids together; the limit is 80"),
        ("/v1/completions", {"prompt": [1] * 300}, "(max_body_values)"),
    ],
)
def test_a_request_past_a_bound_is_413_naming_it(path: str, fields: dict, fragment: str, bounded) -> None:
    body = {"model": "text-lrnn", "prompt": "x", "max_tokens": 1, **fields}
    assert_error(bounded.post(path, json=body), 413, "request_too_large", fragment)


def test_a_request_at_every_bound_is_served(bounded) -> None:
    body = {
        "model": "text-lrnn",
        "prompt": [[1] * 40, [2] * 40],
        "max_tokens": 2,
        "stop": ["ab", "cde", "fghij"],
        "logit_bias": {"1": 1, "2": -1},
        "n": 2,
    }
    response = bounded.post("/v1/completions", json=body)
    assert response.status_code == 200, response.text
    assert len(response.json()["choices"]) == 4


def test_the_value_count_is_a_bound_that_strings_do_not_break() -> None:
    body = json.dumps({"a": [1, 2, [3, {"b": "x,[{"}]], "c": 'q\\",,:'}).encode()
    exact = 12  # {...}, [1, ...], 1, 2, [3, ...], 3, {...}, 2 strings, 3 keys
    assert count_values(body) > exact and values_outside_strings(body, 100) == exact
    assert values_outside_strings(b'{"a": "x\\\\", "b": "y\\",z"}', 100) == 5  # the object, 2 keys, 2 strings
    many = json.dumps({str(key): 1 for key in range(20_000)}).encode()
    assert 100 < values_outside_strings(many, 100) < 40_001  # stopped early, past the limit


def test_commas_in_strings_do_not_count_against_the_bound(bounded) -> None:
    body = {"model": "text-lrnn", "prompt": "x", "max_tokens": 1, "user": ",[{" * 500}
    assert bounded.post("/v1/completions", json=body).status_code == 200


def test_token_ids_written_as_integral_numbers_are_integers(bounded) -> None:
    response = bounded.post(
        "/v1/completions", json={"model": "text-lrnn", "prompt": [1.0, 2], "max_tokens": 1, "echo": True}
    )
    assert response.status_code == 200, response.text
    assert_error(
        bounded.post("/v1/completions", json={"model": "text-lrnn", "prompt": [1.5]}),
        422,
        "invalid_request_error",
        "prompt.tokens.0",
    )


def test_a_large_body_parses_as_a_small_one(checkpoints_dir) -> None:
    """Bodies of THREADED_PARSE_BYTES and more go to orjson, whose refusals (NaN, huge integers) go back to json."""
    app = create_app(make_settings(checkpoints_dir))
    padding = "x" * 300_000
    with TestClient(app) as client:
        app.state.engine.wait_loaded()
        for small, large in [
            (
                b'{"model": "text-lrnn", "prompt": "x", "temperature": NaN}',
                b'{"model": "text-lrnn", "prompt": "x", "temperature": NaN, "user": "' + padding.encode() + b'"}',
            ),
            (
                b'{"model": "text-lrnn", "prompt": "x", "seed": 1' + b"0" * 30 + b', "max_tokens": 1}',
                b'{"model": "text-lrnn", "prompt": "x", "seed": 1'
                + b"0" * 30
                + b', "max_tokens": 1, "user": "'
                + padding.encode()
                + b'"}',
            ),
        ]:
            answers = [
                client.post("/v1/completions", content=body, headers={"content-type": "application/json"})
                for body in (small, large)
            ]
            assert answers[0].status_code == answers[1].status_code, answers[1].text
            if answers[0].status_code != 200:
                assert answers[0].json() == answers[1].json()


def test_the_default_value_bound_holds_a_request_at_the_other_limits() -> None:
    settings = Settings()
    at_limits = (
        settings.max_request_symbols + settings.max_inputs + settings.max_stop_strings + 2 * settings.max_logit_bias
    )
    # a schema of structured_max_chars characters holds fewer values and keys than characters
    assert settings.max_body_values >= at_limits + settings.structured_max_chars
