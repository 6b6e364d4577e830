"""The ``no_network`` fixture (tests/conftest.py) really refuses connections."""

from __future__ import annotations

import socket

import pytest


def test_no_network_refuses_a_connection(no_network) -> None:
    with pytest.raises(AssertionError, match="network connection"):
        socket.create_connection(("127.0.0.1", 9))
    with socket.socket() as raw, pytest.raises(AssertionError, match="network connection"):
        raw.connect(("127.0.0.1", 9))
