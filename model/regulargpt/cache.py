"""RegularGPT's decoding state (:class:`RegularGPTCache`: a ring window of keys and values per block and thick layer)
and the plans saying where a chunk's dilated keys come from (:func:`plan_chunk`)."""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from model.cache import InferenceCache
from model.ops.attention.dispatch import cached_attention_impl
from model.ops.attention.slots import reachable_slots


def adaptive_depth(position: int, chunk_size: int) -> int:
    """D(m) = max(1, ceil(log_C(m + 1))): the fewest thick layers for position m to see position 0."""
    depth, reach = 1, chunk_size
    while reach < position + 1:
        depth, reach = depth + 1, reach * chunk_size
    return depth


def adaptive_depths(positions: torch.Tensor, chunk_size: int) -> torch.Tensor:
    """The :func:`adaptive_depth` of every element of an integer tensor of positions >= 0."""
    depths = torch.ones_like(positions)
    reach, last = chunk_size, int(positions.max()) if positions.numel() else 0
    while reach <= last:
        depths += positions >= reach
        reach *= chunk_size
    return depths


def row_depths(lengths: torch.Tensor, chunk_size: int) -> torch.Tensor:
    """The thick layers a cache row holding ``lengths`` tokens has computed: D(length - 1), 0 when empty."""
    return torch.where(lengths > 0, adaptive_depths((lengths - 1).clamp(min=0), chunk_size), 0)


def capacity(length: int) -> int:
    """Room for the longest row's ``length`` tokens: the next power of two (0 for 0)."""
    return 0 if length == 0 else 1 << (length - 1).bit_length()


def ring_slot(
    position: torch.Tensor, dilation: int | torch.Tensor, columns: int | torch.Tensor, chunk_size: int
) -> torch.Tensor:
    """Slot of position p >= 0 in a ring at dilation D with K = ``columns`` <= C - 1 columns: (p mod D) K + (p div D)
    mod (C - 1). A position's keys share its residue, so lie in one run; any (C - 1) D consecutive positions take
    distinct slots."""
    return position % dilation * columns + position // dilation % (chunk_size - 1)


def ring_columns(ring: int, dilation: int, room: int) -> int:
    """K of :func:`ring_slot` with room for positions < room: min(C - 1, ceil(room / D))."""
    return min(ring // dilation, -(-room // dilation))


def resized(tensor: torch.Tensor, dim: int, size: int) -> torch.Tensor:
    """``tensor`` cut or zero-padded to ``size`` along ``dim`` (itself if already that size)."""
    have = tensor.shape[dim]
    if have == size:
        return tensor
    if have > size:
        return tensor.narrow(dim, 0, size)
    room = list(tensor.shape)
    room[dim] = size - have
    return torch.cat([tensor, tensor.new_zeros(room)], dim=dim)


@dataclass
class StepPlan:
    """A decode step's keys at one layer: slot j from the ring, but slot 0, which the new key replaces."""

    ring_index: torch.Tensor  # (2 * B * H * J,) entries of the flat window, keys then values, slot 0 the new one's
    write_index: torch.Tensor  # (B * 2 H,) the new position's entries, row by row
    valid: torch.Tensor | None  # (B, 1, 1, J) bool: the key lies at a position >= 0; None when all do


@dataclass
class ChunkPlan:
    """A chunk's gathered keys at one layer: from the chunk itself, else from the ring, else out of range."""

    chunk_index: torch.Tensor  # (n * J,) index into the chunk, clamped at 0
    valid: torch.Tensor | None  # (B, 1, n, J) bool: the key lies at a position >= 0; None when all do
    window_source: torch.Tensor | None  # (B * 2 H * m,) entries of the flat window: the m keys before each chunk
    window_target: torch.Tensor | None  # (m,) their entries in the flat (n * J) slots of a row
    write_index: torch.Tensor  # (B * 2 H * w,) entries of the flat window for the chunk's last w = min(n, ring)


@dataclass
class BandedPlan:
    """A long chunk's keys for :func:`attend_banded`: the chunk after ``prefix`` ring positions (``first_key`` masks
    those before position 0)."""

    prefix_index: torch.Tensor | None  # (B * 2 H * prefix,) entries of the flat window, None when prefix = 0
    first_key: torch.Tensor | None  # (B,) prefix - start[b] where positive: the keys before position 0
    write_index: torch.Tensor  # (B * 2 H * w,) as in ChunkPlan


Plan = StepPlan | ChunkPlan | BandedPlan


def plan_chunk(
    start: torch.Tensor,
    length: int,
    chunk_size: int,
    heads: int,
    allocated: list[int],
    device: torch.device,
    rows: torch.Tensor | None = None,
    first_layer: int = 0,
) -> list[Plan]:
    """Per thick layer from ``first_layer``: a :class:`StepPlan` for n = 1, else a gathered or banded plan. start (B,)
    int64 on the CPU: each row's first new position; rows: the cache rows, or None for all."""
    last, latest, batch = int(start.max()) + length - 1, int(start.max()), start.shape[0]
    if length == 1 and rows is None:
        return _plan_step(start, chunk_size, heads, allocated, device, int(start.min()), latest)
    has_context = latest > 0
    start_host, start = start, start.to(device)
    rows = torch.arange(batch, device=device) if rows is None else rows.to(device)
    own = start[:, None] + torch.arange(length, device=device)  # (B, n) the chunk's positions
    plans: list[Plan] = []
    for layer, slots_per_row in enumerate(allocated, start=first_layer):
        dilation = chunk_size**layer
        ring, slots = (chunk_size - 1) * dilation, reachable_slots(chunk_size, dilation, last)
        first = _first_entries(rows, 2 * heads, slots_per_row)  # (B, 2 H, 1)
        entries = functools.partial(_entries, first, dilation, slots_per_row // dilation, chunk_size)
        write_index = entries(own[:, length - min(length, ring) :])  # the last w positions
        prefix = min(slots - 1, -(-latest // dilation)) * dilation  # the keys before the chunk, for banded
        if cached_attention_impl(length, slots, prefix) == "banded":
            prefix_index = first_key = None
            if prefix:  # every key < start + n has its slot among those allocated
                key = (start[:, None] - prefix + torch.arange(prefix, device=device)).clamp(min=0)  # (B, prefix)
                prefix_index = entries(key)
            if int(start_host.min()) < prefix:
                first_key = (prefix - start_host).clamp(min=0).to(device)
            plans.append(BandedPlan(prefix_index=prefix_index, first_key=first_key, write_index=write_index))
            continue
        relative, chunk_index, before, before_offset = _relative_keys(length, dilation, slots, device)
        window_source = window_target = None
        if has_context and before.numel():  # every key < start + n has its slot among those allocated
            key = (start[:, None] + before_offset).clamp(min=0)  # (B, m) the position, 0 when out of range
            window_source, window_target = entries(key), before
        all_valid = int(start_host.min()) >= (slots - 1) * dilation  # every slot's key at a position >= 0
        plans.append(
            ChunkPlan(
                chunk_index=chunk_index,
                valid=None if all_valid else (start[:, None, None] + relative >= 0)[:, None],
                window_source=window_source,
                window_target=window_target,
                write_index=write_index,
            )
        )
    return plans


def _entries(
    first: torch.Tensor, dilation: int, columns: int, chunk_size: int, positions: torch.Tensor
) -> torch.Tensor:
    return (first + ring_slot(positions, dilation, columns, chunk_size)[:, None]).flatten()


def _first_entries(rows: torch.Tensor, channels: int, slots_per_row: int) -> torch.Tensor:
    channel = torch.arange(channels, device=rows.device)
    return ((rows[:, None] * channels + channel) * slots_per_row)[:, :, None]


def _plan_step(
    start: torch.Tensor,
    chunk_size: int,
    heads: int,
    allocated: list[int],
    device: torch.device,
    earliest: int,
    latest: int,
) -> list[Plan]:
    slots = [reachable_slots(chunk_size, chunk_size**layer, latest) for layer in range(len(allocated))]
    offsets, dilations, columns, firsts = _step_tables(
        chunk_size, heads, tuple(slots), tuple(allocated), start.shape[0], device
    )
    key = start.to(device)[None, :, None] - offsets  # (L, B, J_max) each slot's key position
    slot = ring_slot(key.clamp(min=0), dilations, columns, chunk_size)  # (L, B, J_max) its slot in the ring
    index = firsts + slot[:, None, :, None, :]  # (L, 2, B, H, J_max) its entry in the flat window
    all_valid = [earliest >= (count - 1) * chunk_size**layer for layer, count in enumerate(slots)]
    valid = None if all(all_valid) else key >= 0  # (L, B, J_max)
    return [
        StepPlan(
            ring_index=index[layer, ..., :count].reshape(-1),
            write_index=index[layer, ..., 0].transpose(0, 1).reshape(-1),  # (B, 2, H): the new key's layout
            valid=None if all_valid[layer] or valid is None else valid[layer, :, None, None, :count],
        )
        for layer, count in enumerate(slots)
    ]


@functools.lru_cache(maxsize=64)
def _step_tables(
    chunk_size: int, heads: int, slots: tuple[int, ...], allocated: tuple[int, ...], batch: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    with torch.inference_mode(False):  # plain tensors, usable in and out of inference mode
        dilations = torch.tensor([chunk_size**layer for layer in range(len(slots))], device=device)[:, None, None]
        j = torch.arange(max(slots), device=device)
        offsets = torch.where(j < torch.tensor(slots, device=device)[:, None, None], j * dilations, 0)
        rows = torch.arange(batch, device=device)
        firsts = torch.stack(
            [_first_entries(rows, 2 * heads, count).view(batch, 2, heads).transpose(0, 1) for count in allocated]
        )  # (L, 2, B, H)
        columns = torch.tensor(allocated, device=device)[:, None, None] // dilations
        return offsets, dilations, columns, firsts[..., None]


@functools.lru_cache(maxsize=64)
def _relative_keys(length: int, dilation: int, slots: int, device: torch.device) -> tuple[torch.Tensor, ...]:
    """Cached chunk-relative key indices i - j dilation, clamped and flat, and those before the chunk."""
    with torch.inference_mode(False):  # plain tensors, usable in and out of inference mode
        relative = torch.arange(length, device=device)[:, None] - dilation * torch.arange(slots, device=device)
        before = (relative.flatten() < 0).nonzero().flatten()  # (m,)
        return relative, relative.clamp(min=0).flatten(), before, relative.flatten()[before]


@dataclass
class KVWindow:
    """One block's keys and values at thick layer l: per row 2 H channels, each a ring of (C - 1) C**l positions at
    :func:`ring_slot`."""

    ring: int
    dilation: int
    kv: torch.Tensor  # (B, 2 H, D K, hd) contiguous; never reassigned (a resized window is a new one)

    @functools.cached_property
    def entries(self) -> np.ndarray:
        return self.kv.view(-1, self.kv.shape[-1]).numpy()

    def gather(self, plan: ChunkPlan, kv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The chunk's dilated keys and values: kv (B, n, 2 d) -> (B, H, n, J, hd) each."""
        (batch, length, _), (_, channels, _, head_dim) = kv.shape, self.kv.shape
        chunk = kv.view(batch, length, channels, head_dim).transpose(1, 2)  # (B, 2 H, n, hd)
        gathered = chunk.index_select(2, plan.chunk_index)  # (B, 2 H, n * J, hd) in the chunk
        if plan.window_source is not None:  # the keys before the chunk, from the ring
            assert plan.window_target is not None  # (set together)
            ring = self.kv.view(-1, head_dim).index_select(0, plan.window_source).view(batch, channels, -1, head_dim)
            gathered.index_copy_(2, plan.window_target, ring)
        keys, values = gathered.view(batch, channels, length, -1, head_dim).split(channels // 2, dim=1)
        return keys, values

    def gather_step(self, plan: StepPlan, kv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The step's dilated keys and values: kv (B, 2 d) of the new positions -> (B, H, J, hd) each."""
        batch, (_, channels, _, head_dim) = kv.shape[0], self.kv.shape
        gathered = self.kv.view(-1, head_dim).index_select(0, plan.ring_index)  # (2 B H J, hd)
        gathered = gathered.view(2, batch, channels // 2, -1, head_dim)  # (2, B, H, J, hd)
        gathered.select(3, 0).copy_(kv.view(batch, 2, channels // 2, head_dim).transpose(0, 1))  # slot 0: the new
        return gathered[0], gathered[1]

    def prefixed(self, plan: BandedPlan, kv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The chunk's keys and values after the plan's ring prefix, (B, H, prefix + n, hd) each."""
        batch, (_, channels, _, head_dim) = kv.shape[0], self.kv.shape
        kv = kv.view(batch, kv.shape[1], channels, head_dim).transpose(1, 2)  # (B, 2 H, n, hd)
        if plan.prefix_index is not None:
            before = self.kv.view(-1, head_dim).index_select(0, plan.prefix_index).view(batch, channels, -1, head_dim)
            kv = torch.cat([before, kv], dim=2)  # (B, 2 H, prefix + n, hd)
        return kv[:, : channels // 2], kv[:, channels // 2 :]

    def write(self, plan: Plan, kv: torch.Tensor) -> None:
        """Store the chunk's last positions (at most ``ring``, distinct slots); kv: (B, n, 2 d)."""
        batch, (_, channels, _, head_dim) = kv.shape[0], self.kv.shape
        kept = plan.write_index.shape[0] // (batch * channels)
        kv = kv[:, kv.shape[1] - kept :].reshape(batch, kept, channels, head_dim).transpose(1, 2)  # (B, 2 H, w, hd)
        self.kv.view(-1, head_dim).index_copy_(0, plan.write_index, kv.reshape(-1, head_dim))

    def zeros(self, batch_size: int, room: int) -> KVWindow:
        _, channels, _, head_dim = self.kv.shape
        slots = self.dilation * ring_columns(self.ring, self.dilation, room)
        return KVWindow(self.ring, self.dilation, self.kv.new_zeros(batch_size, channels, slots, head_dim))

    def fit(self, room: int, rows: torch.Tensor | None = None) -> KVWindow:
        """A window with room for positions < room, of ``rows`` only (copies); positions < room keep their slots."""
        batch, channels, slots, head_dim = self.kv.shape
        columns = ring_columns(self.ring, self.dilation, room)
        kv = self.kv
        if columns != slots // self.dilation:
            runs = kv.view(batch, channels, self.dilation, slots // self.dilation, head_dim)
            kv = resized(runs, 3, columns).reshape(batch, channels, self.dilation * columns, head_dim)
        if rows is not None:
            kv = kv[rows]
        return KVWindow(self.ring, self.dilation, kv.contiguous()) if kv is not self.kv else self


@dataclass
class RegularGPTCache(InferenceCache):
    """Decoding state of B rows, row b at depth D(t_b - 1): ``windows[l][k]`` is block k's :class:`KVWindow` at layer l;
    ``top_hidden`` (B, capacity, d_model) each row's states after its top layer, continued when it deepens."""

    chunk_size: int
    top_hidden: torch.Tensor
    windows: list[list[KVWindow]] = field(default_factory=list)

    @property
    def depth(self) -> int:
        return len(self.windows)

    @property
    def depths(self) -> torch.Tensor:
        """(B,) each row's own depth D_b."""
        return row_depths(self.lengths, self.chunk_size)

    @classmethod
    def stack(cls, caches: Sequence[RegularGPTCache]) -> RegularGPTCache:
        lengths = torch.cat([cache.lengths for cache in caches])
        room = capacity(int(lengths.max()) if lengths.numel() else 0)
        deepest = max(caches, key=lambda cache: cache.depth)
        windows: list[list[KVWindow]] = []
        for layer, blocks in enumerate(deepest.windows):
            windows.append([])
            for k, template in enumerate(blocks):
                parts = [
                    cache.windows[layer][k].fit(room) if cache.depth > layer else template.zeros(cache.batch_size, room)
                    for cache in caches
                ]
                windows[-1].append(KVWindow(template.ring, template.dilation, torch.cat([part.kv for part in parts])))
        top_hidden = torch.cat([resized(cache.top_hidden, 1, room) for cache in caches])
        return cls(lengths=lengths, chunk_size=caches[0].chunk_size, top_hidden=top_hidden, windows=windows)

    def select(self, rows: Sequence[int]) -> RegularGPTCache:
        selected = torch.as_tensor(list(rows), dtype=torch.long)
        lengths = self.lengths[selected]
        longest = int(lengths.max()) if lengths.numel() else 0
        depth = int(row_depths(lengths, self.chunk_size).max()) if longest else 0
        room, index = capacity(longest), selected.to(self.top_hidden.device)
        windows = [[window.fit(room, index) for window in layer] for layer in self.windows[:depth]]
        top_hidden = resized(self.top_hidden, 1, room)[index]
        return RegularGPTCache(lengths=lengths, chunk_size=self.chunk_size, top_hidden=top_hidden, windows=windows)

    @property
    def nbytes(self) -> int:
        tensors = [self.top_hidden, *(window.kv for layer in self.windows for window in layer)]
        return sum(t.numel() * t.element_size() for t in tensors)
