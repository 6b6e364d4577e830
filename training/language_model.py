"""The objective of ``python -m training text-train`` (``train --corpus``): a language model on text
(training/loop.py runs it).

Batches: windows of ``length + 1`` tokens (training/text_data.py) from a corpus (training/text_corpus.py); the
model reads the first ``length`` and is scored on each next token. Under torchrun each process draws its own
windows (in-memory corpora: its random stream is keyed by its rank; OpenWebText2: its own shards). Evaluation:
the next-token loss over every position of fixed validation windows of the training length (the held-out tails
of an in-memory corpus's documents, or ``validation_corpus``); the checkpoint holds the latest weights.

The output folder is a ``kind="generate"`` checkpoint: besides ``config.json`` and ``model.safetensors``, the
tokenizer's ranks file ``tokenizer.tiktoken`` (named ``file:tokenizer.tiktoken`` in the config) when the
tokenizer is one.
"""

from __future__ import annotations

import dataclasses
import math
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from model.base import SequenceModel
from model.config import BaseModelConfig, CheckpointConfig
from model.tokenizer import FILE_PREFIX, Tokenizer
from training.data import Batch
from training.distributed import Distributed
from training.loop import Evaluation, Objective, RunState
from training.text_corpus import corpus_documents, is_streamed, split_document
from training.text_data import StreamedWindows, TokenArray, tokenize_documents

RANKS_FILE = "tokenizer.tiktoken"
VALIDATION_STREAM = 1  # key of the validation windows' random stream (with the seed)


@dataclass(frozen=True)
class TextData:
    """What a language model trains and is validated on. ``tokenizer`` is what the checkpoint names."""

    corpus: str
    tokenizer: str
    length: int = 128  # the training context length L_tr
    validation_fraction: float = 0.1  # the tail of each document held out (in-memory corpora)
    validation_corpus: str | None = None  # for a streamed corpus: where validation windows come from
    validation_windows: int = 64


class LanguageModelObjective(Objective):
    name = "text"
    keep_best = False

    def __init__(
        self, data: TextData, tokenizer: Tokenizer, ranks_file: Path | None, batch_size: int, seed: int,
        evaluate: bool, dist: Distributed,
    ) -> None:
        self.data, self.tokenizer, self.ranks_file, self.batch_size = data, tokenizer, ranks_file, batch_size
        if is_streamed(data.corpus):
            self.windows: TokenArray | StreamedWindows = StreamedWindows(
                lambda: corpus_documents(data.corpus, dist.rank, dist.world_size), tokenizer)
            self.train_tokens = None
        else:
            texts = [split_document(document.text, data.validation_fraction, "train")
                     for document in corpus_documents(data.corpus)]
            tokens = tokenize_documents(texts, tokenizer)
            self.windows, self.train_tokens = TokenArray(tokens), len(tokens)
        self.validation = self._validation_windows(seed) if evaluate else None

    def _validation_windows(self, seed: int) -> torch.Tensor:
        """Fixed (N, length + 1) validation windows, the same on every process."""
        corpus = self.data.validation_corpus or self.data.corpus
        if is_streamed(corpus) and self.data.validation_corpus is None:
            raise ValueError(f"{corpus} is streamed and has no held-out tail: give a validation corpus "
                             "(--validation-corpus owt2:...) or turn evaluation off (--eval-every 0)")
        tokens = np.concatenate(validation_tokens(corpus, self.data.validation_fraction, self.tokenizer))
        rng = np.random.default_rng([seed, VALIDATION_STREAM])
        return TokenArray(tokens).batch(rng, self.data.validation_windows, self.data.length)

    def batch(self, rng: np.random.Generator, step: int) -> Batch:
        windows = self.windows.batch(rng, self.batch_size, self.data.length)  # (B, L + 1)
        lengths = torch.full((len(windows),), self.data.length, dtype=torch.long)
        return Batch(windows[:, :-1], windows[:, 1:], lengths)

    @torch.no_grad()
    def evaluate(self, model: SequenceModel, dist: Distributed, batch_size: int = 16) -> Evaluation | None:
        if self.validation is None:
            return None
        total = 0.0
        for start in range(0, len(self.validation), batch_size):
            chunk = self.validation[start:start + batch_size].to(dist.device)  # (b, L + 1)
            logits = model(chunk[:, :-1])  # (b, L, V)
            total += float(F.cross_entropy(logits.float().flatten(0, 1), chunk[:, 1:].flatten(), reduction="sum"))
        loss = total / self.validation[:, 1:].numel()
        return Evaluation({"validation_loss": loss, "validation_perplexity": math.exp(loss)}, score=-loss)

    def checkpoint_config(self, architecture: str, model_config: BaseModelConfig,
                          metadata: dict[str, Any]) -> CheckpointConfig:
        return CheckpointConfig(architecture=architecture, model=model_config, kind="generate",
                                tokenizer=self.data.tokenizer, metadata=metadata)

    def write_files(self, out: Path) -> None:
        if self.ranks_file is not None and self.ranks_file.resolve() != (out / RANKS_FILE).resolve():
            shutil.copyfile(self.ranks_file, out / RANKS_FILE)

    def start_figures(self) -> dict[str, Any]:
        return {"corpus": self.data.corpus, "tokenizer": self.data.tokenizer, "train_tokens": self.train_tokens}

    def metadata(self, run: RunState) -> dict[str, Any]:
        loss = (run.last_evaluation or {}).get("validation_loss")
        return {"train_length": self.data.length, "validation_loss": loss}

    def settings(self) -> dict[str, Any]:
        return dataclasses.asdict(self.data)

    def data_state(self) -> Any:
        return self.windows.state() if isinstance(self.windows, StreamedWindows) else None

    def load_data_state(self, state: Any) -> None:
        if isinstance(self.windows, StreamedWindows):
            self.windows.load_state(state)


def checkpoint_tokenizer_name(ranks_file: Path | None, spec: str) -> str:
    """What config.json calls the tokenizer: the copied ranks file, or the tokenizer's own name."""
    return f"{FILE_PREFIX}{RANKS_FILE}" if ranks_file is not None else spec


def validation_tokens(corpus: str, validation_fraction: float, tokenizer: Tokenizer) -> list[np.ndarray]:
    """The held-out tokens, one array per document: the tails of an in-memory corpus's documents, or the
    whole documents of a streamed one (then give a held-out shard)."""
    documents = corpus_documents(corpus)
    if is_streamed(corpus):
        texts = [document.text for document in documents]
    else:
        texts = [split_document(document.text, validation_fraction, "validation") for document in documents]
    return [tokenize_documents([text], tokenizer) for text in texts if text]
