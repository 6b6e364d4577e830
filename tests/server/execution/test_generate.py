"""/v1/generate: greedy decoding equals the parallel pass for every architecture; seeds, stop strings,
max_tokens, streaming; the state cache; O(1) decoding memory of the LRNN."""

from __future__ import annotations

import asyncio
import json

import pytest
import torch

from model.ops.cpu import cpu_decode
from server.api.serving import coalesced
from server.errors import ModelFailure
from server.execution import generation as generation_module
from server.execution.generation import (
    DecodeBatch,
    Finished,
    GenerationRequest,
    Sequence,
    prefill,
    prefill_length,
    start,
)
from server.execution.sampling import SamplingParams
from server.metrics import ServerMetrics
from server.sched.state_cache import StateCache
from server.sched.work import Status
from tests.server import reference
from tests.server.checkpoints import LANGUAGE_MODELS
from tests.server.driven import FakeClock, Recorder, events, generation, language_model, receive, run_until_done
from tests.server.driven import scheduler as driven_scheduler


def generate(client, **body) -> dict:
    response = client.post("/v1/generate", json={"model": "text-lrnn", "prompt": "The cat", **body})
    assert response.status_code == 200, response.text
    return response.json()


@pytest.mark.parametrize("model_id", sorted(LANGUAGE_MODELS))
def test_greedy_equals_the_parallel_pass(model_id: str, client, checkpoints_dir) -> None:
    body = generate(client, model=model_id, prompt="Hello, wörld", max_tokens=12, temperature=0)
    assert body["text"] == reference.text(reference.greedy_tokens(checkpoints_dir / model_id, "Hello, wörld", 12))
    assert body["finish_reason"] == "length"
    assert body["usage"] == {"prompt_tokens": 13, "completion_tokens": 12, "total_tokens": 25}


def test_seed_is_repeatable(client) -> None:
    first = generate(client, max_tokens=20, seed=7)["text"]
    assert generate(client, max_tokens=20, seed=7)["text"] == first
    assert generate(client, max_tokens=20, seed=8)["text"] != first


def test_stop_string_cuts_the_text(client) -> None:
    full = generate(client, max_tokens=30, seed=3, temperature=0.5)["text"]
    stop = full[5:7]
    cut = generate(client, max_tokens=30, seed=3, temperature=0.5, stop=[stop, "never"])
    assert cut["finish_reason"] == "stop"
    assert cut["text"] == full[: full.index(stop)]


def test_max_tokens_zero(client) -> None:
    body = generate(client, max_tokens=0)
    assert body["text"] == "" and body["finish_reason"] == "length" and body["usage"]["completion_tokens"] == 0


def test_stream_gives_the_same_text(client) -> None:
    whole = generate(client, max_tokens=25, seed=11)
    with client.stream(
        "POST",
        "/v1/generate",
        json={"model": "text-lrnn", "prompt": "The cat", "max_tokens": 25, "seed": 11, "stream": True},
    ) as response:
        assert response.headers["content-type"].startswith("text/event-stream")
        lines = [line for line in response.iter_lines() if line]
    assert lines[-1] == "data: [DONE]"
    chunks = [json.loads(line.removeprefix("data: ")) for line in lines[:-1]]
    assert "".join(chunk["text"] for chunk in chunks) == whole["text"]
    assert chunks[-1]["finish_reason"] == "length" and chunks[-1]["usage"] == whole["usage"]
    assert all(chunk["finish_reason"] is None for chunk in chunks[:-1])


def test_repeated_long_prompt_is_prefilled_from_the_state_cache(client) -> None:
    stats = client.app.state.engine.state_cache.stats
    prompt = "A long shared system prompt that is worth keeping. " * 3
    cold = generate(client, prompt=prompt, max_tokens=8, temperature=0)
    hits, hit_tokens = stats.hits, stats.hit_tokens
    warm = generate(client, prompt=prompt, max_tokens=8, temperature=0)
    longer = generate(client, prompt=prompt + "And more.", max_tokens=8, temperature=0)
    assert warm["text"] == cold["text"]
    assert stats.hits == hits + 2 and stats.hit_tokens == hit_tokens + 2 * len(prompt)
    fresh = generate(client, prompt=prompt + "And more.", max_tokens=8, temperature=0, model="text-lstm")
    assert longer["text"] == reference.text(
        reference.greedy_tokens(client.app.state.engine.models["text-lrnn"].path, prompt + "And more.", 8)
    )
    assert fresh["text"]  # another model never uses text-lrnn's snapshots
    metrics = client.get("/metrics").text
    assert 'regularlm_prefix_cache_hits_total{model_name="text-lrnn"}' in metrics


class _Record:
    def __init__(self) -> None:
        self.items: list = []

    def put(self, item) -> None:
        self.items.append(item)

    def put_many(self, items) -> None:
        self.items += items


def test_lrnn_decoding_state_does_not_grow_with_the_context(client) -> None:
    served = client.app.state.engine.models["text-lrnn"]
    sizes = []
    for length in (10, 2000):
        sequence = Sequence(served, GenerationRequest(prompt=[65] * length, max_tokens=10), _Record())
        state_cache, metrics = StateCache(0, 0, 1), ServerMetrics()
        metrics.queued([sequence.times])
        start(sequence, state_cache, metrics)
        while sequence.prefilling:
            prefill([sequence], prefill_length(sequence, 512), state_cache, metrics)
        batch = DecodeBatch()
        batch.join([sequence])
        for _ in range(3):
            batch.step(metrics)
            sizes.append(batch.cache.nbytes)
        assert batch.cache.lengths.tolist() == [length + 3]
    assert len(set(sizes)) == 1


@pytest.mark.parametrize("stream", [True, False])
def test_a_whole_answer_gets_its_tokens_at_the_end(stream: bool, client) -> None:
    """A request that does not stream has its tokens' events held until its last event, in order (no wake-up of
    its coroutine per token); a streamed one gets each at once. (With stop strings: a plain whole answer has no token
    events, next test.)"""
    served = client.app.state.engine.models["text-lrnn"]
    mailbox, metrics = _Record(), ServerMetrics()
    request = GenerationRequest(prompt=[65, 66], max_tokens=4, stream=stream, stop=["never in this text"])
    sequence = Sequence(served, request, mailbox)
    metrics.queued([sequence.times])
    start(sequence, StateCache(0, 0, 1), metrics)
    prefill([sequence], 2, StateCache(0, 0, 1), metrics)  # samples the first token
    batch = DecodeBatch()
    batch.join([sequence])
    batch.step(metrics)
    sequence.emit()  # what the scheduler's sweep does after each step
    assert len(mailbox.items) == (2 if stream else 0)
    batch.step(metrics)
    batch.step(metrics)  # the fourth token: finished
    sequence.emit()
    events = [event for _, event in mailbox.items]
    assert [type(event).__name__ for event in events] == ["TokenGenerated"] * 4 + ["Finished"]
    assert [event.token for event in events[:4]] == sequence.generated


def test_a_plain_whole_answer_has_its_text_in_the_finished_event(client, monkeypatch) -> None:
    """Not streamed, no stop strings, no log-probabilities: no token events, and the same text as streamed; an
    end-of-text token is not part of it."""
    served = client.app.state.engine.models["text-lrnn"]

    def answer(sampling: SamplingParams, stream: bool) -> tuple[str, int, int, list[int]]:
        mailbox, metrics = _Record(), ServerMetrics()
        request = GenerationRequest(prompt=[65, 66], max_tokens=12, sampling=sampling, stream=stream)
        sequence = Sequence(served, request, mailbox)
        metrics.queued([sequence.times])
        start(sequence, StateCache(0, 0, 1), metrics)
        prefill([sequence], 2, StateCache(0, 0, 1), metrics)
        batch = DecodeBatch()
        batch.join([sequence])
        while not sequence.done:
            batch.step(metrics)
        sequence.emit()
        events = [event for _, event in mailbox.items]
        return "".join(event.text for event in events), events[-1].completion_tokens, len(events), sequence.generated

    for sampling in (SamplingParams(temperature=0.0), SamplingParams(seed=5)):
        text, tokens, _, ids = answer(sampling, stream=True)
        assert answer(sampling, stream=False) == (text, tokens, 1, ids) and tokens == 12
    # The bytes tokenizer has no end-of-text token: the greedy answer's fourth token plays it.
    greedy = SamplingParams(temperature=0.0)
    ids = answer(greedy, stream=True)[3]
    end = ids.index(ids[3])
    monkeypatch.setattr(served.tokenizer, "eot_token", ids[3])
    streamed = answer(greedy, stream=True)
    assert streamed[:2] == (served.tokenizer.decode(ids[:end]), end + 1)
    assert answer(greedy, stream=False) == (*streamed[:2], 1, streamed[3])


def test_log_probabilities_come_from_each_rows_own_logits(client) -> None:
    """Two sequences decoded in one batch get the log-probabilities they get alone."""
    served = client.app.state.engine.models["text-lrnn"]

    def logprobs(prompts: list[list[int]]) -> list[list[float]]:
        metrics, mailboxes, sequences = ServerMetrics(), [], []
        for prompt in prompts:
            mailboxes.append(_Record())
            request = GenerationRequest(prompt, max_tokens=5, sampling=SamplingParams(temperature=0.0), logprobs=1)
            sequences.append(Sequence(served, request, mailboxes[-1]))
            metrics.queued([sequences[-1].times])
            start(sequences[-1], StateCache(0, 0, 1), metrics)
            prefill([sequences[-1]], len(prompt), StateCache(0, 0, 1), metrics)
        batch = DecodeBatch()
        batch.join(sequences)
        while not all(sequence.done for sequence in sequences):
            batch.step(metrics)
            batch.drop_finished()
        for sequence in sequences:
            sequence.emit()
        return [[event.logprob.logprob for _, event in mailbox.items[:-1]] for mailbox in mailboxes]  # then Finished

    together = logprobs([[65, 66], [70, 71, 72]])
    assert len(together[1]) == 5
    assert together[1] == pytest.approx(logprobs([[70, 71, 72]])[0], abs=1e-5)
    assert together[0] == pytest.approx(logprobs([[65, 66]])[0], abs=1e-5)


class ScriptedHandle:
    """Stands in for a GenerationHandle: ``ready`` answers from a script, one answer per call."""

    def __init__(self, answers: list[bool]) -> None:
        self.answers = iter(answers)

    def ready(self) -> bool:
        return next(self.answers)


async def source(chunks: list[str], closed: list[bool]):
    try:
        for chunk in chunks:
            yield chunk
    finally:
        closed.append(True)


@pytest.mark.parametrize(
    ("chunks", "ready", "written"),
    [
        ("abcde", [True, False, True, True, False], ["ab", "cde"]),  # what was queued behind a chunk leaves with it
        ("abcde", [False] * 5, ["a", "b", "c", "d", "e"]),  # nothing queued: each chunk at once
        ("abcde", [True] * 5, ["abcde"]),  # the rest of a finished stream needs no waiting: one write
        (["a", "", "b"], [True, False, False], ["a", "b"]),  # an event that writes nothing still lets "a" go
        (["", ""], [False, True], []),  # no empty writes
    ],
)
def test_a_stream_writes_what_is_ready_together(chunks, ready: list[bool], written: list[str]) -> None:
    async def run() -> list[str]:
        return [chunk async for chunk in coalesced(source(list(chunks), closed), ScriptedHandle(ready))]

    closed: list[bool] = []
    assert asyncio.run(run()) == written and closed == [True]


def test_a_stream_closes_its_source_when_the_client_leaves() -> None:
    async def first_two_then_leave() -> list[str]:
        stream = coalesced(source(list("abcde"), closed), ScriptedHandle([False] * 5))
        written = [await anext(stream), await anext(stream)]
        await stream.aclose()
        assert closed == [True]  # at once, not when the collector gets to it: the handle cancels its sequences
        return written

    closed: list[bool] = []
    assert asyncio.run(first_two_then_leave()) == ["a", "b"]


def finished(sequence: Sequence) -> bool:
    return isinstance(events(sequence)[-1], Finished)


def failure(sequence: Sequence) -> str:
    last = events(sequence)[-1]
    assert isinstance(last, ModelFailure)
    return last.message


def test_a_prefill_call_that_fails_fails_only_the_sequence_that_fails_alone(checkpoints_dir) -> None:
    """Two prompts prefilled as one call, one of which the model refuses. The stacked call worked on
    copies of their caches, so each runs again alone: the other one goes on as if it had been alone all along."""
    clock = FakeClock()
    served = language_model(checkpoints_dir / "text-lrnn", clock, tokens_per_slice=64)
    forward, calls = served.model.forward, []

    def refusing_byte_255(tokens, cache=None, **options):
        calls.append(tokens.shape[0])
        if tokens.shape[1] > 1 and bool((tokens == 255).any()):
            raise RuntimeError("byte 255 refused")
        return forward(tokens, cache, **options)

    served.model.forward = refusing_byte_255
    alone = generation(served, [97, 98, 99, 100], 6, clock)
    run_until_done(receive_into(driven_scheduler(clock), alone), [alone])
    calls.clear()
    clean, poisoned = generation(served, [97, 98, 99, 100], 6, clock), generation(served, [97, 98, 99, 255], 6, clock)
    run_until_done(receive_into(driven_scheduler(clock), clean, poisoned), [clean, poisoned])
    assert calls[:3] == [2, 1, 1]  # the stacked call, then each alone
    assert finished(clean) and clean.generated == alone.generated
    assert failure(poisoned) == "the model failed: byte 255 refused"


def test_under_batch_invariance_a_failing_prefill_call_fails_only_its_own_sequences(checkpoints_dir) -> None:
    """Under batch invariance a prefill group runs as several calls (short unscored chunks stepped together, every
    other chunk alone); a call that raises fails its own sequences only. Before, the group was one guarded call: the
    sequences whose calls had already run were failed with the one that raised."""
    clock = FakeClock()
    cpu_decode.set_row_invariant(True)
    try:
        served = language_model(checkpoints_dir / "text-lrnn", clock, tokens_per_slice=64)
        forward = served.model.forward

        def refusing_byte_255(tokens, cache=None, **options):
            if bool((tokens == 255).any()):
                raise RuntimeError("byte 255 refused")
            return forward(tokens, cache, **options)

        served.model.forward = refusing_byte_255

        def scored(prompt: list[int]) -> Sequence:
            request = GenerationRequest(prompt, 4, SamplingParams(temperature=0.0), prompt_logprobs=True)
            return Sequence(served, request, Recorder(clock), flow="client")

        alone = [generation(served, [97, 98, 99, 100], 4, clock), scored([97, 98, 99, 101])]
        for sequence in alone:
            run_until_done(receive_into(driven_scheduler(clock), sequence), [sequence])
        stepped, first_scored = generation(served, [97, 98, 99, 100], 4, clock), scored([97, 98, 99, 101])
        poisoned = scored([97, 98, 99, 255])  # prefilled after the other two, in a call of its own
        together = [stepped, first_scored, poisoned]
        run_until_done(receive_into(driven_scheduler(clock), *together), together)
    finally:
        cpu_decode.set_row_invariant(False)
    assert finished(stepped) and stepped.generated == alone[0].generated
    assert finished(first_scored) and first_scored.generated == alone[1].generated
    assert failure(poisoned) == "the model failed: byte 255 refused"


def test_a_prefill_runs_the_head_on_the_last_position_unless_the_prompt_is_scored(checkpoints_dir) -> None:
    """An LRNN's prompt chunks run its head on each row's last position alone (logits (B, V)), unless a sequence of
    the call scores its prompt (every position's logits); the tokens are the same either way."""
    clock = FakeClock()
    served = language_model(checkpoints_dir / "text-lrnn", clock, tokens_per_slice=64)
    forward, shapes = served.model.forward, []

    def recorded(tokens, cache=None, **options):
        logits = forward(tokens, cache, **options)
        shapes.append(tuple(logits.shape[:-1]))
        return logits

    served.model.forward = recorded
    plain = generation(served, "It was a dark night", 5, clock)
    run_until_done(receive_into(driven_scheduler(clock), plain), [plain])
    assert shapes == [(1,)]
    shapes.clear()
    request = GenerationRequest(list(b"It was a dark night"), 5, SamplingParams(temperature=0.0), prompt_logprobs=True)
    scored = Sequence(served, request, Recorder(clock), flow="client")
    run_until_done(receive_into(driven_scheduler(clock), scored), [scored])
    assert shapes == [(1, len(b"It was a dark night"))]
    assert scored.generated == plain.generated


def test_a_prefill_call_is_charged_for_the_head_where_it_runs(checkpoints_dir) -> None:
    """What the executor records for a prefill call (the model's measured speed, the fairness charge): an unscored
    LRNN chunk pays its head on the last positions (``prefill_cost``); a scored one and decode steps at every one."""
    clock = FakeClock()
    served = language_model(checkpoints_dir / "text-lrnn", clock, tokens_per_slice=64)
    model, text = served.model, "It was a dark night"
    plain = [generation(served, text, 5, clock), generation(served, text, 5, clock)]
    request = GenerationRequest(list(text.encode()), 5, SamplingParams(temperature=0.0), prompt_logprobs=True)
    scored = Sequence(served, request, Recorder(clock), flow="client")
    assert generation_module.prefill_call_cost(plain, 16) == model.prefill_cost(2, 16)
    assert generation_module.prefill_call_cost(plain + [scored], 16) == model.cost("cached", 3, 16)
    assert model.prefill_cost(2, 16).flops < model.cost("cached", 2, 16).flops
    cpu_decode.set_row_invariant(True)
    try:
        steps = [model.cost("cached", 2, 1, position) for position in range(8)]  # decode steps: one call each
        assert generation_module.prefill_call_cost(plain, 8).flops == sum(step.flops for step in steps)
        assert generation_module.prefill_call_cost(plain, 0) == model.cost("cached", 2, 0)  # prompts from the cache
        assert generation_module.prefill_call_cost(plain, 9) == model.prefill_cost(2, 9)
    finally:
        cpu_decode.set_row_invariant(False)


def test_under_batch_invariance_short_prompts_prefill_together_as_decode_steps(checkpoints_dir) -> None:
    """Under batch invariance a chunk of at most STEPPED_PREFILL_TOKENS unscored tokens runs as decode steps of every
    such row together, with the bits it gets alone; a scored chunk or a longer one is a pass of its own per row.
    Without invariance one pass takes them all."""
    clock, metrics, calls = FakeClock(), ServerMetrics(), []

    def prefilled(served, prompts: list[str], scored: tuple[int, ...] = ()) -> list[Sequence]:
        sequences = []
        for index, prompt in enumerate(prompts):
            request = GenerationRequest(
                list(prompt.encode()), 3, SamplingParams(temperature=0.0), prompt_logprobs=index in scored
            )
            sequences.append(Sequence(served, request, Recorder(clock), flow="client"))
            start(sequences[-1], StateCache(0, 0, 1), metrics)
        calls.clear()
        with torch.inference_mode():  # as the engine runs it
            prefill(sequences, len(prompts[0].encode()), StateCache(0, 0, 1), metrics)
        return sequences

    def recording(served):
        forward, step, advance = served.model.forward, served.model.step, served.model.advance
        served.model.forward = lambda tokens, cache=None, **options: (
            calls.append(("forward", tokens.shape[0])) or forward(tokens, cache, **options)
        )
        served.model.step = lambda tokens, cache: calls.append(("step", tokens.shape[0])) or step(tokens, cache)
        served.model.advance = lambda tokens, cache: (
            calls.append(("advance", tokens.shape[0])) or advance(tokens, cache)
        )
        return served

    prompts = ["It was", "A dark", "Nights"]
    cpu_decode.set_row_invariant(True)
    try:
        served = recording(language_model(checkpoints_dir / "text-lrnn", clock, tokens_per_slice=64))
        together = prefilled(served, prompts)
        assert calls == [("advance", 3)] * 5 + [("step", 3)]  # the head on the last token only
        for prompt, sequence in zip(prompts, together):
            alone = prefilled(served, [prompt])[0]
            assert calls == [("advance", 1)] * 5 + [("step", 1)]
            assert torch.equal(alone.next_logits, sequence.next_logits) and alone.generated == sequence.generated
        prefilled(served, prompts[:2], scored=(1,))
        assert calls == [("advance", 1)] * 5 + [("step", 1), ("forward", 1)]
        assert generation_module.STEPPED_PREFILL_TOKENS == 8
        prefilled(served, ["It was a ", "A dark ni"])  # 9 tokens
        assert calls == [("forward", 1), ("forward", 1)]
    finally:
        cpu_decode.set_row_invariant(False)
    served = recording(language_model(checkpoints_dir / "text-lrnn", clock, tokens_per_slice=64))
    prefilled(served, prompts)
    assert calls == [("forward", 3)]


def test_under_batch_invariance_short_prompts_run_as_rows_of_the_decode_batch(checkpoints_dir) -> None:
    """Under batch invariance a prompt of at most STEPPED_PREFILL_TOKENS unscored tokens that the state cache would not
    keep joins its model's decode batch when it is admitted, beside the sequences decoding there: its tokens are its
    first steps, and no call is its own. Each row gets the tokens, seeded samples and log-probabilities it gets
    alone through the stepped prefill (a state cache that keeps every prompt turns the rows off); a row cancelled
    mid-prompt leaves the others as they were. In inference mode, as the engine runs (outside it torch's own ops
    run, whose bits depend on the batch)."""
    clock = FakeClock()
    served = language_model(checkpoints_dir / "text-lrnn", clock, tokens_per_slice=64)
    calls: list[tuple[str, int]] = []

    def recording(kind: str):
        call = getattr(served.decoder, kind)

        def recorded(tokens, cache):
            calls.append((kind, tokens.shape[0]))
            return call(tokens, cache)

        return recorded

    for kind in ("advance", "greedy_step", "step"):
        setattr(served.decoder, kind, recording(kind))
    forward = served.model.forward
    served.model.forward = lambda tokens, cache=None, **options: (
        calls.append(("forward", tokens.shape[0])) or forward(tokens, cache, **options)
    )

    def requests() -> list[Sequence]:
        """A 19-token prompt, then 6-token ones (greedy; sampled; with log-probabilities; to be cancelled), each with
        31 or 18 tokens of context: one context class, one decode batch."""
        scored = GenerationRequest(list(b"It was"), 12, SamplingParams(temperature=0.0), logprobs=2)
        return [
            generation(served, "It was a dark night", 12, clock),
            generation(served, "Nights", 12, clock),
            generation(served, "A dark", 12, clock, temperature=1.0, seed=5),
            Sequence(served, scored, Recorder(clock), flow="client"),
            generation(served, "Gone!!", 12, clock),
        ]

    running = requests()
    long, *short = running
    cpu_decode.set_row_invariant(True)
    try:
        with torch.inference_mode():
            worker = driven_scheduler(clock, decode_steps=1)
            receive(worker, long)
            for _ in range(3):
                worker.iteration()
            assert long.status is Status.DECODING and calls[0] == ("forward", 1)  # its 19 tokens: prefilled
            calls.clear()
            receive(worker, *short)
            worker.iteration()
            (batch,) = worker.decoding.values()
            assert batch.sequences == running and batch.prompting == 4 and not worker.prefilling
            assert all(sequence.status is Status.DECODING and sequence.prefilled == 1 for sequence in short)
            assert calls == [("greedy_step", 5)]  # only the long row samples: the others' logits are read from
            # their prompts' last tokens on
            short[3].cancelled = True
            worker.iteration()
            assert short[3].done and batch.prompting == 3 and batch.sequences == running[:4]
            run_until_done(worker, running[:4])
            assert all(kind != "forward" and rows >= 3 for kind, rows in calls)  # the long row ends first
            calls.clear()
            for index, together in enumerate(running[:4]):
                alone = requests()[index]
                run_until_done(receive_into(driven_scheduler(clock, StateCache(4, 2**30, 1)), alone), [alone])
                assert finished(together) and together.generated == alone.generated and len(alone.generated) == 12
                assert events(together) == events(alone)
            assert ("advance", 1) not in calls  # alone, the prompts were prefilled (the model's own advance)
    finally:
        cpu_decode.set_row_invariant(False)


def receive_into(worker, *sequences: Sequence):
    receive(worker, *sequences)
    return worker


def test_a_token_outside_the_vocabulary_ends_only_its_sequence(checkpoints_dir, monkeypatch) -> None:
    """A sampler that draws id V for one row (its third token) ends that sequence with a message;
    the other rows of its decode batch step on (before, the next step's embedding raised for the whole batch:
    'the model failed: index out of range in self' for all of them)."""
    sample, draws = generation_module.sample, {}

    def drawing_the_vocabulary_size_for_seed_13(adjusted, params, generators):
        tokens = sample(adjusted, params, generators)
        for row, (parameters, generator) in enumerate(zip(params, generators)):
            draws[id(generator)] = draws.get(id(generator), 0) + 1
            if parameters.seed == 13 and draws[id(generator)] == 3:
                tokens[row] = adjusted.shape[-1]
        return tokens

    monkeypatch.setattr(generation_module, "sample", drawing_the_vocabulary_size_for_seed_13)
    clock = FakeClock()
    served = language_model(checkpoints_dir / "text-lrnn", clock, tokens_per_slice=64)
    sequences = [generation(served, f"prompt {row}", 8, clock, seed=10 + row, temperature=1.0) for row in range(5)]
    worker = receive_into(driven_scheduler(clock), *sequences)
    run_until_done(worker, sequences)
    culprit = sequences[3]
    assert failure(culprit) == "the model failed: output token 3 was drawn as id 256, outside its vocabulary of 256"
    assert all(finished(sequence) and len(sequence.generated) == 8 for sequence in sequences if sequence is not culprit)


def test_a_row_whose_text_fails_ends_alone(checkpoints_dir) -> None:
    """What one row's bookkeeping raises after sampling (its text, log-probability or constraint) ends that row."""
    clock = FakeClock()
    served = language_model(checkpoints_dir / "text-lrnn", clock, tokens_per_slice=64)
    sequences = [generation(served, f"prompt {row}", 8, clock) for row in range(3)]

    def failing_push(token):
        raise UnicodeError("cannot decode")

    sequences[1].assembler.push = failing_push
    run_until_done(receive_into(driven_scheduler(clock), *sequences), sequences)
    assert failure(sequences[1]) == "the model failed: cannot decode"
    assert finished(sequences[0]) and finished(sequences[2])


@pytest.mark.parametrize("invariant", [False, True])
def test_greedy_rows_take_the_picks_alone_and_get_the_tokens_the_logits_give(checkpoints_dir, invariant) -> None:
    """A decode step whose rows are all greedy and read nothing else of the logits asks the model for its picks
    alone (``step_greedy``: under batch invariance the head never writes the logits); the same prompts with
    log-probabilities (which read the logits) get the same tokens. A pick whose logit is not finite ends its row
    alone, with the message the sampled path gives. Under batch invariance the 8-token prompts run in the decode
    batch (``prompt_in_batch``), so the step of a prompt's last token picks its first output token too."""
    clock = FakeClock()
    first = 1 if invariant else 2  # the output token the first step_greedy call picks
    cpu_decode.set_row_invariant(invariant)
    try:
        served = language_model(checkpoints_dir / "text-lrnn", clock, tokens_per_slice=64)
        step_greedy, calls = served.model.step_greedy, []

        def counted(tokens, cache):
            calls.append(tokens.shape[0])
            picks, values = step_greedy(tokens, cache)
            if len(calls) == 3:
                values[1] = float("nan")
            return picks, values

        served.model.step_greedy = counted
        prompts = [list(f"prompt {row}".encode()) for row in range(4)]
        plain = [generation(served, prompt, 8, clock) for prompt in prompts]
        run_until_done(receive_into(driven_scheduler(clock), *plain), plain)
        assert calls[:3] == [4, 4, 4]
        scored = [
            Sequence(served, GenerationRequest(prompt, 8, SamplingParams(temperature=0.0), logprobs=0), Recorder(clock))
            for prompt in prompts
        ]
        run_until_done(receive_into(driven_scheduler(clock), *scored), scored)
    finally:
        cpu_decode.set_row_invariant(False)
    nan_at = first + 2  # the third call's
    assert failure(plain[1]) == f"the model failed: its logits for output token {nan_at} are not finite (nan)"
    assert [sequence.generated for sequence in plain if sequence is not plain[1]] == [
        sequence.generated for sequence in scored if sequence is not scored[1]
    ]
    assert plain[1].generated == scored[1].generated[: nan_at - 1]
    assert len(calls) == 9 - first  # a call for each token from the first'th; the scored rows: none
