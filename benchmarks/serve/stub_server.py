"""``python -m server`` whose models answer without computing: a transducer's ``final_logits`` and ``forward`` and a
language model's decode ``step`` return zeros of the right shapes, so that what a request or a token costs is the
server's own path (benchmarks/serve/api/bench_http_path.py, api/bench_generate.py --stub). A language model's prefill
still runs the model.

    python -m benchmarks.serve.stub_server --models DIR [the options of python -m server]
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

from benchmarks.serve.harness import stub_decode_steps
from server import __main__ as server_main
from server.models import store as model_store
from server.models.store import ServedModel

load_served_model = model_store.load_served_model


def load_stubbed(folder: Path, device: str) -> ServedModel:
    served = load_served_model(folder, device)
    if served.kind == "generate":
        stub_decode_steps(served.model, served.config.model.vocab_size)
        return served
    labels = served.config.model.num_labels
    served.model.final_logits = lambda tokens, lengths=None: torch.zeros(len(tokens), labels)  # (B, L)
    served.model.forward = lambda tokens: torch.zeros(*tokens.shape, labels)  # (B, T, L)
    return served


# At import, not under __main__: the engine process (server/engine/core.py, started with spawn) imports this module as
# its main module too, and must load the stubs as well. So nothing else may import this module: every model it then
# loaded would be stubbed, and its rates would be the stub's.
model_store.load_served_model = load_stubbed

if __name__ == "__main__":
    sys.exit(server_main.main())
