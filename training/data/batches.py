"""Batches for training and evaluating transducers: strings of a task as token tensors right-padded with 0 (ids
are positions in the alphabet and labels), padded targets ``IGNORE_INDEX``.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Literal

import numpy as np
import torch

from model.base import SequenceModel
from training.data.tasks import Task, sample_batch

IGNORE_INDEX = -100  # torch.nn.functional.cross_entropy's default ignore_index
Curriculum = Literal["uniform", "growing"]


@dataclass(frozen=True)
class Batch:
    """tokens: (B, T) int64 right-padded with 0; targets: (B, T) int64 label ids, IGNORE_INDEX on padding;
    lengths: (B,) int64, each in [1, T]; fresh: (B,) bool, the rows that start from the model's initial state
    instead of their carried one, or None; distilled: (B,) bool, the rows that learn a teacher's distributions too,
    or None; weights: (B,) float, each row's loss weight, or None (all 1)."""

    tokens: torch.Tensor
    targets: torch.Tensor
    lengths: torch.Tensor
    fresh: torch.Tensor | None = None
    distilled: torch.Tensor | None = None
    weights: torch.Tensor | None = None

    def to(self, device: torch.device) -> Batch:
        return Batch(
            self.tokens.to(device),
            self.targets.to(device),
            self.lengths.to(device),
            self.fresh,
            self.distilled,
            self.weights,
        )

    def split(self, parts: int) -> list[Batch]:
        """The rows in ``parts`` consecutive groups of nearly equal size (no empty one), each cut to its own
        longest row."""
        groups = zip(*(tensor.tensor_split(parts) for tensor in (self.tokens, self.targets, self.lengths)))
        return [
            Batch(tokens[:, : int(lengths.max())], targets[:, : int(lengths.max())], lengths)
            for tokens, targets, lengths in groups
            if len(lengths)
        ]


def encode_strings(strings: Sequence[str], alphabet: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Strings -> tokens (B, T) right-padded with 0, lengths (B,). Every symbol must be in ``alphabet``."""
    index = {symbol: i for i, symbol in enumerate(alphabet)}
    lengths = torch.tensor([len(string) for string in strings], dtype=torch.long)  # (B,)
    tokens = torch.zeros(len(strings), int(lengths.max()), dtype=torch.long)  # (B, T)
    for row, string in enumerate(strings):
        tokens[row, : len(string)] = torch.tensor([index[symbol] for symbol in string], dtype=torch.long)
    return tokens, lengths


def label_batch(task: Task, strings: Sequence[str]) -> Batch:
    """The strings with the task's reference label at every position as targets."""
    tokens, lengths = encode_strings(strings, task.alphabet)
    label_ids = {label: i for i, label in enumerate(task.labels)}
    targets = torch.full_like(tokens, IGNORE_INDEX)  # (B, T)
    for row, string in enumerate(strings):
        targets[row, : len(string)] = torch.tensor([label_ids[label] for label in task.label(string)])
    return Batch(tokens, targets, lengths)


@dataclass(frozen=True)
class LengthCurriculum:
    """The training lengths at each step: drawn uniformly from ``[shortest, longest(step)]``.

    "uniform": longest(step) is ``longest`` throughout. "growing": it rises linearly from ``start`` (at step 1)
    to ``longest`` (at ``ramp_steps`` and after).
    """

    shortest: int
    longest: int
    kind: Curriculum = "uniform"
    start: int = 10
    ramp_steps: int = 1

    def __post_init__(self) -> None:
        if not 1 <= self.shortest <= self.longest:
            raise ValueError(f"training lengths must satisfy 1 <= shortest <= longest: {self.shortest}-{self.longest}")
        if self.ramp_steps < 1:
            raise ValueError(f"the curriculum needs at least one ramp step, got {self.ramp_steps}")

    def length_range(self, step: int) -> tuple[int, int]:
        """The inclusive length range of the batch at ``step`` (1-based)."""
        if self.kind == "uniform":
            return self.shortest, self.longest
        start = min(max(self.start, self.shortest), self.longest)
        progress = min(1.0, (step - 1) / max(1, self.ramp_steps - 1))
        return self.shortest, round(start + progress * (self.longest - start))


@dataclass(frozen=True)
class TrainingData:
    """Draws the training batches of one process: its own random stream, the curriculum, the sampling options."""

    task: Task
    batch_size: int
    curriculum: LengthCurriculum
    p_one: float | tuple[float, float] | None = None  # one P(second symbol), or a per-string range
    balanced: bool = False
    power_offset_fraction: float = 0.0  # each string's chance to be drawn by the task's draw_power_offset instead
    final_only: bool = False  # the loss on each string's last position only (the others' targets IGNORE_INDEX)
    p_times: float | tuple[float, float] | None = None  # modular_arithmetic: P("*" among operators), or a range

    def batch(self, rng: np.random.Generator, step: int) -> Batch:
        lengths = self.curriculum.length_range(step)
        strings = sample_batch(self.task, rng, self.batch_size, lengths, self.p_one, self.balanced, self.p_times)
        if self.power_offset_fraction:  # no draw at 0: runs without it keep their random stream
            chosen = rng.random(len(strings)) < self.power_offset_fraction
            strings = [
                self._power_offset_string(rng, len(string)) if pick else string for string, pick in zip(strings, chosen)
            ]
        batch = label_batch(self.task, strings)
        if self.final_only:
            last = batch.lengths - 1  # (B,)
            final = batch.targets.gather(1, last[:, None])  # (B, 1)
            batch.targets.fill_(IGNORE_INDEX).scatter_(1, last[:, None], final)
        return batch

    def _power_offset_string(self, rng: np.random.Generator, length: int) -> str:
        assert self.task.draw_power_offset is not None  # the command line allows the fraction for such tasks only
        return self.task.draw_power_offset(rng, length)


@dataclass(frozen=True)
class FinalLabelSet:
    """Strings and the label id of each one's last position, sorted by length so that batches pad little."""

    strings: tuple[str, ...]
    final_labels: tuple[int, ...]

    @classmethod
    def draw(
        cls,
        task: Task,
        rng: np.random.Generator,
        n: int,
        length_range: tuple[int, int],
        p_one: float | None = None,
        power_offsets: bool = False,
        p_times: float | None = None,
    ) -> FinalLabelSet:
        """``n`` strings of lengths uniform in ``length_range``; ``power_offsets``: each drawn by the task's
        ``draw_power_offset`` (its decisive symbol a power of two before the end) instead of its generator."""
        strings = sample_batch(task, rng, n, length_range, p_one, p_times=p_times)
        if power_offsets:
            assert task.draw_power_offset is not None
            strings = [task.draw_power_offset(rng, len(string)) for string in strings]
        strings = sorted(strings, key=len)
        label_ids = {label: i for i, label in enumerate(task.labels)}
        return cls(tuple(strings), tuple(label_ids[task.label(string)[-1]] for string in strings))

    def shard(self, rank: int, world_size: int) -> FinalLabelSet:
        """Every ``world_size``-th example from ``rank`` on: the part one process evaluates."""
        return FinalLabelSet(self.strings[rank::world_size], self.final_labels[rank::world_size])

    def __len__(self) -> int:
        return len(self.strings)


@torch.no_grad()
def count_correct_final(
    model: SequenceModel, examples: FinalLabelSet, alphabet: str, batch_size: int, chunk_symbols: int | None = None
) -> int:
    """How many examples' final label the model gets right (argmax), in batches of ``batch_size``: through
    ``model.final_logits``, or with ``chunk_symbols`` through ``new_cache`` and ``forward(chunk, cache)`` in chunks
    of at most that many symbols (rows x positions), memory bounded at any length."""
    device = next(model.parameters()).device
    correct = 0
    for first in range(0, len(examples), batch_size):
        strings = examples.strings[first : first + batch_size]
        targets = torch.tensor(examples.final_labels[first : first + batch_size], device=device)  # (B,)
        if chunk_symbols is None:
            tokens, lengths = encode_strings(strings, alphabet)  # (B, T), (B,)
            logits = model.final_logits(tokens.to(device), lengths.to(device))  # (B, num_labels)
        else:
            logits = _final_logits_in_chunks(model, strings, alphabet, chunk_symbols, device)  # (B, num_labels)
        correct += int((logits.argmax(dim=-1) == targets).sum())
    return correct


def _final_logits_in_chunks(
    model: SequenceModel, strings: Sequence[str], alphabet: str, chunk_symbols: int, device: torch.device
) -> torch.Tensor:
    """(len(strings), num_labels): each run of strings of one length fed through one cache, ``chunk_symbols`` //
    rows positions (at least one) per call."""
    rows: list[torch.Tensor] = []
    start = 0
    while start < len(strings):
        end = start + 1
        while end < len(strings) and len(strings[end]) == len(strings[start]):
            end += 1
        tokens, _ = encode_strings(strings[start:end], alphabet)  # (R, T)
        for logits in logits_in_chunks(model, tokens.to(device), max(1, chunk_symbols // (end - start))):
            continue  # the last chunk's logits end every row
        rows.append(logits[:, -1])
        start = end
    return torch.cat(rows)  # (B, num_labels)


def logits_in_chunks(model: SequenceModel, tokens: torch.Tensor, chunk: int) -> Iterator[torch.Tensor]:
    """tokens (R, T) fed through one ``new_cache`` ``chunk`` positions a call: each call's logits (R, chunk,
    num_labels) in turn, so that memory stays bounded at any length."""
    cache = model.new_cache(tokens.shape[0])
    for position in range(0, tokens.shape[1], chunk):
        yield model.forward(tokens[:, position : position + chunk], cache=cache)
