"""What the server should answer, computed straight from the checkpoints with the parallel forward pass."""

from __future__ import annotations

from functools import cache
from pathlib import Path

import torch

from model.checkpoint import load_checkpoint
from model.tokenizer import load_tokenizer

BYTES = load_tokenizer("bytes", ".")


@cache
def _model(path: Path):
    return load_checkpoint(path, device="cpu").model


@torch.no_grad()
def labels(path: Path, text: str, alphabet: str = "01") -> list[int]:
    """The label id at every position of a transducer input."""
    tokens = torch.tensor([[alphabet.index(symbol) for symbol in text]])
    return _model(path)(tokens)[0].argmax(-1).tolist()


@torch.no_grad()
def greedy_tokens(path: Path, prompt: str, count: int) -> list[int]:
    """``count`` greedy tokens after ``prompt``, each from a full parallel pass over everything so far."""
    tokens = BYTES.encode(prompt)
    for _ in range(count):
        tokens.append(int(_model(path)(torch.tensor([tokens]))[0, -1].argmax()))
    return tokens[-count:]


@torch.no_grad()
def prompt_logprobs(path: Path, prompt: str) -> list[float]:
    """log p(token i | tokens before i) for i >= 1."""
    tokens = torch.tensor([BYTES.encode(prompt)])
    logprobs = _model(path)(tokens)[0].log_softmax(-1)  # (T, V)
    return logprobs[:-1].gather(1, tokens[0, 1:, None])[:, 0].tolist()


def text(tokens: list[int]) -> str:
    return BYTES.decode(tokens)
