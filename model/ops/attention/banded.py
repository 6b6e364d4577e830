"""The banded fast path: positions grouped by residue mod dilation, blocks of P queries attending to their key window
by dense matmuls (``dilated_attention_banded``; ``attend_banded`` for queries after a prefix of keys)."""

from __future__ import annotations

import math

import torch
from torch.nn import functional as F

from model.ops.attention.slots import reachable_slots

BANDED_MIN_BLOCK_ROWS = 16  # attend_banded's query blocks: P = max(16, J // 2) rows (or fewer, all there are)


def dilated_attention_banded(
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
    return attend_banded(q, k, v, relative_bias, chunk_size, dilation, key_offset, null_key, null_value)


def attend_banded(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    relative_bias: torch.Tensor,
    chunk_size: int,
    dilation: int,
    first_key: torch.Tensor | None = None,
    null_key: torch.Tensor | None = None,
    null_value: torch.Tensor | None = None,
) -> torch.Tensor:
    """Sliding-Dilated-Attention of the last n of Tk positions through dense blocks: positions reordered by residue mod
    dilation, blocks of P queries attending by one matmul to the J - 1 key rows before them and their own, the band an
    additive bias. q (B, H, n, hd); k, v (B, H, Tk, hd), Tk - n a multiple of ``dilation``; keys below ``first_key[b]``
    out of range but a query's own. -> (B, H, n, hd)."""
    length, head_dim, keys_length = q.shape[2], q.shape[3], k.shape[2]
    before = keys_length - length  # key positions before the first query
    rows = -(-length // dilation)  # query rows per residue class
    slots = reachable_slots(chunk_size, dilation, keys_length - 1)  # J
    window_rows, block = slots - 1, banded_block(slots, rows)  # W, P
    blocks = -(-rows // block)
    kept = min(before, window_rows * dilation)  # key positions kept before the first query
    front, back = window_rows * dilation - kept, blocks * block * dilation - length  # zero padding
    k_rows = _residue_rows(F.pad(k[:, :, before - kept :], (0, 0, front, back)), dilation)  # (B, H, δ, W + N P, hd)
    v_rows = _residue_rows(F.pad(v[:, :, before - kept :], (0, 0, front, back)), dilation)
    q_rows = _residue_rows(F.pad(q / math.sqrt(head_dim), (0, 0, 0, back)), dilation)  # (B, H, δ, N P, hd)
    q_blocks: torch.Tensor = q_rows.unflatten(3, (blocks, block))  # (B, H, δ, N, P, hd)
    k_windows = k_rows.unfold(3, window_rows + block, block)  # (B, H, δ, N, hd, W + P)
    v_windows = v_rows.unfold(3, window_rows + block, block).transpose(-1, -2)  # (B, H, δ, N, W + P, hd)
    scores = q_blocks @ k_windows  # (B, H, δ, N, P, W + P)
    band = _band_bias(relative_bias, block, window_rows)  # (H, 1, 1, P, W + P)
    # the key indices the windows hold: (δ, N, W + P), -dilation * W + before for the first row of the first window
    key_index = (
        before
        - window_rows * dilation
        + torch.arange(dilation, device=q.device)[:, None, None]
        + dilation
        * (block * torch.arange(blocks, device=q.device)[:, None] + torch.arange(window_rows + block, device=q.device))
    )
    lowest = 0 if first_key is None else first_key.to(q.device).clamp(min=0).view(-1, 1, 1, 1, 1, 1)
    columns, query_rows = torch.arange(window_rows + block, device=q.device), torch.arange(block, device=q.device)
    own = columns == window_rows + query_rows[:, None]  # (P, W + P) the query's own key
    valid = (key_index[:, :, None, :] >= lowest) | own  # (B or 1, 1, δ, N, P, W + P)
    if null_key is None:
        probs = (scores.masked_fill(~valid, float("-inf")) + band).softmax(dim=-1)
        out = probs @ v_windows  # (B, H, δ, N, P, hd)
    else:
        assert null_value is not None, "null_key and null_value come together"
        null_scores = torch.einsum("bhrnpd,hd->bhrnp", q_blocks, null_key)[..., None]  # (B, H, δ, N, P, 1)
        scores = torch.where(valid, scores, null_scores) + band
        missing = _missing_null_bias(relative_bias, block, slots)  # (H, 1, 1, P, C - J): slots before every key
        probs = torch.cat([scores, null_scores + missing], dim=-1).softmax(dim=-1)
        in_range = probs[..., : scores.shape[-1]].masked_fill(~valid, 0.0)  # (B, H, δ, N, P, W + P)
        null_weight = 1.0 - in_range.sum(dim=-1, keepdim=True)  # (B, H, δ, N, P, 1)
        out = in_range @ v_windows + null_weight * null_value[:, None, None, None, :]
    out = out.flatten(3, 4).transpose(2, 3).flatten(2, 3)  # (B, H, N P δ, hd) back in position order
    return out[:, :, :length]


def _residue_rows(x: torch.Tensor, dilation: int) -> torch.Tensor:
    rows: torch.Tensor = x.unflatten(2, (-1, dilation)).transpose(2, 3)
    return rows


def _band_bias(relative_bias: torch.Tensor, block: int, window_rows: int) -> torch.Tensor:
    chunk_size = relative_bias.shape[1]
    slot = (
        window_rows
        + torch.arange(block, device=relative_bias.device)[:, None]
        - torch.arange(window_rows + block, device=relative_bias.device)
    )  # (P, W + P)
    in_band = (slot >= 0) & (slot < chunk_size)
    bias = relative_bias[:, slot.clamp(0, chunk_size - 1)].masked_fill(~in_band, float("-inf"))
    return bias[:, None, None]


def _missing_null_bias(relative_bias: torch.Tensor, block: int, slots: int) -> torch.Tensor:
    chunk_size = relative_bias.shape[1]
    slot = torch.arange(slots, chunk_size, device=relative_bias.device)  # (C - J,)
    inside = slot <= slots - 1 + torch.arange(block, device=relative_bias.device)[:, None]  # (P, C - J)
    return relative_bias[:, None, slots:].masked_fill(inside, float("-inf"))[:, None, None]


def banded_block(slots: int, rows: int) -> int:
    """P, the query rows of one :func:`attend_banded` block for J = ``slots`` and ``rows`` per class."""
    return min(rows, max(BANDED_MIN_BLOCK_ROWS, slots // 2))
