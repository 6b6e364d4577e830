"""``python -m server`` as a process: exit code 2 when no model loads; SIGTERM drains requests in flight, and
answers 503 to those still running past the drain timeout."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

from server.__main__ import parse_settings
from server.settings import SHIPPED_CHECKPOINTS
from tests.server.checkpoints import BROKEN, LANGUAGE_MODELS, TRANSDUCERS
from tests.server.live import wait_healthy

ROOT = Path(__file__).resolve().parents[2]


def start_server(*args: str, **settings: object) -> subprocess.Popen:
    """``python -m server *args`` with REGULARLM_* ``settings``."""
    env = {key: value for key, value in os.environ.items() if not key.startswith("REGULARLM_")}
    env["REGULARLM_TORCH_THREADS"] = "1"
    env.update({f"REGULARLM_{key.upper()}": str(value) for key, value in settings.items()})
    return subprocess.Popen(
        [sys.executable, "-m", "server", "--log-level", "warning", *args],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_no_loadable_model_exits_2_with_the_reasons(tmp_path) -> None:
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "config.json").write_text('{"format_version": 1}')
    process = start_server("--no-shipped-models", "--models", str(tmp_path), "--port", str(free_port()))
    _, stderr = process.communicate(timeout=60)
    assert process.returncode == 2
    assert f"error: no model could be loaded from {tmp_path}" in stderr
    assert str(tmp_path / "bad") in stderr and "unknown architecture" in stderr


@pytest.mark.parametrize("argv", [["--device", "tpu"], ["--port", "-1"]])
def test_bad_option_exits_2(argv: list[str], capsys) -> None:
    with pytest.raises(SystemExit) as exit_info:
        parse_settings(argv)
    assert exit_info.value.code == 2 and argv[0].strip("-") in capsys.readouterr().err


def test_models_are_served_beside_the_shipped_ones_unless_told_otherwise(tmp_path, monkeypatch) -> None:
    assert parse_settings([]).model_folders == [SHIPPED_CHECKPOINTS]
    one, two = tmp_path / "one", tmp_path / "two"
    settings = parse_settings(["--models", str(one), str(two)])
    assert settings.models == [one, two] and settings.model_folders == [SHIPPED_CHECKPOINTS, one, two]
    assert parse_settings(["--models", str(one), "--models", str(two)]).models == [one, two]
    assert parse_settings(["--models", str(one), "--no-shipped-models"]).model_folders == [one]
    assert parse_settings(["--models", str(SHIPPED_CHECKPOINTS), str(one)]).model_folders == [SHIPPED_CHECKPOINTS, one]
    monkeypatch.setenv("REGULARLM_MODELS", f"{one}{os.pathsep}{two}")  # as PATH is written; or a JSON list
    monkeypatch.setenv("REGULARLM_SHIPPED_MODELS", "false")
    assert parse_settings([]).model_folders == [one, two]
    assert parse_settings(["--models", str(two)]).model_folders == [two]  # the command line wins
    monkeypatch.setenv("REGULARLM_MODELS", json.dumps([str(two)]))
    assert parse_settings([]).model_folders == [two]


def test_no_shipped_models_and_no_folder_is_a_bad_option(capsys) -> None:
    with pytest.raises(SystemExit) as exit_info:
        parse_settings(["--no-shipped-models"])
    assert exit_info.value.code == 2 and "nothing to serve" in capsys.readouterr().err


def test_enforce_eager_turns_cuda_graphs_off() -> None:
    assert parse_settings([]).cuda_graphs and not parse_settings(["--enforce-eager"]).cuda_graphs


def test_sigterm_drains_requests_in_flight(checkpoints_dir) -> None:
    """Also: start-up at INFO is a handful of lines, "ready on" the last, once /health is 200 (not uvicorn's "running
    on", said as the socket opens before the models are loaded)."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    process = start_server(
        "--no-shipped-models", "--models", str(checkpoints_dir), "--port", str(port), "--log-level", "info"
    )
    stderr = ""
    try:
        wait_healthy(url, timeout=300)
        body = {"model": "text-lstm", "prompt": "x", "max_tokens": 800, "stream": True}
        with httpx.stream("POST", f"{url}/v1/generate", json=body, timeout=60) as response:
            lines = response.iter_lines()
            assert next(lines).startswith("data: ")
            process.send_signal(signal.SIGTERM)
            health = httpx.get(f"{url}/health")
            assert health.status_code == 503 and health.json()["status"] == "draining"
            refused = httpx.post(f"{url}/v1/transduce", json={"model": "parity-lrnn", "inputs": ["0"]})
            assert refused.status_code == 503 and "retry-after" in refused.headers
            rest = [line for line in lines if line]
        assert rest[-1] == "data: [DONE]"
        assert json.loads(rest[-2].removeprefix("data: "))["usage"]["completion_tokens"] == 800
        assert process.wait(timeout=30) == 0
    finally:
        if process.poll() is None:
            process.kill()
        _, stderr = process.communicate()
    lines = stderr.splitlines()
    ready = next(index for index, line in enumerate(lines) if f"ready on http://127.0.0.1:{port}" in line)
    startup = lines[: ready + 1]
    assert len(startup) <= 6 and not any("Uvicorn running on" in line for line in lines), stderr
    assert f"loading {len(TRANSDUCERS) + len(LANGUAGE_MODELS) + 1} models from {checkpoints_dir}" in startup[0]
    assert any(f"{len(TRANSDUCERS) + len(LANGUAGE_MODELS)} models ready in " in line for line in startup), stderr
    assert any(" WARNING " in line and f"skipped {checkpoints_dir / BROKEN}" in line for line in startup), stderr


def test_sigterm_past_the_drain_timeout_answers_503_and_exits_0(checkpoints_dir) -> None:
    """Work still in flight when drain_timeout_s runs out: a stream gets an SSE error event then [DONE], a
    plain request a JSON 503, and the process exits 0 within drain_timeout_s + 5 s."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    drain_timeout_s = 0.5
    process = start_server(
        "--no-shipped-models", "--models", str(checkpoints_dir), "--port", str(port), drain_timeout_s=drain_timeout_s
    )
    try:
        wait_healthy(url, timeout=300)
        body = {"model": "text-transformer", "prompt": "x", "max_tokens": 4096}
        plain: dict = {}
        waiting = threading.Thread(
            target=lambda: plain.update(response=httpx.post(f"{url}/v1/generate", json=body, timeout=60))
        )
        waiting.start()
        with httpx.stream("POST", f"{url}/v1/generate", json={**body, "stream": True}, timeout=60) as response:
            lines = response.iter_lines()
            assert next(lines).startswith("data: ")
            process.send_signal(signal.SIGTERM)
            signalled = time.monotonic()
            rest = [line for line in lines if line]
        waiting.join(60)
        assert process.wait(timeout=30) == 0
        assert time.monotonic() - signalled < drain_timeout_s + 5
    finally:
        if process.poll() is None:
            process.kill()
        process.communicate()
    assert rest[-1] == "data: [DONE]"
    error = json.loads(rest[-2].removeprefix("data: "))["error"]
    assert error["type"] == "service_unavailable" and "drain timeout" in error["message"]
    assert plain["response"].status_code == 503
    assert plain["response"].json()["error"]["type"] == "service_unavailable"


def engine_process_of(pid: int) -> int:
    """The engine core's process among the server's children (multiprocessing's resource tracker is one too)."""
    for task in Path(f"/proc/{pid}/task").iterdir():
        for child in (task / "children").read_text().split():
            if b"spawn_main" in Path(f"/proc/{child}/cmdline").read_bytes():
                return int(child)
    raise AssertionError(f"process {pid} has no engine process")


def test_the_engine_process_dying_exits_3(checkpoints_dir) -> None:
    """``python -m server`` runs its engine core in a child process; if that dies, the server exits 3, so that Docker
    or Kubernetes restarts it (the 503 answers and /health: tests/server/engine/test_engine_process.py)."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    process = start_server("--no-shipped-models", "--models", str(checkpoints_dir), "--port", str(port))
    try:
        wait_healthy(url, timeout=300)
        os.kill(engine_process_of(process.pid), signal.SIGKILL)
        assert process.wait(timeout=30) == 3
    finally:
        if process.poll() is None:
            process.kill()
        _, stderr = process.communicate()
    assert "error: the engine process exited (exit code -9)" in stderr


def test_engine_in_process_keeps_the_engine_on_a_thread() -> None:
    assert parse_settings([]).engine_process is None and parse_settings(["--engine-in-process"]).engine_process is False


def test_the_access_log_is_off_unless_asked_for(monkeypatch) -> None:
    assert not parse_settings([]).access_log and parse_settings(["--access-log"]).access_log
    monkeypatch.setenv("REGULARLM_ACCESS_LOG", "true")
    assert parse_settings([]).access_log  # the flag left out does not turn the environment's setting off


def closed_by_server(sock: socket.socket) -> bytes:
    """What the server sends until it closes the connection (a socket timeout, if it does not, fails the test)."""
    received = b""
    try:
        while chunk := sock.recv(4096):
            received += chunk
    except ConnectionResetError:
        pass
    return received


def test_slow_clients_are_cut_off(checkpoints_dir) -> None:
    """A connection whose request headers are not complete header_timeout_s after it opened is closed without a
    response; a body still arriving body_timeout_s after it was first read gets 408.
    The sockets wait 3 s: several timeouts of 0.5 s, less than the defaults (10 s) or the keep-alive (75 s)."""
    port = free_port()
    process = start_server(
        "--no-shipped-models",
        "--models",
        str(checkpoints_dir),
        "--port",
        str(port),
        header_timeout_s=0.5,
        body_timeout_s=0.5,
    )
    try:
        wait_healthy(f"http://127.0.0.1:{port}", timeout=300)
        with socket.create_connection(("127.0.0.1", port), timeout=3) as slow_headers:
            slow_headers.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n")
            assert closed_by_server(slow_headers) == b""
        with socket.create_connection(("127.0.0.1", port), timeout=3) as slow_body:
            slow_body.sendall(
                b"POST /v1/transduce HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                b'Content-Length: 100\r\n\r\n{"model": '
            )
            response = closed_by_server(slow_body)  # the 408, then closed: the rest of the body is on the connection
        assert response.startswith(b"HTTP/1.1 408 ")
        assert b"connection: close" in response.partition(b"\r\n\r\n")[0].lower().split(b"\r\n")
        assert json.loads(response.partition(b"\r\n\r\n")[2])["error"] == {
            "message": "the body took longer than 0.5 s to arrive (body_timeout_s)",
            "type": "request_timeout",
        }
        assert httpx.get(f"http://127.0.0.1:{port}/health").status_code == 200
    finally:
        process.terminate()
        process.communicate(timeout=30)


def read_response(sock: socket.socket) -> bytes:
    """The head of one HTTP response with a Content-Length, read from ``sock`` (ConnectionError if it closes first)."""

    def more() -> bytes:
        chunk = sock.recv(4096)
        if not chunk:
            raise ConnectionError("the server closed the connection")
        return chunk

    received = b""
    while b"\r\n\r\n" not in received:
        received += more()
    head, _, body = received.partition(b"\r\n\r\n")
    declared = next(line for line in head.split(b"\r\n") if line.lower().startswith(b"content-length:"))
    length = int(declared.split(b":")[1])
    while len(body) < length:
        body += more()
    return head


def test_idle_connections_are_kept_alive_for_their_next_request(checkpoints_dir) -> None:
    """A kept-alive connection that idles longer than header_timeout_s after a response still gets its next request
    answered (the header deadline runs from the request's first byte: counted from the response, it closed
    connections that a late reader was reusing, and that request was reset); a request's headers that stop coming
    are cut off header_timeout_s after its first byte; an idle connection is closed keep_alive_s after its response.
    The default keep-alive outlasts the idle connections of httpx (and the openai client on it)."""
    assert parse_settings([]).keep_alive_s > httpx.Limits().keepalive_expiry
    port = free_port()
    process = start_server(
        "--no-shipped-models",
        "--models",
        str(checkpoints_dir),
        "--port",
        str(port),
        header_timeout_s=0.5,
        keep_alive_s=2,
    )
    request = b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n"
    try:
        wait_healthy(f"http://127.0.0.1:{port}", timeout=300)
        with socket.create_connection(("127.0.0.1", port), timeout=5) as sock:
            sock.sendall(request)
            assert read_response(sock).startswith(b"HTTP/1.1 200 ")
            time.sleep(1.0)  # twice header_timeout_s, half keep_alive_s
            sock.sendall(request)
            assert read_response(sock).startswith(b"HTTP/1.1 200 ")
            idle_from = time.monotonic()
            assert closed_by_server(sock) == b""
            assert 1.5 < time.monotonic() - idle_from < 4.5  # keep_alive_s, not header_timeout_s
        with socket.create_connection(("127.0.0.1", port), timeout=5) as sock:
            sock.sendall(request)
            assert read_response(sock).startswith(b"HTTP/1.1 200 ")
            time.sleep(1.0)
            sock.sendall(b"GET /health HTTP/1.1\r\n")  # then nothing more
            started = time.monotonic()
            assert closed_by_server(sock) == b""
            assert time.monotonic() - started < 1.5  # header_timeout_s from the first byte, not keep_alive_s
    finally:
        process.terminate()
        process.communicate(timeout=30)


@pytest.mark.parametrize("module", ["server.api.protocol", "clients.client"])
def test_protocol_and_client_import_without_torch(module: str) -> None:
    code = f"import sys, {module}; sys.exit('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], cwd=ROOT).returncode == 0


def test_a_serving_process_tunes_its_garbage_collector() -> None:
    """``python -m server`` raises the collector's thresholds and freezes its start-up heap once the models are loaded
    (``on_ready``, before the first request), in a child process: a frozen heap stays frozen."""
    code = (
        "import gc\n"
        "from server.heap import GC_THRESHOLDS, freeze_startup_heap, tune_garbage_collector\n"
        "tune_garbage_collector()\n"
        "assert gc.get_threshold() == GC_THRESHOLDS, gc.get_threshold()\n"
        "assert gc.get_freeze_count() == 0\n"
        "freeze_startup_heap()\n"
        "assert gc.get_freeze_count() > 1000, gc.get_freeze_count()\n"
    )
    assert subprocess.run([sys.executable, "-c", code], check=False, cwd=ROOT).returncode == 0
