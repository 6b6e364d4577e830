"""Sampling: greedy, filters, per-request seeds; log-probabilities."""

from __future__ import annotations

import math
from types import SimpleNamespace

import torch

from server.sampling import SamplingParams, penalize, sample, token_logprobs

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
    return SimpleNamespace(prompt_ids=torch.tensor(prompt), generated=generated)


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
