"""The fast Sliding-Dilated-Attention agrees with the T x T reference in values and gradients."""

from __future__ import annotations

import pytest
import torch

from model.ops.dilated_attention import (
    dilated_attention,
    dilated_attention_fast,
    dilated_attention_reference,
)
from model.regulargpt import adaptive_depth


def make_inputs(batch: int, heads: int, length: int, chunk_size: int, dtype: torch.dtype):
    q, k, v = (torch.randn(batch, heads, length, 4, dtype=dtype, requires_grad=True) for _ in range(3))
    relative_bias = torch.randn(heads, chunk_size, dtype=dtype, requires_grad=True)
    return q, k, v, relative_bias


def values_and_grads(op, inputs, chunk_size: int, dilation: int, key_offset=None):
    out = op(*inputs, chunk_size, dilation, key_offset)  # (B, H, T, hd)
    weights = torch.randn(out.shape, generator=torch.Generator().manual_seed(1), dtype=out.dtype)
    grads = torch.autograd.grad((out * weights).sum(), inputs)
    return out, grads


def assert_agree(inputs, chunk_size: int, dilation: int, key_offset=None, **tolerance) -> None:
    fast = values_and_grads(dilated_attention_fast, inputs, chunk_size, dilation, key_offset)
    reference = values_and_grads(dilated_attention_reference, inputs, chunk_size, dilation, key_offset)
    torch.testing.assert_close(fast[0], reference[0], **tolerance)
    for name, fast_grad, reference_grad in zip(("q", "k", "v", "relative_bias"), fast[1], reference[1]):
        torch.testing.assert_close(fast_grad, reference_grad, **tolerance, msg=lambda m: f"grad {name}: {m}")


def dilations(length: int, chunk_size: int) -> list[int]:
    """Every dilation the model uses at this length, and the first at which a position sees only itself."""
    return [chunk_size**layer for layer in range(adaptive_depth(length - 1, chunk_size) + 1)]


@pytest.mark.parametrize("chunk_size", [2, 3, 4])
@pytest.mark.parametrize("length", [1, 2, 3, 7, 41, 500])
def test_fast_equals_reference_float64(chunk_size: int, length: int) -> None:
    inputs = make_inputs(1, 2, length, chunk_size, torch.float64)
    for dilation in dilations(length, chunk_size):
        assert_agree(inputs, chunk_size, dilation, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("chunk_size", [2, 3, 4])
def test_fast_equals_reference_long_float32(chunk_size: int) -> None:
    inputs = make_inputs(1, 1, 4097, chunk_size, torch.float32)
    for dilation in dilations(4097, chunk_size)[:-1]:
        assert_agree(inputs, chunk_size, dilation, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("chunk_size", [2, 3])
def test_key_offset_is_left_padding(chunk_size: int) -> None:
    """Row b with key_offset o gives, at positions >= o, the output of its unpadded suffix."""
    length, offsets = 37, [0, 5, 36]
    inputs = make_inputs(3, 2, length, chunk_size, torch.float64)
    key_offset = torch.tensor(offsets)
    for dilation in dilations(length, chunk_size):
        assert_agree(inputs, chunk_size, dilation, key_offset, rtol=1e-10, atol=1e-10)
        padded = dilated_attention_fast(*inputs, chunk_size, dilation, key_offset)  # (B, H, T, hd)
        assert torch.isfinite(padded).all()
        for row, offset in enumerate(offsets):
            q, k, v = (t[row : row + 1, :, offset:] for t in inputs[:3])
            alone = dilated_attention_fast(q, k, v, inputs[3], chunk_size, dilation)
            torch.testing.assert_close(padded[row : row + 1, :, offset:], alone, rtol=1e-12, atol=1e-12)


def test_dispatch_is_explicit() -> None:
    inputs = make_inputs(1, 2, 9, 3, torch.float64)
    auto = dilated_attention(*inputs, 3, 3, impl="auto")
    torch.testing.assert_close(auto, dilated_attention_fast(*inputs, 3, 3), rtol=0, atol=0)
    torch.testing.assert_close(dilated_attention(*inputs, 3, 3, impl="reference"), auto, rtol=1e-12, atol=1e-12)
    with pytest.raises(ValueError, match="unknown dilated attention impl"):
        dilated_attention(*inputs, 3, 3, impl="flash")
