"""Weights kept a second time in oneDNN's blocked layout, for the CPU products of many rows that a server runs.

A product of 8 to a few thousand rows (a batched decode step, a prefill chunk, a transduce pass) with a weight of a
million entries runs through MKL's general matrix product (``F.linear``), which packs the weight into its blocked
layout on every call. oneDNN (bundled with torch's CPU builds) can pack it once: on this project's CPU, one thread,
its product with a packed weight was 1.3-2.4x faster than ``F.linear`` at 4-32 rows and 1.1-1.3x at 256-2,048 rows
for the size-L LRNN's weights (512 x 512 to 8192 x 512) and the 8192 x 128 head; for weights of under ~2^18
entries its ~10 us per call lost (docs/benchmarks.md, "Prepacked weights"). At 1-4 rows the streaming kernel of
model/ops/cpu_decode.py stays faster, so the weight is kept as stored as well: packing costs one more copy of each
packed weight (a model's ``for_serving`` says how many bytes).

:func:`prepack` registers a weight's packed copy; :func:`product` is that copy's product where it is still valid,
and None otherwise: when any tensor the copy was made from (its *owners*: the weight, or the parameters it is a
view of) has been changed in place since (its version counter moved: ``copy_``, ``add_``, ``load_state_dict``), has
moved to other memory (``.to()``, an assignment to ``.data``) or is gone. A change made in place through ``.data``
is not seen (it bypasses the version counter): change a served model's weights through the parameters, or reload it.
Results equal ``F.linear``'s up to float rounding (another order of the sums; tests/model/test_prepacked.py). Packs
are looked up by the weight's address, shape and strides; an owner's death drops its pack. Without oneDNN (a torch
build without it, or without the operators) nothing is packed and a warning says why once.
"""

from __future__ import annotations

import logging
import weakref
from collections.abc import Sequence
from dataclasses import dataclass

import torch

logger = logging.getLogger(__name__)

MIN_ELEMENTS = 2**18  # smaller weights lost to F.linear (oneDNN's ~10 us per call; docs/benchmarks.md)
PACKED_FOR_ROWS = 32  # the batch size oneDNN is told to pack for (its result does not depend on it)

Key = tuple[int, tuple[int, ...], tuple[int, ...]]  # a weight's data_ptr, shape, strides


@dataclass(frozen=True)
class Pack:
    blocked: torch.Tensor  # the weight in oneDNN's layout (layout torch._mkldnn)
    owners: tuple[tuple[weakref.ref, int, int], ...]  # per owner: a reference, its data_ptr and version at packing

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
    """Keep ``weight`` (out, in; float32, CPU, at least :data:`MIN_ELEMENTS` entries, any strides) packed for
    :func:`product`; ``owners``: the tensors its values live in, if it is a view made anew for each product
    (default: the weight itself). Returns the bytes the packed copy takes, made now or before (0 where the weight
    does not qualify or oneDNN is unavailable)."""
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
    """x: (..., in) -> ``F.linear(x, weight, bias)`` (..., out) through ``weight``'s valid pack, without gradients;
    None where there is none or x or bias is not float32 on the CPU (the caller then multiplies as it would)."""
    if not _packs or torch.is_grad_enabled() or x.dtype is not torch.float32 or not x.is_cpu or x.numel() == 0:
        return None
    if bias is not None and (bias.dtype is not torch.float32 or not bias.is_cpu):
        return None
    pack = _packs.get(_key(weight))
    if pack is None or not pack.valid():
        return None
    return torch.ops.mkldnn._linear_pointwise(x, pack.blocked, bias, "none", [], "")


def packed_bytes() -> int:
    """Bytes of every valid pack in this process."""
    return sum(pack.blocked.numel() * pack.blocked.element_size() for pack in _packs.values() if pack.valid())


def _key(weight: torch.Tensor) -> Key:
    return weight.data_ptr(), tuple(weight.shape), weight.stride()


def _drop(key: Key, pack_id: int) -> None:
    """An owner of the pack ``pack_id`` died: forget it unless the key has been packed anew since."""
    pack = _packs.get(key)
    if pack is not None and id(pack) == pack_id:
        del _packs[key]
