"""A real uvicorn server on a free port, in a thread, with the HTTP protocol the server runs, for tests that need real
HTTP (streaming, disconnects, the openai client)."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import httpx
import uvicorn
from fastapi import FastAPI

from server.api.app import create_app, http_protocol
from server.engine.engine import Engine
from server.settings import Settings


@dataclass
class LiveServer:
    url: str
    app: FastAPI

    @property
    def engine(self) -> Engine:
        return self.app.state.engine


@contextmanager
def serve(settings: Settings) -> Iterator[LiveServer]:
    app = create_app(settings)
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)  # TCP_NODELAY needs the proto
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(
        uvicorn.Config(app, log_level="warning", http=http_protocol(app), timeout_graceful_shutdown=5)
    )
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    live = LiveServer(f"http://127.0.0.1:{sock.getsockname()[1]}", app)
    try:
        wait_healthy(live.url)
        yield live
    finally:
        server.should_exit = True
        thread.join(10)
        sock.close()


def wait_healthy(url: str, timeout: float = 300.0) -> None:
    """Until /health answers 200: loading includes compiling the CPU decode kernels (numba, once per process: up to
    ~20 s on a loaded 2-core machine), which the server does before it is ready rather than in a first request."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"{url}/health", timeout=1.0).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.02)
    raise TimeoutError(f"{url} did not become healthy in {timeout} s")
