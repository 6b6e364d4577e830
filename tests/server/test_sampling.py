"""Sampling: greedy, filters, per-request seeds; log-probabilities."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

from server.sampling import SamplingParams, draw, filtered_weights, greedy, penalize, sample, token_logprobs

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


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_sampling_on_cuda_draws_what_the_cpu_draws() -> None:
    """The filters and the search where the logits are (a GPU) take the tokens the CPU takes with the same
    generators (the sums' rounding differs: a draw within ~1e-7 of a boundary could differ; these seeds have none)."""
    torch.manual_seed(0)
    logits = torch.randn(64, 1000) * 3  # (B, V)
    rows = [SamplingParams(temperature=0.0), SamplingParams(seed=1), SamplingParams(temperature=0.7, top_k=20, seed=2),
            SamplingParams(top_p=0.8, seed=3)] * 16  # fmt: skip
    for device_logits in (logits, logits[::4]):  # mixed groups; one group holding every row
        chosen = rows if device_logits.shape[0] == 64 else rows[1::4]
        on_cpu = [params.generator() for params in chosen]
        on_cuda = [params.generator() for params in chosen]
        for _ in range(10):
            assert sample(device_logits.cuda(), chosen, on_cuda) == sample(device_logits, chosen, on_cpu)
