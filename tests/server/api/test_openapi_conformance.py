"""/openapi.json against the server, by schemathesis: every check it has, with the repository's
schemathesis.toml, in-process (ASGI, no network), on the tiny checkpoints, a bounded number of cases per route.

The schema lists the served models, so the generated requests reach them: a transducer's inputs in its
alphabet, a language model's token ids in its vocabulary. The same run against a live server:
``st run http://127.0.0.1:8000/openapi.json --checks all`` from the repository root (README).
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from schemathesis import GenerationMode
from schemathesis.python import asgi

from server.api.app import create_app
from server.api.openapi import decimals_below
from tests.server.helpers import make_settings

CONFIG = Path(__file__).resolve().parents[3] / "schemathesis.toml"
LIMITS = {"max_input_symbols": 48, "max_inputs": 4, "max_tokens": 8}  # small: generated requests stay cheap
# POST /v1/models is answered 413 here: a runtime model added by one generated request would change the set of
# served models that the loaded schema lists (tests/server/models/test_runtime_models.py tests the route).
FIXED_MODELS = {"runtime_models_max": 0}


@pytest.fixture(scope="module")
def api_schema(checkpoints_dir):
    app = create_app(make_settings(checkpoints_dir, **LIMITS, **FIXED_MODELS))
    with asgi.get_client(app):  # starts the lifespan: the schema lists the models once they are loaded
        app.state.engine.wait_loaded()
    yield schemathesis.openapi.from_asgi("/openapi.json", app, config=schemathesis.Config.from_path(CONFIG))
    asgi.shutdown_lifespans()


@pytest.fixture
def served_schema(api_schema):
    """The schema, its application started and its models loaded: schemathesis's pytest plugin ends every ASGI
    lifespan after each test, so each test starts it again (the next request would otherwise meet a loading server)."""
    app = api_schema.app
    with asgi.get_client(app):
        app.state.engine.wait_loaded()
        yield api_schema


# Every operation of the schema, each checked with its own cases: through schemathesis's strategies and hypothesis,
# not its pytest plugin (schemathesis 4.32.5's lazy fixture reads a private attribute that pytest 9.2 removed).
# Valid requests to each, and invalid ones to those whose input can be invalid, as `st run` does (any string names a
# model to delete: DELETE has no invalid request).
NO_INVALID_INPUT = [("GET", "/health"), ("GET", "/metrics"), ("GET", "/v1/models"), ("DELETE", "/v1/models/{model_id}")]
TAKE_INPUT = [
    ("POST", "/v1/models"),
    ("GET", "/v1/models/{model_id}"),
    ("POST", "/v1/transduce"),
    ("POST", "/v1/generate"),
    ("POST", "/v1/completions"),
    ("POST", "/v1/chat/completions"),
]
CASES = [
    *[(*operation, GenerationMode.POSITIVE) for operation in NO_INVALID_INPUT + TAKE_INPUT],
    *[(*operation, GenerationMode.NEGATIVE) for operation in TAKE_INPUT],
]


@pytest.mark.parametrize(("method", "path", "mode"), CASES)
def test_the_server_answers_as_its_schema_says(served_schema, method: str, path: str, mode: GenerationMode) -> None:
    @given(case=served_schema[path][method].as_strategy(generation_mode=mode))
    @settings(max_examples=25, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])
    def answers_as_documented(case) -> None:
        case.call_and_validate()

    answers_as_documented()


def test_every_operation_of_the_schema_is_checked(api_schema) -> None:
    operations = {(result.ok().method.upper(), result.ok().path) for result in api_schema.get_all_operations()}
    assert operations == set(NO_INVALID_INPUT + TAKE_INPUT)


def test_the_schema_lists_models_and_static_limits(api_schema) -> None:
    components = api_schema.raw_schema["components"]["schemas"]
    transduce = components["TransduceRequest"]
    assert transduce["properties"]["model"]["enum"] == ["parity-lrnn", "parity-regulargpt", "parity-transformer"]
    assert transduce["properties"]["inputs"]["maxItems"] == LIMITS["max_inputs"]
    assert transduce["properties"]["inputs"]["items"]["maxLength"] == LIMITS["max_input_symbols"]
    assert transduce["anyOf"][0]["properties"]["inputs"]["items"] == {"pattern": "^[01]*$"}
    assert components["GenerateRequest"]["properties"]["max_tokens"]["maximum"] == LIMITS["max_tokens"]
    assert "x-regularlm-setting" not in str(api_schema.raw_schema)


@pytest.mark.parametrize("bound", [*range(1, 130), 256, 1000, 1001, 50257, 100277])
def test_decimals_below_matches_exactly_the_token_ids(bound: int) -> None:
    pattern = re.compile(decimals_below(bound))
    for number in range(min(bound + 1100, 2 * bound + 10)):
        assert bool(pattern.match(str(number))) == (number < bound), number
    for text in ["", "00", "01", "-1", "1.0", " 1"]:
        assert not pattern.match(text)
