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
from hypothesis import HealthCheck, settings
from schemathesis.python import asgi

from server.app import create_app
from server.openapi import decimals_below
from tests.server.conftest import make_settings

CONFIG = Path(__file__).resolve().parents[2] / "schemathesis.toml"
LIMITS = {"max_input_symbols": 48, "max_inputs": 4, "max_tokens": 8}  # small: generated requests stay cheap
# POST /v1/models is answered 413 here: a runtime model added by one generated request would change the set of
# served models that the loaded schema lists (tests/server/test_runtime_models.py tests the route).
FIXED_MODELS = {"runtime_models_max": 0}


@pytest.fixture(scope="module")
def api_schema(checkpoints_dir):
    app = create_app(make_settings(checkpoints_dir, **LIMITS, **FIXED_MODELS))
    with asgi.get_client(app):  # starts the lifespan (schemathesis keeps it until shutdown_lifespans)
        app.state.engine.wait_loaded()
    yield schemathesis.openapi.from_asgi("/openapi.json", app, config=schemathesis.Config.from_path(CONFIG))
    asgi.shutdown_lifespans()


schema = schemathesis.pytest.from_fixture("api_schema")


@schema.parametrize()
@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
def test_the_server_answers_as_its_schema_says(case) -> None:
    case.call_and_validate()


def test_the_schema_lists_models_and_static_limits(api_schema) -> None:
    components = api_schema.raw_schema["components"]["schemas"]
    transduce = components["TransduceRequest"]
    assert transduce["properties"]["model"]["enum"] == ["parity-lrnn", "parity-regulargpt", "parity-transformer"]
    assert transduce["properties"]["inputs"]["maxItems"] == LIMITS["max_inputs"]
    assert transduce["properties"]["inputs"]["items"]["maxLength"] == LIMITS["max_input_symbols"]
    assert {"pattern": "^[01]*$"} == transduce["anyOf"][0]["properties"]["inputs"]["items"]
    assert components["GenerateRequest"]["properties"]["max_tokens"]["maximum"] == LIMITS["max_tokens"]
    assert "x-regularlm-setting" not in str(api_schema.raw_schema)


@pytest.mark.parametrize("bound", [*range(1, 130), 256, 1000, 1001, 50257, 100277])
def test_decimals_below_matches_exactly_the_token_ids(bound: int) -> None:
    pattern = re.compile(decimals_below(bound))
    for number in range(min(bound + 1100, 2 * bound + 10)):
        assert bool(pattern.match(str(number))) == (number < bound), number
    for text in ["", "00", "01", "-1", "1.0", " 1"]:
        assert not pattern.match(text)
