"""Token windows of ``length + 1`` tokens for language models, documents joined by the tokenizer's ``eot_token``:
:class:`TokenArray` (in memory, random offsets) and :class:`StreamedWindows` (a stream cut into windows drawn from
a shuffle buffer, its position saved by :meth:`StreamedWindows.state`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from typing import TypedDict

import numpy as np
import torch

from model.tokenizer import Tokenizer
from training.data.corpus import Document


def tokenize_documents(documents: Iterable[str], tokenizer: Tokenizer) -> np.ndarray:
    """The documents' tokens, ``eot_token`` before each document but the first. Returns (N,) int64."""
    pieces: list[list[int]] = []
    for index, text in enumerate(documents):
        if index and tokenizer.eot_token is not None:
            pieces.append([tokenizer.eot_token])
        pieces.append(tokenizer.encode(text))
    return np.fromiter((token for piece in pieces for token in piece), dtype=np.int64)


def cycled(tokens: np.ndarray, start: int, count: int) -> np.ndarray:
    """``count`` tokens of ``tokens`` from ``start``, going on from the beginning where they end: (count,)."""
    return np.take(tokens, np.arange(start, start + count), mode="wrap")


class TokenArray:
    """Random windows of a token array held in memory."""

    def __init__(self, tokens: np.ndarray) -> None:
        self.tokens = tokens  # (N,) int64

    def batch(self, rng: np.random.Generator, batch_size: int, length: int) -> torch.Tensor:
        """(batch_size, length + 1) windows at random offsets."""
        if len(self.tokens) <= length:
            raise ValueError(f"the corpus has {len(self.tokens)} tokens, too few for windows of {length + 1}")
        starts = rng.integers(0, len(self.tokens) - length, size=batch_size)
        index = starts[:, None] + np.arange(length + 1)[None, :]  # (B, length + 1)
        return torch.from_numpy(self.tokens[index])


class StreamState(TypedDict):
    """Where a :class:`StreamedWindows` is, in JSON values."""

    documents_read: int  # in this pass
    windows_this_pass: int
    pending: list[int]  # tokens not yet cut into a window
    buffer: list[list[int]]  # the windows drawn from at random


class StreamedWindows:
    """Windows cut from a document stream, drawn at random from a buffer of ``buffer_windows`` of them."""

    def __init__(
        self, documents: Callable[[], Iterator[Document]], tokenizer: Tokenizer, buffer_windows: int = 4096
    ) -> None:
        self._documents = documents  # called again when the stream ends (a new epoch)
        self._tokenizer = tokenizer
        self._buffer_windows = buffer_windows
        self._buffer: list[np.ndarray] = []
        self._pending = np.zeros(0, dtype=np.int64)  # tokens not yet cut into a window
        self._stream: Iterator[Document] | None = None
        self._windows_this_pass = 0
        self._documents_read = 0  # in this pass

    def state(self) -> StreamState:
        """Where the stream is (JSON values): restored by :meth:`load_state`, the same windows follow."""
        return {
            "documents_read": self._documents_read,
            "windows_this_pass": self._windows_this_pass,
            "pending": self._pending.tolist(),
            "buffer": [window.tolist() for window in self._buffer],
        }

    def load_state(self, state: StreamState) -> None:
        """Go back to a position saved by :meth:`state`: the stream is reopened and read up to it again."""
        self._stream = self._documents()
        for _ in range(state["documents_read"]):
            if next(self._stream, None) is None:
                raise ValueError(f"the corpus holds fewer than the {state['documents_read']} documents already read")
        self._documents_read = state["documents_read"]
        self._windows_this_pass = state["windows_this_pass"]
        self._pending = np.asarray(state["pending"], dtype=np.int64)
        self._buffer = [np.asarray(window, dtype=np.int64) for window in state["buffer"]]

    def batch(self, rng: np.random.Generator, batch_size: int, length: int) -> torch.Tensor:
        """(batch_size, length + 1) windows; each leaves the buffer when drawn."""
        rows = []
        for _ in range(batch_size):
            self._fill(length + 1)
            position = int(rng.integers(len(self._buffer)))
            self._buffer[position], self._buffer[-1] = self._buffer[-1], self._buffer[position]
            rows.append(self._buffer.pop())
        return torch.from_numpy(np.stack(rows))

    def _fill(self, window: int) -> None:
        while len(self._buffer) < self._buffer_windows:
            while len(self._pending) < window:
                text = self._next_document()
                if text is None:  # the end of a pass over the corpus
                    if self._buffer:
                        return
                    if not self._windows_this_pass:
                        raise ValueError(f"the corpus holds fewer tokens than one window of {window}")
                    self._windows_this_pass = 0
                    continue
                eot = [self._tokenizer.eot_token] if self._tokenizer.eot_token is not None else []
                self._pending = np.concatenate([self._pending, np.asarray(eot + self._tokenizer.encode(text))])
            count = len(self._pending) // window
            windows = self._pending[: count * window].reshape(count, window)
            self._buffer.extend(windows)
            self._windows_this_pass += count
            self._pending = self._pending[count * window :]

    def _next_document(self) -> str | None:
        """The next document's text; None once per pass, at the end of the stream."""
        if self._stream is None:
            self._stream = self._documents()
        document = next(self._stream, None)
        if document is None:
            self._stream, self._documents_read = None, 0
            return None
        self._documents_read += 1
        return document.text
