"""Next-token sampling and log-probabilities.

Each request samples with its own CPU ``torch.Generator`` seeded from the request's seed (a random one when
none is given), so a seeded request gives the same tokens whatever else is decoded beside it. Before the
filters, ``penalize`` adjusts the logits as vLLM and OpenAI define it: the repetition penalty (vLLM's, as in
CTRL: a logit of a token seen in the prompt or the output is divided by it when positive, multiplied when
negative), then OpenAI's ``logit -= frequency_penalty * count + presence_penalty * (count > 0)`` over the output
tokens, then ``logit_bias``. Filters are applied in vLLM's order: temperature, then top-k, then top-p (the
smallest set of tokens whose probability reaches top_p, at least one). A decode step samples all its rows at
once (``sample``); constrained and free rows share the call.
"""

from __future__ import annotations

import secrets
from collections import defaultdict
from dataclasses import dataclass
from typing import Protocol

import torch


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
    """One token per row. logits: (B, V) float, on the model's device; row i samples with params[i] and
    generators[i].

    Rows with the same filters are filtered together; each row then draws one uniform number from its own (CPU)
    generator and takes the token where the cumulative probability first exceeds it (inverse CDF). The filters and
    the search run where the logits are: on a GPU only the uniforms go there and only the B tokens come back.
    """
    groups: dict[tuple[float, int, float], list[int]] = defaultdict(list)
    for row, row_params in enumerate(params):
        if row_params.temperature > 0.0:
            groups[(row_params.temperature, row_params.top_k, row_params.top_p)].append(row)
    # Few ops per step (on a GPU each costs a launch): no argmax when no row is greedy, no gather and scatter of rows
    # when one group holds them all.
    whole = len(groups) == 1 and len(next(iter(groups.values()))) == len(params)
    tokens = None if whole else logits.argmax(-1)  # (B,) greedy rows keep these
    for (temperature, top_k, top_p), rows in groups.items():
        index = None if whole else torch.tensor(rows).to(logits.device, non_blocking=True)  # (R,)
        cdf = filtered_probs(logits if whole else logits[index], temperature, top_k, top_p).cumsum(-1)  # (R, V)
        uniforms = torch.tensor([torch.rand(1, generator=generators[row]).item() for row in rows])  # (R,)
        thresholds = uniforms.to(logits.device, non_blocking=True)[:, None] * cdf[:, -1:]  # (R, 1)
        picks = torch.searchsorted(cdf, thresholds, right=True)[:, 0]  # (R,)
        # Rounding may put the draw at the total: take the last token with a probability, never a filtered one.
        last = (cdf < cdf[:, -1:]).sum(-1)  # (R,) where the cumulative probability reaches its total
        if whole:
            tokens = torch.minimum(picks, last)
        else:
            tokens[index] = torch.minimum(picks, last)
    return tokens.tolist()


class TokenHistory(Protocol):
    """What the penalties read of a sequence: its prompt (P,) int64 and its output token ids so far."""

    prompt_ids: torch.Tensor
    generated: list[int]


def penalize(logits: torch.Tensor, params: list[SamplingParams], histories: list[TokenHistory]) -> torch.Tensor:
    """The logits to sample from: logits (B, V) float (on any device), adjusted per row by params[i] given the row's
    prompt and output tokens so far (module docstring). Rows without penalties or biases are left as they are;
    the input is not modified."""
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


def filtered_probs(logits: torch.Tensor, temperature: float, top_k: int, top_p: float) -> torch.Tensor:
    """logits: (R, V) -> probabilities (R, V) after temperature, top-k and top-p (filtered tokens get 0)."""
    # Shifted so that each row's largest score is 0 (softmax is the same), and the temperature at least the smallest
    # normal float: a tiny one cannot make NaN probabilities (inf - inf, 0 / 0) or every score -inf.
    temperature = max(temperature, torch.finfo(logits.dtype).tiny)
    scores = (logits - logits.max(-1, keepdim=True).values) / temperature  # (R, V)
    if 0 < top_k < scores.shape[-1]:
        kth = torch.topk(scores, top_k, dim=-1).values[:, -1:]  # (R, 1)
        scores = scores.masked_fill(scores < kth, float("-inf"))
    probs = scores.softmax(-1)  # (R, V)
    if top_p < 1.0:
        sorted_probs, order = probs.sort(dim=-1, descending=True)  # (R, V) each
        drop_sorted = sorted_probs.cumsum(-1) - sorted_probs >= top_p  # the mass before it already reached top_p
        drop_sorted[:, 0] = False  # the most likely token stays: a top_p below float32's range (5e-324) compares as 0
        probs = probs.masked_fill(torch.empty_like(drop_sorted).scatter_(-1, order, drop_sorted), 0.0)
    return probs


@dataclass
class TokenLogprob:
    """A token's log-probability under the model (no temperature or filters) and the ``top`` most likely
    alternatives as (token, log-probability), most likely first."""

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
