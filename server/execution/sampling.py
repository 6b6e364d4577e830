"""Next-token sampling and log-probabilities.

Each request samples with its own CPU ``torch.Generator`` seeded from its seed (random when none), row by row: a row's
token depends only on its logits, parameters and generator. ``penalize`` applies vLLM's repetition penalty, then
OpenAI's ``logit -= frequency_penalty * count + presence_penalty * (count > 0)``, then ``logit_bias``; filters go in
vLLM's order (temperature, top-k, top-p), keeping ties. Any logits give an id in the vocabulary; NaN is never drawn
while anything else can be.
"""

from __future__ import annotations

import math
import secrets
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch

from model.ops.cpu.cpu_decode import rows_argmax


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias added to its logit)

    @property
    def penalizes(self) -> bool:
        penalties = self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0
        return bool(penalties or self.logit_bias)

    def generator(self) -> torch.Generator:
        generator = torch.Generator()
        generator.manual_seed(self.seed if self.seed is not None else secrets.randbits(63))
        return generator


def sample(logits: torch.Tensor, params: list[SamplingParams], generators: list[torch.Generator]) -> list[int]:
    """One token per row from logits (B, V) on the model's device; row i samples with params[i] and generators[i]
    (temperature 0: greedy), by inverse CDF (:func:`draw`)."""
    groups: dict[tuple[float, int, float], list[int]] = defaultdict(list)
    for row, row_params in enumerate(params):
        if row_params.temperature > 0.0:
            groups[(row_params.temperature, row_params.top_k, row_params.top_p)].append(row)
    # Few ops per step (on a GPU each costs a launch): no argmax when no row is greedy, no gather and scatter of rows
    # when one group holds them all.
    whole = len(groups) == 1 and len(next(iter(groups.values()))) == len(params)
    tokens = None if whole else greedy(logits)  # (B,) greedy rows keep these
    for (temperature, top_k, top_p), rows in groups.items():
        index = None if whole else torch.tensor(rows).to(logits.device, non_blocking=True)  # (R,)
        weights = filtered_weights(logits if whole else logits[index], temperature, top_k, top_p)  # (R, V)
        uniforms = torch.tensor([torch.rand(1, generator=generators[row]).item() for row in rows])  # (R,)
        picks = draw(weights, uniforms.to(logits.device, non_blocking=True))  # (R,)
        if whole:
            tokens = picks
        else:
            assert tokens is not None  # greedy(logits) where not whole
            tokens[index] = picks
    assert tokens is not None  # whole: its one group drew them
    return tokens.tolist()


def unusable_rows(logits: torch.Tensor, tokens: list[int]) -> list[int]:
    """The rows whose token was drawn at a NaN or infinite logit of ``logits`` (B, V); ``tokens`` (B,)."""
    return unusable(drawn_logits(logits, tokens))


def unusable(drawn: list[float]) -> list[int]:
    """The rows whose drawn logit (:func:`drawn_logits`, or a greedy pick's value) is NaN or infinite."""
    if math.isfinite(sum(drawn)):
        return []
    return [row for row, value in enumerate(drawn) if not math.isfinite(value)]


def drawn_logits(logits: torch.Tensor, tokens: list[int]) -> list[float]:
    """Each row's logit at its token: logits (B, V), tokens (B,) -> B values."""
    if logits.device.type == "cpu":
        drawn: list[float] = logits.detach().numpy()[np.arange(len(tokens)), tokens].tolist()
        return drawn
    rows = torch.arange(len(tokens), device=logits.device)
    return logits[rows, torch.tensor(tokens, device=logits.device)].tolist()


def greedy(logits: torch.Tensor) -> torch.Tensor:
    """Each row's largest logit, the first of ties: (B, V) -> (B,) int64."""
    return rows_argmax(logits)[0]


def draw(weights: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """Inverse CDF per row: the first token whose cumulative weight exceeds its uniform times the total. weights (R, V),
    non-negative, summed in place; uniforms (R,) in [0, 1) -> (R,) ids in [0, V); a row of total 0 gets 0."""
    cdf = weights.cumsum_(-1)  # (R, V), in place
    total = cdf[:, -1:].contiguous()  # (R, 1)
    picks = torch.searchsorted(cdf, uniforms[:, None] * total, right=True)[:, 0]  # (R,)
    last = torch.searchsorted(cdf, total)[:, 0]  # (R,) the first index where the sum reaches its total (V if NaN)
    return torch.minimum(picks, last).clamp_(max=weights.shape[-1] - 1)


class TokenHistory(Protocol):
    """What the penalties read of a sequence: its prompt (P,) int64 and its output token ids so far."""

    @property
    def prompt_ids(self) -> torch.Tensor: ...

    @property
    def generated(self) -> list[int]: ...


def penalize(logits: torch.Tensor, params: list[SamplingParams], histories: Sequence[TokenHistory]) -> torch.Tensor:
    """The logits (B, V) adjusted per row by params[i] given its history; rows without penalties are left as they are,
    the input unchanged."""
    rows = [row for row, row_params in enumerate(params) if row_params.penalizes]
    if not rows:
        return logits
    logits = logits.clone()
    vocabulary = logits.shape[-1]
    for row in rows:
        row_params, row_logits, history = params[row], logits[row], histories[row]  # row_logits: (V,) a view
        generated = torch.tensor(history.generated, dtype=torch.long).to(logits.device)  # (N,)
        counts = torch.bincount(generated, minlength=vocabulary)[:vocabulary]  # (V,)
        if row_params.repetition_penalty != 1.0:
            seen = counts > 0
            seen[history.prompt_ids.to(logits.device)] = True
            # At least float32's smallest normal (below, the penalty rounds to 0 and a masked -inf x 0 is NaN), and no
            # logit pushed past float32's largest (inf - inf is NaN when the sampler shifts the scores).
            limits = torch.finfo(row_logits.dtype)
            penalty = max(row_params.repetition_penalty, limits.tiny)
            penalized = torch.where(row_logits > 0, (row_logits / penalty).clamp(max=limits.max), row_logits * penalty)
            row_logits.copy_(torch.where(seen, penalized, row_logits))
        if row_params.frequency_penalty or row_params.presence_penalty:
            counts = counts.to(row_logits.dtype)  # (V,)
            row_logits -= row_params.frequency_penalty * counts + row_params.presence_penalty * (counts > 0)
        for token, bias in row_params.logit_bias:
            row_logits[token] += bias
    return logits


def filtered_weights(logits: torch.Tensor, temperature: float, top_k: int, top_p: float) -> torch.Tensor:
    """logits (R, V) -> weights (R, V) proportional to the probabilities after temperature, top-k and top-p, each row's
    largest 1, filtered 0, never NaN."""
    # Shifted so that each row's largest score is 0, and the temperature at least the smallest normal float: a tiny one
    # cannot make NaN weights (inf - inf, 0 / 0) or every score -inf. Whatever the logits, no weight is NaN: a NaN
    # logit is never drawn (-inf), +inf is the largest float (inf - inf is NaN), and a row with no finite logit keeps
    # every score at -inf (its shift is the lowest float, not -inf) and gets all-zero weights (:func:`draw`). amax
    # (max also finds the indices) and exp2 (exp is slow where it underflows), the temperature and log2(e) in one product.
    limits = torch.finfo(logits.dtype)
    temperature = max(temperature, limits.tiny)
    scores = logits.nan_to_num(-math.inf, limits.max, -math.inf)  # (R, V), a new tensor: the steps below work in place
    scores -= scores.amax(-1, keepdim=True).clamp_(min=limits.min)  # (R, V) <= 0, or -inf
    # base-2 scores; below the largest, -inf where a tiny temperature overflows them
    scores *= math.log2(math.e) / temperature
    if 0 < top_k < scores.shape[-1]:
        scores.masked_fill_(scores < _kth_largest(scores, top_k), float("-inf"))
    weights = scores.exp2_()  # (R, V)
    if top_p < 1.0:
        # The nucleus: in descending order, every token up to the first whose cumulative weight reaches top_p of the
        # total (the most likely token always: a top_p below float32's range, 5e-324, is 0 here), and tokens tied with
        # that last one. The threshold only, so the values are sorted without their indices.
        descending = _descending(weights)  # (R, V)
        cumulative = descending.cumsum(-1)  # (R, V)
        last = torch.searchsorted(cumulative, top_p * cumulative[:, -1:].contiguous()).clamp_(max=weights.shape[-1] - 1)
        weights.masked_fill_(weights < descending.gather(-1, last), 0.0)  # (R, 1) thresholds
    return weights


def _kth_largest(values: torch.Tensor, k: int) -> torch.Tensor:
    """Each row's k-th largest value: (R, V) -> (R, 1) (numpy's partition on the CPU)."""
    if values.device.type != "cpu":
        return torch.topk(values, k, dim=-1).values[:, -1:]
    position = values.shape[-1] - k
    return torch.from_numpy(np.partition(values.detach().numpy(), position, axis=-1)[:, position : position + 1])


def _descending(values: torch.Tensor) -> torch.Tensor:
    """Each row sorted from its largest value: (R, V) -> (R, V) (numpy's sort on the CPU)."""
    if values.device.type != "cpu":
        return values.sort(dim=-1, descending=True).values
    negated = np.negative(values.detach().numpy())
    negated.sort(axis=-1)
    return torch.from_numpy(np.negative(negated, out=negated))


@dataclass
class TokenLogprob:
    """A token's log-probability under the model (no temperature or filters) and the ``top`` alternatives, most likely
    first."""

    token: int
    logprob: float
    top: list[tuple[int, float]]


def token_logprobs(logits: torch.Tensor, tokens: torch.Tensor, top: int) -> list[TokenLogprob]:
    """logits: (N, V) predicting tokens: (N,) -> one :class:`TokenLogprob` per row, with ``top`` alternatives."""
    logprobs = logits.float().log_softmax(-1)  # (N, V)
    chosen = logprobs.gather(1, tokens[:, None].to(logprobs.device))[:, 0].tolist()  # (N,)
    if top:
        best = logprobs.topk(top, dim=-1)  # (N, top) values and indices
        alternatives = [list(zip(ids, values)) for ids, values in zip(best.indices.tolist(), best.values.tolist())]
    else:
        alternatives = [[] for _ in chosen]
    return [TokenLogprob(token, logprob, alt) for token, logprob, alt in zip(tokens.tolist(), chosen, alternatives)]
