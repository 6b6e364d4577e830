"""Fixtures shared by every test package."""

from __future__ import annotations

import socket

import pytest


@pytest.fixture
def no_network(monkeypatch):
    """Any attempt to open a network connection fails the test (tokenizers, corpora and weights must come from
    the repository or installed packages). Use with ``pytestmark = pytest.mark.usefixtures("no_network")``."""

    def refuse(*args, **kwargs):
        raise AssertionError("a test tried to open a network connection")

    monkeypatch.setattr(socket.socket, "connect", refuse)
    monkeypatch.setattr(socket, "create_connection", refuse)
