"""A query's C slots, key j * dilation back for j in [C]: how many can reach a key (``reachable_slots``), which
hold one (``slots_in_range``) and the null key's logit in each (``null_scores``), for every implementation."""

from __future__ import annotations

import torch


def reachable_slots(chunk_size: int, dilation: int, last_position: int) -> int:
    """J = min(C, last_position // dilation + 1): slots j >= J are out of range for every query up to last_position."""
    return min(chunk_size, last_position // dilation + 1)


def null_key_scores(q: torch.Tensor, null_key: torch.Tensor, relative_bias: torch.Tensor) -> torch.Tensor:
    return torch.einsum("bhtd,hd->bht", q, null_key)[..., None] + relative_bias[:, None, :]


def slots_in_range(
    length: int, chunk_size: int, dilation: int, key_offset: torch.Tensor | None, device: torch.device
) -> torch.Tensor:
    """Whether slot j of query t has a key: (B or 1, 1, T, C) bool, True at j = 0."""
    query = torch.arange(length, device=device).view(-1, 1)  # (T, 1)
    key = query - dilation * torch.arange(chunk_size, device=device)  # (T, C) key position, j steps back
    return unmasked(query, key, key_offset)  # (B or 1, 1, T, C)


def unmasked(query: torch.Tensor, key: torch.Tensor, key_offset: torch.Tensor | None) -> torch.Tensor:
    first = torch.zeros(1, dtype=torch.long, device=key.device) if key_offset is None else key_offset.to(key.device)
    return (key >= first.view(-1, 1, 1, 1)) | (key == query)  # (B or 1, 1, Tq, Tk)
