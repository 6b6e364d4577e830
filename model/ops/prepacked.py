"""Weights kept a second time in oneDNN's blocked layout for CPU products of many rows. :func:`product` uses a pack
while its owners are alive, unmoved and unchanged in place (``.data`` writes are not seen); equal to ``F.linear`` up to
rounding."""

from __future__ import annotations

import logging
import weakref
from collections.abc import Sequence
from dataclasses import dataclass

import torch

logger = logging.getLogger(__name__)

MIN_ELEMENTS = 2**18  # below this oneDNN's per-call overhead outweighs the packing (docs/benchmarks.md)
PACKED_FOR_ROWS = 32  # the batch size oneDNN is told to pack for (its result does not depend on it)

Key = tuple[int, tuple[int, ...], tuple[int, ...]]  # a weight's data_ptr, shape, strides


@dataclass(frozen=True)
class Pack:
    blocked: torch.Tensor  # the weight in oneDNN's layout (layout torch._mkldnn)
    owners: tuple[
        tuple[weakref.ref[torch.Tensor], int, int], ...
    ]  # per owner: a reference, its data_ptr and version at packing

    def valid(self) -> bool:
        """Whether every owner is alive, at the same memory, and unchanged in place since packing."""
        for reference, pointer, version in self.owners:
            owner = reference()
            if owner is None or owner.data_ptr() != pointer or owner._version != version:
                return False
        return True


_packs: dict[Key, Pack] = {}
_unavailable: str | None = None  # why nothing can be packed here, once known


def prepack(weight: torch.Tensor, owners: Sequence[torch.Tensor] = ()) -> int:
    """Keep ``weight`` (out, in; float32, CPU, >= :data:`MIN_ELEMENTS`) packed, ``owners`` the tensors its values live
    in; returns the pack's bytes (0 if not packed)."""
    global _unavailable
    if (
        _unavailable is not None
        or weight.dim() != 2
        or weight.dtype is not torch.float32
        or not weight.is_cpu
        or weight.numel() < MIN_ELEMENTS
    ):
        return 0
    key = _key(weight)
    if key in _packs and _packs[key].valid():
        return weight.numel() * weight.element_size()
    try:
        blocked = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), PACKED_FOR_ROWS)
    except (AttributeError, RuntimeError) as error:  # a build without oneDNN or without these operators
        _unavailable = f"{type(error).__name__}: {error}"
        logger.warning("weights are not prepacked for many-row CPU products: %s", _unavailable)
        return 0
    owners = tuple(owners) or (weight,)
    pack = Pack(blocked, tuple((weakref.ref(owner), owner.data_ptr(), owner._version) for owner in owners))
    _packs[key] = pack
    for owner in owners:
        weakref.finalize(owner, _drop, key, id(pack))
    return weight.numel() * weight.element_size()


def product(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor | None:
    """``F.linear(x, weight, bias)`` through a valid pack without gradients; None where there is none or the inputs are
    not float32 on the CPU."""
    if not _packs or torch.is_grad_enabled() or x.dtype is not torch.float32 or not x.is_cpu or x.numel() == 0:
        return None
    if bias is not None and (bias.dtype is not torch.float32 or not bias.is_cpu):
        return None
    pack = _packs.get(_key(weight))
    if pack is None or not pack.valid():
        return None
    out: torch.Tensor = torch.ops.mkldnn._linear_pointwise(x, pack.blocked, bias, "none", [], "")
    return out


def packed_bytes() -> int:
    """Bytes of every valid pack in this process."""
    return sum(pack.blocked.numel() * pack.blocked.element_size() for pack in _packs.values() if pack.valid())


def _key(weight: torch.Tensor) -> Key:
    return weight.data_ptr(), tuple(weight.shape), weight.stride()


def _drop(key: Key, pack_id: int) -> None:
    pack = _packs.get(key)
    if pack is not None and id(pack) == pack_id:
        del _packs[key]
