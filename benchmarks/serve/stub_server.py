"""``python -m server`` whose models answer without computing: a transducer's ``final_logits`` and ``forward`` and a
language model's decode ``step`` return zeros of the right shapes, so that what a request or a token costs is the
server's own path (benchmarks/serve/bench_http_path.py, bench_generate.py --stub). A language model's prefill still
runs the model.

    python -m benchmarks.serve.stub_server --models DIR [the options of python -m server]
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

from server import __main__ as server_main
from server import model_store
from server.model_store import ServedModel

load_served_model = model_store.load_served_model


def load_stubbed(folder: Path, device: str) -> ServedModel:
    served = load_served_model(folder, device)
    if served.kind == "generate":
        served.model.step = zero_step(served.config.model.vocab_size)
        return served
    labels = served.config.model.num_labels
    served.model.final_logits = lambda tokens, lengths=None: torch.zeros(len(tokens), labels)  # (B, L)
    served.model.forward = lambda tokens: torch.zeros(*tokens.shape, labels)  # (B, T, L)
    return served


def zero_step(vocabulary: int):
    """A decode step that advances the cache's lengths and returns zero logits (one tensor per batch size)."""
    zeros: dict[int, torch.Tensor] = {}

    def step(tokens: torch.Tensor, cache) -> torch.Tensor:
        cache.lengths = cache.lengths + 1
        rows = tokens.shape[0]
        if rows not in zeros:
            zeros[rows] = torch.zeros(rows, vocabulary)
        return zeros[rows]

    return step


# At import, not under __main__: the engine process (server/engine_core.py, started with spawn) imports this module as
# its main module too, and must load the stubs as well.
model_store.load_served_model = load_stubbed

if __name__ == "__main__":
    sys.exit(server_main.main())
