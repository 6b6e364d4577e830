"""The HTTP edges: a body answered before it was read is discarded (bounded) before the connection closes, so that
every client reads its 413; with httptools the protocol answers refusals from the headers with the guard's bytes,
without the app; a full queue refuses from the headers (429) before the body is read, the requests it
counts as arriving are counted out however they end, and admitted requests go on one per turn of the event loop;
405s name the allowed methods; no redirect is built from the Host header; a 409 names no server path; /health says
"degraded" while checkpoint folders were skipped."""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import itertools
import json
import socket
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest
import uvicorn
from fastapi.testclient import TestClient
from pydantic import SecretStr
from uvicorn.protocols.http.h11_impl import H11Protocol
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from server.api.app import api_error_response, create_app, http_protocol
from server.api.guard import HeaderChecks, Linger, RequestGuard, Turnstile, closing, guarded_protocol, within
from server.engine.engine import EngineFront
from server.errors import Overloaded
from server.metrics import RequestTimes, ServerMetrics
from server.models.store import failed_folder
from server.settings import Settings
from tests.server.checkpoints import BROKEN
from tests.server.helpers import make_settings, wait_for
from tests.server.live import wait_healthy

MB = 10**6


class Idle(EngineFront):
    """An engine ready at once that serves no model: what is tested with it is decided before a model is needed."""

    def start(self) -> None:
        self.state = "ready"

    def add_warm_up(self, prepare) -> None:
        pass

    def abort_in_flight(self, message: str) -> None:
        pass

    def stop(self, timeout: float = 1.0) -> bool:
        self.state = "stopped"
        return True

    async def transduce(self, served, inputs, all_outputs, flow=""):
        raise NotImplementedError

    def submit_generation(self, served, requests, flow=""):
        raise NotImplementedError

    async def add_model(self, served):
        raise NotImplementedError

    async def remove_model(self, model_id: str) -> None:
        raise NotImplementedError


class LingerSettings(Settings):
    """The lingering close's bounds as settings (the app reads them where the settings have them), small."""

    linger_max_bytes: int = 2**20
    linger_timeout_s: float = 1.0
    linger_read_timeout_s: float = 0.5


@contextmanager
def running(settings: Settings, http: str = "httptools") -> Iterator[str]:
    """An app on an :class:`Idle` engine behind a real uvicorn (``http``: its httptools or h11 protocol, as the
    server runs it), in a thread; yields its URL."""
    app = create_app(settings, Idle(settings, ServerMetrics()))
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.bind(("127.0.0.1", 0))
    protocol = http_protocol(app, HttpToolsProtocol if http == "httptools" else H11Protocol)
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", http=protocol, timeout_graceful_shutdown=5))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{sock.getsockname()[1]}"
    try:
        wait_healthy(url, timeout=60)
        yield url
    finally:
        server.should_exit = True
        thread.join(10)
        sock.close()


def connect(url: str, timeout: float = 30) -> socket.socket:
    host, port = url.removeprefix("http://").split(":")
    return socket.create_connection((host, int(port)), timeout=timeout)


def head(path: str, length: int, chunked: bool = False) -> bytes:
    framing = b"Transfer-Encoding: chunked" if chunked else b"Content-Length: %d" % length
    return b"POST %s HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n%s\r\n\r\n" % (path.encode(), framing)


def until_closed(sock: socket.socket) -> bytes:
    """What the server sends until it closes the connection (a socket timeout, if it does not, fails the test)."""
    received = b""
    while chunk := sock.recv(65536):
        received += chunk
    return received


def one_response(sock: socket.socket) -> tuple[bytes, dict]:
    """The head and the JSON body of one response with a Content-Length, read without waiting for the close."""
    received = b""
    while b"\r\n\r\n" not in received:
        received += sock.recv(65536)
    response_head, _, body = received.partition(b"\r\n\r\n")
    length = next(
        int(line.split(b":")[1]) for line in response_head.split(b"\r\n") if line.lower().startswith(b"content-length:")
    )
    while len(body) < length:
        body += sock.recv(65536)
    return response_head, json.loads(body)


def header(response_head: bytes, name: bytes) -> bytes | None:
    for line in response_head.split(b"\r\n")[1:]:
        key, _, value = line.partition(b":")
        if key.strip().lower() == name:
            return value.strip()
    return None


# --- A: a body answered before it was read is discarded before the connection closes -------------------------


@pytest.fixture(scope="module")
def idle_url(tmp_path_factory) -> Iterator[str]:
    with running(make_settings(tmp_path_factory.mktemp("none"))) as url:
        yield url


@pytest.mark.parametrize("http", ["httptools", "h11"])
def test_a_client_that_sends_its_whole_body_first_reads_the_413(http: str, tmp_path) -> None:
    """20 MB declared over the 16 MiB limit and sent without waiting (no Expect: 100-continue): the 413 was written
    at once, and the server read the body to its end before closing, so the sends all succeed and the answer is
    there to read."""
    with running(make_settings(tmp_path), http) as url, connect(url) as sock:
        sock.sendall(head("/v1/transduce", 20 * MB))
        sock.sendall(b" " * (20 * MB))
        response = until_closed(sock)
    response_head, _, body = response.partition(b"\r\n\r\n")
    assert response_head.startswith(b"HTTP/1.1 413 ") and header(response_head, b"connection") == b"close"
    assert json.loads(body)["error"] == {
        "message": f"the body has {20 * MB} bytes; the limit is {16 * 2**20} (max_body_bytes)",
        "type": "request_too_large",
    }


def test_urllib_posting_40_mb_reads_the_413(idle_url: str) -> None:
    request = urllib.request.Request(
        f"{idle_url}/v1/transduce", data=b" " * (40 * MB), headers={"Content-Type": "application/json"}
    )
    with pytest.raises(urllib.error.HTTPError) as refused:
        urllib.request.urlopen(request, timeout=30)
    assert refused.value.code == 413
    assert json.loads(refused.value.read())["error"]["type"] == "request_too_large"


def test_a_chunked_body_past_the_limit_is_refused_and_the_rest_discarded(idle_url: str) -> None:
    chunk = b" " * 2**16
    with connect(idle_url) as sock:
        sock.sendall(head("/v1/transduce", 0, chunked=True))
        for _ in range(20 * MB // len(chunk)):
            sock.sendall(b"%x\r\n%s\r\n" % (len(chunk), chunk))
        sock.sendall(b"0\r\n\r\n")
        response = until_closed(sock)
    response_head, _, body = response.partition(b"\r\n\r\n")
    assert response_head.startswith(b"HTTP/1.1 413 ")
    assert "the limit (max_body_bytes)" in json.loads(body)["error"]["message"]


def test_a_refusal_of_a_request_without_a_body_closes_at_once(tmp_path) -> None:
    with running(make_settings(tmp_path, api_key="s3cret")) as url, connect(url, timeout=3) as sock:
        sock.sendall(b"GET /v1/models HTTP/1.1\r\nHost: x\r\n\r\n")
        response = until_closed(sock)  # nothing to discard: no wait for a body (the socket times out in 3 s)
    assert response.startswith(b"HTTP/1.1 401 ")


def test_a_body_past_the_discard_bound_is_cut_off(tmp_path) -> None:
    """The server discards at most linger_max_bytes (1 MiB here) of a body it answered unread, then closes: a client
    still sending 40 MB meets the close long before it is done."""
    sent = 0
    with running(LingerSettings(models=tmp_path, device="cpu")) as url, connect(url) as sock:
        sock.sendall(head("/v1/transduce", 40 * MB))
        with contextlib.suppress(OSError):  # reset, or a broken pipe
            while sent < 40 * MB:
                sent += sock.send(b" " * 2**16)
    assert sent < 40 * MB  # what the sockets' buffers held past the 1 MiB discarded, not the whole body


def test_a_body_that_trickles_is_cut_off_after_the_discard_time(tmp_path) -> None:
    """A client that keeps sending a byte at a time, never idle for linger_read_timeout_s, is closed on after
    linger_timeout_s (1 s here) of discarding, not left to hold the connection."""
    with running(LingerSettings(models=tmp_path, device="cpu")) as url, connect(url, timeout=0.1) as sock:
        sock.sendall(head("/v1/transduce", 40 * MB))
        received, deadline = b"", time.monotonic() + 30
        while time.monotonic() < deadline:
            try:
                sock.sendall(b" ")
                chunk = sock.recv(65536)
            except TimeoutError:
                continue
            except OSError:  # reset: the server has closed
                break
            if not chunk:
                break
            received += chunk
        else:
            pytest.fail("the server kept discarding past linger_timeout_s")
    assert received.startswith(b"HTTP/1.1 413 ")


# --- A2: with httptools, a request refused from its headers is answered by the protocol, as the guard would ------


@contextmanager
def protocol_only(
    checks: HeaderChecks, linger: Linger = Linger(), failing: bool = False
) -> Iterator[tuple[str, list[str]]]:
    """A uvicorn with ``guarded_protocol(httptools, checks)`` around an app that answers 200 (or, ``failing``, raises)
    and notes each path it sees, access lines logged; yields its URL and the notes."""
    seen: list[str] = []

    async def app(scope, receive, send) -> None:
        if scope["type"] != "http":
            return
        seen.append(scope["path"])
        if failing:
            raise RuntimeError("a bug outside the guard")
        while (await receive()).get("more_body"):
            pass
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"2")]})
        await send({"type": "http.response.body", "body": b"ok"})

    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.bind(("127.0.0.1", 0))
    protocol = guarded_protocol(HttpToolsProtocol, 30.0, checks, linger)
    config = uvicorn.Config(app, log_level="info", http=protocol, lifespan="off", access_log=True)
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    try:
        wait_for(lambda: server.started)
        yield f"http://127.0.0.1:{sock.getsockname()[1]}", seen
    finally:
        server.should_exit = True
        thread.join(10)
        sock.close()


def test_the_protocol_answers_refusals_from_the_headers_without_the_app(capsys) -> None:
    full = [True]
    overloaded = Overloaded("the queue is full (2 requests waiting); retry later", retry_after_s=3)

    def arrive():
        if full[0]:
            raise overloaded
        return lambda: None

    checks = HeaderChecks(SecretStr("s3cret"), lambda path: path.startswith("/v1/"), 1000, api_error_response, arrive)
    key = b"Authorization: Bearer s3cret\r\n"
    body = b'{"model": "m", "prompt": "x"}'
    with protocol_only(checks, Linger(timeout_s=1.0, read_timeout_s=0.2)) as (url, seen):
        answers = {}
        for name, request in [
            ("no key", head("/v1/generate", len(body)) + body),
            ("declared too large", head("/v1/generate", 2000).replace(b"Host: x\r\n", b"Host: x\r\n" + key)),
            ("queue full", head("/v1/generate", len(body)).replace(b"Host: x\r\n", b"Host: x\r\n" + key) + body),
        ]:
            with connect(url, timeout=5) as sock:
                sock.sendall(request)
                answers[name] = until_closed(sock)  # closed once the body is read (or, for 2000 bytes, timed out)
        full[0] = False
        passed = httpx.post(f"{url}/v1/generate", content=body, headers={"authorization": "Bearer s3cret"})
        health = httpx.get(f"{url}/health")
    assert seen == ["/v1/generate", "/health"]  # the refused requests never reached the app
    assert (passed.status_code, health.status_code) == (200, 200)
    statuses = {name: answer.split(b" ", 2)[1] for name, answer in answers.items()}
    assert statuses == {"no key": b"401", "declared too large": b"413", "queue full": b"429"}
    response_head, _, content = answers["queue full"].partition(b"\r\n\r\n")
    assert header(response_head, b"retry-after") == b"3" and header(response_head, b"connection") == b"close"
    assert header(response_head, b"server") == b"uvicorn" and header(response_head, b"date")
    assert json.loads(content)["error"]["message"] == overloaded.message
    assert '"POST /v1/generate HTTP/1.1" 429' in capsys.readouterr().out  # uvicorn's access line


def test_an_arrival_taken_by_the_protocol_ends_even_if_the_guard_is_never_reached() -> None:
    """The app here fails before any guard (as a middleware outside it could): the arrival taken from the headers
    still ends, with the response (an engine's ``leave`` counts out once however often called)."""
    arrivals: list[str] = []

    def arrive():
        arrivals.append("arrived")
        return lambda: arrivals.append("left")

    checks = HeaderChecks(None, lambda path: False, 1000, api_error_response, arrive)
    body = b'{"model": "m", "prompt": "x"}'
    with protocol_only(checks, failing=True) as (url, _):
        with connect(url, timeout=5) as sock:
            sock.sendall(head("/v1/generate", len(body)) + body)
            response = until_closed(sock)
        wait_for(lambda: arrivals[:2] == ["arrived", "left"])
    assert response.startswith(b"HTTP/1.1 500 ")


def test_a_refusal_from_the_protocol_is_the_guards_response_byte_for_byte(tmp_path) -> None:
    """The same 401 and 429 through httptools (answered by the protocol) and h11 (by the guard in the app), but for
    the Date header; a HEAD is left to the app, which sends no body."""

    def answer(url: str, request: bytes) -> bytes:
        with connect(url, timeout=5) as sock:
            sock.sendall(request)
            response = until_closed(sock)
        return b"\r\n".join(line for line in response.split(b"\r\n") if not line.lower().startswith(b"date:"))

    requests = [
        b"GET /v1/models HTTP/1.1\r\nHost: x\r\n\r\n",
        head("/v1/transduce", 2) + b"{}",
        b"HEAD /v1/models HTTP/1.1\r\nHost: x\r\n\r\n",
    ]
    answers = {}
    for http in ("httptools", "h11"):
        with running(make_settings(tmp_path, api_key="s3cret"), http) as url:
            answers[http] = [answer(url, request) for request in requests]
    assert answers["httptools"] == answers["h11"]
    assert [response.split(b" ", 2)[1] for response in answers["h11"]] == [b"401", b"401", b"401"]
    assert answers["h11"][2].endswith(b"\r\n\r\n")  # the HEAD's answer has no body


def test_with_cors_the_refusals_are_the_apps_and_carry_its_headers(tmp_path) -> None:
    settings = make_settings(tmp_path, api_key="s3cret", cors_origins=["https://a.example"])
    with running(settings) as url:
        refused = httpx.get(f"{url}/v1/models", headers={"Origin": "https://a.example"})
    assert refused.status_code == 401 and refused.headers["access-control-allow-origin"] == "https://a.example"


# --- B: a full queue refuses from the headers; arrivals are counted out however they end ----------------------


def test_arrivals_fill_the_queue_and_admission_counts_them_out(tmp_path) -> None:
    engine = Idle(make_settings(tmp_path, max_waiting=2), ServerMetrics())
    engine.start()
    first, second = engine.arrive(), engine.arrive()
    with pytest.raises(Overloaded, match="the queue is full"):
        engine.arrive()
    first.leave()
    first.leave()  # once only
    assert engine.arriving == 1
    second.leave()

    def admitted() -> None:
        engine.arrive()  # the guard's, in the request's context
        engine._admit([RequestTimes("m")])

    contextvars.copy_context().run(admitted)
    assert (engine.arriving, engine.queue.waiting) == (0, 1)


def guard_around(app, arrive) -> RequestGuard:
    return RequestGuard(app, HeaderChecks(None, lambda path: False, 1000, api_error_response, arrive), 10.0)


def call(guard: RequestGuard, method: str = "POST", path: str = "/v1/generate") -> list[dict]:
    """One request through ``guard`` (its body, 2 bytes, there at once); what was sent."""
    sent: list[dict] = []
    scope = {"type": "http", "method": method, "path": path, "headers": [(b"content-length", b"2")]}

    async def receive() -> dict:
        return {"type": "http.request", "body": b"{}", "more_body": False}

    async def send(message: dict) -> None:
        sent.append(message)

    asyncio.run(guard(scope, receive, send))
    return sent


@pytest.mark.parametrize("ending", ["answered", "raised", "cancelled"])
def test_the_guard_ends_an_arrival_however_the_request_ends(ending: str) -> None:
    arrivals: list[str] = []

    def arrive():
        arrivals.append("arrived")
        return lambda: arrivals.append("left")

    async def app(scope, receive, send) -> None:
        assert arrivals == ["arrived"]  # counted while the app works on it
        if ending == "raised":
            raise RuntimeError("a bug")
        if ending == "cancelled":
            raise asyncio.CancelledError  # as a task cancelled at shutdown sees it
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b""})

    with contextlib.suppress(RuntimeError, asyncio.CancelledError):
        call(guard_around(app, arrive))
    assert arrivals == ["arrived", "left"]


def test_only_posts_to_the_queued_endpoints_arrive() -> None:
    arrivals: list[str] = []

    async def app(scope, receive, send) -> None:
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b""})

    guard = guard_around(app, lambda: arrivals.append("arrived") or (lambda: None))
    counted = {}
    for method, path in [
        ("GET", "/v1/models"),
        ("POST", "/v1/models"),
        ("POST", "/v1/chat/completions"),
        ("POST", "/v1/transduce"),
        ("POST", "/v1/generate"),
        ("POST", "/v1/completions"),
    ]:
        before = len(arrivals)
        call(guard, method, path)
        counted[method, path] = len(arrivals) - before
    assert [request for request, count in counted.items() if count] == [
        ("POST", "/v1/transduce"),
        ("POST", "/v1/generate"),
        ("POST", "/v1/completions"),
    ]


def test_a_refusal_from_the_arrival_is_a_429_without_calling_the_app() -> None:
    async def app(scope, receive, send) -> None:
        raise AssertionError("the app was called")

    def full():
        raise Overloaded("the queue is full (2 requests waiting); retry later", retry_after_s=3)

    start, *bodies = call(guard_around(app, full))
    assert start["status"] == 429 and (b"retry-after", b"3") in start["headers"]
    assert json.loads(b"".join(body["body"] for body in bodies))["error"]["type"] == "overloaded_error"


def test_a_refusal_is_rendered_once_and_sent_as_the_response_would_be() -> None:
    """The guard's 429 carries the bytes and headers of ``closing(api_error_response(error))``, each time in a header
    list of its own (a middleware outside may add to it); another message is rendered anew."""

    async def app(scope, receive, send) -> None:
        raise AssertionError("the app was called")

    message = ["the queue is full (2 requests waiting); retry later"]

    def full():
        raise Overloaded(message[0], retry_after_s=3)

    expected = closing(api_error_response(Overloaded(message[0], retry_after_s=3)))
    guard = guard_around(app, full)
    first, second = call(guard), call(guard)
    for sent in (first, second):
        start, *bodies = sent
        assert (start["status"], start["headers"]) == (expected.status_code, expected.raw_headers)
        assert b"".join(body["body"] for body in bodies) == expected.body
        assert not bodies[-1].get("more_body", False)
    assert first[0]["headers"] is not second[0]["headers"]
    first[0]["headers"].append((b"x-added", b"1"))
    assert (b"x-added", b"1") not in call(guard)[0]["headers"]
    message[0] = "the queue is full (3 requests waiting); retry later"
    start, *bodies = call(guard)
    assert json.loads(b"".join(body["body"] for body in bodies))["error"]["message"] == message[0]
    assert [name for name, _ in start["headers"]] == [name for name, _ in expected.raw_headers]


def test_within_times_out_as_wait_for_does() -> None:
    """``within``: the result in time; ``TimeoutError`` past the limit, the call cancelled; at once for a limit <= 0,
    the call never started."""
    events: list[str] = []

    async def slow(result: str) -> str:
        events.append(f"{result} started")
        try:
            await asyncio.sleep(10)
        except asyncio.CancelledError:
            events.append(f"{result} cancelled")
            raise
        return result

    async def quick() -> str:
        await asyncio.sleep(0)
        return "quick"

    async def scenario() -> None:
        assert await within(quick(), 1.0) == "quick"
        with pytest.raises(asyncio.TimeoutError):
            await within(slow("late"), 0.01)
        with pytest.raises(asyncio.TimeoutError):
            await within(slow("never"), 0)

    asyncio.run(scenario())
    assert events == ["late started", "late cancelled"]


def test_the_turnstile_lets_one_request_on_per_turn_of_the_loop_after_those_that_came_with_it() -> None:
    """a, b, c and d wait on the turnstile; x, which came with them, does its cheap first step before any goes on; a
    turn of the loop (a tick) passes between two of them going on; c, cancelled while it waits, holds no one up."""
    events: list[str] = []

    async def scenario() -> None:
        turnstile, loop = Turnstile(), asyncio.get_running_loop()
        ticking = True

        def tick() -> None:
            events.append("tick")
            if ticking:
                loop.call_soon(tick)

        async def admitted(name: str) -> None:
            await turnstile.enter()
            events.append(name)

        async def refused() -> None:
            events.append("x")

        tasks = [asyncio.ensure_future(admitted(name)) for name in "abcd"]
        tasks.append(asyncio.ensure_future(refused()))
        loop.call_soon(tick)
        await asyncio.sleep(0)
        tasks[2].cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        ticking = False

    asyncio.run(scenario())
    let_on = [event for event in events if event != "tick"]
    assert let_on == ["x", "a", "b", "d"]
    positions = [events.index(name) for name in let_on]
    assert all("tick" in events[before:after] for before, after in itertools.pairwise(positions))


@pytest.mark.parametrize("path", ["/v1/generate", "/v1/completions", "/v1/transduce"])
def test_a_full_queue_is_429_before_the_body_is_read(path: str, live, monkeypatch) -> None:
    queue = live.engine.queue
    monkeypatch.setattr(queue, "waiting", queue.max_waiting)
    body = json.dumps({"model": "text-lrnn", "prompt": "x"}).encode()
    with connect(live.url) as sock:
        sock.sendall(head(path, len(body)))  # the headers alone
        response_head, answer = one_response(sock)
        assert response_head.startswith(b"HTTP/1.1 429 ") and header(response_head, b"retry-after") == b"1"
        assert answer["error"]["type"] == "overloaded_error" and "the queue is full" in answer["error"]["message"]
        assert header(response_head, b"connection") == b"close"
        sock.sendall(body)  # discarded; then the connection closes
        assert until_closed(sock) == b""
    assert live.engine.arriving == 0


def test_arrivals_are_counted_out_after_success_error_and_disconnect(live) -> None:
    engine = live.engine
    with connect(live.url) as sock:  # arriving: its headers have come, its body has not
        sock.sendall(head("/v1/transduce", 100) + b'{"model": ')
        wait_for(lambda: engine.arriving == 1)
    wait_for(lambda: engine.arriving == 0)  # the client went away before it was admitted

    ok = httpx.post(f"{live.url}/v1/transduce", json={"model": "parity-lrnn", "inputs": ["0110"]})
    assert ok.status_code == 200 and engine.arriving == 0  # counted out when admitted, before the answer
    for body, status in [
        (b"{not json", 422),
        (json.dumps({"model": "nope", "inputs": ["0"]}).encode(), 404),
        (json.dumps({"model": "parity-lrnn", "inputs": ["0a"]}).encode(), 422),
    ]:
        refused = httpx.post(f"{live.url}/v1/transduce", content=body, headers={"content-type": "application/json"})
        assert refused.status_code == status, refused.text
        wait_for(lambda: engine.arriving == 0)
    stream = {"model": "text-lrnn", "prompt": "x", "max_tokens": 50, "stream": True}
    with httpx.stream("POST", f"{live.url}/v1/generate", json=stream) as response:
        next(response.iter_lines())
        assert engine.arriving == 0  # admitted: the queue counts it, not the arrivals
    wait_for(lambda: engine.in_flight == 0)


# --- C: 405, trailing slashes, 409, /health -----------------------------------------------------------------


@pytest.fixture(scope="module")
def routes_only(tmp_path_factory) -> TestClient:
    """The app without its lifespan: routing answers these before any engine is asked."""
    return TestClient(create_app(make_settings(tmp_path_factory.mktemp("none"))))


@pytest.mark.parametrize(
    "method, path, allowed",
    [
        ("POST", "/health", "GET"),
        ("POST", "/metrics", "GET"),
        ("PUT", "/v1/models", "GET, POST"),
        ("PUT", "/v1/models/anything", "GET, DELETE"),
        ("GET", "/v1/transduce", "POST"),
        ("DELETE", "/v1/completions", "POST"),
        ("POST", "/docs", "GET, HEAD"),
        ("POST", "/openapi.json", "GET, HEAD"),
    ],
)
def test_every_405_names_the_allowed_methods(method: str, path: str, allowed: str, routes_only) -> None:
    response = routes_only.request(method, path)
    assert response.status_code == 405 and response.headers["allow"] == allowed
    assert response.json()["error"]["type"] == "invalid_request_error"


@pytest.mark.parametrize("path", ["/metrics/", "/health/", "/v1/models/"])
def test_a_trailing_slash_is_404_not_a_redirect_built_from_the_host(path: str, routes_only) -> None:
    response = routes_only.get(path, headers={"Host": "evil.example"}, follow_redirects=False)
    assert response.status_code == 404 and "location" not in response.headers
    error = response.json()["error"]
    assert error["type"] == "not_found_error" and f"the route is {path.rstrip('/')}" in error["message"]


def test_an_unknown_path_with_a_slash_is_a_plain_404(routes_only) -> None:
    response = routes_only.get("/nothing/")
    assert response.status_code == 404 and response.json()["error"]["message"] == "Not Found"


def test_deleting_a_shipped_model_is_409_naming_it_not_its_path(live, checkpoints_dir) -> None:
    response = httpx.delete(f"{live.url}/v1/models/parity-lrnn")
    assert response.status_code == 409
    message = response.json()["error"]["message"]
    assert "'parity-lrnn' is a shipped model" in message and "only models added with POST /v1/models" in message
    assert str(checkpoints_dir) not in message and checkpoints_dir.name not in message


def test_health_is_degraded_while_folders_were_skipped(live, checkpoints_dir) -> None:
    response = httpx.get(f"{live.url}/health")
    assert response.status_code == 200  # the models that loaded serve
    assert response.json() == {
        "status": "degraded",
        "detail": f"1 checkpoint folder was skipped at load and not served: {BROKEN} (the server's log says why)",
    }
    assert live.engine.load_failures[0].startswith(str(checkpoints_dir))  # the log and the engine keep the path


def test_health_is_ok_with_nothing_skipped(idle_url: str) -> None:
    assert httpx.get(f"{idle_url}/health").json() == {"status": "ok"}


@pytest.mark.parametrize(
    "failure, directory, folder",
    [
        ("/srv/models/broken: config.json is not valid JSON", "/srv/models", "broken"),
        ("/srv/models/lm: measuring its speed failed: RuntimeError: x", "/srv/models", "lm"),
        ("/srv/a: b/lm: measuring its speed failed: RuntimeError: x", "/srv/a: b", "lm"),
        ("/srv/one: not a checkpoint", "/srv/one", "one"),  # the folder served is itself a checkpoint folder
    ],
)
def test_a_failure_names_its_folder_without_the_path(failure: str, directory: str, folder: str) -> None:
    assert failed_folder(failure, [Path("/elsewhere"), Path(directory)]) == folder
