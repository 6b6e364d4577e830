"""/v1/transduce work as units of bounded size: batches of short inputs across requests, and long inputs run
slice by slice.

Every input of every request is an item, costed when it arrives (``ModelBudget.transduce_cost``):

- an input whose whole call fits one slice (``settings.slice_ms`` of its model's measured speed) is **short**:
  short items are gathered for ``batch_wait_ms`` after the oldest arrived (or until ``max_batch_symbols`` are
  waiting), then planned into batches: items of one model and one output mode ("final" or "all") only,
  bucketed by length class, powers of two ([1], [2, 3], [4, 7], ...), so that right padding at most doubles
  a row, sorted by length inside a bucket, and cut at ``max_batch_size`` rows, ``max_batch_symbols`` padded
  symbols (rows x the longest row), or when the batch's call would outgrow one slice;
- a longer input is a :class:`LongTransduce`: ``model.run_in_slices`` (a causal model prefills it chunk by
  chunk through its cache; the exact encoders resume between attention blocks), one slice per turn, holding
  its memory (``cost.nbytes``) from its first slice to its last.

A batch runs on the cheapest exact path for what was asked: ``model.final_logits`` for "final" (RegularGPT's
shrinking path, the LRNN's scan with the head on the last positions only) and the parallel ``forward`` for
"all".
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Generator
from dataclasses import dataclass, field

import torch

from model.base import Cost, gather_last
from server.errors import APIError
from server.mailbox import Mailbox
from server.metrics import RequestTimes, ServerMetrics
from server.model_store import ServedModel


@dataclass
class TransduceOutput:
    final: int  # label id at the last position
    confidence: float  # its probability under the model
    labels: list[int] | None  # the label id at every position, when asked for


@dataclass
class TransduceJob:
    """One /v1/transduce request: its inputs as token ids, answered once all of them are computed."""

    served: ServedModel
    inputs: list[list[int]]
    all_outputs: bool
    times: RequestTimes
    mailbox: Mailbox
    flow: str = ""  # who asked (the scheduler's fairness key)
    service: float = 0.0  # model seconds spent on it so far
    outputs: list[TransduceOutput | None] = field(default_factory=list)
    cancelled: bool = False
    done: bool = False

    def items(self) -> list[TransduceItem]:
        self.outputs = [None] * len(self.inputs)
        budget = self.served.budget
        items = []
        for index, tokens in enumerate(self.inputs):
            cost, sliced = budget.transduce_cost(len(tokens), self.all_outputs)
            items.append(TransduceItem(self, index, cost, sliced))
        return items

    def complete(self, index: int, output: TransduceOutput, metrics: ServerMetrics) -> None:
        self.outputs[index] = output
        if not self.done and all(out is not None for out in self.outputs):
            self.done = True
            metrics.transduced_symbols.labels(self.served.id).inc(sum(map(len, self.inputs)))
            metrics.finished(self.times, "stop")
            self.mailbox.put(self.outputs)

    def fail(self, error: APIError, metrics: ServerMetrics) -> None:
        if not self.done:
            self.done = True
            metrics.finished(self.times, "error")
            self.mailbox.put(error)

    def abort(self, metrics: ServerMetrics) -> None:
        """The client went away: no answer."""
        if not self.done:
            self.done = True
            metrics.finished(self.times, "abort")


@dataclass
class TransduceItem:
    job: TransduceJob
    index: int
    cost: Cost  # of its whole call (short) or of all its slices (long)
    sliced: bool

    @property
    def tokens(self) -> list[int]:
        return self.job.inputs[self.index]


def plan_batches(items: list[TransduceItem], max_batch_size: int, max_batch_symbols: int) -> list[list[TransduceItem]]:
    """The batching policy of the module docstring, for short items."""
    buckets: dict[tuple[str, bool, int], list[TransduceItem]] = defaultdict(list)
    for item in items:
        buckets[(item.job.served.id, item.job.all_outputs, len(item.tokens).bit_length())].append(item)
    batches = []
    for key in sorted(buckets):
        batch: list[TransduceItem] = []
        for item in sorted(buckets[key], key=lambda item: len(item.tokens)):
            rows, longest = len(batch) + 1, len(item.tokens)
            too_big = rows > max_batch_size or rows * longest > max_batch_symbols
            if batch and (too_big or not _fits_one_slice(batch[0], rows, longest)):
                batches.append(batch)
                batch = []
            batch.append(item)
        batches.append(batch)
    return batches


def _fits_one_slice(item: TransduceItem, rows: int, longest: int) -> bool:
    return item.job.served.budget.fits_one_slice(batch_cost(item, rows, longest))


def batch_cost(item: TransduceItem, rows: int, longest: int) -> Cost:
    """The call of a batch of ``rows`` inputs padded to ``longest``, of ``item``'s model and output mode."""
    return item.job.served.model.cost("forward" if item.job.all_outputs else "final", rows, longest)


@torch.inference_mode()
def run_batch(batch: list[TransduceItem]) -> list[TransduceOutput]:
    """Compute one planned batch (one model, one output mode)."""
    model = batch[0].job.served.model
    lengths = torch.tensor([len(item.tokens) for item in batch])  # (B,)
    tokens = torch.zeros(len(batch), int(lengths.max()), dtype=torch.long)  # (B, T) right-padded
    for row, item in enumerate(batch):
        tokens[row, : len(item.tokens)] = torch.tensor(item.tokens)
    tokens = tokens.to(model.device)
    labels = None
    if batch[0].job.all_outputs:
        logits = model(tokens)  # (B, T, L)
        labels = logits.argmax(-1).tolist()  # (B, T)
        final_logits = gather_last(logits, lengths)  # (B, L)
    else:
        final_logits = model.final_logits(tokens, lengths)  # (B, L)
    return [
        _output(row_logits, None if labels is None else labels[row][: len(item.tokens)])
        for row, (item, row_logits) in enumerate(zip(batch, final_logits))
    ]


class LongTransduce:
    """One long input, computed a slice per :meth:`advance` through ``model.run_in_slices``."""

    def __init__(self, item: TransduceItem) -> None:
        self.item = item
        self._slices: Generator[None, None, tuple[torch.Tensor, torch.Tensor | None]] | None = None
        self.output: TransduceOutput | None = None

    @property
    def started(self) -> bool:
        return self._slices is not None or self.output is not None

    @torch.inference_mode()
    def advance(self) -> bool:
        """Run the next slice; True once the output is ready."""
        if self._slices is None:
            served = self.item.job.served
            tokens = torch.tensor([self.item.tokens], device=served.model.device)  # (1, T)
            self._slices = served.model.run_in_slices(tokens, self.item.job.all_outputs, served.budget.slice_flops)
        try:
            next(self._slices)
        except StopIteration as finished:
            final_logits, labels = finished.value  # (L,), (T,) or None
            self.output = _output(final_logits, None if labels is None else labels.tolist())
            self._slices = None
            return True
        return False

    def close(self) -> None:
        """Stop computing (the request is gone): frees what the slices hold."""
        if self._slices is not None:
            self._slices.close()
            self._slices = None


def _output(final_logits: torch.Tensor, labels: list[int] | None) -> TransduceOutput:
    """final_logits: (L,) -> the label, its probability and the per-position labels."""
    confidence, final = final_logits.float().softmax(-1).max(-1)
    return TransduceOutput(final=int(final), confidence=float(confidence), labels=labels)
