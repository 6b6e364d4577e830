"""The clients are tested against a live server on the tiny checkpoints of the server tests."""

from tests.server.conftest import checkpoints_dir, live  # noqa: F401 -- fixtures
