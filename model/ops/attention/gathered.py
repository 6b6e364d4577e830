"""The gathered fast paths: each query's J reachable keys stacked beside it and attended by one small product
(``dilated_attention_fast``; ``attend_gathered`` and ``attend_slots`` for a cached chunk and a decode step)."""

from __future__ import annotations

import math

import torch
from torch.nn import functional as F

from model.ops.attention.slots import null_key_scores, reachable_slots, slots_in_range


def dilated_attention_fast(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    relative_bias: torch.Tensor,
    chunk_size: int,
    dilation: int,
    key_offset: torch.Tensor | None = None,
    null_key: torch.Tensor | None = None,
    null_value: torch.Tensor | None = None,
) -> torch.Tensor:
    """q, k, v (B, H, T, hd); relative_bias (H, C); key_offset (B,) or None; null_key, null_value (H, hd) or None. ->
    (B, H, T, hd)."""
    length = q.shape[2]
    slots = reachable_slots(chunk_size, dilation, length - 1)  # J: the keys j >= J back lie before position 0
    reach = (slots - 1) * dilation
    k_padded = F.pad(k, (0, 0, reach, 0))  # (B, H, reach + T, hd)
    v_padded = F.pad(v, (0, 0, reach, 0))  # (B, H, reach + T, hd)
    starts = [reach - j * dilation for j in range(slots)]
    keys = torch.stack([k_padded[:, :, s : s + length] for s in starts], dim=3)  # (B, H, T, J, hd)
    values = torch.stack([v_padded[:, :, s : s + length] for s in starts], dim=3)  # (B, H, T, J, hd)
    valid = slots_in_range(length, slots, dilation, key_offset, q.device)  # (B or 1, 1, T, J)
    return attend_gathered(q, keys, values, relative_bias, valid, null_key, null_value)


def attend_gathered(
    q: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    relative_bias: torch.Tensor,
    valid: torch.Tensor | None,
    null_key: torch.Tensor | None = None,
    null_value: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention of q (B, H, T, hd) over its gathered keys, values (B, H, T, J, hd), j = 0 its own; slots not ``valid``
    are masked or null. -> (B, H, T, hd)."""
    batch, heads, length, head_dim = q.shape
    slots = keys.shape[3]
    rows = (batch * heads * length, slots, head_dim)  # one (1, hd) x (hd, J) product per query, batched
    scores = torch.bmm(q.reshape(rows[0], 1, head_dim), keys.reshape(rows).transpose(1, 2))  # (B H T, 1, J)
    scores = scores.view(batch, heads, length, slots)
    scores = torch.add(relative_bias[:, None, :slots], scores, alpha=1 / math.sqrt(head_dim))  # (B, H, T, J)
    null_scores = None if null_key is None else null_key_scores(q / math.sqrt(head_dim), null_key, relative_bias)
    weights, null_weight = _slot_weights(scores, valid, null_scores)  # (B, H, T, J), (B, H, T, 1) or None
    out = torch.bmm(weights.reshape(rows[0], 1, slots), values.reshape(rows)).view(q.shape)  # (B, H, T, hd)
    if null_weight is None:
        return out
    assert null_value is not None, "null_key and null_value come together"
    return out + null_weight * null_value[:, None, :]


def attend_slots(
    q: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    relative_bias: torch.Tensor,
    valid: torch.Tensor | None,
    null_key: torch.Tensor | None = None,
    null_value: torch.Tensor | None = None,
) -> torch.Tensor:
    """:func:`attend_gathered` for one query per row: q (B, H, hd), keys, values (B, H, J, hd) contiguous, valid (B, 1,
    1, J) or None -> (B, H, hd)."""
    batch, heads, head_dim = q.shape
    count = keys.shape[2]
    keys, values = keys.view(batch * heads, count, head_dim), values.view(batch * heads, count, head_dim)
    q, bias, scale = q.reshape(batch * heads, 1, head_dim), relative_bias[:, None, :count], 1 / math.sqrt(head_dim)
    if batch == 1:  # the bias (H, 1, J) is the batch's: one fused op
        scores = torch.baddbmm(bias, q, keys.transpose(1, 2), alpha=scale).view(1, heads, 1, count)
    else:
        scores = torch.add(bias, torch.bmm(q, keys.transpose(1, 2)).view(batch, heads, 1, count), alpha=scale)
    null_scores = None
    if null_key is not None:
        null_scores = null_key_scores(
            q.view(batch, heads, 1, head_dim) * scale, null_key, relative_bias
        )  # (B, H, 1, C)
    weights, null_weight = _slot_weights(scores, valid, null_scores)  # (B, H, 1, J), (B, H, 1, 1) or None
    out = torch.bmm(weights.view(batch * heads, 1, count), values).view(batch, heads, head_dim)  # (B, H, hd)
    if null_weight is None:
        return out
    assert null_value is not None, "null_key and null_value come together"
    return out + null_weight[:, :, 0] * null_value


def _slot_weights(
    scores: torch.Tensor, valid: torch.Tensor | None, null_scores: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor | None]:
    if null_scores is None:
        if valid is not None:
            scores = scores.masked_fill(~valid, float("-inf"))
        return scores.softmax(dim=-1), None
    slots = scores.shape[-1]
    if valid is not None:
        scores = torch.where(valid, scores, null_scores[..., :slots])
    probs = torch.cat([scores, null_scores[..., slots:]], dim=-1).softmax(dim=-1)  # (..., C)
    in_range = probs[..., :slots] if valid is None else probs[..., :slots].masked_fill(~valid, 0.0)  # (..., J)
    return in_range, 1.0 - in_range.sum(dim=-1, keepdim=True)  # the null slots' share
