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
  keys and values and attends over them, O(T * J) memory, never a T x T tensor; J = min(chunk_size, (T - 1) //
  dilation + 1) are the slots any query can reach (the others are out of range for every position);
- ``dilated_attention_banded`` (:func:`attend_banded`): reorders the positions by residue mod the dilation, where
  each query's keys are C consecutive members of its class, and attends block by block, a block of P query rows
  against the J - 1 rows before it and its own, by dense matmuls with the band 0 <= j < C as a -inf bias:
  O(T * (J + P)) scores and no gathered copy of the keys (the fast path copies J keys per query: 64 for the
  text model's C = 64, 0.27 GB per block at 8k positions).

``dilated_attention(..., impl)`` picks one explicitly; "auto" is "reference" up to ``AUTO_REFERENCE_MAX_T``
positions, beyond it "banded" when the queries reach J >= ``BANDED_MIN_SLOTS`` keys and "fast" below. All are
exact. The crossovers, measured on this project's 2-core CPU with one thread (``python -m
benchmarks.bench_dilated_attention --crossover``: the op alone, H = 4, hd = 32, C = J at dilation 1, CPU ms, best
of five; docs/benchmarks.md, "RegularGPT decode and prefill"):

- up to 64 positions the reference's few large matmuls win for training (forward + backward, 4096 / T rows:
  10-18 ms against banded 18-43 and fast 20-830 at T = 16-64); for inference all are below 1.3 ms there.
  Known gap: at J = 64 the reference stays faster for training up to ~200 positions (26 against 40 ms at
  T = 128; banded wins from 256: 40 against 47), and "auto" does not look at J for that;
- beyond, banded beats fast from J = 4 on (inference at T = 1024: 0.97 against 2.3 ms at J = 4, 3.2 against 33
  at J = 64; training at T = 256: 18 against 32 ms at J = 4, 40 against 793 at J = 64). At J = 2 they are within
  25% either way (inference 0.27 against 0.23 ms at T = 128, 0.94 against 1.17 at 1024; training 17.1 against
  18.3 at 128) and "auto" keeps fast there, as before: the C = 2 task models do not change.

A cache's chunks attend through the same functions over the keys they read from the cache (model/regulargpt/decode.py):
one query per row through :func:`attend_slots`, a chunk through :func:`attend_gathered` or, once
:func:`cached_attention_impl` says so, :func:`attend_banded` over the ring's last keys and the chunk. That
crossover, measured the same way after a long context (J - 1 ring keys before the chunk at dilation 1): banded
from n = 128 at J = 4 (0.25 against 0.27 ms), 64 at J = 8 and 16, 16-32 at J = 64 (0.26 against 0.40 at 32);
with a long prefix, at dilation 64 and J = 64 (4032 ring keys before the chunk), from n ~ 100 (2.8 against 3.5
ms at n = 128, 2.6 against 1.5 at 64), at J = 16 (960 ring keys) between 128 and 512. The rule
n * J >= max(1024, 2 * (prefix + n)) follows them within a factor of two of n.
"""

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
    """q, k, v: (B, H, T, hd); relative_bias: (H, C); key_offset: (B,) int or None; null_key, null_value:
    (H, hd) or None -> (B, H, T, hd). See :func:`attend_banded`."""
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
    """Sliding-Dilated-Attention of the queries at the last n of Tk key positions, through dense blocks.

    Position m's keys m - j * dilation all lie in m's residue class mod dilation, C consecutive members of it. So
    the positions are reordered by residue (one copy), each class cut into blocks of P query rows
    (:func:`banded_block`), and a block's queries attend, by one matmul, to the W = J - 1 key rows before it and
    its own P rows; the band 0 <= j < C is an additive bias (-inf outside). O(T * (W + P)) scores, never a
    gathered copy of the keys.

    q: (B, H, n, hd); k, v: (B, H, Tk, hd) with Tk - n a multiple of ``dilation`` (query i is key Tk - n + i;
    the parallel op has Tk = n, cached chunks put the ring's keys first); relative_bias: (H, C); first_key: (B,)
    int or None: key indices below first_key[b] are out of range for row b, except a query's own; null_key,
    null_value: (H, hd) or None. Returns (B, H, n, hd).
    """
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
    q_blocks = q_rows.unflatten(3, (blocks, block))  # (B, H, δ, N, P, hd)
    k_windows = k_rows.unfold(3, window_rows + block, block)  # (B, H, δ, N, hd, W + P)
    v_windows = v_rows.unfold(3, window_rows + block, block).transpose(-1, -2)  # (B, H, δ, N, W + P, hd)
    scores = q_blocks @ k_windows  # (B, H, δ, N, P, W + P)
    band = _band_bias(relative_bias, block, window_rows)  # (H, 1, 1, P, W + P)
    # the key indices the windows hold: (δ, N, W + P), -dilation * W + before for the first row of the first window
    key_index = before - window_rows * dilation + torch.arange(dilation, device=q.device)[:, None, None] + dilation * (
        block * torch.arange(blocks, device=q.device)[:, None] + torch.arange(window_rows + block, device=q.device)
    )
    lowest = 0 if first_key is None else first_key.to(q.device).clamp(min=0).view(-1, 1, 1, 1, 1, 1)
    columns, query_rows = torch.arange(window_rows + block, device=q.device), torch.arange(block, device=q.device)
    own = columns == window_rows + query_rows[:, None]  # (P, W + P) the query's own key
    valid = (key_index[:, :, None, :] >= lowest) | own  # (B or 1, 1, δ, N, P, W + P)
    if null_key is None:
        probs = (scores.masked_fill(~valid, float("-inf")) + band).softmax(dim=-1)
        out = probs @ v_windows  # (B, H, δ, N, P, hd)
    else:
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
    """x: (B, H, R * dilation, hd) -> (B, H, dilation, R, hd): element [.., r, i, :] is position i * dilation + r."""
    return x.unflatten(2, (-1, dilation)).transpose(2, 3)


def _band_bias(relative_bias: torch.Tensor, block: int, window_rows: int) -> torch.Tensor:
    """The additive bias of a block's scores: query row u against window column c is slot j = W + u - c, r_j for
    0 <= j < C and -inf outside. relative_bias: (H, C) -> (H, 1, 1, P, W + P)."""
    chunk_size = relative_bias.shape[1]
    slot = window_rows + torch.arange(block, device=relative_bias.device)[:, None] - torch.arange(
        window_rows + block, device=relative_bias.device
    )  # (P, W + P)
    in_band = (slot >= 0) & (slot < chunk_size)
    bias = relative_bias[:, slot.clamp(0, chunk_size - 1)].masked_fill(~in_band, float("-inf"))
    return bias[:, None, None]


def _missing_null_bias(relative_bias: torch.Tensor, block: int, slots: int) -> torch.Tensor:
    """r_j for the slots j in [J, C) that lie before a query's window (j > W + u, all out of range, so null), -inf
    for those inside it. relative_bias: (H, C) -> (H, 1, 1, P, C - J)."""
    chunk_size = relative_bias.shape[1]
    slot = torch.arange(slots, chunk_size, device=relative_bias.device)  # (C - J,)
    inside = slot <= slots - 1 + torch.arange(block, device=relative_bias.device)[:, None]  # (P, C - J)
    return relative_bias[:, None, slots:].masked_fill(inside, float("-inf"))[:, None, None]


def reachable_slots(chunk_size: int, dilation: int, last_position: int) -> int:
    """J = min(C, last_position // dilation + 1): the slots j whose key m - j * dilation can lie at a position >= 0
    for some query m <= last_position. The slots j >= J are out of range for every such query."""
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
    """Softmax attention of each query over its own gathered keys (j = 0 is the query's own position).

    q: (B, H, T, hd); keys, values: (B, H, T, J, hd), finite, the first J <= C slots (the slots j >= J are out of
    range for every query, see :func:`reachable_slots`, and are not gathered); relative_bias: (H, C); valid: bool
    broadcastable to (B, H, T, J), True at least at j = 0, or None when every slot is in range; null_key,
    null_value: (H, hd) or None. The slots that
    are not ``valid`` are masked, or hold the null key and value. Returns (B, H, T, hd). Shared by the fast op
    and cached decoding.
    """
    batch, heads, length, head_dim = q.shape
    slots = keys.shape[3]
    rows = (batch * heads * length, slots, head_dim)  # one (1, hd) x (hd, J) product per query, batched
    scores = torch.bmm(q.reshape(rows[0], 1, head_dim), keys.reshape(rows).transpose(1, 2))  # (B H T, 1, J)
    scores = scores.view(batch, heads, length, slots)
    scores = torch.add(relative_bias[:, None, :slots], scores, alpha=1 / math.sqrt(head_dim))  # (B, H, T, J)
    null_scores = None if null_key is None else _null_scores(q / math.sqrt(head_dim), null_key, relative_bias)
    weights, null_weight = _slot_weights(scores, valid, null_scores)  # (B, H, T, J), (B, H, T, 1) or None
    out = torch.bmm(weights.reshape(rows[0], 1, slots), values.reshape(rows)).view(q.shape)  # (B, H, T, hd)
    return out if null_weight is None else out + null_weight * null_value[:, None, :]


def attend_slots(
    q: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    relative_bias: torch.Tensor,
    valid: torch.Tensor | None,
    null_key: torch.Tensor | None = None,
    null_value: torch.Tensor | None = None,
) -> torch.Tensor:
    """:func:`attend_gathered` for one query per row (a decode step), in the fewest ops: q (B, H, hd); keys,
    values: (B, H, J, hd) contiguous, as gathered from a cache; valid: (B, 1, 1, J) bool or None. Returns
    (B, H, hd)."""
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
    return out if null_weight is None else out + null_weight[:, :, 0] * null_value


def _slot_weights(
    scores: torch.Tensor, valid: torch.Tensor | None, null_scores: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Softmax weights of the J gathered slots, scores (..., J) with their r_j, and, with null slots, the weight of
    the null value: the slots not ``valid`` (broadcastable bool, or None for all) score null_scores (..., C)
    instead, as do the slots j >= J never gathered. Returns (..., J) and (..., 1) or None."""
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
    """Sliding-Dilated-Attention through the implementation ``impl``: "reference", "fast", "banded" or "auto"
    (module doc)."""
    length = q.shape[-2]
    name = resolve_impl(impl, length, reachable_slots(chunk_size, dilation, length - 1))
    return IMPLEMENTATIONS[name](q, k, v, relative_bias, chunk_size, dilation, key_offset, null_key, null_value)


def banded_block(slots: int, rows: int) -> int:
    """P, the query rows of one block of :func:`attend_banded` when its queries reach J = ``slots`` keys and a
    residue class holds ``rows`` query rows: each block attends to W + P = J - 1 + P keys per query."""
    return min(rows, max(BANDED_MIN_BLOCK_ROWS, slots // 2))


def cached_attention_impl(length: int, slots: int, prefix: int) -> str:
    """How a cached chunk of n = ``length`` new positions whose queries reach J = ``slots`` keys attends:
    "gathered" (the n * J keys copied, :func:`attend_gathered`) or "banded" (:func:`attend_banded` over the
    ``prefix`` keys before the chunk, read from the cache, and the chunk). Banded once J >= BANDED_MIN_SLOTS and
    n * J >= max(BANDED_MIN_GATHERED, 2 * (prefix + n)): it copies the prefix and the chunk a few times where
    gathering copies n * J keys (the measured crossovers in the module docstring)."""
    gathered = length * slots
    if slots >= BANDED_MIN_SLOTS and gathered >= max(BANDED_MIN_GATHERED, 2 * (prefix + length)):
        return "banded"
    return "gathered"


def resolve_impl(impl: str, length: int, slots: int) -> str:
    """The implementation ``impl`` ("reference", "fast", "banded" or "auto") runs at ``length`` positions whose
    queries reach J = ``slots`` keys (:func:`reachable_slots`)."""
    name = impl
    if impl == "auto":
        if length <= AUTO_REFERENCE_MAX_T:
            name = "reference"
        else:
            name = "banded" if slots >= BANDED_MIN_SLOTS else "fast"
    if name not in IMPLEMENTATIONS:
        raise ValueError(f"unknown dilated attention impl {impl!r}; choose from {['auto', *IMPLEMENTATIONS]}")
    return name
