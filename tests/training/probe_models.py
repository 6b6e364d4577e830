"""Hand-made and tiny language models shared by the long-context probe tests (evaluation/test_passkey_probe.py,
evaluation/test_retrieval_probe.py): a tiny untrained LRNN checkpoint and :class:`Answerer`, a model that reads the
prompt's text and says what a given reader finds in it."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from model.base import SequenceModel
from model.cache import InferenceCache, long_tensor
from model.checkpoint import save_checkpoint
from model.config import ARCHITECTURE_CONFIGS, BaseModelConfig, CheckpointConfig
from model.registry import build_model
from model.serving import CallPath, Cost
from model.tokenizer import Tokenizer, load_tokenizer

REPO = Path(__file__).resolve().parents[2]
TINY = {
    "lrnn": {"d_model": 16, "n_layers": 1, "block_size": 4, "num_blocks": 4, "d_ff": 32},
    "regulargpt": {"d_model": 16, "n_heads": 2, "d_ff": 32, "chunk_size": 4, "thickness": 2},
}
BYTES = load_tokenizer("bytes", ".")


def tiny_model(architecture: str) -> SequenceModel:
    torch.manual_seed(0)
    config = ARCHITECTURE_CONFIGS[architecture](vocab_size=BYTES.vocab_size, num_labels=0, **TINY[architecture])
    return build_model(architecture, config).eval()


def save_tiny_lrnn(folder: Path) -> Path:
    """A tiny untrained LRNN language model with the bytes tokenizer in ``folder``, as text-train would write it."""
    model = tiny_model("lrnn")
    save_checkpoint(
        model,
        CheckpointConfig(
            architecture="lrnn", model=model.config, kind="generate", tokenizer="bytes", metadata={"train_length": 16}
        ),
        folder,
    )
    return folder


@dataclass
class TranscriptCache(InferenceCache):
    """Every token each row has read, and what it still has to say."""

    tokens: list[list[int]]
    answers: list[list[int]]

    @classmethod
    def stack(cls, caches):
        return cls(
            torch.cat([cache.lengths for cache in caches]),
            [row for cache in caches for row in cache.tokens],
            [row for cache in caches for row in cache.answers],
        )

    def select(self, rows):
        rows = list(rows)
        return TranscriptCache(
            self.lengths[rows], [list(self.tokens[row]) for row in rows], [list(self.answers[row]) for row in rows]
        )

    @property
    def nbytes(self) -> int:
        return 8 * sum(map(len, self.tokens))


class Answerer(SequenceModel):
    """A hand-made language model: after a prompt it reads the key from the needle and says ``answer(key)``, one
    token at a time; a perfect retriever when ``answer`` is the key."""

    def __init__(
        self,
        config: BaseModelConfig,
        tokenizer: Tokenizer,
        answer,
        cache_bytes_per_token: int = 8,
        read=lambda text: (re.findall(r"The pass key is (\d+)\.", text) or [None])[0],
    ) -> None:
        """``read``: the text read so far -> the key it answers (None: nothing yet)."""
        super().__init__()
        self.config = config
        self.tokenizer, self.answer, self.cache_bytes_per_token = tokenizer, answer, cache_bytes_per_token
        self.read = read
        self.anchor = nn.Parameter(torch.zeros(1))  # the model's device and dtype
        self.chunks: list[int] = []

    def new_cache(self, batch_size: int) -> TranscriptCache:
        return TranscriptCache(
            long_tensor(0, batch_size), [[] for _ in range(batch_size)], [[] for _ in range(batch_size)]
        )

    def forward(self, tokens: torch.Tensor, cache: InferenceCache | None = None) -> torch.Tensor:
        assert isinstance(cache, TranscriptCache)
        self.chunks.append(tokens.shape[1])
        for row, new in enumerate(tokens.tolist()):
            cache.tokens[row] += new
            key = self.read(self.tokenizer.decode(cache.tokens[row]))
            cache.answers[row] = self.tokenizer.encode(self.answer(key)) if key is not None else []
        cache.lengths = cache.lengths + tokens.shape[1]
        logits = torch.zeros(*tokens.shape, self.tokenizer.vocab_size)  # (B, T, V)
        logits[:, -1] = self._say(cache)
        return logits

    def step(self, tokens: torch.Tensor, cache: InferenceCache) -> torch.Tensor:
        assert isinstance(cache, TranscriptCache)
        cache.lengths = cache.lengths + 1
        return self._say(cache)

    def _say(self, cache: TranscriptCache) -> torch.Tensor:
        """(B, V): one-hot of each row's next answer token (a space once it has said everything)."""
        space = self.tokenizer.encode(" ")[0]
        said = [answer.pop(0) if answer else space for answer in cache.answers]
        return nn.functional.one_hot(torch.tensor(said), self.tokenizer.vocab_size).float()

    def cost(self, path: CallPath, rows: int, length: int, context: int = 0) -> Cost:
        return Cost(flops=0.0, nbytes=rows * length * self.tokenizer.vocab_size * 4)

    def cache_nbytes(self, length: int) -> int:
        return self.cache_bytes_per_token * length
