"""Properties every architecture must have: step equals parallel, final equals gather, causality, heads."""

from __future__ import annotations

import pytest
import torch

from tests.model.tiny_models import DEVICES, MODEL_IDS, build_tiny

VOCAB, LABELS = 5, 3


def make(model_id: str, num_labels: int = LABELS, dtype: torch.dtype = torch.float64, device: str = "cpu"):
    return build_tiny(model_id, VOCAB, num_labels).to(device=device, dtype=dtype).eval()


@pytest.mark.parametrize("model_id", MODEL_IDS)
@pytest.mark.parametrize("num_labels", [0, LABELS], ids=["lm", "transducer"])
def test_shapes_and_heads(model_id: str, num_labels: int) -> None:
    model = make(model_id, num_labels)
    tokens = torch.randint(0, VOCAB, (3, 11))
    logits = model(tokens)
    assert logits.shape == (3, 11, num_labels or VOCAB)
    assert torch.isfinite(logits).all()


@pytest.mark.parametrize("model_id", MODEL_IDS)
@pytest.mark.parametrize("length", [1, 2, 9, 30])
def test_step_by_step_equals_parallel(model_id: str, length: int) -> None:
    model = make(model_id, num_labels=0)
    tokens = torch.randint(0, VOCAB, (2, length))
    with torch.no_grad():
        parallel = model(tokens)  # (B, T, V)
        cache = model.new_cache(batch_size=2)
        stepped = torch.stack([model.step(tokens[:, t], cache) for t in range(length)], dim=1)
    assert cache.length == length
    torch.testing.assert_close(stepped, parallel, rtol=1e-9, atol=1e-9)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("model_id", MODEL_IDS)
def test_prefill_then_step_equals_parallel(model_id: str, device: str) -> None:
    model = make(model_id, num_labels=0, device=device)
    tokens = torch.randint(0, VOCAB, (2, 23)).to(device)
    with torch.no_grad():
        parallel = model(tokens)
        cache = model.new_cache(batch_size=2)
        prefilled = model(tokens[:, :13], cache=cache)
        stepped = torch.stack([model.step(tokens[:, t], cache) for t in range(13, 23)], dim=1)
    assert cache.length == 23
    torch.testing.assert_close(prefilled, parallel[:, :13], rtol=1e-9, atol=1e-9)
    torch.testing.assert_close(stepped, parallel[:, 13:], rtol=1e-9, atol=1e-9)


@pytest.mark.parametrize("model_id", MODEL_IDS)
def test_cache_clone_is_independent(model_id: str) -> None:
    """Stepping a clone and its original alternately, on different tokens, gives each its own sequence."""
    model = make(model_id, num_labels=0)
    first_tokens = torch.randint(0, VOCAB, (1, 14))
    second_tokens = torch.cat([first_tokens[:, :6], torch.randint(0, VOCAB, (1, 8))], dim=1)
    with torch.no_grad():
        expected_first, expected_second = model(first_tokens), model(second_tokens)
        cache = model.new_cache(batch_size=1)
        model(first_tokens[:, :6], cache=cache)
        snapshot = cache.clone()
        first, second = [], []
        for t in range(6, 14):
            first.append(model.step(first_tokens[:, t], cache))
            second.append(model.step(second_tokens[:, t], snapshot))
    assert snapshot.length == cache.length == 14
    assert snapshot.memory_bytes() > 0
    torch.testing.assert_close(torch.stack(first, 1), expected_first[:, 6:], rtol=1e-9, atol=1e-9)
    torch.testing.assert_close(torch.stack(second, 1), expected_second[:, 6:], rtol=1e-9, atol=1e-9)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("model_id", MODEL_IDS)
def test_final_logits_equal_gathered_parallel_logits(model_id: str, device: str) -> None:
    model = make(model_id, device=device)
    tokens = torch.randint(0, VOCAB, (4, 37)).to(device)
    lengths = torch.tensor([37, 1, 20, 28], device=device)
    with torch.no_grad():
        parallel = model(tokens)
        final = model.final_logits(tokens, lengths)
        final_full = model.final_logits(tokens)
    expected = parallel[torch.arange(4, device=device), lengths - 1]
    torch.testing.assert_close(final, expected, rtol=1e-9, atol=1e-9)
    torch.testing.assert_close(final_full, parallel[:, -1], rtol=1e-9, atol=1e-9)


@pytest.mark.parametrize("model_id", MODEL_IDS)
def test_causal_prefix_outputs_do_not_depend_on_later_tokens(model_id: str) -> None:
    model = make(model_id)
    tokens = torch.randint(0, VOCAB, (2, 26))
    with torch.no_grad():
        full = model(tokens)
        prefix = model(tokens[:, :10])
    torch.testing.assert_close(full[:, :10], prefix, rtol=1e-9, atol=1e-9)


@pytest.mark.parametrize("model_id", MODEL_IDS)
def test_gradients_reach_every_parameter(model_id: str) -> None:
    model = make(model_id, dtype=torch.float32).train()
    tokens = torch.randint(0, VOCAB, (2, 17))
    model(tokens).square().mean().backward()
    missing = [name for name, p in model.named_parameters() if p.grad is None]
    assert not missing, f"parameters without a gradient: {missing}"


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("model_id", MODEL_IDS)
def test_bfloat16_runs_close_to_float32(model_id: str, device: str) -> None:
    model = make(model_id, dtype=torch.float32, device=device)
    tokens = torch.randint(0, VOCAB, (2, 19)).to(device)
    with torch.no_grad():
        reference = model(tokens)
        low = model.to(torch.bfloat16)(tokens)
    assert low.dtype == torch.bfloat16
    torch.testing.assert_close(low.float(), reference, rtol=0.1, atol=0.1)
