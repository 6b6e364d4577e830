"""Dynamic batching of /v1/transduce inputs across concurrent requests.

Every input of every request is an item. The engine gathers items for ``batch_wait_ms`` after the oldest
arrived (or until ``max_batch_symbols`` are waiting), then plans batches:

- items of one model and one output mode ("final" or "all") only;
- bucketed by length class, powers of two ([1], [2, 3], [4, 7], [8, 15], ...), so that right padding at
  most doubles a row; inside a bucket sorted by length;
- cut into batches of at most ``max_batch_size`` rows and ``max_batch_symbols`` padded symbols (rows x the
  longest row); an input longer than that runs alone.

A batch runs on the cheapest exact path for what was asked: ``model.final_logits`` for "final" (RegularGPT's
shrinking path, the LRNN's scan with the head on the last positions only) and the parallel ``forward`` for
"all". Both use the implementation the checkpoint's config names; its ``auto`` policies pick the log-depth
paths (fast dilated attention; parallel or chunked scan) where they were measured to pay (``model/ops``).
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field

import torch

from model.base import gather_last
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
    outputs: list[TransduceOutput | None] = field(default_factory=list)
    cancelled: bool = False
    done: bool = False

    def items(self) -> list[TransduceItem]:
        self.outputs = [None] * len(self.inputs)
        return [TransduceItem(self, index) for index in range(len(self.inputs))]

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

    @property
    def tokens(self) -> list[int]:
        return self.job.inputs[self.index]


def plan_batches(items: list[TransduceItem], max_batch_size: int, max_batch_symbols: int) -> list[list[TransduceItem]]:
    """The batching policy of the module docstring."""
    buckets: dict[tuple[str, bool, int], list[TransduceItem]] = defaultdict(list)
    for item in items:
        buckets[(item.job.served.id, item.job.all_outputs, len(item.tokens).bit_length())].append(item)
    batches = []
    for key in sorted(buckets):
        batch: list[TransduceItem] = []
        for item in sorted(buckets[key], key=lambda item: len(item.tokens)):
            rows, longest = len(batch) + 1, len(item.tokens)
            if batch and (rows > max_batch_size or rows * longest > max_batch_symbols):
                batches.append(batch)
                batch = []
            batch.append(item)
        batches.append(batch)
    return batches


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
    confidence, final = final_logits.float().softmax(-1).max(-1)  # (B,), (B,)
    return [
        TransduceOutput(
            final=int(final[row]),
            confidence=float(confidence[row]),
            labels=None if labels is None else labels[row][: len(item.tokens)],
        )
        for row, item in enumerate(batch)
    ]
