"""Fixtures shared by every test package.

Tests run torch on one intra-op thread: the tiny models gain nothing from more, and on a small machine whose
other cores are busy (a server subprocess, a parallel job) torch's default of one thread per core stalls in
its thread pool (a tiny LRNN step: 0.35 ms on one thread, 86 ms on two with the other core busy).
"""

from __future__ import annotations

import os
import socket

import pytest
import torch

torch.set_num_threads(1)
if not torch.cuda.is_available():  # Triton kernels (model/ops/scan/triton.py) then run in Triton's interpreter;
    os.environ.setdefault("TRITON_INTERPRET", "1")  # it must be set before Triton is first imported


@pytest.fixture
def no_network(monkeypatch):
    """Any attempt to open a network connection fails the test (tokenizers, corpora and weights must come from
    the repository or installed packages). Use with ``pytestmark = pytest.mark.usefixtures("no_network")``."""

    def refuse(*args, **kwargs):
        raise AssertionError("a test tried to open a network connection")

    monkeypatch.setattr(socket.socket, "connect", refuse)
    monkeypatch.setattr(socket, "create_connection", refuse)
