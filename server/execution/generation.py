"""One generated sequence's life in the engine: prefill (from a state-cache snapshot when one matches) in chunks through
its own cache, then one token per decode step in its model's :class:`DecodeBatch`, until max_tokens, the end-of-text
token or a stop string.

Prefill chunks of one model and length run as one call on stacked caches (``InferenceCache.stack``); a decode batch
keeps its rows' caches stacked, so a decode step is one call per model whatever the architecture and the rows' lengths.
The engine never looks at a cache's class.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal, Protocol, cast

import torch

from model.cache import InferenceCache, long_tensor
from model.ops.cpu import cpu_decode
from model.serving import Cost, largest_fitting
from server.errors import APIError, ModelFailure
from server.execution.detokenize import TextAssembler
from server.execution.sampling import (
    SamplingParams,
    TokenLogprob,
    drawn_logits,
    penalize,
    sample,
    token_logprobs,
    unusable,
)
from server.metrics import RequestTimes, ServerMetrics
from server.models.store import ServedModel
from server.sched.state_cache import StateCache
from server.sched.work import FinishReason, Recipient, Work
from server.structured.outputs import CompiledConstraint, Masks, token_bias, token_bias_later

logger = logging.getLogger(__name__)
# Logits of at most this many elements are sampled on the CPU, more where the model runs (fewer cost more in op
# launches than in computing; docs/benchmarks.md, "Sampling and the exact models' softmax").
HOST_SAMPLING_ELEMENTS = 16_384
# A prefill chunk that stops short of its prompt's end is a multiple of this many tokens, or below it a power of two,
# so that a long prompt runs few input shapes (each new shape holds memory for good: docs/serving.md).
PREFILL_QUANTUM = 64
# Under batch invariance, an unscored prompt chunk of at most this many tokens runs as decode steps, all such rows of a
# call together (row-invariant at any row count, and cheaper than a pass of its own per row).
STEPPED_PREFILL_TOKENS = 8


class Assembler(Protocol):
    """A sequence's text: a :class:`TextAssembler`, or ``IdsOnly`` in the engine process."""

    def push(self, token: int) -> tuple[str, bool]: ...

    def whole_answer(self, tokens: list[int]) -> str: ...

    def finish(self) -> str: ...


class SelectsPositions(Protocol):
    """A model whose ``forward`` takes a (B, T) bool mask ``positions`` and returns the logits there only."""

    def forward(
        self, tokens: torch.Tensor, cache: InferenceCache | None = None, positions: torch.Tensor | None = None
    ) -> torch.Tensor: ...


@dataclass(frozen=True)
class GenerationRequest:
    """What the engine needs to generate one sequence (no HTTP here)."""

    prompt: list[int]
    max_tokens: int
    sampling: SamplingParams = SamplingParams()
    stop: list[str] = field(default_factory=list)
    logprobs: int | None = None  # None: none; k: the chosen token's and k alternatives'
    prompt_logprobs: bool = False  # score every prompt token (then the state cache is not used)
    constraint: CompiledConstraint | None = None  # structured_outputs: what every text must match
    stream: bool = True  # False: its tokens' events are held and posted with the last one (no wake-up per token)

    @property
    def whole_answer(self) -> bool:
        """Nothing is needed per token (no stream, stop strings or log-probabilities)."""
        return not self.stream and not self.stop and self.logprobs is None


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


class Sequence(Work):
    """A sequence's state. Its events go to ``mailbox`` as (index, event) through its outbox."""

    def __init__(
        self, served: ServedModel, request: GenerationRequest, mailbox: Recipient, index: int = 0, flow: str = ""
    ) -> None:
        super().__init__(RequestTimes(served.id), flow, mailbox)
        self.served, self.request, self.index = served, request, index
        self.reserved_bytes = 0  # memory held for its cache while it runs (the scheduler's ledger)
        self.prefill_resumes_at = 0.0  # the scheduler's clock: until then its prefill yields to less-served sequences
        self.generator = request.sampling.generator()
        assert served.tokenizer is not None  # a language model is served with its tokenizer
        self.assembler: Assembler = TextAssembler(served.tokenizer, request.stop)
        self.constraint = None if request.constraint is None else request.constraint.start()  # its own matcher
        self.cache: InferenceCache | None = None  # its own while prefilling; then a row of its decode batch
        self.next_logits: torch.Tensor | None = None  # (V,) predicting the next token
        self.prefilled = 0
        self.cached_tokens = 0
        self.snapshot_at: int | None = None  # a prompt position where its prefill stops to snapshot its state
        self.prompt_scores: list[TokenLogprob | None] = []
        self.generated: list[int] = []
        self.held: list[TokenGenerated] = []  # a request that does not stream: its tokens' events until the end
        self.plain = request.whole_answer

    @functools.cached_property
    def cache_bytes(self) -> int:
        """The memory its cache may take while it runs (``ModelBudget.context_cost``)."""
        assert self.served.budget is not None  # measured when the model was installed
        return self.served.budget.context_cost(len(self.request.prompt) + self.request.max_tokens).nbytes

    @functools.cached_property
    def prompt_ids(self) -> torch.Tensor:
        """The prompt as a (P,) int64 CPU tensor, for the repetition penalty."""
        return torch.tensor(self.request.prompt, dtype=torch.long)

    @functools.cached_property
    def picks_greedily(self) -> bool:
        """Its next token is always its logits' first largest and nothing else of them is read."""
        request = self.request
        return (
            request.sampling.temperature <= 0.0
            and not request.sampling.penalizes
            and request.constraint is None
            and request.logprobs is None
        )

    @property
    def prefilling(self) -> bool:
        return self.prefilled < len(self.request.prompt)

    @property
    def ready_to_decode(self) -> bool:
        """Its first token is sampled and it has not ended."""
        return bool(self.generated) and not self.done

    def finish(self, reason: Literal["stop", "length"], metrics: ServerMetrics) -> None:
        """Answered: its last text and the Finished event."""
        if not self.end(reason, metrics):
            return
        text = self.assembler.whole_answer(self.generated) if self.plain else self.assembler.finish()
        self.send(Finished(reason, text, len(self.request.prompt), len(self.generated), self.cached_tokens))

    def end(self, reason: FinishReason, metrics: ServerMetrics) -> bool:
        ended = super().end(reason, metrics)
        if ended:
            self.cache = None
        return ended

    def deliver(self, answer: object) -> None:
        assert isinstance(answer, APIError)  # a sequence's answers are its events; this is ``Work.fail``'s error
        self.send(answer)

    def send(self, event: PromptScored | TokenGenerated | Finished | APIError) -> None:
        """Into its outbox; a request that does not stream gets its tokens' events with the next other event."""
        if not self.request.stream and isinstance(event, TokenGenerated):
            self.held.append(event)
            return
        if self.held:  # in order, before the event that ends the sequence (or a prompt's scores)
            self.outbox += [(self.index, held) for held in self.held]
            self.held = []
        self.outbox.append((self.index, event))


def start(sequence: Sequence, state_cache: StateCache, metrics: ServerMetrics) -> None:
    """Begin an admitted sequence: an empty cache, or a clone of the longest cached prefix of its prompt."""
    model, prompt = sequence.served.model, sequence.request.prompt
    metrics.child(metrics.prompt_tokens, sequence.served.id).inc(len(prompt))
    snapshot = None
    if not sequence.request.prompt_logprobs:
        snapshot = state_cache.lookup(sequence.served.id, prompt)
        metrics.child(metrics.prefix_cache_queries, sequence.served.id).inc(len(prompt))
    if snapshot is None:
        sequence.cache = model.new_cache(1)
    else:
        metrics.child(metrics.prefix_cache_hits, sequence.served.id).inc(snapshot.length)
        sequence.cache, sequence.next_logits = snapshot.cache, snapshot.logits
        sequence.prefilled = sequence.cached_tokens = snapshot.length
    sequence.snapshot_at = _snapshot_at(state_cache, len(prompt), sequence.prefilled)


def start_point(sequence: Sequence, state_cache: StateCache) -> tuple[int, int | None]:
    """(prefilled, snapshot_at) that :func:`start` will give the sequence, without changing anything."""
    prompt = sequence.request.prompt
    cached = 0 if sequence.request.prompt_logprobs else state_cache.peek(sequence.served.id, prompt)
    return cached, _snapshot_at(state_cache, len(prompt), cached)


def _snapshot_at(state_cache: StateCache, prompt_tokens: int, prefilled: int) -> int | None:
    position = state_cache.tail_position(prompt_tokens)
    return position if position is not None and position > prefilled else None


def prefill_calls(sequences: list[Sequence], length: int) -> list[list[Sequence]]:
    """The calls in which the next ``length`` tokens of ``sequences`` prefill: one, unless batch invariance is on; then
    one per sequence, but unscored chunks of at most ``STEPPED_PREFILL_TOKENS`` run together as (row-invariant) decode
    steps."""
    if not length or not cpu_decode.row_invariant():
        return [sequences]
    stepped = [sequence for sequence in sequences if _stepped(sequence, length)]
    return ([stepped] if stepped else []) + [[sequence] for sequence in sequences if not _stepped(sequence, length)]


def _stepped(sequence: Sequence, length: int) -> bool:
    """Whether a chunk of ``length`` of the sequence runs as decode steps (:func:`prefill_calls`)."""
    return length <= STEPPED_PREFILL_TOKENS and not sequence.request.prompt_logprobs and cpu_decode.row_invariant()


def prompt_in_batch(sequence: Sequence, at: tuple[int, int | None], state_cache: StateCache) -> bool:
    """Whether an admitted sequence's whole prompt runs as its first steps in its decode batch rather than as prefill
    calls: a prompt stepped from its start (``at``: :func:`start_point`'s), asking for a token, that the state cache
    would not keep."""
    prompt = sequence.request.prompt
    return (
        at == (0, None)
        and len(prompt) > 0
        and _stepped(sequence, len(prompt))
        and sequence.request.max_tokens > 0
        and not state_cache.keeps(len(prompt))
    )


def prefill(sequences: list[Sequence], length: int, state_cache: StateCache, metrics: ServerMetrics) -> None:
    """Consume the next ``length`` prompt tokens of each sequence (one model). A sequence at its ``snapshot_at`` is
    snapshotted; one whose prompt is done is snapshotted, scored if asked, and gets its first token. ``length`` 0 only
    completes prompts taken whole from the state cache."""
    for call in prefill_calls(sequences, length) if length else []:
        _prefill_call(call, length)
    for sequence in sequences:
        if sequence.prefilled == sequence.snapshot_at:
            prefix = sequence.request.prompt[: sequence.prefilled]
            state_cache.store(sequence.served.id, prefix, _cache(sequence), _next_logits(sequence))
    done = [sequence for sequence in sequences if not sequence.prefilling]
    for sequence in done:
        state_cache.store(sequence.served.id, sequence.request.prompt, _cache(sequence), _next_logits(sequence))
        if sequence.request.prompt_logprobs:
            sequence.send(PromptScored(sequence.prompt_scores))
        if sequence.request.max_tokens == 0:
            sequence.finish("length", metrics)
    sampling = [sequence for sequence in done if not sequence.done]
    if sampling:
        accept(sampling, torch.stack([_next_logits(sequence) for sequence in sampling]), metrics)


def _cache(sequence: Sequence) -> InferenceCache:
    assert sequence.cache is not None
    return sequence.cache


def _next_logits(sequence: Sequence) -> torch.Tensor:
    assert sequence.next_logits is not None
    return sequence.next_logits


def prefill_call_cost(sequences: list[Sequence], length: int) -> Cost:
    """What one call of :func:`prefill_calls` costs."""
    model, context = sequences[0].served.model, min(sequence.prefilled for sequence in sequences)
    if length and _stepped(sequences[0], length):
        return _stepped_cost(model.cost, len(sequences), length, context)
    if _head_on_last(sequences, length):
        return model.prefill_cost(len(sequences), length, context)
    return model.cost("cached", len(sequences), length, context)


def _stepped_cost(cost: Callable[..., Cost], rows: int, length: int, context: int) -> Cost:
    """``length`` decode steps of ``rows`` rows after ``context`` tokens."""
    steps = [cost("cached", rows, 1, context + step) for step in range(length)]
    return Cost(flops=sum(step.flops for step in steps), nbytes=max(step.nbytes for step in steps))


def _head_on_last(sequences: list[Sequence], length: int) -> bool:
    """Whether a call's pass may run its head on each row's last position only."""
    scoring = any(sequence.request.prompt_logprobs for sequence in sequences)
    return sequences[0].served.model.selects_positions and not scoring and not _stepped(sequences[0], length)


def _prefill_call(sequences: list[Sequence], length: int) -> None:
    """The next ``length`` prompt tokens of each sequence over their stacked caches, as decode steps or one pass; sets
    ``next_logits``, advances ``prefilled`` and scores the chunk where asked."""
    model = sequences[0].served.model
    chunks = torch.tensor(
        [sequence.request.prompt[sequence.prefilled : sequence.prefilled + length] for sequence in sequences],
        device=model.device,
    )  # (B, n)
    caches = [_cache(sequence) for sequence in sequences]
    cache = caches[0] if len(caches) == 1 else type(caches[0]).stack(caches)
    if _stepped(sequences[0], length):
        for position in range(length - 1):  # no logits but the last position's: nothing scores this chunk
            model.advance(chunks[:, position], cache)
        logits = model.step(chunks[:, -1], cache)[:, None]  # (B, 1, V)
    elif _head_on_last(sequences, length):
        positions = torch.zeros(chunks.shape, dtype=torch.bool, device=model.device)  # (B, n)
        positions[:, -1] = True
        selecting = cast(SelectsPositions, model)  # _head_on_last: its selects_positions is true
        logits = selecting.forward(chunks, cache=cache, positions=positions)[:, None]  # (B, 1, V)
    else:
        logits = model.forward(chunks, cache=cache)  # (B, n, V)
    if len(caches) > 1:
        for sequence, row in zip(sequences, cache.split()):
            sequence.cache = row
    for sequence, chunk, chunk_logits in zip(sequences, chunks, logits):
        if sequence.request.prompt_logprobs:
            _score_prompt_chunk(sequence, chunk, chunk_logits)
        sequence.next_logits = chunk_logits[-1]  # (V,)
        sequence.prefilled += length


def prefill_length(sequence: Sequence, budget: int, at: tuple[int, int | None] | None = None) -> int:
    """How many prompt tokens the sequence prefills next: what remains (up to ``snapshot_at``), within ``budget`` and
    one slice of work at that depth; short of the end, a multiple of ``PREFILL_QUANTUM``. ``at``: (prefilled,
    snapshot_at) if not started."""
    prefilled, snapshot_at = at or (sequence.prefilled, sequence.snapshot_at)
    end = len(sequence.request.prompt)
    if snapshot_at is not None and prefilled < snapshot_at:
        end = snapshot_at
    remaining = min(end - prefilled, budget)
    if remaining <= 0:
        return max(remaining, 0)
    model_budget = sequence.served.budget  # its memo of the cost formulas: most prompts start at context 0
    assert model_budget is not None  # measured when the model was installed
    scored = bool(sequence.request.prompt_logprobs)
    length = sequence.served.model.chunk_length(
        model_budget.slice_flops, prefilled, remaining, model_budget.cost, scored
    )
    if prefilled + length < end:
        length = length - length % PREFILL_QUANTUM if length >= PREFILL_QUANTUM else 1 << (length.bit_length() - 1)
    if _stepped(sequence, length):  # it runs as decode steps: as many as fit the slice (more than a pass's where the
        # pass's fixed work is most of the slice: RegularGPT deep in a long prompt on a loaded machine)
        return largest_fitting(
            lambda steps: _stepped_cost(model_budget.cost, 1, steps, prefilled).flops <= model_budget.slice_flops,
            min(remaining, STEPPED_PREFILL_TOKENS),
        )
    return length


def _score_prompt_chunk(sequence: Sequence, chunk: torch.Tensor, logits: torch.Tensor) -> None:
    """Log-probabilities of the chunk's tokens: token j is predicted by the logits of token j - 1."""
    if sequence.next_logits is None:
        sequence.prompt_scores.append(None)  # the first prompt token has no prediction
        predictors, targets = logits[:-1], chunk[1:]  # (n-1, V), (n-1,)
    else:
        predictors, targets = torch.cat([sequence.next_logits[None], logits[:-1]]), chunk  # (n, V), (n,)
    sequence.prompt_scores += token_logprobs(predictors, targets, sequence.request.logprobs or 0)


class DecodeBatch:
    """The decoding sequences of one model, their caches stacked in one (row i is ``sequences[i]``)."""

    def __init__(self) -> None:
        self.sequences: list[Sequence] = []
        self.cache: InferenceCache | None = None
        self.prompting = 0  # rows whose inputs are still their prompt's tokens (:func:`prompt_in_batch`)

    def __len__(self) -> int:
        return len(self.sequences)

    def join(self, joining: list[Sequence]) -> None:
        """Add sequences whose prefill is done, or whose prompt runs here; their caches become rows of the batch's."""
        caches = ([] if self.cache is None else [self.cache]) + [_cache(sequence) for sequence in joining]
        self.cache = caches[0] if len(caches) == 1 else type(caches[0]).stack(caches)
        self.sequences += joining
        for sequence in joining:
            sequence.cache = None
            self.prompting += sequence.prefilling

    def drop_finished(self) -> None:
        keep = [row for row, sequence in enumerate(self.sequences) if not sequence.done]
        if len(keep) == len(self.sequences):
            return
        self.sequences = [self.sequences[row] for row in keep]
        assert self.cache is not None  # its rows are the sequences'
        self.cache = self.cache.select(keep) if keep else None
        if self.prompting:
            self.prompting = sum(sequence.prefilling for sequence in self.sequences)

    def step(self, metrics: ServerMetrics) -> None:
        """One token for every sequence in one call of the model's decoder (greedy rows: the picks alone, the same
        tokens). A row still in its prompt takes its next prompt token and samples nothing until its prompt's last."""
        served, sampling, rows = self.sequences[0].served, self.sequences, None
        if self.prompting:
            inputs, rows = self._prompt_inputs()
            sampling = [self.sequences[row] for row in rows]
        else:
            inputs = [sequence.generated[-1] for sequence in self.sequences]
        tokens = long_tensor(inputs)  # (B,): the decoder moves them
        assert served.decoder is not None and self.cache is not None  # set by the engine; the rows' caches
        if not sampling:
            served.decoder.advance(tokens, self.cache)
            return
        if all(sequence.picks_greedily for sequence in sampling):
            picked, picked_values = served.decoder.greedy_step(tokens, self.cache)  # (B,), (B,)
            picks: list[int] = picked.tolist()
            values: list[float] = picked_values.tolist()
            if rows is not None:
                picks, values = [picks[row] for row in rows], [values[row] for row in rows]
            take(sampling, picks, values, metrics)
            return
        constrained = [sequence.constraint for sequence in sampling if sequence.constraint is not None]
        vocabulary = served.config.model.vocab_size
        masks = token_bias_later(constrained, vocabulary) if constrained else None  # while the model runs
        logits = served.decoder.step(tokens, self.cache)  # (B, V)
        accept(sampling, logits if rows is None else logits[rows], metrics, masks)

    def _prompt_inputs(self) -> tuple[list[int], list[int]]:
        """(each row's input token, the rows that sample after this step); consumes the prompt tokens."""
        inputs, rows = [], []
        for row, sequence in enumerate(self.sequences):
            if sequence.prefilling:
                inputs.append(sequence.request.prompt[sequence.prefilled])
                sequence.prefilled += 1
            else:
                inputs.append(sequence.generated[-1])
            if not sequence.prefilling:
                rows.append(row)
        self.prompting = len(self.sequences) - len(rows)
        return inputs, rows


def accept(sequences: list[Sequence], logits: torch.Tensor, metrics: ServerMetrics, masks: Masks | None = None) -> None:
    """Sample each sequence's next token from its row of ``logits`` (B, V) and :func:`take` them. ``masks``: the
    constrained rows' masks, if already under way."""
    logits = logits.float()  # (B, V) where the model runs: sampling draws on the CPU, filters and searches there
    if logits.numel() <= HOST_SAMPLING_ELEMENTS:
        logits = logits.cpu()  # unless there are so few that launching the ops costs more than computing them
    sequences, logits, masked = _constrain(sequences, logits, metrics, masks)  # (B', V) each
    if not sequences:
        return
    params = [sequence.request.sampling for sequence in sequences]
    adjusted = penalize(masked, params, sequences)  # (B', V); log-probabilities stay the model's
    tokens = sample(adjusted, params, [sequence.generator for sequence in sequences])
    _end_outside_the_vocabulary(sequences, tokens, metrics)
    if masked is not logits:
        _keep_to_the_masks(sequences, adjusted, tokens)
    take(sequences, tokens, drawn_logits(logits, tokens), metrics, logits)


def take(
    sequences: list[Sequence],
    tokens: list[int],
    drawn: list[float],
    metrics: ServerMetrics,
    logits: torch.Tensor | None = None,
) -> None:
    """Hand each sequence its next token (``drawn``: its logit; ``logits``: (B, V), for log-probabilities) and finish
    those that end. A row drawn at a non-finite logit, or whose text or constraint raises, fails alone (500)."""
    for row in unusable(drawn):
        sequence, value = sequences[row], drawn[row]
        if not sequence.done:
            sequence.fail(
                ModelFailure(
                    f"the model failed: its logits for output token {len(sequence.generated) + 1} are not finite ({value})"
                ),
                metrics,
            )
    metrics.tokens(sequences[0].served.id, [sequence.times for sequence in sequences if not sequence.done])
    for row, (sequence, token) in enumerate(zip(sequences, tokens)):
        if sequence.done:
            continue
        try:
            _append(sequence, token, logits, row, metrics)
        except Exception as error:  # its text, log-probability or constraint: this row alone fails
            logger.exception("a sequence failed on its output token %d", len(sequence.generated))
            sequence.fail(ModelFailure(f"the model failed: {error}"), metrics)


def _end_outside_the_vocabulary(sequences: list[Sequence], tokens: list[int], metrics: ServerMetrics) -> None:
    """A drawn id outside the vocabulary ends its own sequence; its place in ``tokens`` becomes 0."""
    vocabulary = sequences[0].served.config.model.vocab_size
    for row, (sequence, token) in enumerate(zip(sequences, tokens)):
        if not 0 <= token < vocabulary:
            sequence.fail(
                ModelFailure(
                    f"the model failed: output token {len(sequence.generated) + 1} was drawn as id {token}, outside its "
                    f"vocabulary of {vocabulary}"
                ),
                metrics,
            )
            tokens[row] = 0


def _constrain(
    sequences: list[Sequence], logits: torch.Tensor, metrics: ServerMetrics, masks: Masks | None = None
) -> tuple[list[Sequence], torch.Tensor, torch.Tensor]:
    """Apply the constraints' masks to ``logits`` (B, V): (the sequences that go on, their logits, the masked logits). A
    row that may sample nothing ends: "stop" at a complete match, else its ``Constraint.failure``."""
    rows = [row for row, sequence in enumerate(sequences) if sequence.constraint is not None]
    if not rows:
        return sequences, logits, logits
    if masks is None:
        constraints = [constraint for row in rows if (constraint := sequences[row].constraint) is not None]  # all
        bias, any_allowed = token_bias(constraints, logits.shape[-1])  # (R, V), (R,)
    else:
        bias, any_allowed = masks.result()
    bias = bias.to(logits.device)  # (R, V)
    if len(rows) == len(sequences):
        masked = logits + bias  # (B, V)
    else:
        masked = logits.clone()  # (B, V)
        masked[rows] += bias
    for row, allowed in zip(rows, any_allowed):
        sequence = sequences[row]
        assert sequence.constraint is not None  # rows: the constrained sequences
        if sequence.constraint.error is not None:
            sequence.fail(sequence.constraint.failure(), metrics)
        elif not allowed:
            sequence.finish("stop", metrics)
    live = [row for row, sequence in enumerate(sequences) if not sequence.done]
    if len(live) < len(sequences):
        return [sequences[row] for row in live], logits[live], masked[live]
    return sequences, logits, masked


def _keep_to_the_masks(sequences: list[Sequence], adjusted: torch.Tensor, tokens: list[int]) -> None:
    """A constrained row that drew a forbidden token takes its best allowed one instead."""
    drawn = adjusted[torch.arange(len(tokens)), torch.tensor(tokens)]  # (B,)
    for row in torch.nonzero(drawn == float("-inf"))[:, 0].tolist():
        if sequences[row].constraint is not None:
            logger.warning(
                "structured_outputs: token %d was drawn against its mask; taking the best allowed one", tokens[row]
            )
            tokens[row] = int(adjusted[row].argmax())


def _append(sequence: Sequence, token: int, logits: torch.Tensor | None, row: int, metrics: ServerMetrics) -> None:
    """Append ``token`` (sampled from ``logits[row]``, None where not read) and send or finish accordingly."""
    sequence.generated.append(token)
    if sequence.constraint is not None and not sequence.constraint.consume(token):
        sequence.fail(sequence.constraint.failure(token), metrics)
        return
    assert sequence.served.tokenizer is not None  # a language model is served with its tokenizer
    if token == sequence.served.tokenizer.eot_token:
        sequence.finish("stop", metrics)
        return
    stopped = False
    if not sequence.plain:
        logprob = None
        if sequence.request.logprobs is not None:
            assert logits is not None  # a sequence that reads log-probabilities does not pick greedily
            logprob = token_logprobs(logits[row, None], torch.tensor([token]), sequence.request.logprobs)[0]
        text, stopped = sequence.assembler.push(token)
        sequence.send(TokenGenerated(token, text, logprob))
    if stopped or (sequence.constraint is not None and sequence.constraint.finished):
        sequence.finish("stop", metrics)
    elif len(sequence.generated) >= sequence.request.max_tokens:
        sequence.finish("length", metrics)
