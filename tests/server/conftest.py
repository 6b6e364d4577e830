"""Fixtures: tiny checkpoints written once per session, a TestClient app and a live uvicorn server."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from server.api.app import create_app
from tests.server.checkpoints import write_checkpoints
from tests.server.helpers import make_settings
from tests.server.live import LiveServer, serve


@pytest.fixture(scope="session")
def checkpoints_dir(tmp_path_factory) -> Path:
    return write_checkpoints(tmp_path_factory.mktemp("checkpoints"))


@pytest.fixture(scope="module")
def client(checkpoints_dir) -> Iterator[TestClient]:
    app = create_app(make_settings(checkpoints_dir))
    with TestClient(app) as test_client:
        app.state.engine.wait_loaded()
        yield test_client


@pytest.fixture(scope="module")
def live(checkpoints_dir) -> Iterator[LiveServer]:
    with serve(make_settings(checkpoints_dir)) as server:
        yield server
