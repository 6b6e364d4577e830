"""Helpers that more than one test module of tests/server uses (tests/clients too): the settings of a test
server and a wait for a condition. Fixtures stay in conftest.py; a live server is live.py's, the tiny
checkpoints checkpoints.py's."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from server.settings import Settings


def make_settings(models: Path | list[Path], **overrides) -> Settings:
    """The settings of a test server on the checkpoints of ``models`` alone (not the shipped ones)."""
    return Settings(
        **{
            "models": models,
            "shipped_models": False,
            "device": "cpu",
            "batch_wait_ms": 2.0,
            "torch_threads": 1,
            **overrides,
        }
    )


def assert_error(response, status: int, error_type: str, *fragments: str) -> dict:
    """The response is an error of the API's shape with that status and type, its message holding each fragment."""
    assert response.status_code == status, response.text
    body = response.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type"}
    assert body["error"]["type"] == error_type
    for fragment in fragments:
        assert fragment in body["error"]["message"]
    return body


def wait_for(condition, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise TimeoutError("condition not reached")
        time.sleep(0.02)


def before_each_decode_step(monkeypatch: pytest.MonkeyPatch, model, before: Callable[[torch.Tensor], None]) -> None:
    """Call ``before(tokens)`` at the start of each decode step of ``model`` from now on: ``step`` (the logits) and
    ``step_greedy`` (the picks alone, which the engine calls where every row of a step is greedy)."""
    for name in ("step", "step_greedy"):
        original = getattr(model, name)

        def wrapped(tokens, cache, original=original):
            before(tokens)
            return original(tokens, cache)

        monkeypatch.setattr(model, name, wrapped)
