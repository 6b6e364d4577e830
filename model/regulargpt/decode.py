"""RegularGPT's cached path (model/regulargpt/model.py is the model; model/regulargpt/cache.py the state and the plans):
``forward(chunk, cache)`` and ``step`` (the chunk of one) through a :class:`RegularGPTCache`.

Each block keeps the keys and values of only the last (C-1) * C**l positions its dilated pattern can reach, in a
ring buffer, plus each row's hidden states at its top thick layer, needed to grow its depth when it reaches C**L.
A chunk of n new positions per row runs every thick layer over them at once, each layer's keys found as its plan
says: a step (n = 1) gathers its J <= C keys from the ring (:class:`StepPlan`; every layer's indices from one
computation); a short chunk gathers, for each new position t, the key t - j * C**l from the chunk itself if it is
at or after the row's first new position, else from the ring, else it is out of range (:class:`ChunkPlan`,
O(n * J * d) memory per block); a long one attends banded over the ring's last (J - 1) * C**l keys and the chunk
(:class:`BandedPlan`, ``cached_attention_impl`` decides). Never T x T, never O(T) per position. Rows of one batch
may hold different lengths and depths: every row runs through all of the batch's layers (above a row's own depth
that is the pointwise continuation) and is read at its own D(t); a row first reaches the depth its chunk needs by
running its consumed positions through the new layers (:func:`_reserve`).

The blocks run from their tensors (:class:`CachedBlock`): a decode step is ~15 small ops per block, and module
calls would add a quarter to it. Served on the CPU (``for_serving``: :func:`pack_blocks`), a decode step of 1-4
rows runs each thick layer as one compiled call (:func:`_compiled_thick_layer`).
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
import torch
from torch import nn
from torch.nn import functional as F

from model.config import RegularGPTConfig
from model.layers import Block
from model.ops import cpu_decode
from model.ops.cpu_decode import linear
from model.ops.dilated_attention import attend_banded, attend_gathered, attend_slots, reachable_slots
from model.regulargpt.cache import (
    BandedPlan,
    KVWindow,
    Plan,
    RegularGPTCache,
    StepPlan,
    adaptive_depth,
    adaptive_depths,
    capacity,
    plan_chunk,
    resized,
    ring_columns,
)


class CachedBlock(NamedTuple):
    """A Block as the cached path runs it, its parameters read from the modules once per call.

    The computation is the Block's, x + attention(ln_1(x)) then x + mlp(ln_2(x)) (or with ``post_norm``
    ln_1(x + attention(x)) then ln_2(x + mlp(x))), written with those
    tensors: a decode step is a chain of small ops, and the modules' eleven __call__ and ~35 attribute lookups per
    block (an nn.Module attribute costs ~1 us here, six times a dict's) came to about a quarter of it. The
    tensors are read through the modules' own dicts (:func:`_children`), for the same reason.
    """

    ln_1: tuple[torch.Tensor, torch.Tensor]  # weight, bias
    c_attn: tuple[torch.Tensor, torch.Tensor]
    c_proj: tuple[torch.Tensor, torch.Tensor]
    ln_2: tuple[torch.Tensor, torch.Tensor]
    c_fc: tuple[torch.Tensor, torch.Tensor]
    mlp_proj: tuple[torch.Tensor, torch.Tensor]
    relative_bias: torch.Tensor  # (H, C)
    null_key: torch.Tensor | None  # (H, hd)
    null_value: torch.Tensor | None
    heads: int
    chunk_size: int
    eps: float
    dropout: float  # the residual branches' dropout probability when training, else 0
    post_norm: bool

    @classmethod
    def of(cls, block: Block) -> CachedBlock:
        modules = _children(block)
        attention = _children(modules["attention"])
        heads, mlp = attention["heads"], _children(modules["mlp"])
        projections = _children(heads)
        ln_1, ln_2 = modules["ln_1"], modules["ln_2"]
        parameters = vars(modules["attention"])["_parameters"]
        return cls(
            _weight_bias(ln_1),
            _weight_bias(projections["c_attn"]),
            _weight_bias(projections["c_proj"]),
            _weight_bias(ln_2),
            _weight_bias(mlp["c_fc"]),
            _weight_bias(mlp["c_proj"]),
            parameters["relative_bias"],
            parameters["null_key"],
            parameters["null_value"],
            heads.n_heads,
            modules["attention"].chunk_size,
            ln_1.eps,
            mlp["dropout"].p if block.training else 0.0,
            vars(block)["post_norm"],
        )

    def matrices(self) -> list[torch.Tensor]:
        """The block's weights that are matrices, as :func:`model.ops.cpu_decode.block_panels` takes them."""
        return [self.c_attn[0], self.c_proj[0], self.c_fc[0], self.mlp_proj[0]]

    def tensors(self) -> list[torch.Tensor]:
        """The block's parameters in the order :func:`model.ops.cpu_decode.regulargpt_layer_step` packs them."""
        nulls = [] if self.null_key is None else [self.null_key, self.null_value]
        matrices = [*self.ln_1, *self.c_attn, *self.c_proj, *self.ln_2, *self.c_fc, *self.mlp_proj]
        return [*matrices, self.relative_bias, *nulls]

    def forward(self, x: torch.Tensor, dilation: int, window: KVWindow, plan: Plan) -> torch.Tensor:
        """x: (B, n, d) new positions -> (B, n, d), attending through ``window``, which then stores them."""
        shape = x.shape[-1:]
        if self.post_norm:
            out = linear(self.attend(linear(x, *self.c_attn), dilation, window, plan), *self.c_proj)  # (B, n, d)
            x = F.layer_norm(self._residual(x, out), shape, *self.ln_1, self.eps)
            out = linear(F.gelu(linear(x, *self.c_fc)), *self.mlp_proj)  # (B, n, d)
            return F.layer_norm(self._residual(x, out), shape, *self.ln_2, self.eps)
        qkv = linear(F.layer_norm(x, shape, *self.ln_1, self.eps), *self.c_attn)  # (B, n, 3 d)
        x = self._residual(x, linear(self.attend(qkv, dilation, window, plan), *self.c_proj))  # (B, n, d)
        hidden = F.gelu(linear(F.layer_norm(x, shape, *self.ln_2, self.eps), *self.c_fc))  # (B, n, d_ff)
        return self._residual(x, linear(hidden, *self.mlp_proj))

    def _residual(self, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """x + a branch's output, dropped out as the Block's residual dropout does when training."""
        return x + (F.dropout(out, self.dropout) if self.dropout else out)

    def attend(self, qkv: torch.Tensor, dilation: int, window: KVWindow, plan: Plan) -> torch.Tensor:
        """The chunk's attention through the window, heads merged: qkv (B, n, 3 d), q | k | v with heads in order
        (as HeadProjections.qkv splits it) -> (B, n, d); the window then stores the chunk's keys and values."""
        batch, length, width = qkv.shape
        heads, d_model = self.heads, width // 3
        if isinstance(plan, StepPlan):
            kv = qkv[:, 0, d_model:]  # (B, 2 d)
            keys, values = window.gather_step(plan, kv)  # (B, H, J, hd) each
            q = qkv[:, 0, :d_model].view(batch, heads, -1)  # (B, H, hd)
            out = attend_slots(q, keys, values, self.relative_bias, plan.valid, self.null_key, self.null_value)
            window.kv.view(-1, d_model // heads).index_copy_(0, plan.write_index, kv.reshape(-1, d_model // heads))
            return out.view(batch, 1, d_model)
        q = qkv[..., :d_model].view(batch, length, heads, -1).transpose(1, 2)  # (B, H, n, hd)
        kv = qkv[..., d_model:]  # (B, n, 2 d)
        if isinstance(plan, BandedPlan):
            keys, values = window.prefixed(plan, kv)  # (B, H, prefix + n, hd) each
            out = attend_banded(
                q, keys, values, self.relative_bias, self.chunk_size, dilation, plan.first_key,
                self.null_key, self.null_value,
            )
        else:
            keys, values = window.gather(plan, kv)  # (B, H, n, J, hd) each
            out = attend_gathered(q, keys, values, self.relative_bias, plan.valid, self.null_key, self.null_value)
        window.write(plan, kv)
        return out.transpose(1, 2).reshape(batch, length, d_model)


class PackedBlocks(NamedTuple):
    """The K blocks' parameters as views of one buffer, for the compiled decode step
    (:func:`model.ops.cpu_decode.regulargpt_layer_step` takes them as one array): made by ``for_serving``."""

    packed: np.ndarray  # the buffer, which every block parameter views (CachedBlock.tensors order, block by block)
    starts: np.ndarray  # (K, n + 1) int64: each block's tensors' starts in it, then the block's end
    pointers: tuple[int, ...]  # each parameter's data_ptr when packed: one that differs was replaced since
    has_null: bool

    def holds(self, blocks: list[CachedBlock]) -> bool:
        """Whether the blocks' parameters are still the packed views (``.to``, ``.half``, ``load_state_dict(...,
        assign=True)`` or an assignment to ``.data`` replace them; an in-place change keeps them)."""
        return self.pointers == tuple(tensor.data_ptr() for block in blocks for tensor in block.tensors())


def _children(module: nn.Module) -> dict[str, nn.Module]:
    """A module's submodules by name, read from its dict (no nn.Module.__getattr__)."""
    return vars(module)["_modules"]


def _weight_bias(module: nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
    parameters = vars(module)["_parameters"]
    return parameters["weight"], parameters["bias"]


def pack_blocks(modules: nn.ModuleList, packed: PackedBlocks | None) -> PackedBlocks:
    """Make the K blocks' parameters views of one buffer (:class:`PackedBlocks`): values, shapes and the
    checkpoint unchanged; the compiled decode step then takes one array for all of them. ``packed``: the blocks'
    present packing, returned as it is while it still holds."""
    blocks = [CachedBlock.of(block) for block in modules]
    if packed is not None and packed.holds(blocks):
        return packed
    tensors = [tensor for block in blocks for tensor in block.tensors()]
    flat, starts = cpu_decode.pack(tensors)
    for tensor, start, end in zip(tensors, starts[:-1], starts[1:]):
        tensor.data = flat[start:end].view(tensor.shape)
    per_block = len(tensors) // len(blocks)
    return PackedBlocks(
        packed=flat.numpy(),
        starts=np.stack([starts[k * per_block : (k + 1) * per_block + 1] for k in range(len(blocks))]),
        pointers=tuple(tensor.data_ptr() for tensor in tensors),
        has_null=blocks[0].null_key is not None,
    )


def forward_chunk(
    x: torch.Tensor, cache: RegularGPTCache, modules: nn.ModuleList, packed: PackedBlocks | None,
    config: RegularGPTConfig,
) -> torch.Tensor:
    """x: (B, n, d) the embeddings of n tokens continuing each row of ``cache`` -> (B, n, d) the hidden states
    before the final LayerNorm; advances the cache by n. ``modules``: the K blocks; ``packed``: their packing by
    :func:`pack_blocks`, if any.

    Every row first reaches the depth its last new position needs (:func:`_reserve`), then all the batch's
    thick layers run over the n positions of every row; position t's output is read at its own D(t), and row
    b's hidden states after its own top layer go to ``top_hidden``.
    """
    if x.shape[1] == 0:
        return x
    chunk_size, length, start = config.chunk_size, x.shape[1], cache.lengths
    blocks = [CachedBlock.of(block) for block in modules]
    first_depths = _reserve(cache, length, blocks, config)  # each row's depth at its first new position
    mixed = min(first_depths) < cache.depth  # some outputs are read below the top layer
    positions = start.to(x.device)[:, None] + torch.arange(length, device=x.device)  # (B, n)
    if mixed:  # (B, n) nondecreasing along n, from the lengths on the CPU (no device sync)
        position_depths = adaptive_depths(start[:, None] + torch.arange(length), chunk_size).to(x.device)
    out = top = x
    compiled = length == 1 and _compiles_step(x, blocks, packed)
    if compiled:  # each layer finds its ring entries itself (no plan)
        step_positions = start.numpy()
        latest = int(step_positions.max())
        panels = cpu_decode.block_panels([matrix for block in blocks for matrix in block.matrices()])
    else:
        allocated = [windows[0].kv.shape[2] for windows in cache.windows]
        plans = plan_chunk(start, length, chunk_size, config.n_heads, allocated, x.device)
    for layer, windows in enumerate(cache.windows):
        if compiled:
            x = _compiled_thick_layer(x, layer, windows, step_positions, latest, packed, panels, config)  # (B, 1, d)
        else:
            x = _cached_thick_layer(x, chunk_size**layer, windows, plans[layer], blocks)  # (B, n, d)
        if mixed:
            out = torch.where(position_depths[..., None] == layer + 1, x, out)  # (B, n, d)
            top = torch.where(position_depths[:, -1:, None] == layer + 1, x, top)  # each row's own top layer
    if not mixed:
        out = top = x
    room = cache.top_hidden.shape[1]
    flat = positions + room * torch.arange(cache.batch_size, device=x.device)[:, None]  # (B, n)
    cache.top_hidden.view(-1, top.shape[-1]).index_copy_(0, flat.flatten(), top.reshape(-1, top.shape[-1]))
    cache.lengths = start + length
    return out


def _reserve(cache: RegularGPTCache, length: int, blocks: list[CachedBlock], config: RegularGPTConfig) -> list[int]:
    """Make room for ``length`` more tokens per row, add the thick layers the batch will need and bring every
    row to the depth its last new position needs: row b at depth D_b < D(t_b + n - 1) runs its t_b consumed
    positions (``top_hidden``) through layers D_b, D_b + 1, ...; there every key but a position's own is out of
    range (t_b <= C**D_b), so this is the parallel pass's pointwise continuation, and it fills the row's
    windows at those layers. Rows that reach a layer together run it as one chunk of context 0. Returns each
    row's D(t_b), the depth of its first new position."""
    chunk_size, heads, lengths = config.chunk_size, config.n_heads, cache.lengths.tolist()
    old = [adaptive_depth(t - 1, chunk_size) if t else 0 for t in lengths]
    first = [adaptive_depth(t, chunk_size) for t in lengths]
    new = first if length == 1 else [adaptive_depth(t + length - 1, chunk_size) for t in lengths]
    room = capacity(max(lengths) + length)
    if room != cache.top_hidden.shape[1]:
        cache.top_hidden = resized(cache.top_hidden, 1, room)
        for layer in cache.windows:  # one at a time: the old tensor goes before the next is copied
            for k, window in enumerate(layer):
                layer[k] = window.fit(room)
    while cache.depth < max(new):
        cache.windows.append(_new_layer(cache.batch_size, cache.depth, room, blocks, config))
    for layer in range(1, cache.depth):
        rows = [row for row, (held, needed) in enumerate(zip(old, new)) if 1 <= held <= layer < needed]
        if not rows:
            continue
        # Together, or where batch invariance is asked for (cpu_decode.row_invariant) each row as it runs alone:
        # rows run together came out other in the last bits (text-regulargpt, 2 rows reaching layer 1 at t = 64).
        for group in [[row] for row in rows] if cpu_decode.row_invariant() else [rows]:
            consumed = max(lengths[row] for row in group)
            index = torch.tensor(group, device=cache.top_hidden.device)  # (R,)
            allocated = [cache.windows[layer][0].kv.shape[2]]
            start = torch.zeros(len(group), dtype=torch.long)  # the consumed positions as one chunk
            (plan,) = plan_chunk(start, consumed, chunk_size, heads, allocated, index.device, index, layer)
            hidden = cache.top_hidden[index, :consumed]  # (R, t, d) after layer - 1; garbage past each t_b
            cache.top_hidden[index, :consumed] = _cached_thick_layer(
                hidden, chunk_size**layer, cache.windows[layer], plan, blocks
            )
    return first


def _new_layer(
    batch_size: int, layer: int, room: int, blocks: list[CachedBlock], config: RegularGPTConfig
) -> list[KVWindow]:
    """Empty windows of thick layer ``layer``'s K blocks, with room for ``room`` positions, on the blocks' device
    and dtype."""
    dilation = config.chunk_size**layer
    ring = (config.chunk_size - 1) * dilation
    heads = config.n_heads
    shape = (batch_size, 2 * heads, dilation * ring_columns(ring, dilation, room), config.d_model // heads)
    weight = blocks[0].c_attn[0]
    return [KVWindow(ring, dilation, torch.zeros(shape, device=weight.device, dtype=weight.dtype)) for _ in blocks]


def _cached_thick_layer(
    x: torch.Tensor, dilation: int, windows: list[KVWindow], plan: Plan, blocks: list[CachedBlock]
) -> torch.Tensor:
    """The K blocks over a chunk of new positions, attending through their windows. x: (B, n, d) -> (B, n, d)."""
    for block, window in zip(blocks, windows):
        x = block.forward(x, dilation, window, plan)
    return x


def _compiles_step(x: torch.Tensor, blocks: list[CachedBlock], packed: PackedBlocks | None) -> bool:
    """Whether a decode step over x (B, 1, d) runs each thick layer as one compiled call: packed blocks
    (``for_serving``) still in place, pre-norm blocks (the compiled kernel's), no dropout, and
    :func:`model.ops.cpu_decode.compiles_step`."""
    return (
        packed is not None and not blocks[0].dropout and not blocks[0].post_norm and cpu_decode.compiles_step(x)
        and packed.holds(blocks)
    )


def _compiled_thick_layer(
    x: torch.Tensor, layer: int, windows: list[KVWindow], positions: np.ndarray, latest: int, packed: PackedBlocks,
    panels: tuple[np.ndarray, ...], config: RegularGPTConfig,
) -> torch.Tensor:
    """Thick layer ``layer``'s K blocks over one new position per row (``positions``: (B,) int64, the largest
    ``latest``), as one compiled call (equal to :func:`_cached_thick_layer` with the step's plan up to float
    rounding); ``panels``: the blocks' matrices as :func:`model.ops.cpu_decode.block_panels` gives them for the
    step. x: (B, 1, d) -> (B, 1, d)."""
    batch, _, width = x.shape
    chunk_size = config.chunk_size
    dilation = chunk_size**layer
    out = cpu_decode.regulargpt_layer_step(
        x.view(batch, width), tuple(window.entries for window in windows), positions, dilation, windows[0].ring,
        reachable_slots(chunk_size, dilation, latest), packed.packed, packed.starts, panels,
        packed.has_null, config.n_heads, config.layer_norm_eps,
    )
    return out.view(batch, 1, width)
