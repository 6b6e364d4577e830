"""``python -m server`` whose transducers answer without computing: ``final_logits`` and ``forward`` return zeros
of the right shapes, so that what a request costs is the server's own path (benchmarks/serve/bench_http_path.py).

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
    labels = served.config.model.num_labels
    served.model.final_logits = lambda tokens, lengths=None: torch.zeros(len(tokens), labels)  # (B, L)
    served.model.forward = lambda tokens: torch.zeros(*tokens.shape, labels)  # (B, T, L)
    return served


if __name__ == "__main__":
    model_store.load_served_model = load_stubbed
    sys.exit(server_main.main())
