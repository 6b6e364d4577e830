"""LSTM baseline: the cache holds nn.LSTM's (h, c), of fixed size, and clones without sharing storage."""

from __future__ import annotations

import torch

from model.config import LSTMConfig
from model.lstm.model import LSTMModel

CONFIG = LSTMConfig(vocab_size=5, d_model=16, n_layers=2, hidden_size=24)


def test_cache_holds_the_lstm_state_of_fixed_size() -> None:
    model = LSTMModel(CONFIG).double().eval()
    tokens = torch.randint(0, 5, (3, 9))
    cache = model.new_cache(batch_size=3)
    empty_bytes = cache.nbytes
    with torch.no_grad():
        model(tokens, cache=cache)
        _, (hidden, cell) = model.lstm(model.embedding(tokens))
    assert cache.hidden.shape == cache.cell.shape == (2, 3, 24)  # (n_layers, B, hidden_size)
    assert cache.nbytes == empty_bytes == 2 * 2 * 3 * 24 * 8
    torch.testing.assert_close(cache.hidden, hidden, rtol=0, atol=0)
    torch.testing.assert_close(cache.cell, cell, rtol=0, atol=0)


def test_clone_shares_no_storage() -> None:
    model = LSTMModel(CONFIG).eval()
    cache = model.new_cache(batch_size=2)
    with torch.no_grad():
        model(torch.randint(0, 5, (2, 4)), cache=cache)
    snapshot = cache.clone()
    before = snapshot.hidden.clone(), snapshot.cell.clone()
    cache.hidden.add_(1.0)
    cache.cell.add_(1.0)
    assert snapshot.length == 4
    assert torch.equal(snapshot.hidden, before[0]) and torch.equal(snapshot.cell, before[1])
