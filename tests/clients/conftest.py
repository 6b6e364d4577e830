"""The clients are tested against a live server on the tiny checkpoints of the server tests (the same fixtures as
tests/server/conftest.py's, built from the same helpers)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.server.checkpoints import write_checkpoints
from tests.server.helpers import make_settings
from tests.server.live import LiveServer, serve


@pytest.fixture(scope="session")
def checkpoints_dir(tmp_path_factory) -> Path:
    return write_checkpoints(tmp_path_factory.mktemp("checkpoints"))


@pytest.fixture(scope="module")
def live(checkpoints_dir) -> Iterator[LiveServer]:
    with serve(make_settings(checkpoints_dir)) as server:
        yield server
