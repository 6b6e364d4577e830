"""``dilated_attention`` through a named implementation ("reference", "fast", "banded") or the one ``resolve_impl``
picks ("auto"); ``cached_attention_impl`` picks a cached chunk's path."""

from __future__ import annotations

import torch

from model.ops.attention.banded import dilated_attention_banded
from model.ops.attention.gathered import dilated_attention_fast
from model.ops.attention.reference import dilated_attention_reference
from model.ops.attention.slots import reachable_slots

AUTO_REFERENCE_MAX_T = 64  # "auto" attends through the reference up to this many positions
BANDED_MIN_SLOTS = 4  # beyond AUTO_REFERENCE_MAX_T "auto" is banded from this many reachable keys J, fast below
BANDED_MIN_GATHERED = 1024  # a cached chunk attends banded from n * J gathered keys on (cached_attention_impl)


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
