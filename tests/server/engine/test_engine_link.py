"""The API process's link to the engine process: it never blocks the event loop on an engine that does not read,
a late heartbeat makes the engine unresponsive (/health 503) until the next one, and a silent engine's requests in
flight end with 503 after ``engine_timeout_s``. Driven by hand (a link that never reads, a clock given to
``check_engine``), then once with a real engine process stopped by SIGSTOP."""

from __future__ import annotations

import asyncio
import os
import signal
import threading
import time

import pytest
from fastapi.testclient import TestClient

import server.engine.client
from server.api.app import create_app
from server.engine.client import EngineClient, RemoteGeneration
from server.engine.mailbox import Mailbox
from server.errors import Unavailable
from server.metrics import ServerMetrics
from tests.server.helpers import make_settings, wait_for


class NeverReads:
    """An engine's end of the pipe that takes nothing: every write blocks, as on a stopped engine's full pipe."""

    def __init__(self) -> None:
        self.released = threading.Event()

    def send_bytes(self, data: bytes) -> None:
        self.released.wait()
        raise OSError("closed")


@pytest.fixture
def link(checkpoints_dir, monkeypatch):
    client = EngineClient(
        make_settings(checkpoints_dir, engine_heartbeat_timeout_s=5, engine_timeout_s=60), ServerMetrics()
    )
    connection = NeverReads()
    client._connection = connection
    client.state = "ready"
    client._loop = asyncio.new_event_loop()  # the event loop's calls wait there, unrun, unless a test runs its own
    client._writer.start()
    yield client
    connection.released.set()
    client._loop.close()


def test_an_engine_that_does_not_read_never_blocks_the_caller(link, monkeypatch) -> None:
    monkeypatch.setattr(server.engine.client, "SEND_BUFFER_BYTES", 10_000)
    started = time.monotonic()
    for _ in range(5):
        link._send(("transduce", b"x" * 1000))  # each returns at once: the writer thread holds the blocked write
    with pytest.raises(Unavailable, match="not reading its requests"):
        link._send(("transduce", b"x" * 9000))
    link._send_quietly(("cancel", 1))  # a cancellation is never refused
    assert time.monotonic() - started < 5


def test_a_late_heartbeat_makes_the_engine_unresponsive_until_the_next(link) -> None:
    link._last_heard = 100.0
    link.check_engine(104.0)
    assert link.state == "ready"
    link.check_engine(105.5)
    assert link.state == "unresponsive" and "engine not responding: no heartbeat for 5.5 s" in link.detail
    with pytest.raises(Unavailable, match="engine not responding"):
        link.check_serving()
    link._control(("heartbeat", 0.0))
    assert link.state == "ready" and link.detail is None


def test_a_stuck_worker_is_unresponsive_though_heartbeats_come(link) -> None:
    link._last_heard = 100.0
    link._control(("heartbeat", 61.0))
    link.check_engine(100.5)
    assert link.state == "unresponsive" and "worker has not turned" in link.detail


def test_requests_in_flight_end_with_503_after_the_engine_timeout(link) -> None:
    async def scenario() -> tuple[list, BaseException | None]:
        link._loop = asyncio.get_running_loop()
        mailbox = Mailbox(None)
        link._generations[7] = RemoteGeneration(mailbox, [])
        link._transductions[8] = answer = link._loop.create_future()
        link._last_heard = 0.0
        link.check_engine(59.0)
        await asyncio.sleep(0.01)
        assert mailbox.queue.empty() and not answer.done()
        link.check_engine(61.0)
        await asyncio.sleep(0.01)
        return [mailbox.queue.get_nowait()], answer.exception()

    (event,), error = asyncio.run(scenario())
    assert isinstance(event[1], Unavailable) and "engine_timeout_s = 60" in event[1].message
    assert isinstance(error, Unavailable)
    assert link._outbox_bytes > 0  # the cancellations wait for the engine to read again


@pytest.mark.slow
def test_a_stopped_engine_is_found_and_served_again_once_it_resumes(checkpoints_dir) -> None:
    settings = make_settings(checkpoints_dir, engine_process=True, engine_heartbeat_timeout_s=1.5, engine_timeout_s=4)
    engine = EngineClient(settings, ServerMetrics())
    app = create_app(settings, engine)
    with TestClient(app) as client:
        engine.wait_loaded(300)
        answered: dict = {}
        body = {"model": "text-transformer", "prompt": "x", "max_tokens": 4096}
        os.kill(engine.process.pid, signal.SIGSTOP)
        try:
            waiting = threading.Thread(target=lambda: answered.update(response=client.post("/v1/generate", json=body)))
            waiting.start()
            wait_for(lambda: client.get("/health").status_code == 503, timeout=10)
            health = client.get("/health").json()
            assert health["status"] == "unresponsive" and "engine not responding" in health["detail"]
            assert client.post("/v1/transduce", json={"model": "parity-lrnn", "inputs": ["0"]}).status_code == 503
            waiting.join(30)
            assert answered["response"].status_code == 503
            assert "engine_timeout_s" in answered["response"].json()["error"]["message"]
        finally:
            os.kill(engine.process.pid, signal.SIGCONT)
        wait_for(lambda: client.get("/health").status_code == 200, timeout=10)
        response = client.post("/v1/transduce", json={"model": "parity-lrnn", "inputs": ["0110"]})
        assert response.status_code == 200, response.text
