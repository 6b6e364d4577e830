"""One generated sequence's life in the engine: prefill (from a state-cache snapshot when one matches),
then one token per decode step, until max_tokens, the end-of-text token or a stop string.

Prefill runs in chunks of the prompt through ``forward(chunk, cache=cache)``, except for RegularGPT, whose
cached forward continues one token at a time: its prompt goes through one parallel pass (which fills the
cache). Chunks of equal length of several sequences, and decode steps of several sequences, run as one
batch when their caches stack (``cache_stacking``): the LRNNs and the LSTM, whose O(1) state makes a
step's cost and memory independent of the context length. Transformer and RegularGPT sequences run one at
a time.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

import torch

from model.base import InferenceCache
from server.cache_stacking import can_stack, split_cache, stack_caches
from server.detokenize import TextAssembler
from server.errors import APIError
from server.mailbox import Mailbox
from server.metrics import RequestTimes, ServerMetrics
from server.model_store import ServedModel
from server.sampling import SamplingParams, TokenLogprob, sample, token_logprobs
from server.state_cache import StateCache

WHOLE_PROMPT_PREFILL = {"regulargpt"}  # architectures whose cached forward is sequential


@dataclass(frozen=True)
class GenerationRequest:
    """What the engine needs to generate one sequence (no HTTP here)."""

    prompt: list[int]
    max_tokens: int
    sampling: SamplingParams = SamplingParams()
    stop: list[str] = field(default_factory=list)
    logprobs: int | None = None  # None: none; k: the chosen token's and k alternatives'
    prompt_logprobs: bool = False  # score every prompt token (then the state cache is not used)


@dataclass
class PromptScored:
    logprobs: list[TokenLogprob | None]  # one per prompt token; the first has no context, so None


@dataclass
class TokenGenerated:
    token: int
    text: str  # the text this token releases (may be empty: see detokenize.py)
    logprob: TokenLogprob | None


@dataclass
class Finished:
    reason: Literal["stop", "length"]
    text: str  # text still held back when generation ended
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int  # prompt tokens taken from the state cache


class Sequence:
    """A sequence's state. Its events go to ``mailbox`` as (index, event): the sequences of one HTTP request
    (several prompts, n choices) share a mailbox."""

    def __init__(self, served: ServedModel, request: GenerationRequest, mailbox: Mailbox, index: int = 0) -> None:
        self.served, self.request, self.mailbox, self.index = served, request, mailbox, index
        self.times = RequestTimes(served.id)
        self.generator = request.sampling.generator()
        self.assembler = TextAssembler(served.tokenizer, request.stop)
        self.cache: InferenceCache | None = None
        self.next_logits: torch.Tensor | None = None  # (V,) predicting the next token
        self.prefilled = 0
        self.cached_tokens = 0
        self.prompt_scores: list[TokenLogprob | None] = []
        self.generated: list[int] = []
        self.cancelled = False  # set by the request's side when the client goes away
        self.done = False

    @property
    def prefilling(self) -> bool:
        return self.prefilled < len(self.request.prompt)

    def finish(self, reason: Literal["stop", "length"], metrics: ServerMetrics) -> None:
        self.done = True
        self.cache = None
        metrics.finished(self.times, reason)
        prompt_tokens = len(self.request.prompt)
        self.send(Finished(reason, self.assembler.finish(), prompt_tokens, len(self.generated), self.cached_tokens))

    def abort(self, metrics: ServerMetrics, error: APIError | None = None) -> None:
        """End without an answer: the client left (no error) or the model call failed (error)."""
        self.done = True
        self.cache = None
        metrics.finished(self.times, "abort" if error is None else "error")
        if error is not None:
            self.send(error)

    def send(self, event: PromptScored | TokenGenerated | Finished | APIError) -> None:
        self.mailbox.put((self.index, event))


def start(sequence: Sequence, state_cache: StateCache, metrics: ServerMetrics) -> None:
    """Schedule a waiting sequence: an empty cache, or a clone of the longest cached prefix of its prompt."""
    metrics.scheduled(sequence.times)
    model, prompt = sequence.served.model, sequence.request.prompt
    metrics.prompt_tokens.labels(sequence.served.id).inc(len(prompt))
    snapshot = None
    if not sequence.request.prompt_logprobs:
        snapshot = state_cache.lookup(sequence.served.id, prompt)
        metrics.prefix_cache_queries.labels(sequence.served.id).inc(len(prompt))
    if snapshot is None:
        sequence.cache = model.new_cache(1)
        return
    metrics.prefix_cache_hits.labels(sequence.served.id).inc(snapshot.length)
    sequence.cache, sequence.next_logits = snapshot.cache, snapshot.logits
    sequence.prefilled = sequence.cached_tokens = snapshot.length


def prefill(sequences: list[Sequence], length: int, state_cache: StateCache, metrics: ServerMetrics) -> None:
    """Consume the next ``length`` prompt tokens of each sequence in one forward pass (one model; stackable
    caches, or a single sequence). A sequence whose prompt is then done is snapshotted, scored if asked,
    and gets its first token. ``length`` 0 only completes prompts taken whole from the state cache."""
    if length:
        model = sequences[0].served.model
        chunks = torch.tensor(
            [sequence.request.prompt[sequence.prefilled : sequence.prefilled + length] for sequence in sequences],
            device=model.device,
        )  # (B, n)
        logits = _run_stacked(model.forward, chunks, [sequence.cache for sequence in sequences])  # (B, n, V)
        for sequence, chunk, chunk_logits in zip(sequences, chunks, logits):
            if sequence.request.prompt_logprobs:
                _score_prompt_chunk(sequence, chunk, chunk_logits)
            sequence.next_logits = chunk_logits[-1]  # (V,)
            sequence.prefilled += length
    done = [sequence for sequence in sequences if not sequence.prefilling]
    for sequence in done:
        state_cache.store(sequence.served.id, sequence.request.prompt, sequence.cache, sequence.next_logits)
        if sequence.request.prompt_logprobs:
            sequence.send(PromptScored(sequence.prompt_scores))
        if sequence.request.max_tokens == 0:
            sequence.finish("length", metrics)
    sampling = [sequence for sequence in done if not sequence.done]
    if sampling:
        accept(sampling, torch.stack([sequence.next_logits for sequence in sampling]), metrics)


def prefill_length(sequence: Sequence, budget: int) -> int:
    """How many prompt tokens the sequence prefills next within ``budget``: all that remain for RegularGPT,
    whose cached forward would go one token at a time."""
    remaining = len(sequence.request.prompt) - sequence.prefilled
    whole = sequence.served.config.architecture in WHOLE_PROMPT_PREFILL
    return remaining if whole else min(remaining, budget)


def _score_prompt_chunk(sequence: Sequence, chunk: torch.Tensor, logits: torch.Tensor) -> None:
    """Log-probabilities of the chunk's tokens: token j is predicted by the logits of token j - 1."""
    if sequence.next_logits is None:
        sequence.prompt_scores.append(None)  # the first prompt token has no prediction
        predictors, targets = logits[:-1], chunk[1:]  # (n-1, V), (n-1,)
    else:
        predictors, targets = torch.cat([sequence.next_logits[None], logits[:-1]]), chunk  # (n, V), (n,)
    sequence.prompt_scores += token_logprobs(predictors, targets, sequence.request.logprobs or 0)


def decode_step(sequences: list[Sequence], metrics: ServerMetrics) -> None:
    """One token for each sequence (one model; stackable caches, or a single sequence)."""
    model = sequences[0].served.model
    tokens = torch.tensor([sequence.generated[-1] for sequence in sequences], device=model.device)  # (B,)
    accept(sequences, _run_stacked(model.step, tokens, [sequence.cache for sequence in sequences]), metrics)


def _run_stacked(call, tokens: torch.Tensor, caches: list[InferenceCache]) -> torch.Tensor:
    """``call(tokens, cache)`` for B sequences at once: tokens (B, ...) -> (B, ...), on their stacked caches
    (or on the one cache of a single sequence), each cache advanced."""
    if len(caches) == 1 and not can_stack(caches[0]):
        return call(tokens, caches[0])
    stacked = stack_caches(caches)
    out = call(tokens, stacked)
    split_cache(stacked, caches)
    return out


def accept(sequences: list[Sequence], logits: torch.Tensor, metrics: ServerMetrics) -> None:
    """Sample each sequence's next token from its row of logits (B, V), hand the tokens to the requests,
    and finish the sequences that end."""
    logits = logits.float().cpu()  # (B, V): sampling runs on the CPU with each request's generator
    params = [sequence.request.sampling for sequence in sequences]
    tokens = sample(logits, params, [sequence.generator for sequence in sequences])
    for sequence, token, row_logits in zip(sequences, tokens, logits):
        _append(sequence, token, row_logits, metrics)


def _append(sequence: Sequence, token: int, logits: torch.Tensor, metrics: ServerMetrics) -> None:
    """logits: (V,), from which ``token`` was sampled."""
    sequence.generated.append(token)
    metrics.token(sequence.times)
    if token == sequence.served.tokenizer.eot_token:
        sequence.finish("stop", metrics)
        return
    logprob = None
    if sequence.request.logprobs is not None:
        logprob = token_logprobs(logits[None], torch.tensor([token]), sequence.request.logprobs)[0]
    text, stopped = sequence.assembler.push(token)
    sequence.send(TokenGenerated(token, text, logprob))
    if stopped:
        sequence.finish("stop", metrics)
    elif len(sequence.generated) >= sequence.request.max_tokens:
        sequence.finish("length", metrics)
