"""Sampling: greedy, filters, per-request seeds; log-probabilities."""

from __future__ import annotations

import asyncio
import json
import logging
import math
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace

import httpx
import pytest
import torch
from fastapi.testclient import TestClient
from hypothesis import given, settings
from hypothesis import strategies as st

from model.ops.cpu import cpu_decode
from server.api.app import create_app
from server.execution import generation
from server.execution.sampling import (
    SamplingParams,
    draw,
    filtered_weights,
    greedy,
    penalize,
    sample,
    token_logprobs,
    unusable_rows,
)
from tests.server import reference
from tests.server.helpers import before_each_decode_step, make_settings, wait_for
from tests.server.live import LiveServer, serve

LOGITS = torch.tensor([0.1, 2.0, 1.9, -1.0, 0.5])


def draws(params: SamplingParams, count: int = 200) -> list[int]:
    generator = params.generator()
    return [sample(LOGITS[None], [params], [generator])[0] for _ in range(count)]


def test_greedy_and_degenerate_filters_pick_the_argmax() -> None:
    assert set(draws(SamplingParams(temperature=0.0), 5)) == {1}
    assert set(draws(SamplingParams(top_k=1, seed=3))) == {1}
    assert set(draws(SamplingParams(top_p=0.01, seed=3))) == {1}
    assert set(draws(SamplingParams(top_p=5e-324, seed=3))) == {1}  # 0 as float32: it dropped every token, took 0
    assert set(draws(SamplingParams(temperature=1e-135, seed=3))) == {1}  # logits / it overflowed to NaN, took 0
    masked = torch.tensor([[-5.0, float("-inf"), -4.0, float("-inf")]])  # what a structured_outputs mask leaves
    params = SamplingParams(temperature=1e-45, top_p=0.5, seed=1)
    assert sample(masked, [params], [params.generator()]) == [2]


def test_filters_keep_the_right_tokens() -> None:
    assert set(draws(SamplingParams(top_k=2, seed=0))) == {1, 2}
    probs = LOGITS.softmax(-1)  # 1 and 2 hold ~0.71 together; the nucleus at 0.7 needs both, not a third
    assert probs[1] + probs[2] > 0.7 > probs[1]
    assert set(draws(SamplingParams(top_p=0.7, seed=0))) == {1, 2}
    assert set(draws(SamplingParams(seed=0), 2000)) == {0, 1, 2, 3, 4}


def test_rows_sample_alone_whatever_else_is_in_the_batch() -> None:
    rows = [
        SamplingParams(seed=1),
        SamplingParams(temperature=0.0),
        SamplingParams(seed=2, top_k=3),
        SamplingParams(seed=1),
    ]
    logits = torch.stack([LOGITS, LOGITS.flip(0), LOGITS, LOGITS])  # (4, V)
    generators = [params.generator() for params in rows]
    batched = [sample(logits, rows, generators) for _ in range(50)]
    for row, params in enumerate(rows):
        generator = params.generator()
        alone = [sample(logits[row : row + 1], [params], [generator])[0] for _ in range(50)]
        assert [tokens[row] for tokens in batched] == alone
    assert {tokens[1] for tokens in batched} == {3}


def test_greedy_on_the_cpu_is_torch_argmax() -> None:
    """numpy's argmax on the CPU: the same first-of-ties, -inf and NaN answers as torch's."""
    logits = torch.randn(6, 300)
    logits[1] = 0.0  # all tied: the first
    logits[2, 7] = logits[2, 9] = 50.0  # two tied at the top
    logits[3] = float("-inf")
    logits[3, 5] = -1e30
    logits[4, 11] = float("nan")  # NaN wins, as in torch
    logits[5, ::2] = float("-inf")
    assert torch.equal(greedy(logits), logits.argmax(-1))
    assert greedy(logits[:, 1::3]).tolist() == logits[:, 1::3].argmax(-1).tolist()  # strided rows


def test_top_k_keeps_the_k_largest() -> None:
    torch.manual_seed(1)
    logits = torch.randn(8, 300)  # (R, V), no ties
    for top_k in (1, 7, 299):
        kept = filtered_weights(logits, 0.5, top_k, 1.0) > 0  # (R, V)
        expected = torch.zeros_like(kept).scatter_(-1, logits.topk(top_k, dim=-1).indices, True)
        assert torch.equal(kept, expected), top_k


def test_top_p_keeps_the_smallest_set_that_reaches_it() -> None:
    """Against a plain reference: tokens by probability, most likely first, up to the one whose cumulative probability
    reaches top_p."""
    torch.manual_seed(0)
    logits = torch.randn(8, 50) * 2  # (R, V)
    for top_p in (0.05, 0.3, 0.9, 0.999):
        kept = filtered_weights(logits, 1.0, 0, top_p) > 0  # (R, V)
        for row, row_logits in enumerate(logits.double().softmax(-1)):
            expected, total = set(), 0.0
            for token in sorted(range(50), key=lambda token: -row_logits[token]):
                expected.add(token)
                total += float(row_logits[token])
                if total >= top_p:
                    break
            assert set(torch.nonzero(kept[row])[:, 0].tolist()) == expected, (top_p, row)
    tied = torch.tensor([[1.0, 1.0, 1.0, 0.0]])  # the nucleus at 0.5 ends inside a tie: all three tied tokens stay
    assert (filtered_weights(tied, 1.0, 0, 0.5) > 0).tolist() == [[True, True, True, False]]


def test_draw_inverts_the_cumulative_weights() -> None:
    weights = torch.tensor([[0.0, 1.0, 0.0, 3.0, 0.0], [2.0, 2.0, 0.0, 0.0, 0.0]])
    for uniform, expected in [(0.0, [1, 0]), (0.2499, [1, 0]), (0.25, [3, 0]), (0.5, [3, 1]), (0.9999, [3, 1])]:
        assert draw(weights.clone(), torch.tensor([uniform, uniform])).tolist() == expected
    # A uniform at the total (rounding) takes the last token with a weight, not a filtered one after it.
    assert draw(weights.clone(), torch.tensor([1.0, 1.0])).tolist() == [3, 1]


def test_seed_makes_sampling_repeatable() -> None:
    assert draws(SamplingParams(seed=42)) == draws(SamplingParams(seed=42))
    assert draws(SamplingParams(seed=42)) != draws(SamplingParams(seed=43))


def test_token_logprobs() -> None:
    logits = torch.stack([LOGITS, LOGITS.flip(0)])  # (2, V)
    scored = token_logprobs(logits, torch.tensor([1, 0]), top=2)
    expected = LOGITS.log_softmax(-1)
    assert math.isclose(scored[0].logprob, float(expected[1]), rel_tol=1e-6)
    assert [token for token, _ in scored[0].top] == [1, 2]
    assert [token for token, _ in scored[1].top] == [3, 2]
    assert token_logprobs(logits, torch.tensor([1, 0]), top=0)[0].top == []


def history(prompt: list[int], generated: list[int]) -> SimpleNamespace:
    return SimpleNamespace(prompt_ids=torch.tensor(prompt, dtype=torch.long), generated=generated)


def test_penalize_follows_openai_and_vllm() -> None:
    logits = torch.tensor([[2.0, -1.0, 0.5, 0.0]])
    same = penalize(logits, [SamplingParams()], [history([0], [1])])
    assert same is logits  # no penalty: nothing copied
    params = SamplingParams(presence_penalty=0.5, frequency_penalty=0.25, logit_bias=((3, 1.5),))
    adjusted = penalize(logits, [params], [history([0], [1, 1, 2])])
    # token 1 seen twice: -1 - 0.25 * 2 - 0.5; token 2 once: 0.5 - 0.25 - 0.5; token 3 biased; prompt not counted
    torch.testing.assert_close(adjusted, torch.tensor([[2.0, -2.0, -0.25, 1.5]]))
    repeated = penalize(logits, [SamplingParams(repetition_penalty=2.0)], [history([0], [1])])
    torch.testing.assert_close(repeated, torch.tensor([[1.0, -2.0, 0.5, 0.0]]))  # prompt and output tokens
    assert logits.tolist() == [[2.0, -1.0, 0.5, 0.0]]  # the input is left as it was


def test_a_repetition_penalty_near_zero_keeps_masked_tokens_out() -> None:
    """5e-324 (valid: > 0) is 0 in float32: masked tokens (-inf, as structured_outputs leaves them) became NaN and
    seen ones +inf, and the sampler took token 0."""
    logits = torch.tensor([[float("-inf"), 3.0, -1.0, float("-inf")]])  # tokens 0 and 3 forbidden
    params = SamplingParams(repetition_penalty=5e-324, seed=0)
    adjusted = penalize(logits, [params], [history([0, 1, 2, 3], [])])
    assert not adjusted.isnan().any() and adjusted[0, 0] == adjusted[0, 3] == float("-inf")
    assert set(sample(adjusted.repeat(50, 1), [params] * 50, [params.generator() for _ in range(50)])) == {1}
    assert sample(adjusted, [SamplingParams(temperature=0.0)], [None]) == [1]


# --- any logits, any values the API accepts: an id in the vocabulary --------------------------------------------------

FLOAT32 = torch.finfo(torch.float32)
SPECIAL = [math.nan, math.inf, -math.inf, FLOAT32.max, FLOAT32.min, FLOAT32.tiny, -FLOAT32.tiny, 1.4e-45, 0.0, 1.0]
LOGIT = st.one_of(st.sampled_from(SPECIAL), st.floats(-50, 50, width=32), st.sampled_from([2.0, -3.0]))  # ties
POSITIVE_EDGES = [5e-324, 1.4e-45, FLOAT32.tiny]  # below float32's range, its smallest subnormal, its smallest normal
PARAMS = st.builds(
    SamplingParams,
    temperature=st.one_of(st.sampled_from([0.0, *POSITIVE_EDGES, 31.05, 100.0]), st.floats(0.0, 100.0)),
    top_p=st.one_of(st.sampled_from([*POSITIVE_EDGES, 1.0 - 1e-7, 1.0]), st.floats(5e-324, 1.0)),
    top_k=st.integers(0, 40),
    seed=st.integers(0, 2**63 - 1),
    presence_penalty=st.floats(-2.0, 2.0),
    frequency_penalty=st.floats(-2.0, 2.0),
    repetition_penalty=st.one_of(
        st.sampled_from([*POSITIVE_EDGES, 1.1754943508222875e-38, 100.0]), st.floats(5e-324, 100.0)
    ),
    logit_bias=st.lists(st.tuples(st.integers(0, 0), st.floats(-100.0, 100.0)), max_size=1).map(tuple),
)


@st.composite
def batches(draw_from) -> tuple[torch.Tensor, list[SamplingParams], list[SimpleNamespace]]:
    """Logits (B, V) with NaN, infinities, float32's extremes and ties; per row the request's parameters (any the API
    accepts) and a history for the penalties."""
    rows, vocabulary = draw_from(st.integers(1, 5)), draw_from(st.integers(1, 24))
    logits = torch.tensor(draw_from(st.lists(LOGIT, min_size=rows * vocabulary, max_size=rows * vocabulary)))
    params = draw_from(st.lists(PARAMS, min_size=rows, max_size=rows))
    token = st.integers(0, vocabulary - 1)
    histories = [
        history(draw_from(st.lists(token, max_size=4)), draw_from(st.lists(token, max_size=6))) for _ in range(rows)
    ]
    return logits.view(rows, vocabulary), params, histories


@settings(max_examples=200, deadline=None)
@given(batches())
def test_sampling_returns_an_id_of_the_vocabulary_whatever_the_logits(batch) -> None:
    """Never an id outside [0, V) (the sampler returned V for NaN logits: the batch's next step failed on it). And
    never a NaN or -inf token while the row has a finite or +inf logit to draw; where it has +inf, a +inf token (or
    one at float32's largest: +inf counts as that); greedy rows take torch's argmax."""
    logits, params, histories = batch
    adjusted = penalize(logits, params, histories)  # (B, V)
    tokens = sample(adjusted, params, [row_params.generator() for row_params in params])
    vocabulary = logits.shape[-1]
    assert all(0 <= token < vocabulary for token in tokens), tokens
    for row, (token, row_params) in enumerate(zip(tokens, params)):
        row_logits = adjusted[row]
        if row_params.temperature == 0.0:
            assert token == int(row_logits.argmax())
        elif (row_logits == math.inf).any():
            assert row_logits[token] >= FLOAT32.max  # +inf counts as the largest float
        elif (row_logits.isfinite()).any():
            assert row_logits[token].isfinite()
    usable = [bool(row.isfinite().any()) and not bool(row.isnan().any() or (row == math.inf).any()) for row in adjusted]
    failed = set(unusable_rows(adjusted, tokens))
    assert all(row not in failed for row, fine in enumerate(usable) if fine)  # a finite row never flagged


@settings(max_examples=200, deadline=None)
@given(
    st.lists(st.one_of(st.just(0.0), st.floats(0.0, 1.0, width=32)), min_size=1, max_size=64),
    st.one_of(st.sampled_from([0.0, 1.0 - 2**-24, 0.5]), st.floats(0.0, 1.0 - 2**-24, width=32)),
)
def test_draw_stays_on_tokens_with_a_weight(weights, uniform) -> None:
    """float32's rounding at the end of the cumulative sum (a uniform near 1 times the total rounds to the total): the
    token drawn has a weight, and no id reaches V."""
    row = torch.tensor([weights])
    token = int(draw(row.clone(), torch.tensor([uniform]))[0])
    assert 0 <= token < len(weights)
    if sum(weights) > 0:
        assert weights[token] > 0


def test_extreme_sampling_parameters_still_give_an_id_of_the_vocabulary() -> None:
    """An extreme request: temperature 31.05, top_k 269, top_p 1.4e-45, repetition penalty float32's smallest
    normal. Its model's state overflowed after 1,051 tokens and every logit was NaN: the sampler returned 8,192 (= V),
    and the batch's next step failed on it for every request. Now an id in range, and the row is reported as one the
    model gave no distribution for (the engine ends that request alone: see the test below)."""
    params = SamplingParams(
        temperature=31.05, top_k=269, top_p=1.4e-45, repetition_penalty=1.1754943508222875e-38, seed=100
    )
    logits = torch.randn(3, 8192)  # (B, V)
    logits[1] = math.nan
    logits[2, 7] = math.inf
    rows = [params, params, SamplingParams(temperature=0.0)]
    seen = [history([95, 95, 109], [265, 265]) for _ in rows]
    adjusted = penalize(logits, rows, seen)
    tokens = sample(adjusted, rows, [row_params.generator() for row_params in rows])
    assert all(0 <= token < 8192 for token in tokens)
    assert tokens[0] in {95, 109, 265}  # seen tokens' positive logits / 1.2e-38: the largest are all of them
    assert tokens[2] == 7
    assert unusable_rows(logits, tokens) == [1, 2]
    assert draw(torch.full((2, 5), math.nan), torch.tensor([0.3, 0.9])).tolist() == [4, 4]  # NaN weights: in range
    assert draw(torch.zeros(1, 5), torch.tensor([0.3])).tolist() == [0]  # nothing to draw: 0


def test_a_sequence_whose_logits_are_not_finite_fails_alone(live, monkeypatch) -> None:
    """The extreme request's failure in small: ten greedy requests beside one at the extreme parameters, whose model
    state overflows (its logits NaN from its 5th output token on). Only that one fails, with a message, streamed or
    not; the others answer as they do alone (before: 500 for all eleven, "index out of range in self")."""
    model = live.engine.models["text-lrnn"].model
    greedy_bodies = [
        {"model": "text-lrnn", "prompt": "__main__", "max_tokens": 8, "temperature": 0, "seed": 100 + i}
        for i in range(10)
    ]  # prompt + max_tokens: the decode batch class of the extreme ones (16-31 tokens), never 17 tokens in the cache
    extreme = {
        "model": "text-lrnn",
        "max_tokens": 12,
        "temperature": 31.05,
        "top_k": 269,
        "top_p": 1.4e-45,
        "repetition_penalty": 1.1754943508222875e-38,
    }
    overflowing = [{**extreme, "prompt": "x" * 12}, {**extreme, "prompt": "y" * 12, "stream": True}]
    with httpx.Client(base_url=live.url, timeout=60) as client:
        alone = [client.post("/v1/generate", json=body).json() for body in greedy_bodies]
    step, sizes = model.step, []

    def overflowing_step(tokens: torch.Tensor, cache) -> torch.Tensor:
        sizes.append(tokens.shape[0])
        logits = step(tokens, cache)  # (B, V)
        return logits.masked_fill((cache.lengths >= 17).to(logits.device)[:, None], math.nan)

    monkeypatch.setattr(model, "step", overflowing_step)

    async def together() -> list[httpx.Response]:
        async with httpx.AsyncClient(base_url=live.url, timeout=60) as client:
            posts = (client.post("/v1/generate", json=body) for body in [*overflowing, *greedy_bodies])
            return list(await asyncio.gather(*posts))  # the overflowing ones first: on a loaded machine the greedy
            # ones, sent first, could all end before the others came in (then no step held both: max(sizes) == 2)

    failed, streamed, *answers = asyncio.run(together())
    assert [answer.json() for answer in answers] == alone
    assert max(sizes) > 2  # they shared decode steps
    message = "the model failed: its logits for output token 6 are not finite (nan)"
    assert failed.status_code == 500 and failed.json()["error"]["message"] == message
    events = [line[len("data: ") :] for line in streamed.text.splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]" and json.loads(events[-2])["error"]["message"] == message


# --- batch invariance -------------------------------------------------------------------------------------------------

ROW_INVARIANT = ["text-lrnn", "text-regulargpt"]


def models_folder(checkpoints_dir: Path, folder: Path, model_ids: list[str]) -> Path:
    for model_id in model_ids:
        (folder / model_id).symlink_to(checkpoints_dir / model_id)
    return folder


@pytest.fixture(scope="module")
def invariant(checkpoints_dir, tmp_path_factory) -> Iterator[LiveServer]:
    """A server of the LRNN and RegularGPT language models, batch_invariant as by default ("auto": on, as it holds)."""
    folder = models_folder(checkpoints_dir, tmp_path_factory.mktemp("invariant"), ROW_INVARIANT)
    with serve(make_settings(folder)) as server:
        yield server


@pytest.mark.parametrize("prompt", ["__main__", "ab"])
@pytest.mark.parametrize("model_id", ROW_INVARIANT)
def test_a_seeded_request_samples_beside_others_what_it_samples_alone(
    model_id: str, prompt: str, invariant, monkeypatch
) -> None:
    """With batch_invariant, a seeded request's tokens and log-probabilities are bit for bit its solo run's beside ten
    others of other parameters, some prompts as long as its own (prefilled together but for batch_invariant), the
    rest longer: the decode batch goes past the kernels' default MAX_ROWS (where MKL took over: text-regulargpt's
    sample diverged from its solo run), and rows reach new depths together and apart."""
    seeded = {"model": model_id, "prompt": prompt, "max_tokens": 40, "temperature": 0.8, "seed": 7, "logprobs": 3}
    prompts = [prompt.upper(), prompt[::-1], "?" * len(prompt)] + ["an other prompt, " * (1 + i % 4) for i in range(7)]
    others = [
        {
            "model": model_id,
            "prompt": other,
            "max_tokens": 40 - 2 * i,
            "seed": i,
            "temperature": [0.0, 1.0, 0.7][i % 3],
            "top_p": [1.0, 0.9][i % 2],
            "repetition_penalty": [1.0, 1.3][i % 2],
        }
        for i, other in enumerate(prompts)
    ]
    with httpx.Client(base_url=invariant.url, timeout=60) as client:
        alone = client.post("/v1/completions", json=seeded).json()["choices"]
    sizes: list[int] = []

    def record(tokens: torch.Tensor) -> None:
        if not sizes:  # the first step waits for all eleven to be admitted, so that they decode together however
            wait_for(lambda: invariant.engine.queue.in_flight == len(others) + 1)  # apart they arrive
        sizes.append(tokens.shape[0])

    before_each_decode_step(monkeypatch, invariant.engine.models[model_id].model, record)

    async def together() -> list[dict]:
        async with httpx.AsyncClient(base_url=invariant.url, timeout=60) as client:
            answers = await asyncio.gather(*(client.post("/v1/completions", json=body) for body in [*others, seeded]))
            return [answer.json() for answer in answers]

    beside = asyncio.run(together())[-1]["choices"]
    assert beside == alone
    assert max(sizes) > cpu_decode.MAX_ROWS


@pytest.mark.parametrize("model_id", ROW_INVARIANT)
def test_under_batch_invariance_greedy_from_a_short_prompt_equals_the_parallel_pass(
    model_id: str, invariant, checkpoints_dir
) -> None:
    """A prompt of at most STEPPED_PREFILL_TOKENS runs in the decode batch under batch invariance
    (``server.execution.generation.prompt_in_batch``): the text of the parallel pass, for both architectures."""
    body = {"model": model_id, "prompt": "Hi wörl", "max_tokens": 12, "temperature": 0}
    with httpx.Client(base_url=invariant.url, timeout=60) as client:
        answer = client.post("/v1/generate", json=body).json()
    assert answer["usage"]["prompt_tokens"] <= generation.STEPPED_PREFILL_TOKENS
    assert answer["text"] == reference.text(reference.greedy_tokens(checkpoints_dir / model_id, "Hi wörl", 12))


@pytest.mark.parametrize("model_id", ["text-lstm", "text-transformer"])
def test_batch_invariant_refuses_to_serve_models_it_does_not_hold_for(model_id: str, checkpoints_dir, tmp_path) -> None:
    folder = models_folder(checkpoints_dir, tmp_path, ["text-lrnn", model_id])
    with TestClient(create_app(make_settings(folder, batch_invariant=True))) as client:
        engine = client.app.state.engine
        engine.wait_loaded()
        assert engine.state == "failed"
        assert "batch_invariant holds for float32 LRNN and RegularGPT language models only, not " in engine.detail
        assert client.get("/health").status_code == 503


def test_batch_invariant_auto_serves_models_it_does_not_hold_for_without_it(checkpoints_dir, tmp_path, caplog) -> None:
    folder = models_folder(checkpoints_dir, tmp_path, ["text-lrnn", "text-lstm"])
    with (
        caplog.at_level(logging.INFO, logger="server.engine.engine"),
        TestClient(create_app(make_settings(folder))) as client,
    ):
        client.app.state.engine.wait_loaded()
        assert client.get("/health").status_code == 200
    assert "batch invariance: off: batch_invariant holds for float32 LRNN and RegularGPT language models only" in (
        caplog.text
    )


def test_batch_invariant_false_serves_without_it_where_it_would_hold(checkpoints_dir, tmp_path) -> None:
    """false turns it off even where auto would turn it on: the decode steps keep the kernels' default policy (their
    compiled layer steps at 1-MAX_ROWS rows, MKL beyond). It was left on (on at 64 rows, a tiny LRNN's server gave
    half the tokens/s: docs/benchmarks.md, "The engine's own cost per token")."""
    folder = models_folder(checkpoints_dir, tmp_path, ["text-lrnn"])
    with TestClient(create_app(make_settings(folder, batch_invariant=False))) as client:
        engine = client.app.state.engine
        engine.wait_loaded()
        notes = engine.models["text-lrnn"].notes
    assert any(f"at 1-{cpu_decode.MAX_ROWS} rows" in note for note in notes), notes


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_sampling_on_cuda_draws_what_the_cpu_draws() -> None:
    """The filters and the search where the logits are (a GPU) take the tokens the CPU takes with the same
    generators (the sums' rounding differs: a draw within ~1e-7 of a boundary could differ; these seeds have none)."""
    torch.manual_seed(0)
    logits = torch.randn(64, 1000) * 3  # (B, V)
    rows = [
        SamplingParams(temperature=0.0),
        SamplingParams(seed=1),
        SamplingParams(temperature=0.7, top_k=20, seed=2),
        SamplingParams(top_p=0.8, seed=3),
    ] * 16
    for device_logits in (logits, logits[::4]):  # mixed groups; one group holding every row
        chosen = rows if device_logits.shape[0] == 64 else rows[1::4]
        on_cpu = [params.generator() for params in chosen]
        on_cuda = [params.generator() for params in chosen]
        for _ in range(10):
            assert sample(device_logits.cuda(), chosen, on_cuda) == sample(device_logits, chosen, on_cpu)
