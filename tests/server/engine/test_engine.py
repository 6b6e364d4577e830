"""The engine under many clients, against a live server: mixed-length decode batches for every architecture, limits
and admission; and the generation policy on the driven scheduler (real tiny models, a fake clock). Long transduce
inputs in slices beside short requests and disconnects mid-slice are tests/server/sched/test_scheduler.py's."""

from __future__ import annotations

import asyncio
import logging
import shutil
import time

import httpx
import pytest

from model.lstm.model import LSTMModel
from server.engine import engine as engine_module
from server.errors import Unavailable
from server.sched.scheduler import FairShare
from tests.server.checkpoints import BROKEN, LANGUAGE_MODELS
from tests.server.driven import FakeClock, finished_at, generation, language_model, receive
from tests.server.driven import scheduler as driven_scheduler
from tests.server.helpers import before_each_decode_step, make_settings
from tests.server.live import serve


def record_step_batches(monkeypatch, engine, model_id: str) -> list[int]:
    """The batch size of every decode step of ``model_id`` from now on."""
    sizes: list[int] = []
    before_each_decode_step(monkeypatch, engine.models[model_id].model, lambda tokens: sizes.append(tokens.shape[0]))
    return sizes


@pytest.mark.parametrize("model_id", sorted(LANGUAGE_MODELS))
def test_mixed_length_generations_decode_in_one_batch(model_id: str, live, monkeypatch) -> None:
    """Prompts of different lengths decode together (every architecture) and answer as they do alone. The
    lengths share one context class (prompt + max_tokens in [64, 127]: ``server/sched/costing.py``)."""
    bodies = [
        {"model": model_id, "prompt": "p" * length, "max_tokens": 12, "seed": length, "temperature": 0.9}
        for length in (52, 61, 80, 110)
    ]
    with httpx.Client(base_url=live.url, timeout=60) as client:
        alone = [client.post("/v1/generate", json=body).json() for body in bodies]
    sizes = record_step_batches(monkeypatch, live.engine, model_id)

    async def together() -> list[dict]:
        async with httpx.AsyncClient(base_url=live.url, timeout=60) as client:
            return [r.json() for r in await asyncio.gather(*(client.post("/v1/generate", json=b) for b in bodies))]

    assert asyncio.run(together()) == alone
    assert max(sizes) > 1


def test_prompts_prefilled_in_many_chunks_score_and_continue_as_in_one(checkpoints_dir) -> None:
    """Tiny slices cut every prompt into chunks of a few tokens (every architecture): the prompt's
    log-probabilities and the greedy continuation equal those of the default slices (one chunk)."""
    prompt = "It is a truth universally acknowledged, that a single man " * 3
    bodies = [
        {"model": model_id, "prompt": prompt, "max_tokens": 6, "temperature": 0, "echo": True, "logprobs": 0}
        for model_id in sorted(LANGUAGE_MODELS)
    ]
    answers = []
    for slice_ms in (50.0, 0.001):
        with serve(make_settings(checkpoints_dir, slice_ms=slice_ms, state_cache_entries=0)) as server:
            answers.append(
                [httpx.post(f"{server.url}/v1/completions", json=body, timeout=120).json() for body in bodies]
            )
    for whole, chunked in zip(*answers):
        assert chunked["choices"][0]["text"] == whole["choices"][0]["text"]
        expected = whole["choices"][0]["logprobs"]["token_logprobs"]
        assert chunked["choices"][0]["logprobs"]["token_logprobs"][1:] == pytest.approx(expected[1:], abs=1e-4)


def test_sequences_of_different_context_classes_decode_in_separate_batches(live, monkeypatch) -> None:
    """Padded caches give a batch's every row the longest row's room: a long sequence is kept out of a short
    one's batch, so each holds at most 2x what it reserved."""
    sizes = record_step_batches(monkeypatch, live.engine, "text-transformer")
    bodies = [{"model": "text-transformer", "prompt": "p" * length, "max_tokens": 12} for length in (4, 500)]

    async def together() -> None:
        async with httpx.AsyncClient(base_url=live.url, timeout=60) as client:
            await asyncio.gather(*(client.post("/v1/generate", json=body) for body in bodies))

    asyncio.run(together())
    assert sizes and max(sizes) == 1


def test_more_choices_than_the_queue_holds_is_413(checkpoints_dir) -> None:
    with serve(make_settings(checkpoints_dir, max_waiting=8)) as server:
        body = {"model": "text-lrnn", "prompt": "x", "max_tokens": 2, "n": 9}
        refused = httpx.post(f"{server.url}/v1/completions", json=body)
        assert refused.status_code == 413 and "retry-after" not in refused.headers
        assert "queue holds at most 8" in refused.json()["error"]["message"]
        assert httpx.post(f"{server.url}/v1/completions", json={**body, "n": 8}).status_code == 200


def test_inputs_over_a_models_limit_are_413_naming_it(checkpoints_dir) -> None:
    """With a small memory budget every model's limits shrink; /v1/models lists them and admission enforces
    them with a message naming the model's limit."""
    with serve(make_settings(checkpoints_dir, memory_budget_bytes=2_000_000)) as server:
        cards = {card["id"]: card for card in httpx.get(f"{server.url}/v1/models").json()["data"]}
        limit = cards["parity-transformer"]["limits"]["max_input_symbols"]
        assert 0 < limit < 100_000
        over = {"model": "parity-transformer", "inputs": ["0" * (limit + 1)]}
        refused = httpx.post(f"{server.url}/v1/transduce", json=over)
        assert refused.status_code == 413
        assert f"admits at most {limit}" in refused.json()["error"]["message"]
        assert "limits.max_input_symbols" in refused.json()["error"]["message"]
        context = cards["text-transformer"]["limits"]["max_context_tokens"]
        prompt = {"model": "text-transformer", "prompt": "x" * context, "max_tokens": 1}
        refused = httpx.post(f"{server.url}/v1/generate", json=prompt)
        assert refused.status_code == 413 and "max_context_tokens" in refused.json()["error"]["message"]
        fits = {"model": "parity-transformer", "inputs": ["0" * limit]}
        assert httpx.post(f"{server.url}/v1/transduce", json=fits, timeout=120).status_code == 200


def test_a_model_whose_speed_cannot_be_measured_is_skipped_and_reported(checkpoints_dir, monkeypatch) -> None:
    calibrate = engine_module.calibrate

    def failing(model):
        if isinstance(model, LSTMModel):
            raise RuntimeError("no kernel for this")
        return calibrate(model)

    monkeypatch.setattr(engine_module, "calibrate", failing)
    with serve(make_settings(checkpoints_dir)) as server:
        served = {card["id"] for card in httpx.get(f"{server.url}/v1/models").json()["data"]}
        assert "text-lstm" not in served and "text-lrnn" in served
        assert any(
            "measuring its speed failed: RuntimeError: no kernel for this" in failure
            for failure in server.engine.load_failures
        )


def test_models_list_their_limits(client) -> None:
    for card in client.get("/v1/models").json()["data"]:
        limits = card["limits"]
        assert limits["max_input_symbols"] > 0
        assert ("max_context_tokens" in limits) == (card["kind"] == "generate")
        assert ("max_all_outputs_symbols" in limits) == (card["kind"] == "transduce")


def test_fair_share_serves_the_least_served_flow_first() -> None:
    fair = FairShare()
    fair.charge({"heavy": 1.0}, 2.0)
    fair.charge({"heavy": 3.0, "light": 1.0}, 0.4)  # a batch shared by symbols
    assert fair.service == pytest.approx({"heavy": 2.3, "light": 0.1})
    assert fair.priority(["light"]) < fair.priority(["heavy"]) and fair.priority(["new"]) == 0.0
    assert fair.priority(["heavy", "light"]) == pytest.approx(0.1)
    fair.keep_only({"light"})
    assert fair.service == pytest.approx({"light": 0.1})


def test_on_ready_runs_once_the_models_are_loaded_before_serving(checkpoints_dir) -> None:
    """``python -m server`` freezes its start-up heap there (server/__main__.py): the models must be in it."""
    seen = []

    def on_ready() -> None:
        seen.append((engine.state, sorted(engine.models)))

    engine = engine_module.Engine(make_settings(checkpoints_dir), engine_module.ServerMetrics(), on_ready=on_ready)
    engine.start()
    engine.wait_loaded(30)
    try:
        assert engine.state == "ready"
        assert seen == [("loading", sorted(engine.models))] and engine.models
    finally:
        engine.stop()


def test_models_from_several_folders_are_served_and_start_up_says_three_things_at_info(
    checkpoints_dir, tmp_path, caplog
) -> None:
    """The folders of ``models`` are served together (a checkpoint folder named itself, or a folder of them); an id
    served already is skipped and reported, not replaced. At INFO start-up says "loading N models from ...", a warning
    per folder skipped and "N models ready ..."; each model's serving notes are at DEBUG."""
    more = tmp_path / "more"
    shutil.copytree(checkpoints_dir / "parity-lrnn", more / "parity-lrnn")  # the id of a model loaded before it
    shutil.copytree(checkpoints_dir / "parity-lrnn", tmp_path / "parity-again")
    settings = make_settings([checkpoints_dir, more, tmp_path / "parity-again"])
    engine = engine_module.Engine(settings, engine_module.ServerMetrics())
    with caplog.at_level(logging.DEBUG, logger="server"):
        engine.start()
        engine.wait_loaded(60)
    try:
        assert engine.state == "ready"
        assert {"parity-lrnn", "parity-again", "text-lrnn"} <= set(engine.models)
        assert engine.models["parity-lrnn"].path == checkpoints_dir / "parity-lrnn"
        duplicate = next(failure for failure in engine.load_failures if failure.startswith(str(more)))
        assert "model id 'parity-lrnn' is served already, from " + str(checkpoints_dir / "parity-lrnn") in duplicate
        assert sorted(engine.skipped_folders) == sorted([BROKEN, "parity-lrnn"])
    finally:
        engine.stop()
    info = [  # but "batch invariance: off: ...", for the tiny LSTM and transformer
        record
        for record in caplog.records
        if record.levelno == logging.INFO
        and record.name.startswith("server")
        and not record.getMessage().startswith("batch invariance: off: ")
    ]
    folders = f"{checkpoints_dir}, {more}, {tmp_path / 'parity-again'}"
    assert [record.getMessage().split(" in ")[0] for record in info] == [
        f"loading {len(engine.models) + 2} models from {folders}",
        f"{len(engine.models)} models ready",
    ], [record.getMessage() for record in info]
    assert info[-1].getMessage().endswith("; 2 skipped (the warnings above say why)")
    warnings = [record.getMessage() for record in caplog.records if record.levelno == logging.WARNING]
    assert len(warnings) == 2 and all(warning.startswith("skipped ") for warning in warnings), warnings
    notes = [record.getMessage() for record in caplog.records if record.levelno == logging.DEBUG]
    assert any(note.startswith("parity-lrnn: ") for note in notes), notes  # for_serving's notes


def test_a_fault_while_serving_is_told_as_one_with_its_traceback(
    checkpoints_dir, tmp_path, monkeypatch, caplog
) -> None:
    """An exception out of the scheduler after start-up (a bug in the engine's own code) fails the engine as "the
    engine failed while serving", its traceback in the log, and calls ``on_died`` (not a start that failed, whose
    exit code says no model loaded)."""
    (tmp_path / "parity-lrnn").symlink_to(checkpoints_dir / "parity-lrnn")

    def broken(self) -> None:
        raise ZeroDivisionError("integer division or modulo by zero")

    monkeypatch.setattr(engine_module.Scheduler, "loop", broken)
    died: list[str] = []
    engine = engine_module.Engine(make_settings(tmp_path), engine_module.ServerMetrics(), on_died=died.append)
    with caplog.at_level(logging.ERROR, logger="server"):
        engine.start()
        engine.wait_loaded(60)
        deadline = time.monotonic() + 10
        while not died and time.monotonic() < deadline:
            time.sleep(0.01)
    try:
        assert engine.state == "failed"
        assert engine.detail == "the engine failed while serving: ZeroDivisionError: integer division or modulo by zero"
        (record,) = [record for record in caplog.records if record.levelno == logging.ERROR]
        assert record.getMessage() == engine.detail and record.exc_info is not None
        assert died == [engine.detail]  # python -m server: exit code 3, as for any death of the engine
    finally:
        engine.stop()


def test_requests_before_the_models_are_loaded_are_told_so(checkpoints_dir) -> None:
    engine = engine_module.Engine(make_settings(checkpoints_dir), engine_module.ServerMetrics())  # not started
    with pytest.raises(Unavailable) as refused:
        engine.check_serving()
    assert refused.value.message == "the server is loading" and refused.value.status_code == 503


SLICE_S = 0.05  # the default slice_ms


def short_generation_latency(checkpoints_dir, model_id: str, beside_long_prompt: bool) -> float:
    """Seconds (of the fake clock) from a short generation's arrival to its end, alone or beside a 2,000-token prompt
    that has already had three slices of prefill (chunks of one slice each)."""
    clock = FakeClock()
    served = language_model(checkpoints_dir / model_id, clock, tokens_per_slice=32)
    worker = driven_scheduler(clock)
    if beside_long_prompt:
        long = generation(served, "p" * 2000, 1, clock)
        receive(worker, long)
        while long.service < 3 * SLICE_S:
            worker.iteration()
    short, sent = generation(served, "Hello", 8, clock), clock.now
    receive(worker, short)
    for _ in range(100):
        worker.iteration()
        if short.done:
            break
    assert not beside_long_prompt or not long.done
    return finished_at(short) - sent


@pytest.mark.parametrize("model_id", ["text-regulargpt", "text-lrnn"])
def test_a_short_generation_beside_a_long_prefill_waits_at_most_one_slice(model_id: str, checkpoints_dir) -> None:
    """A prompt served more than a slice beyond a running sequence yields to it, so a short request
    beside a long prefill runs as if alone once the slice in progress ends. (Before, every iteration ran a slice of
    the long prompt's prefill and then one decode step: 8 tokens waited 9 slices, 0.47 s here against 0.02 alone.)"""
    alone = short_generation_latency(checkpoints_dir, model_id, beside_long_prompt=False)
    beside = short_generation_latency(checkpoints_dir, model_id, beside_long_prompt=True)
    assert beside <= alone + SLICE_S


def test_a_long_prefill_keeps_half_the_engine_under_a_stream_of_short_requests(checkpoints_dir) -> None:
    """Yielding to less-served sequences has a bound: a long prompt waits no longer than its last round took, so a
    client that sends short requests one after another, each arriving as the last ends, cannot starve it."""
    clock = FakeClock()
    served = language_model(checkpoints_dir / "text-regulargpt", clock, tokens_per_slice=32)
    worker = driven_scheduler(clock)
    long, short, shorts = generation(served, "p" * 300, 1, clock), None, 0
    receive(worker, long)
    for _ in range(2000):
        if short is None or short.done:
            short, shorts = generation(served, f"Hello {shorts}", 4, clock), shorts + 1
            receive(worker, short)
        worker.iteration()
        if long.done:
            break
    assert long.done and shorts > 10
    assert long.service / finished_at(long) >= 0.4  # its prefill had at least ~half the engine's time
