"""What crosses the pipes between the API process and the engine process.

In: one pickled message per request or command (token ids and sampling parameters, a constraint as its spec, transduce
inputs as int32 bytes, cancellations, stop strings found, runtime models as config and safetensors bytes, abort-all,
stop). Out: one :class:`Step` per scheduler iteration that answered anything, its tokens as numpy columns (never a
Python object per token), then the once-per-request events, the metrics' figures and the queue's movements;
:func:`encode_step` and :func:`decode_step` write and read it.
"""

from __future__ import annotations

import pickle
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal

import numpy as np

import server.errors
from server.errors import APIError
from server.execution.sampling import TokenLogprob
from server.metrics import Figure

if TYPE_CHECKING:
    from server.sched.batching import TransduceOutput

STEP, CONTROL = b"S", b"C"  # the first byte of an engine message: a step, or a pickled control message (ready, reply)


@dataclass
class Finish:
    """A sequence's end: its reason and counts; ``tokens``: every generated id, for a whole answer that had no token
    events."""

    request: int
    index: int
    reason: Literal["stop", "length"]
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    tokens: list[int] | None = None


@dataclass
class Step:
    """What one scheduler iteration answered."""

    token_requests: np.ndarray = field(default_factory=lambda: np.empty(0, np.int64))  # (N,)
    token_indexes: np.ndarray = field(default_factory=lambda: np.empty(0, np.int32))  # (N,)
    token_ids: np.ndarray = field(default_factory=lambda: np.empty(0, np.int32))  # (N,)
    logprobs: dict[int, TokenLogprob] = field(default_factory=dict)  # token row -> its log-probability
    scored: list[tuple[int, int, list[TokenLogprob | None]]] = field(default_factory=list)  # (request, index, scores)
    finished: list[Finish] = field(default_factory=list)
    # (request, sequence index or -1, error): an APIError once decoded (``error_to_wire`` sends any other as one)
    errors: list[tuple[int, int, Exception]] = field(default_factory=list)
    transduced: list[tuple[int, list[TransduceOutput]]] = field(default_factory=list)  # (request, its TransduceOutputs)
    figures: list[Figure] = field(default_factory=list)
    scheduled: int = 0  # requests that left the queue's waiting count
    finished_waiting: int = 0  # requests that finished before they were scheduled
    finished_running: int = 0  # requests that finished after


class StepColumns:
    """The token columns of a step being written (on the engine's worker thread)."""

    def __init__(self) -> None:
        self.requests: list[int] = []
        self.indexes: list[int] = []
        self.ids: list[int] = []
        self.logprobs: list[tuple[int, TokenLogprob]] = []  # (token row, its log-probability)

    def add(self, request: int, index: int, token: int, logprob: TokenLogprob | None) -> None:
        if logprob is not None:
            self.logprobs.append((len(self.ids), logprob))
        self.requests.append(request)
        self.indexes.append(index)
        self.ids.append(token)

    def __len__(self) -> int:
        return len(self.ids)


def encode_step(columns: StepColumns, step: Step) -> bytes:
    """One message: the columns as buffers, the rest (a few objects per finished request) pickled around them."""
    rows = np.array([row for row, _ in columns.logprobs], np.int32)
    top_counts = np.array([len(entry.top) for _, entry in columns.logprobs], np.int32)
    top = [pair for _, entry in columns.logprobs for pair in entry.top]
    body = (
        np.array(columns.requests, np.int64).tobytes(),
        np.array(columns.indexes, np.int32).tobytes(),
        np.array(columns.ids, np.int32).tobytes(),
        rows.tobytes(),
        np.array([entry.logprob for _, entry in columns.logprobs], np.float64).tobytes(),
        top_counts.tobytes(),
        np.array([token for token, _ in top], np.int32).tobytes(),
        np.array([value for _, value in top], np.float64).tobytes(),
        step.scored,
        step.finished,
        [(request, index, error_to_wire(error)) for request, index, error in step.errors],
        step.transduced,
        step.figures,
        (step.scheduled, step.finished_waiting, step.finished_running),
    )
    return pickle.dumps(body, protocol=pickle.HIGHEST_PROTOCOL)


def decode_step(message: bytes) -> Step:
    (
        requests,
        indexes,
        ids,
        rows,
        values,
        top_counts,
        top_ids,
        top_values,
        scored,
        finished,
        errors,
        transduced,
        figures,
        (scheduled, finished_waiting, finished_running),
    ) = pickle.loads(message)
    token_ids = np.frombuffer(ids, np.int32)
    logprobs = {}
    if rows:
        starts = np.concatenate([[0], np.cumsum(np.frombuffer(top_counts, np.int32))]).tolist()
        top = list(zip(np.frombuffer(top_ids, np.int32).tolist(), np.frombuffer(top_values, np.float64).tolist()))
        for k, (row, value) in enumerate(
            zip(np.frombuffer(rows, np.int32).tolist(), np.frombuffer(values, np.float64).tolist())
        ):
            logprobs[row] = TokenLogprob(int(token_ids[row]), value, top[starts[k] : starts[k + 1]])
    return Step(
        np.frombuffer(requests, np.int64),
        np.frombuffer(indexes, np.int32),
        token_ids,
        logprobs,
        scored,
        finished,
        [(request, index, error_from_wire(error)) for request, index, error in errors],
        transduced,
        figures,
        scheduled,
        finished_waiting,
        finished_running,
    )


def error_to_wire(error: BaseException) -> tuple[str, str, int | None]:
    """An error as (its class in server.errors, message, Retry-After); any other exception as a ModelFailure."""
    if isinstance(error, APIError) and getattr(server.errors, type(error).__name__, None) is type(error):
        return type(error).__name__, error.message, error.retry_after_s
    return "ModelFailure", f"the engine failed: {type(error).__name__}: {error}", None


def error_from_wire(wire: tuple[str, str, int | None]) -> APIError:
    name, message, retry_after_s = wire
    kind = getattr(server.errors, name)
    error: APIError = kind.__new__(kind)
    APIError.__init__(error, message, retry_after_s)
    return error
