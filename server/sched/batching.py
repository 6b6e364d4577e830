"""/v1/transduce work as units of bounded size: batches of short inputs across requests, and long inputs slice by slice.

Each input is costed on arrival (``ModelBudget.transduce_cost``). Inputs whose whole call fits a slice are gathered for
``batch_wait_ms`` (or until ``max_batch_symbols`` wait) and batched (:func:`plan_batches`); a longer one is a
:class:`LongTransduce`, one slice per turn, holding its memory from its first slice to its last.
"""

from __future__ import annotations

from array import array
from collections import defaultdict
from collections.abc import Generator, Sequence
from dataclasses import dataclass

import torch

from model.base import gather_last
from model.serving import Cost
from server.metrics import RequestTimes, ServerMetrics
from server.models.store import ServedModel
from server.sched.work import Recipient, Work


@dataclass
class TransduceOutput:
    final: int  # label id at the last position
    confidence: float  # its probability under the model
    labels: list[int] | None  # the label id at every position, when asked for


class TransduceJob(Work):
    """One /v1/transduce request, answered once all its inputs are computed."""

    def __init__(
        self,
        served: ServedModel,
        inputs: list[array[int]],
        all_outputs: bool,
        times: RequestTimes,
        mailbox: Recipient,
        flow: str = "",
    ) -> None:
        super().__init__(times, flow, mailbox)
        self.served, self.inputs, self.all_outputs = served, inputs, all_outputs
        self.outputs: list[TransduceOutput | None] = []
        self.missing = 0  # outputs not computed yet

    def items(self) -> list[TransduceItem]:
        self.outputs, self.missing = [None] * len(self.inputs), len(self.inputs)
        budget = self.served.budget
        assert budget is not None  # measured when the model was installed, before any request
        items = []
        for index, tokens in enumerate(self.inputs):
            length = len(tokens)
            cost, sliced = budget.transduce_cost(length, self.all_outputs)
            items.append(TransduceItem(self, index, length, cost, sliced))
        return items

    def complete(self, index: int, output: TransduceOutput, metrics: ServerMetrics) -> None:
        """One input's output; the last one answers the request."""
        self.outputs[index] = output
        self.missing -= 1
        if not self.missing and self.end("stop", metrics):
            metrics.child(metrics.transduced_symbols, self.served.id).inc(sum(map(len, self.inputs)))
            self.deliver(self.outputs)


@dataclass
class TransduceItem:
    job: TransduceJob
    index: int
    length: int
    cost: Cost  # of its whole call (short) or of all its slices (long)
    sliced: bool

    @property
    def tokens(self) -> array[int]:
        return self.job.inputs[self.index]


def plan_batches(items: list[TransduceItem], max_batch_size: int, max_batch_symbols: int) -> list[list[TransduceItem]]:
    """Short items as batches of one model and output mode, bucketed by power-of-two length class, sorted by length, cut
    at ``max_batch_size`` rows, ``max_batch_symbols`` padded symbols, or one slice."""
    buckets: dict[tuple[str, bool, int], list[TransduceItem]] = defaultdict(list)
    for item in items:
        buckets[(item.job.served.id, item.job.all_outputs, item.length.bit_length())].append(item)
    batches = []
    for key in sorted(buckets):
        batch: list[TransduceItem] = []
        for item in sorted(buckets[key], key=lambda item: item.length):
            rows, longest = len(batch) + 1, item.length
            too_big = rows > max_batch_size or rows * longest > max_batch_symbols
            if batch and (too_big or not _fits_one_slice(batch[0], rows, longest)):
                batches.append(batch)
                batch = []
            batch.append(item)
        batches.append(batch)
    return batches


def _fits_one_slice(item: TransduceItem, rows: int, longest: int) -> bool:
    assert item.job.served.budget is not None  # measured when the model was installed
    return item.job.served.budget.fits_one_slice(batch_cost(item, rows, longest))


def batch_cost(item: TransduceItem, rows: int, longest: int) -> Cost:
    """The call of ``rows`` inputs padded to ``longest``, of ``item``'s model and output mode."""
    assert item.job.served.budget is not None  # measured when the model was installed
    return item.job.served.budget.cost("forward" if item.job.all_outputs else "final", rows, longest)


@torch.inference_mode()
def run_batch(batch: list[TransduceItem]) -> list[TransduceOutput]:
    """Compute one planned batch (one model, one output mode)."""
    model = batch[0].job.served.model
    lengths = torch.tensor([item.length for item in batch])  # (B,)
    tokens = padded([item.tokens for item in batch]).to(model.device)  # (B, T)
    labels = None
    if batch[0].job.all_outputs:
        logits = model(tokens)  # (B, T, L)
        labels = logits.argmax(-1).tolist()  # (B, T)
        final_logits = gather_last(logits, lengths)  # (B, L)
    else:
        final_logits = model.final_logits(tokens, lengths)  # (B, L)
    return _outputs(final_logits, None if labels is None else [row[: item.length] for row, item in zip(labels, batch)])


class LongTransduce:
    """One long input, computed a slice per :meth:`advance` through ``model.run_in_slices``."""

    def __init__(self, item: TransduceItem) -> None:
        self.item = item
        self._slices: Generator[float, None, tuple[torch.Tensor, torch.Tensor | None]] | None = None
        self.output: TransduceOutput | None = None

    @property
    def started(self) -> bool:
        return self._slices is not None or self.output is not None

    @torch.inference_mode()
    def advance(self) -> float:
        """Run the next slice; returns the multiply-adds it did. The call after the last slice does no work (0.0) and
        sets ``output``."""
        if self._slices is None:
            served = self.item.job.served
            tokens = padded([self.item.tokens]).to(served.model.device)  # (1, T)
            assert served.budget is not None  # measured when the model was installed
            self._slices = served.model.run_in_slices(tokens, self.item.job.all_outputs, served.budget.slice_flops)
        try:
            return next(self._slices)
        except StopIteration as finished:
            final_logits, labels = finished.value  # (L,), (T,) or None
            self.output = _outputs(final_logits[None], None if labels is None else [labels.tolist()])[0]
            self._slices = None
            return 0.0

    def close(self) -> None:
        """Stop computing (the request is gone): frees what the slices hold."""
        if self._slices is not None:
            self._slices.close()
            self._slices = None


def padded(rows: list[array[int]]) -> torch.Tensor:
    """4-byte token-id arrays -> (B, T) int64, right-padded with 0, built in one buffer."""
    longest = max(map(len, rows))
    buffer = bytearray(4 * longest * len(rows))
    for row, ids in enumerate(rows):
        buffer[4 * longest * row : 4 * (longest * row + len(ids))] = ids
    return torch.frombuffer(buffer, dtype=torch.int32).view(len(rows), longest).long()


def _outputs(final_logits: torch.Tensor, labels: list[list[int]] | None) -> list[TransduceOutput]:
    """final_logits: (B, L) -> per row the label, its probability and the per-position labels."""
    confidence, final = final_logits.float().softmax(-1).max(-1)  # (B,), (B,)
    per_row: Sequence[list[int] | None] = labels or [None] * len(final_logits)
    rows = zip(final.tolist(), confidence.tolist(), per_row)
    return [TransduceOutput(final=label, confidence=probability, labels=all_) for label, probability, all_ in rows]
