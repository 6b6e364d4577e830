"""The fast and banded Sliding-Dilated-Attention agree with the T x T reference in values and gradients, with
out-of-range slots masked and with them holding a null key and value; the banded op also for queries that follow
a prefix of keys (cached chunks)."""

from __future__ import annotations

import pytest
import torch

from model.ops.attention.banded import attend_banded, dilated_attention_banded
from model.ops.attention.dispatch import AUTO_REFERENCE_MAX_T, BANDED_MIN_SLOTS, dilated_attention
from model.ops.attention.gathered import dilated_attention_fast
from model.ops.attention.reference import dilated_attention_reference
from tests.model.helpers import FAST_OPS, assert_agree, assert_close, attend, dilations, make_inputs, values_and_grads

OUT_OF_RANGE = pytest.mark.parametrize("null", [False, True], ids=["mask", "null"])


@FAST_OPS
@OUT_OF_RANGE
@pytest.mark.parametrize("chunk_size", [2, 3, 4, 9, 64])
@pytest.mark.parametrize("length", [1, 2, 3, 7, 41, 500])
def test_fast_equals_reference_float64(op, chunk_size: int, length: int, null: bool) -> None:
    inputs = make_inputs(1, 2, length, chunk_size, torch.float64, null)
    for dilation in dilations(length, chunk_size):
        assert_agree(op, inputs, chunk_size, dilation, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize(("chunk_size", "null"), [(2, False), (3, False), (4, False), (3, True)])
def test_fast_equals_reference_long_float32(chunk_size: int, null: bool) -> None:
    inputs = make_inputs(1, 1, 4097, chunk_size, torch.float32, null)
    for dilation in dilations(4097, chunk_size)[:-1]:
        reference = values_and_grads(dilated_attention_reference, inputs, chunk_size, dilation)
        for op in (dilated_attention_fast, dilated_attention_banded):
            assert_close(values_and_grads(op, inputs, chunk_size, dilation), reference, rtol=1e-4, atol=1e-5)


@FAST_OPS
@OUT_OF_RANGE
@pytest.mark.parametrize("chunk_size", [2, 3, 9])
def test_key_offset_is_left_padding(op, chunk_size: int, null: bool) -> None:
    """Row b with key_offset o gives, at positions >= o, the output of its unpadded suffix."""
    length, offsets = 37, [0, 5, 36]
    inputs = make_inputs(3, 2, length, chunk_size, torch.float64, null)
    key_offset = torch.tensor(offsets)
    for dilation in dilations(length, chunk_size):
        assert_agree(op, inputs, chunk_size, dilation, key_offset, rtol=1e-10, atol=1e-10)
        padded = attend(op, inputs, chunk_size, dilation, key_offset)  # (B, H, T, hd)
        assert torch.isfinite(padded).all()
        for row, offset in enumerate(offsets):
            suffix = tuple(t[row : row + 1, :, offset:] for t in inputs[:3]) + inputs[3:]
            alone = attend(op, suffix, chunk_size, dilation)
            torch.testing.assert_close(padded[row : row + 1, :, offset:], alone, rtol=1e-12, atol=1e-12)


@FAST_OPS
@pytest.mark.parametrize("chunk_size", [2, 3, 9])
def test_null_slots_are_a_left_padding_null_token(op, chunk_size: int) -> None:
    """With null slots, the output equals masked attention over the sequence left-padded with (C-1) * dilation
    null tokens (keys and values = the null ones), at the real positions."""
    length = 23
    q, k, v, relative_bias, null_key, null_value = make_inputs(2, 2, length, chunk_size, torch.float64, null=True)
    for dilation in dilations(length, chunk_size):
        reach = (chunk_size - 1) * dilation
        pad = [tensor[None, :, None, :].expand(2, -1, reach, -1) for tensor in (null_key, null_value)]
        padded_q = torch.cat([torch.zeros_like(pad[0]), q], dim=2)  # those queries' outputs are dropped
        padded_k, padded_v = torch.cat([pad[0], k], dim=2), torch.cat([pad[1], v], dim=2)
        masked = op(padded_q, padded_k, padded_v, relative_bias, chunk_size, dilation)
        nulled = op(q, k, v, relative_bias, chunk_size, dilation, None, null_key, null_value)
        torch.testing.assert_close(nulled, masked[:, :, reach:], rtol=1e-12, atol=1e-12)


@OUT_OF_RANGE
@pytest.mark.parametrize("chunk_size", [2, 3, 9])
@pytest.mark.parametrize(("before", "length"), [(0, 5), (1, 1), (2, 3), (9, 1), (18, 7), (27, 40), (81, 100)])
def test_banded_queries_after_a_prefix_of_keys(chunk_size: int, before: int, length: int, null: bool) -> None:
    """Queries at the last n of n + p key positions (p a multiple of the dilation; the keys before first_key[b]
    out of range) give the reference's outputs at those positions over the whole sequence, whose first
    first_key[b] positions are masked as left padding: a cached chunk after the ring's last keys."""
    total = before + length
    inputs = make_inputs(3, 2, total, chunk_size, torch.float64, null)
    q, k, v, relative_bias, *null_pair = inputs
    first_key = torch.tensor([0, min(before, 4), before])
    for dilation in [d for d in dilations(total, chunk_size) if before % d == 0]:
        expected = dilated_attention_reference(q, k, v, relative_bias, chunk_size, dilation, first_key, *null_pair)
        got = attend_banded(q[:, :, before:], k, v, relative_bias, chunk_size, dilation, first_key, *null_pair)
        torch.testing.assert_close(got, expected[:, :, before:], rtol=1e-10, atol=1e-10)


def test_dispatch_is_explicit() -> None:
    """ "auto" is exactly the reference up to AUTO_REFERENCE_MAX_T positions; beyond, exactly the fast path when the
    queries reach fewer than BANDED_MIN_SLOTS keys and exactly the banded one from there on."""
    short = make_inputs(1, 2, AUTO_REFERENCE_MAX_T, 3, torch.float64)
    auto = dilated_attention(*short, 3, 3, impl="auto")
    torch.testing.assert_close(auto, dilated_attention_reference(*short, 3, 3), rtol=0, atol=0)
    torch.testing.assert_close(dilated_attention(*short, 3, 3, impl="fast"), auto, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(dilated_attention(*short, 3, 3, impl="banded"), auto, rtol=1e-12, atol=1e-12)
    long = make_inputs(1, 2, AUTO_REFERENCE_MAX_T + 1, 3, torch.float64)
    torch.testing.assert_close(
        dilated_attention(*long, 3, 3, impl="auto"), dilated_attention_fast(*long, 3, 3), rtol=0, atol=0
    )
    chunk_size = BANDED_MIN_SLOTS  # J = C keys at dilation 1
    wide = make_inputs(1, 2, AUTO_REFERENCE_MAX_T + 1, chunk_size, torch.float64)
    banded = dilated_attention_banded(*wide, chunk_size, 1)
    torch.testing.assert_close(dilated_attention(*wide, chunk_size, 1, impl="auto"), banded, rtol=0, atol=0)
    with pytest.raises(ValueError, match="unknown dilated attention impl"):
        dilated_attention(*short, 3, 3, impl="flash")
