"""Sliding-Dilated-Attention (RegularGPT paper, eq. 1) as the T x T masked softmax every fast path equals: position m
attends to m - j dilation, j in [C], slot j's logit plus ``relative_bias[h, j]``; out-of-range slots masked or null."""

from __future__ import annotations

import math

import torch

from model.ops.attention.slots import null_key_scores, slots_in_range, unmasked


def dilated_attention_reference(
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
    q = q / math.sqrt(q.shape[-1])
    mask = q.new_full((relative_bias.shape[0], length, length), float("-inf"))  # (H, T, T) the M of eq. 1
    for j in range(chunk_size):  # r_j on the diagonal of keys j * dilation steps back (empty past T)
        mask.diagonal(-j * dilation, dim1=1, dim2=2).copy_(relative_bias[:, j, None])  # (H, T - j * dilation)
    scores = q @ k.transpose(-2, -1) + mask  # (B, H, T, T)
    if key_offset is not None:
        positions = torch.arange(length, device=q.device)  # (T,)
        scores = scores.masked_fill(~unmasked(positions[:, None], positions, key_offset), float("-inf"))
    if null_key is None:
        return scores.softmax(dim=-1) @ v  # (B, H, T, hd)
    in_range = slots_in_range(length, chunk_size, dilation, key_offset, q.device)  # (B or 1, 1, T, C)
    null_scores = null_key_scores(q, null_key, relative_bias).masked_fill(in_range, float("-inf"))  # (B, H, T, C)
    probs = torch.cat([scores, null_scores], dim=-1).softmax(dim=-1)  # (B, H, T, T + C): one null column per j
    null_weight = probs[..., length:].sum(dim=-1, keepdim=True)  # (B, H, T, 1)
    assert null_value is not None, "null_key and null_value come together"
    return probs[..., :length] @ v + null_weight * null_value[:, None, :]  # (B, H, T, hd)
