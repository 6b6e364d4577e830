"""The shipped text checkpoints (checkpoints/text-*): they load as the server loads them, carry their own
tokenizer, and decoding one token at a time reproduces the parallel pass. No network."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from server.models.store import load_served_model

pytestmark = pytest.mark.usefixtures("no_network")

SHIPPED = sorted((Path(__file__).resolve().parents[2] / "checkpoints").glob("text-*"))


@pytest.mark.skipif(not SHIPPED, reason="no text checkpoint shipped")
@pytest.mark.parametrize("folder", SHIPPED, ids=[folder.name for folder in SHIPPED])
def test_shipped_text_checkpoint(folder: Path) -> None:
    served = load_served_model(folder, "cpu")
    assert served.kind == "generate" and served.config.tokenizer == "file:tokenizer.tiktoken"
    assert served.config.model.vocab_size == served.tokenizer.vocab_size
    metadata = served.config.metadata
    assert metadata["train_length"] > 0 and metadata["steps"] > 0
    # a run's own end, or weights `python -m training export` took from a run (which say where from)
    assert metadata["stopped"] in ("steps", "time", "signal") or metadata.get("exported", {}).get("from")
    assert sum(file.stat().st_size for file in folder.iterdir()) < 16 * 2**20  # a few MB
    text = "It is a truth universally acknowledged, that a single man — naïve 👋"
    tokens = served.tokenizer.encode(text)
    assert served.tokenizer.decode(tokens) == text
    model = served.model.eval()
    with torch.no_grad():
        parallel = model(torch.tensor([tokens]))[0]  # (T, V)
        cache = model.new_cache(batch_size=1)
        stepped = torch.stack([model.step(torch.tensor([token]), cache)[0] for token in tokens])  # (T, V)
        final = model.final_logits(torch.tensor([tokens]))[0]
    torch.testing.assert_close(stepped, parallel, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(final, parallel[-1], rtol=1e-4, atol=1e-4)
