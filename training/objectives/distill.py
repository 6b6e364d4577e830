"""A teacher for ``text-train --teacher DIR`` (knowledge distillation, Hinton et al. 2015): a language model whose
next-token distributions the rows of ``Batch.distilled`` learn beside their next tokens, carrying its own states
under state passing. Float32, no gradients, never saved (a resumed run loads it again).
"""

from __future__ import annotations

from pathlib import Path

import torch

from model.base import SequenceModel
from model.cache import InferenceCache
from model.checkpoint import load_checkpoint
from model.tokenizer import Tokenizer, load_tokenizer
from training.objectives.carried import new_carried_state, reset_rows


class Teacher:
    """A language model of the same tokenizer, run beside the one in training."""

    def __init__(self, model: SequenceModel, weight: float, rows: int, carries_state: bool) -> None:
        """``rows``: the batch's (per process); ``carries_state``: the run's state passing."""
        self.model, self.weight = model.eval(), weight
        self.carried = new_carried_state(model, rows) if carries_state else None
        self._ended: list[InferenceCache] = []

    @classmethod
    def load(
        cls, folder: Path, weight: float, tokenizer: Tokenizer, rows: int, carries_state: bool, device: torch.device
    ) -> Teacher:
        """The language model in ``folder``; a ValueError saying why where it cannot teach this run: not a
        language model, or another tokenizer than ``tokenizer`` (every token's bytes must be the same)."""
        try:
            loaded = load_checkpoint(folder, device=str(device), dtype=torch.float32)
        except ValueError as error:  # CheckpointError, ConfigError
            raise ValueError(f"--teacher {folder}: {error}") from None
        if loaded.config.kind != "generate":
            raise ValueError(f"--teacher {folder} is a {loaded.config.kind} checkpoint, not a language model")
        assert loaded.config.tokenizer is not None  # a language model's config names its tokenizer
        theirs = load_tokenizer(loaded.config.tokenizer, folder)
        if not same_tokens(theirs, tokenizer):
            raise ValueError(
                f"--teacher {folder} uses another tokenizer ({loaded.config.tokenizer}, "
                f"{theirs.vocab_size} tokens) than this run ({tokenizer.name}, {tokenizer.vocab_size})"
            )
        for parameter in loaded.model.parameters():
            parameter.requires_grad_(False)
        try:
            return cls(loaded.model, weight, rows, carries_state)
        except ValueError as error:  # state passing with a teacher whose cache grows
            raise ValueError(f"--teacher {folder}: {error}") from None

    def begin(self, fresh: torch.Tensor | None) -> None:
        """A step starts: the rows where ``fresh`` (B,) holds start from the teacher's initial state, as the model's
        do."""
        if self.carried is not None and fresh is not None and bool(fresh.any()):
            self.carried = reset_rows(self.model, self.carried, fresh)
        self._ended = []

    @torch.no_grad()
    def probabilities(self, tokens: torch.Tensor, rows: list[int]) -> torch.Tensor:
        """tokens (b, T) of the batch's ``rows`` -> the teacher's next-token distributions, (b, T, V) float32,
        from those rows' carried states (advanced: :meth:`end` keeps them)."""
        cache = None if self.carried is None else self.carried.select(rows)
        logits = self.model(tokens, cache)  # (b, T, V)
        if cache is not None:
            self._ended.append(cache)
        return torch.softmax(logits.float(), dim=-1)

    def end(self) -> None:
        """The step's micro-batches are done: their rows' states are the ones carried on."""
        if self.carried is not None and self._ended:
            self.carried = type(self.carried).stack(self._ended)
        self._ended = []


def same_tokens(first: Tokenizer, second: Tokenizer) -> bool:
    """Whether two tokenizers have the same tokens: the same count, each id the same bytes (special tokens by name)."""
    if first.vocab_size != second.vocab_size:
        return False
    one, two = first.encoding, second.encoding
    if one._special_tokens != two._special_tokens:  # tiktoken keeps no public accessor for them
        return False
    special = set(one._special_tokens.values())
    return all(
        one.decode_single_token_bytes(token) == two.decode_single_token_bytes(token)
        for token in range(one.n_vocab)
        if token not in special
    )
