"""The sync and async clients against a live server; retries on 429/503 against a scripted transport."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from clients.client import APIStatusError, AsyncClient, Client, RetryPolicy

NO_WAIT = RetryPolicy(max_retries=2, backoff_s=0.0)


def test_sync_client(live) -> None:
    with Client(live.url) as client:
        assert client.health().status == "degraded"  # the fixtures hold a broken folder
        assert "parity-lrnn" in {card.id for card in client.models().data}
        result = client.transduce("parity-lrnn", ["0110", "1"], outputs="all").results[0]
        assert len(result.all) == 4 and result.final == result.all[-1]
        whole = client.generate("text-lrnn", "Once", max_tokens=10, seed=3)
        chunks = list(client.stream_generate("text-lrnn", "Once", max_tokens=10, seed=3))
        assert "".join(chunk.text for chunk in chunks) == whole.text
        assert chunks[-1].finish_reason == "length" and chunks[-1].usage == whole.usage
        with pytest.raises(APIStatusError) as error:
            client.transduce("parity-lrnn", ["012"])
        assert error.value.status_code == 422 and "position 2" in error.value.message


def test_structured_outputs(live) -> None:
    with Client(live.url) as client:
        choice = client.generate("text-lrnn", "Once", seed=1, structured_outputs={"choice": ["yes", "no"]})
        assert choice.text in ("yes", "no") and choice.finish_reason == "stop"
        schema = {"enum": ["a", [1, 2]]}  # sent as "json" (the field's alias)
        value = client.generate("text-lrnn", "Once", seed=1, structured_outputs={"json": schema}).text
        assert value in ('"a"', "[1,2]")


def test_async_client(live) -> None:
    async def run() -> None:
        async with AsyncClient(live.url) as client:
            answers = await asyncio.gather(*(client.transduce("parity-lrnn", ["01" * i + "1"]) for i in range(8)))
            assert all(len(answer.results) == 1 for answer in answers)
            whole = await client.generate("text-lstm", "Once", max_tokens=8, seed=1)
            text = "".join(
                [chunk.text async for chunk in client.stream_generate("text-lstm", "Once", max_tokens=8, seed=1)]
            )
            assert text == whole.text
            with pytest.raises(APIStatusError) as error:
                await client.generate("nope", "x")
            assert error.value.status_code == 404

    asyncio.run(run())


def scripted(statuses: list[int], seen: list[httpx.Request]):
    """A transport answering the given statuses in turn (the last one for good), with JSON bodies."""

    def handle(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        status = statuses[min(len(seen), len(statuses)) - 1]
        if status == 200:
            return httpx.Response(200, json={"status": "ok"})
        headers = {"Retry-After": "0"} if status == 429 else {}
        return httpx.Response(status, json={"error": {"message": "busy", "type": "overloaded_error"}}, headers=headers)

    return handle


def test_retries_429_and_503_then_succeeds() -> None:
    seen: list[httpx.Request] = []
    client = Client(retry=NO_WAIT, transport=httpx.MockTransport(scripted([429, 503, 200], seen)), api_key="k")
    assert client.health().status == "ok"
    assert len(seen) == 3 and seen[0].headers["authorization"] == "Bearer k"


def test_gives_up_after_max_retries() -> None:
    seen: list[httpx.Request] = []
    client = Client(retry=NO_WAIT, transport=httpx.MockTransport(scripted([503], seen)))
    with pytest.raises(APIStatusError) as error:
        client.health()
    assert len(seen) == 3 and error.value.status_code == 503 and error.value.error_type == "overloaded_error"


def test_async_retries_and_does_not_retry_other_errors() -> None:
    async def run() -> None:
        seen: list[httpx.Request] = []
        client = AsyncClient(retry=NO_WAIT, transport=httpx.MockTransport(scripted([429, 200], seen)))
        assert (await client.health()).status == "ok" and len(seen) == 2
        seen.clear()
        client = AsyncClient(retry=NO_WAIT, transport=httpx.MockTransport(scripted([400], seen)))
        with pytest.raises(APIStatusError):
            await client.health()
        assert len(seen) == 1

    asyncio.run(run())


def test_backoff_without_retry_after_doubles() -> None:
    policy = RetryPolicy(max_retries=5, backoff_s=0.5, max_backoff_s=3.0)
    busy = httpx.Response(503)
    assert [policy.delay(busy, attempt) for attempt in range(6)] == [0.5, 1.0, 2.0, 3.0, 3.0, None]
    assert policy.delay(httpx.Response(429, headers={"Retry-After": "2"}), 0) == 2.0
    assert policy.delay(httpx.Response(500), 0) is None
