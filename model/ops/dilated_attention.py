"""Sliding-Dilated-Attention (RegularGPT paper, eq. 1): position m attends to m - j dilation, j in [C], slot j's logit
plus ``relative_bias[h, j]``; slots before position 0 or ``key_offset[b]``, never a position's own, are masked or hold
``null_key``/``null_value``. Exact implementations "reference", "fast" and "banded"; "auto": :func:`resolve_impl`."""

from __future__ import annotations

import math

import torch
from torch.nn import functional as F

AUTO_REFERENCE_MAX_T = 64  # "auto" attends through the reference up to this many positions
BANDED_MIN_SLOTS = 4  # beyond AUTO_REFERENCE_MAX_T "auto" is banded from this many reachable keys J, fast below
BANDED_MIN_BLOCK_ROWS = 16  # attend_banded's query blocks: P = max(16, J // 2) rows (or fewer, all there are)
BANDED_MIN_GATHERED = 1024  # a cached chunk attends banded from n * J gathered keys on (cached_attention_impl)


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
        scores = scores.masked_fill(~_unmasked(positions[:, None], positions, key_offset), float("-inf"))
    if null_key is None:
        return scores.softmax(dim=-1) @ v  # (B, H, T, hd)
    in_range = _slots_in_range(length, chunk_size, dilation, key_offset, q.device)  # (B or 1, 1, T, C)
    null_scores = _null_scores(q, null_key, relative_bias).masked_fill(in_range, float("-inf"))  # (B, H, T, C)
    probs = torch.cat([scores, null_scores], dim=-1).softmax(dim=-1)  # (B, H, T, T + C): one null column per j
    null_weight = probs[..., length:].sum(dim=-1, keepdim=True)  # (B, H, T, 1)
    assert null_value is not None, "null_key and null_value come together"
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
    valid = _slots_in_range(length, slots, dilation, key_offset, q.device)  # (B or 1, 1, T, J)
    return attend_gathered(q, keys, values, relative_bias, valid, null_key, null_value)


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


def reachable_slots(chunk_size: int, dilation: int, last_position: int) -> int:
    """J = min(C, last_position // dilation + 1): slots j >= J are out of range for every query up to last_position."""
    return min(chunk_size, last_position // dilation + 1)


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
    null_scores = None if null_key is None else _null_scores(q / math.sqrt(head_dim), null_key, relative_bias)
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
        null_scores = _null_scores(q.view(batch, heads, 1, head_dim) * scale, null_key, relative_bias)  # (B, H, 1, C)
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


def _null_scores(q: torch.Tensor, null_key: torch.Tensor, relative_bias: torch.Tensor) -> torch.Tensor:
    return torch.einsum("bhtd,hd->bht", q, null_key)[..., None] + relative_bias[:, None, :]


def _slots_in_range(
    length: int, chunk_size: int, dilation: int, key_offset: torch.Tensor | None, device: torch.device
) -> torch.Tensor:
    """Whether slot j of query t has a key: (B or 1, 1, T, C) bool, True at j = 0."""
    query = torch.arange(length, device=device).view(-1, 1)  # (T, 1)
    key = query - dilation * torch.arange(chunk_size, device=device)  # (T, C) key position, j steps back
    return _unmasked(query, key, key_offset)  # (B or 1, 1, T, C)


def _unmasked(query: torch.Tensor, key: torch.Tensor, key_offset: torch.Tensor | None) -> torch.Tensor:
    first = torch.zeros(1, dtype=torch.long, device=key.device) if key_offset is None else key_offset.to(key.device)
    return (key >= first.view(-1, 1, 1, 1)) | (key == query)  # (B or 1, 1, Tq, Tk)


IMPLEMENTATIONS = {
    "reference": dilated_attention_reference,
    "fast": dilated_attention_fast,
    "banded": dilated_attention_banded,
}


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
    """Sliding-Dilated-Attention through ``impl`` ("reference", "fast", "banded" or "auto")."""
    length = q.shape[-2]
    name = resolve_impl(impl, length, reachable_slots(chunk_size, dilation, length - 1))
    return IMPLEMENTATIONS[name](q, k, v, relative_bias, chunk_size, dilation, key_offset, null_key, null_value)


def banded_block(slots: int, rows: int) -> int:
    """P, the query rows of one :func:`attend_banded` block for J = ``slots`` and ``rows`` per class."""
    return min(rows, max(BANDED_MIN_BLOCK_ROWS, slots // 2))


def cached_attention_impl(length: int, slots: int, prefix: int) -> str:
    """ "banded" for a cached chunk of n = ``length`` positions reaching J = ``slots`` keys once J >= BANDED_MIN_SLOTS
    and n J >= max(BANDED_MIN_GATHERED, 2 (prefix + n)), else "gathered"."""
    gathered = length * slots
    if slots >= BANDED_MIN_SLOTS and gathered >= max(BANDED_MIN_GATHERED, 2 * (prefix + length)):
        return "banded"
    return "gathered"


def resolve_impl(impl: str, length: int, slots: int) -> str:
    """The implementation ``impl`` resolves to: "auto" is "reference" up to ``AUTO_REFERENCE_MAX_T`` positions, then
    "banded" from J >= ``BANDED_MIN_SLOTS``, else "fast". ValueError for an unknown name."""
    name = impl
    if impl == "auto":
        if length <= AUTO_REFERENCE_MAX_T:
            name = "reference"
        else:
            name = "banded" if slots >= BANDED_MIN_SLOTS else "fast"
    if name not in IMPLEMENTATIONS:
        raise ValueError(f"unknown dilated attention impl {impl!r}; choose from {['auto', *IMPLEMENTATIONS]}")
    return name
