"""A block-diagonal LRNN with state codes (``LRNNConfig.state_codes``): every path snaps each block's state to its
nearest code after the same symbols, as a plain loop does; the config refuses what cannot have codes."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from model.config import ConfigError
from model.lrnn.model import BlockDiagonalLRNN
from model.ops.cpu import cpu_decode
from model.ops.scan.dispatch import ScanImpl
from tests.model.tiny_models import tiny_configs

VOCAB, LABELS, CODES, EVERY = 5, 3, 6, 3


def make(every: int = EVERY, scan_impl: ScanImpl = "auto") -> BlockDiagonalLRNN:
    """The tiny spectral LRNN with CODES random codes per block, snapped after every ``every``-th symbol."""
    config = dataclasses.replace(
        tiny_configs(VOCAB, LABELS)["lrnn-spectral-b2"], state_codes=CODES, snap_every=every, scan_impl=scan_impl
    )
    torch.manual_seed(0)
    model = BlockDiagonalLRNN(config).double().eval()
    with torch.no_grad():
        for block in model.blocks:
            block.recurrence.state_codes.normal_(std=0.3)
    return model


def plain_loop(model: BlockDiagonalLRNN, tokens: torch.Tensor) -> torch.Tensor:
    """The model's logits (B, T, labels) one symbol at a time, each snap a search over the codes written out."""
    x = model.embedding(tokens)  # (B, T, d)
    every = model.config.snap_every
    for block in model.blocks:
        recurrence = block.recurrence
        state = recurrence.initial_state(tokens.shape[0]).double()  # (B, H, b)
        u = block.ln_1(x)
        outputs = []
        for k in range(tokens.shape[1]):
            transitions, inputs = recurrence.coefficients(u[:, k])  # (B, H, b, b), (B, H, b)
            state = (transitions @ state.unsqueeze(-1)).squeeze(-1) + inputs
            if (k + 1) % every == 0:
                codes = recurrence.state_codes  # (H, K, b)
                nearest = ((state.unsqueeze(2) - codes.unsqueeze(0)) ** 2).sum(-1).argmin(-1)  # (B, H)
                state = torch.stack([codes[h, nearest[:, h]] for h in range(codes.shape[0])], dim=1)
            outputs.append(recurrence.readout(state, u[:, k]))
        x = x + torch.stack(outputs, dim=1)
        x = x + block.mlp(block.ln_2(x))
    return model.embedding.logits(model.ln_f(x))


@pytest.mark.parametrize("impl", ["sequential", "parallel", "chunked", "auto"])
@pytest.mark.parametrize("every", [1, EVERY])
def test_every_path_snaps_where_the_plain_loop_does(impl: ScanImpl, every: int) -> None:
    model = make(every, impl)
    tokens = torch.randint(0, VOCAB, (2, 23))
    with torch.no_grad():
        expected = plain_loop(model, tokens)
        torch.testing.assert_close(model(tokens), expected, rtol=1e-10, atol=1e-10)
        torch.testing.assert_close(model.final_logits(tokens), expected[:, -1], rtol=1e-10, atol=1e-10)
        cache = model.new_cache(batch_size=2)  # prefill in parts that start and end between snaps
        parts = [model(tokens[:, start:end], cache=cache) for start, end in [(0, 4), (4, 5), (5, 23)]]
        torch.testing.assert_close(torch.cat(parts, dim=1), expected, rtol=1e-10, atol=1e-10)
        cache = model.new_cache(batch_size=2)
        stepped = torch.stack([model.step(tokens[:, t], cache) for t in range(23)], dim=1)
        torch.testing.assert_close(stepped, expected, rtol=1e-10, atol=1e-10)
        slices = model.run_in_slices(tokens[:1], True, slice_flops=1.0)  # a slice per symbol: the server's path
        while True:
            try:
                next(slices)
            except StopIteration as finished:
                last, labels = finished.value
                break
    torch.testing.assert_close(last, expected[0, -1], rtol=1e-10, atol=1e-10)
    assert torch.equal(labels, expected[0].argmax(-1))


def test_the_compiled_loop_snaps_where_the_torch_stretches_do(monkeypatch) -> None:
    """float32 on the CPU with "auto": one compiled loop (counted), equal to the scan per stretch ("chunked")."""
    if not cpu_decode.kernel_available():
        pytest.skip("needs numba")
    calls = []
    compiled = cpu_decode.snapped_scan
    monkeypatch.setattr(cpu_decode, "snapped_scan", lambda *args: calls.append(1) or compiled(*args))
    tokens = torch.randint(0, VOCAB, (3, 50))
    with torch.no_grad():
        expected = make(EVERY, "chunked").float()(tokens)
        assert not calls
        model = make(EVERY, "auto").float()
        torch.testing.assert_close(model(tokens), expected, rtol=1e-5, atol=1e-5)
        cache = model.new_cache(batch_size=3)
        parts = [model(tokens[:, start:end], cache=cache) for start, end in [(0, 7), (7, 50)]]
    assert len(calls) == 3 * 2  # each layer of each call
    torch.testing.assert_close(torch.cat(parts, dim=1), expected, rtol=1e-5, atol=1e-5)


def test_the_compiled_loop_skips_only_padding(monkeypatch) -> None:
    """Codes padded as ``snap`` pads them (each block's rows after its own count copy its first; one copy of the
    first also inside): the compiled loop, which reads a block's rows only up to its trailing copies, snaps as the
    torch search over every row does."""
    if not cpu_decode.kernel_available():
        pytest.skip("needs numba")
    tokens = torch.randint(0, VOCAB, (3, 50))
    models = {impl: make(EVERY, impl).float() for impl in ("chunked", "auto")}
    for model in models.values():
        with torch.no_grad():
            for layer, block in enumerate(model.blocks):
                codes = block.recurrence.state_codes  # (H, K, b)
                for h in range(codes.shape[0]):
                    used = 2 + (layer + h) % (CODES - 2)  # 2 .. CODES - 1 rows of its own
                    codes[h, used:] = codes[h, 0]
                codes[0, 1] = codes[0, 0]
    with torch.no_grad():
        expected = models["chunked"](tokens)
        torch.testing.assert_close(models["auto"](tokens), expected, rtol=1e-5, atol=1e-5)


def test_the_codes_change_the_output_and_a_step_reads_the_code() -> None:
    """Not a model whose codes do nothing: the snapped state is what the readout reads."""
    model = make(every=1)
    tokens = torch.randint(0, VOCAB, (2, 9))
    plain = BlockDiagonalLRNN(dataclasses.replace(model.config, state_codes=0)).double().eval()
    plain.load_state_dict({name: value for name, value in model.state_dict().items() if "state_codes" not in name})
    with torch.no_grad():
        assert not torch.allclose(model(tokens), plain(tokens))
        cache = model.new_cache(batch_size=2)
        model.step(tokens[:, 0], cache)
    for block, state in zip(model.blocks, cache.states):
        codes = block.recurrence.state_codes  # (H, K, b)
        for h in range(codes.shape[0]):
            assert all(any(torch.equal(row, code) for code in codes[h]) for row in state[:, h])


def test_a_cache_with_rows_at_different_lengths_is_refused_for_a_prefill() -> None:
    model = make()
    cache = model.new_cache(batch_size=2)
    cache.lengths = torch.tensor([3, 4])
    with pytest.raises(ValueError, match="only at one length"):
        model(torch.zeros(2, 2, dtype=torch.long), cache=cache)


def test_the_config_refuses_what_cannot_have_codes() -> None:
    base = tiny_configs(VOCAB, LABELS)["lrnn-spectral-b2"]
    with pytest.raises(ConfigError, match="state_codes needs a transducer"):
        dataclasses.replace(base, num_labels=0, state_codes=4)
    with pytest.raises(ConfigError, match="state_codes must be >= 0"):
        dataclasses.replace(base, state_codes=-1)
    with pytest.raises(ConfigError, match="snap_every must be > 0"):
        dataclasses.replace(base, state_codes=4, snap_every=0)
