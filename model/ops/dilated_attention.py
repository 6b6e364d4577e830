"""Sliding-Dilated-Attention (regulargpt.txt section 3.1, eq. 1).

Position m attends to the ``chunk_size`` keys m - j * dilation, j in [chunk_size]; the logit of the key j
steps back gets the head's learnable scalar ``relative_bias[h, j]``. A slot is out of range when its key lies
at a negative position or at an index below ``key_offset[b]`` (left padding); a position's own key (j = 0)
never is, which keeps padded queries finite (their outputs are meaningless and never read). Out-of-range
slots are masked, or, given ``null_key`` and ``null_value`` (H, hd), hold that key and value: slot j then
scores q . null_key / sqrt(hd) + relative_bias[h, j], as if the sequence were left-padded with a null token.

Implementations, one signature
``(q, k, v, relative_bias, chunk_size, dilation, key_offset=None, null_key=None, null_value=None) -> out``:

- ``dilated_attention_reference``: the T x T additive mask of eq. 1 (plus one null column per j) and plain
  softmax attention, O(T^2);
- ``dilated_attention_fast``: gathers the dilated keys of every position from shifted views of the left-padded
  keys and values and attends over them, O(T * J), never a T x T tensor; J = min(chunk_size, (T - 1) //
  dilation + 1) are the slots any query can reach (the others are out of range for every position).

``dilated_attention(..., impl)`` picks one explicitly; "auto" is "reference" up to ``AUTO_REFERENCE_MAX_T``
positions and "fast" beyond. Both are exact. Below ~64 positions the reference's few large matmuls beat the fast
path's gathers (measured on the CPU at T = 16, 40, 64 for training, forward + backward: 0.6-0.7x the fast path's
time at B = 128); from 128 on the fast path wins and its O(T * chunk_size) memory is what makes long inputs fit
(benchmarks/bench_dilated_attention.py).
"""

from __future__ import annotations

import math

import torch
from torch.nn import functional as F

AUTO_REFERENCE_MAX_T = 64  # "auto" attends through the reference up to this many positions


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
    """q, k, v: (B, H, T, hd); relative_bias: (H, C); key_offset: (B,) int or None; null_key, null_value:
    (H, hd) or None -> (B, H, T, hd)."""
    length = q.shape[2]
    q = q / math.sqrt(q.shape[-1])
    mask = q.new_full((relative_bias.shape[0], length, length), float("-inf"))  # (H, T, T) the M of eq. 1
    for j in range(chunk_size):  # r_j on the diagonal of keys j * dilation steps back (empty past T)
        mask.diagonal(-j * dilation, dim1=1, dim2=2).copy_(relative_bias[:, j, None])  # (H, T - j * dilation)
    scores = q @ k.transpose(-2, -1) + mask  # (B, H, T, T)
    if key_offset is not None:
        positions = torch.arange(length, device=q.device)  # (T,)
        scores = scores.masked_fill(~_unmasked(positions[:, None], positions, key_offset), float("-inf"))
    if null_key is None:
        return scores.softmax(dim=-1) @ v  # (B, H, T, hd)
    in_range = _slots_in_range(length, chunk_size, dilation, key_offset, q.device)  # (B or 1, 1, T, C)
    null_scores = _null_scores(q, null_key, relative_bias).masked_fill(in_range, float("-inf"))  # (B, H, T, C)
    probs = torch.cat([scores, null_scores], dim=-1).softmax(dim=-1)  # (B, H, T, T + C): one null column per j
    null_weight = probs[..., length:].sum(dim=-1, keepdim=True)  # (B, H, T, 1)
    return probs[..., :length] @ v + null_weight * null_value[:, None, :]  # (B, H, T, hd)


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
    """q, k, v: (B, H, T, hd); relative_bias: (H, C); key_offset: (B,) int or None; null_key, null_value:
    (H, hd) or None -> (B, H, T, hd)."""
    length = q.shape[2]
    slots = reachable_slots(chunk_size, dilation, length - 1)  # J: the keys j >= J back lie before position 0
    reach = (slots - 1) * dilation
    k_padded = F.pad(k, (0, 0, reach, 0))  # (B, H, reach + T, hd)
    v_padded = F.pad(v, (0, 0, reach, 0))  # (B, H, reach + T, hd)
    starts = [reach - j * dilation for j in range(slots)]
    keys = torch.stack([k_padded[:, :, s : s + length] for s in starts], dim=3)  # (B, H, T, J, hd)
    values = torch.stack([v_padded[:, :, s : s + length] for s in starts], dim=3)  # (B, H, T, J, hd)
    valid = _slots_in_range(length, slots, dilation, key_offset, q.device)  # (B or 1, 1, T, J)
    return attend_gathered(q, keys, values, relative_bias, valid, null_key, null_value)


def reachable_slots(chunk_size: int, dilation: int, last_position: int) -> int:
    """J = min(C, last_position // dilation + 1): the slots j whose key m - j * dilation can lie at a position >= 0
    for some query m <= last_position. The slots j >= J are out of range for every such query."""
    return min(chunk_size, last_position // dilation + 1)


def attend_gathered(
    q: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    relative_bias: torch.Tensor,
    valid: torch.Tensor,
    null_key: torch.Tensor | None = None,
    null_value: torch.Tensor | None = None,
) -> torch.Tensor:
    """Softmax attention of each query over its own gathered keys (j = 0 is the query's own position).

    q: (B, H, T, hd); keys, values: (B, H, T, J, hd), finite, the first J <= C slots (the slots j >= J are out of
    range for every query, see :func:`reachable_slots`, and are not gathered); relative_bias: (H, C); valid: bool
    broadcastable to (B, H, T, J), True at least at j = 0; null_key, null_value: (H, hd) or None. The slots that
    are not ``valid`` are masked, or hold the null key and value. Returns (B, H, T, hd). Shared by the fast op
    and cached decoding.
    """
    slots = keys.shape[3]
    q = q / math.sqrt(q.shape[-1])
    scores = torch.einsum("bhtd,bhtcd->bhtc", q, keys) + relative_bias[:, None, :slots]  # (B, H, T, J)
    if null_key is None:
        probs = scores.masked_fill(~valid, float("-inf")).softmax(dim=-1)  # (B, H, T, J)
        return torch.einsum("bhtc,bhtcd->bhtd", probs, values)  # (B, H, T, hd)
    null_scores = _null_scores(q, null_key, relative_bias)  # (B, H, T, C)
    scores = torch.where(valid, scores, null_scores[..., :slots])  # (B, H, T, J)
    probs = torch.cat([scores, null_scores[..., slots:]], dim=-1).softmax(dim=-1)  # (B, H, T, C)
    null_weight = probs[..., :slots].masked_fill(valid, 0.0).sum(dim=-1, keepdim=True)  # (B, H, T, 1)
    null_weight = null_weight + probs[..., slots:].sum(dim=-1, keepdim=True)  # the slots never gathered
    in_range = torch.einsum("bhtc,bhtcd->bhtd", probs[..., :slots].masked_fill(~valid, 0.0), values)  # (B, H, T, hd)
    return in_range + null_weight * null_value[:, None, :]  # (B, H, T, hd)


def _null_scores(q: torch.Tensor, null_key: torch.Tensor, relative_bias: torch.Tensor) -> torch.Tensor:
    """The logit of the null key in every slot: q (B, H, T, hd) already scaled by 1 / sqrt(hd), null_key
    (H, hd), relative_bias (H, C) -> (B, H, T, C)."""
    return torch.einsum("bhtd,hd->bht", q, null_key)[..., None] + relative_bias[:, None, :]


def _slots_in_range(
    length: int, chunk_size: int, dilation: int, key_offset: torch.Tensor | None, device: torch.device
) -> torch.Tensor:
    """Whether slot j of query t has a key: (B or 1, 1, T, C) bool, True at j = 0."""
    query = torch.arange(length, device=device).view(-1, 1)  # (T, 1)
    key = query - dilation * torch.arange(chunk_size, device=device)  # (T, C) key position, j steps back
    return _unmasked(query, key, key_offset)  # (B or 1, 1, T, C)


def _unmasked(query: torch.Tensor, key: torch.Tensor, key_offset: torch.Tensor | None) -> torch.Tensor:
    """Keys that exist: at index >= key_offset[b] (and >= 0), or the query's own key.

    query, key: broadcastable integer positions (Tq, Tk); key_offset: (B,) or None -> (B or 1, 1, Tq, Tk).
    """
    first = torch.zeros(1, dtype=torch.long, device=key.device) if key_offset is None else key_offset.to(key.device)
    return (key >= first.view(-1, 1, 1, 1)) | (key == query)  # (B or 1, 1, Tq, Tk)


IMPLEMENTATIONS = {"reference": dilated_attention_reference, "fast": dilated_attention_fast}


def dilated_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    relative_bias: torch.Tensor,
    chunk_size: int,
    dilation: int,
    key_offset: torch.Tensor | None = None,
    null_key: torch.Tensor | None = None,
    null_value: torch.Tensor | None = None,
    impl: str = "auto",
) -> torch.Tensor:
    """Sliding-Dilated-Attention through the implementation ``impl``: "reference", "fast" or "auto" (module doc)."""
    name = resolve_impl(impl, max(q.shape[-2], k.shape[-2]))
    return IMPLEMENTATIONS[name](q, k, v, relative_bias, chunk_size, dilation, key_offset, null_key, null_value)


def resolve_impl(impl: str, length: int) -> str:
    """The implementation ``impl`` ("reference", "fast" or "auto") runs at ``length`` positions."""
    name = impl
    if impl == "auto":
        name = "reference" if length <= AUTO_REFERENCE_MAX_T else "fast"
    if name not in IMPLEMENTATIONS:
        raise ValueError(f"unknown dilated attention impl {impl!r}; choose from {['auto', *IMPLEMENTATIONS]}")
    return name
