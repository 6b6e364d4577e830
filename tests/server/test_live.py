"""Against a real uvicorn: streaming, client disconnects, concurrent requests, a full queue."""

from __future__ import annotations

import asyncio
import json
import re
import threading
import time

import httpx
import pytest

from tests.server.helpers import before_each_decode_step, make_settings, wait_for
from tests.server.live import serve


def slow_down(monkeypatch, engine, model_id: str, seconds: float = 0.01) -> None:
    """Make each decode step of ``model_id`` take at least ``seconds``, so that a request stays in flight."""
    before_each_decode_step(monkeypatch, engine.models[model_id].model, lambda tokens: time.sleep(seconds))


def metric(url: str, name: str, **labels: str) -> float:
    """The value of one sample of /metrics (0 when absent)."""
    wanted = ",".join(f'{key}="{value}"' for key, value in sorted(labels.items()))
    for line in httpx.get(f"{url}/metrics").text.splitlines():
        match = re.fullmatch(rf"{re.escape(name)}\{{(.*)\}} (\S+)", line)
        if match and ",".join(sorted(match.group(1).split(","))) == wanted:
            return float(match.group(2))
    return 0.0


def test_streaming_over_http(live) -> None:
    body = {"model": "text-lstm", "prompt": "Once", "max_tokens": 40, "seed": 5, "stream": True}
    with httpx.stream("POST", f"{live.url}/v1/generate", json=body) as response:
        assert response.status_code == 200
        lines = [line for line in response.iter_lines() if line]
    assert lines[-1] == "data: [DONE]"
    chunks = [json.loads(line.removeprefix("data: ")) for line in lines[:-1]]
    whole = httpx.post(f"{live.url}/v1/generate", json={**body, "stream": False}).json()
    assert "".join(chunk["text"] for chunk in chunks) == whole["text"]
    assert chunks[-1]["usage"]["completion_tokens"] == 40


@pytest.mark.parametrize("stream", [True, False])
def test_disconnect_stops_generation(stream: bool, live, monkeypatch) -> None:
    slow_down(monkeypatch, live.engine, "text-transformer")
    aborted = metric(
        live.url, "regularlm_request_success_total", model_name="text-transformer", finished_reason="abort"
    )
    body = {"model": "text-transformer", "prompt": "Once", "max_tokens": 4000, "stream": stream}
    if stream:
        with httpx.stream("POST", f"{live.url}/v1/generate", json=body) as response:
            lines = response.iter_lines()
            assert next(lines).startswith("data: ")
    else:
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(f"{live.url}/v1/generate", json=body, timeout=0.5)
    wait_for(lambda: live.engine.in_flight == 0)
    assert (
        metric(live.url, "regularlm_request_success_total", model_name="text-transformer", finished_reason="abort")
        == aborted + 1
    )
    assert metric(live.url, "regularlm_num_requests_running", model_name="text-transformer") == 0


def test_parallel_requests_equal_sequential_ones(live) -> None:
    transduce = [
        {"model": model, "inputs": ["01" * i + "1", "1" * (3 * i + 1)], "outputs": outputs}
        for i in range(8)
        for model, outputs in (("parity-lrnn", "all"), ("parity-regulargpt", "final"), ("parity-transformer", "final"))
    ]
    generate = [
        {"model": model, "prompt": f"prompt {i}", "max_tokens": 16, "seed": i, "temperature": 0.8}
        for i in range(6)
        for model in ("text-lrnn", "text-lstm", "text-transformer", "text-regulargpt")
    ]
    requests = [("/v1/transduce", body) for body in transduce] + [("/v1/generate", body) for body in generate]

    async def run_all() -> list[dict]:
        async with httpx.AsyncClient(base_url=live.url, timeout=60) as client:
            responses = await asyncio.gather(*(client.post(path, json=body) for path, body in requests))
        return [response.json() for response in responses]

    parallel = asyncio.run(run_all())
    with httpx.Client(base_url=live.url, timeout=60) as client:
        sequential = [client.post(path, json=body).json() for path, body in requests]
    for together, alone in zip(parallel, sequential):
        if "results" in alone:
            for a, b in zip(together["results"], alone["results"]):
                assert (a["final"], a.get("all")) == (b["final"], b.get("all"))
                assert a["confidence"] == pytest.approx(b["confidence"], abs=1e-5)
        else:
            assert together == alone


def test_full_queue_answers_429_with_retry_after(checkpoints_dir, monkeypatch) -> None:
    with serve(make_settings(checkpoints_dir, max_running=1, max_waiting=1, retry_after_s=2)) as server:
        slow_down(monkeypatch, server.engine, "text-lrnn")
        long = {"model": "text-lrnn", "prompt": "x", "max_tokens": 300, "stream": True}
        with httpx.stream("POST", f"{server.url}/v1/generate", json=long) as running:
            lines = running.iter_lines()  # kept: dropping the iterator would close the connection
            next(lines)  # the first request runs
            queued = threading.Thread(
                target=httpx.post,
                args=(f"{server.url}/v1/generate",),
                kwargs={"json": {**long, "stream": False, "max_tokens": 5}, "timeout": 60},
            )
            queued.start()
            wait_for(lambda: server.engine.queue.waiting == 1)  # the second waits
            refused = httpx.post(f"{server.url}/v1/transduce", json={"model": "parity-lrnn", "inputs": ["0"]})
            assert refused.status_code == 429 and refused.headers["retry-after"] == "2"
            assert refused.json()["error"]["type"] == "overloaded_error"
            assert httpx.get(f"{server.url}/health").status_code == 200  # health stays responsive
        queued.join(60)


def test_transduce_client_that_leaves_leaves_nothing_in_flight(live, monkeypatch) -> None:
    model = live.engine.models["parity-regulargpt"].model
    final_logits = model.final_logits

    def slow_final_logits(*args, **kwargs):
        time.sleep(0.3)
        return final_logits(*args, **kwargs)

    monkeypatch.setattr(model, "final_logits", slow_final_logits)
    bodies = [{"model": "parity-regulargpt", "inputs": ["0" * length]} for length in (3, 30, 300)]
    for body in bodies:
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(f"{live.url}/v1/transduce", json=body, timeout=0.05)
    wait_for(lambda: live.engine.in_flight == 0)
    assert httpx.post(f"{live.url}/v1/transduce", json=bodies[0]).status_code == 200
