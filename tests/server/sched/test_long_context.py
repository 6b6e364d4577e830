"""A million tokens of context (docs/api.md, Limits): the limits an O(1)-state language model publishes under the
default settings, 413 past them, and the prompt-state cache serving a long prefix to another question."""

from __future__ import annotations

import httpx

from server.engine import engine as engine_module
from server.execution.generation import PREFILL_QUANTUM, Finished, Sequence, prefill_length
from server.sched.costing import ModelSpeed
from server.sched.state_cache import StateCache
from tests.server.driven import FakeClock, events, generation, language_model, receive, run_until_done
from tests.server.driven import scheduler as driven_scheduler
from tests.server.helpers import make_settings
from tests.server.live import serve

MILLION = 2**20
ESTIMATED_SECONDS = 1000.0  # what 2^20 tokens of prefill are made to cost: over max_job_seconds, within the O(1) limit


def test_o1_state_models_publish_a_million_tokens_and_growing_ones_stay_within_their_time(
    checkpoints_dir, monkeypatch
) -> None:
    """Under the default settings, at a measured speed that puts 2^20 tokens of every language model at 1,000 s of
    prefill: the LRNN and the LSTM (one state size at every length) admit 2^20 prompt tokens; the transformer and
    RegularGPT stay within max_job_seconds (300 s). Prompts past either limit are 413 naming it."""
    calibrate = engine_module.calibrate

    def slow(model):
        if not model.config.is_language_model:
            return calibrate(model)
        return ModelSpeed(ESTIMATED_SECONDS / model.cost("cached", 1, MILLION).flops)

    monkeypatch.setattr(engine_module, "calibrate", slow)
    settings = make_settings(checkpoints_dir)
    assert settings.max_job_seconds < ESTIMATED_SECONDS < settings.max_constant_state_job_seconds
    with serve(settings) as server:
        limits = {card["id"]: card["limits"] for card in httpx.get(f"{server.url}/v1/models").json()["data"]}
        for model_id in ("text-lrnn", "text-lstm"):
            assert limits[model_id]["max_input_symbols"] == MILLION
            assert limits[model_id]["max_context_tokens"] >= MILLION + 8
        for model_id in ("text-transformer", "text-regulargpt"):
            budget = server.engine.models[model_id].budget
            context = limits[model_id]["max_context_tokens"]
            assert 0 < context < MILLION and budget.max_job_seconds == settings.max_job_seconds
            assert budget.speed.seconds(budget.context_cost(context).flops) <= settings.max_job_seconds
            over = {"model": model_id, "prompt": "x" * context, "max_tokens": 1}
            refused = httpx.post(f"{server.url}/v1/completions", json=over, timeout=60)
            message = refused.json()["error"]["message"]
            assert refused.status_code == 413 and f"at most {context} tokens of context" in message
            assert "300 s" in message
        over = {"model": "text-lrnn", "prompt": "x" * (MILLION + 1), "max_tokens": 1}
        refused = httpx.post(f"{server.url}/v1/generate", json=over, timeout=60)
        assert refused.status_code == 413
        assert refused.json()["error"]["message"] == f"the prompt has {MILLION + 1} tokens; the limit is {MILLION}"


def test_another_question_on_a_long_prefix_starts_from_its_snapshot(checkpoints_dir) -> None:
    """A prompt is also snapshotted ``tail_tokens`` before its end: a second prompt that differs only in its last
    tokens takes all but those from the cache, and generates what it generates without the cache."""
    document = bytes(range(32, 127)).decode() * 3  # 285 byte tokens
    first, second = document + "What is the key? It is", document + "And the key? It is"

    def answer(cache: StateCache, prompt: str) -> Sequence:
        clock = FakeClock()
        served = language_model(checkpoints_dir / "text-lrnn", clock, tokens_per_slice=64)
        worker = driven_scheduler(clock)
        worker.executor.state_cache = cache
        sequence = generation(served, prompt, 4, clock)
        receive(worker, sequence)
        run_until_done(worker, [sequence])
        return sequence

    cache = StateCache(max_entries=8, max_bytes=2**20, min_tokens=8, tail_tokens=32)
    assert cache.tail_position(len(first)) == len(first) - 32 and cache.tail_position(40) is None
    answer(cache, first)
    assert len(cache) == 2  # the whole prompt and its state 32 tokens before its end
    cached = answer(cache, second)
    uncached = answer(StateCache(0, 0, 0), second)
    finished = next(event for event in events(cached) if isinstance(event, Finished))
    assert finished.cached_tokens == len(first) - 32  # the question is 22 tokens
    assert cached.generated == uncached.generated


def test_a_long_prompts_chunks_take_few_lengths(checkpoints_dir) -> None:
    """Chunks cut short of the prompt's end by the slice, whatever the measured speed, are multiples of
    PREFILL_QUANTUM (or below it powers of two): each new input shape costs the server memory that stays. The last
    chunk is what remains."""
    clock = FakeClock()
    served = language_model(checkpoints_dir / "text-lrnn", clock, tokens_per_slice=100)
    sequence = generation(served, "p" * 5000, 1, clock)
    measured = served.budget.speed.seconds_per_flop
    lengths = set()
    for factor in (0.3, 0.45, 0.7, 0.9, 1.0, 1.3, 1.7, 2.9, 5.0, 9.0, 40.0):
        served.budget.speed = ModelSpeed(measured * factor)
        lengths.add(prefill_length(sequence, budget=2048))
    assert all(length % PREFILL_QUANTUM == 0 or PREFILL_QUANTUM % length == 0 for length in lengths)
    assert len(lengths) >= 4  # the speeds asked for chunks of several sizes
    served.budget.speed, sequence.prefilled = ModelSpeed(measured), 5000 - 37
    assert prefill_length(sequence, budget=2048) == 37


def test_a_prompt_taken_whole_from_the_cache_joins_no_decode_step_before_its_first_token(checkpoints_dir) -> None:
    """A prompt found whole in the state cache has nothing to prefill but its first token, sampled by its (empty)
    prefill chunk. When that chunk does not run in the iteration (a long prompt's chunk took the slice first), the
    sequence must not join its decode batch yet: a decode step reads each row's last token, and it has none (it joined
    anyway, and the step raised for the whole batch, failing a sequence that was decoding beside it)."""
    clock = FakeClock()
    served = language_model(checkpoints_dir / "text-lrnn", clock, tokens_per_slice=64)
    worker = driven_scheduler(clock)
    worker.executor.state_cache = StateCache(max_entries=8, max_bytes=2**20, min_tokens=8)
    prompt = "The same question, asked twice. "
    first = generation(served, prompt, 4, clock)
    receive(worker, first)
    run_until_done(worker, [first])
    decoding = generation(served, "Another text, decoding.", 40, clock, flow="c")
    receive(worker, decoding)
    worker.iteration()
    long, again = generation(served, "x" * 600, 2, clock, flow="a"), generation(served, prompt, 4, clock, flow="b")
    receive(worker, long, again)
    run_until_done(worker, [decoding, long, again])
    for sequence in (decoding, long, again):
        assert sequence.finish_reason == "length", events(sequence)[-1]
    assert again.cached_tokens == len(prompt) and again.generated == first.generated
