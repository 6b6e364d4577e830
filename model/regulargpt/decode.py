"""RegularGPT's cached path: ``forward(chunk, cache)`` and ``step``. A chunk of n positions per row runs every thick
layer at once, keys found through per-layer plans (model/regulargpt/cache.py), each row read at its own depth; a row
reaching a new depth first runs its consumed positions through the new layers (:func:`_reserve`)."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any, NamedTuple, cast

import numpy as np
import torch
from torch import nn
from torch.nn import functional as F

from model.config import RegularGPTConfig
from model.layers import Block
from model.ops.attention.banded import attend_banded
from model.ops.attention.gathered import attend_gathered, attend_slots
from model.ops.attention.slots import reachable_slots
from model.ops.cpu import cpu_decode
from model.ops.cpu.cpu_decode import linear
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
    """A Block run from its tensors, read from the modules' dicts once per call (module calls cost a large share of a
    decode step); same computation, pre- or post-norm."""

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
        """The block's weights that are matrices, as :func:`model.ops.cpu.cpu_decode.block_panels` takes them."""
        return [self.c_attn[0], self.c_proj[0], self.c_fc[0], self.mlp_proj[0]]

    def tensors(self) -> list[torch.Tensor]:
        """The block's parameters in the order :func:`model.ops.cpu.cpu_decode.regulargpt_layer_step` packs them."""
        nulls: list[torch.Tensor] = []
        if self.null_key is not None:
            assert self.null_value is not None  # (both or neither)
            nulls = [self.null_key, self.null_value]
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
                q,
                keys,
                values,
                self.relative_bias,
                self.chunk_size,
                dilation,
                plan.first_key,
                self.null_key,
                self.null_value,
            )
        else:
            keys, values = window.gather(plan, kv)  # (B, H, n, J, hd) each
            out = attend_gathered(q, keys, values, self.relative_bias, plan.valid, self.null_key, self.null_value)
        window.write(plan, kv)
        return out.transpose(1, 2).reshape(batch, length, d_model)


class PackedBlocks(NamedTuple):
    """The K blocks' parameters as views of one buffer, for the compiled decode step."""

    packed: np.ndarray  # the buffer, which every block parameter views (CachedBlock.tensors order, block by block)
    starts: np.ndarray  # (K, n + 1) int64: each block's tensors' starts in it, then the block's end
    pointers: tuple[int, ...]  # each parameter's data_ptr when packed: one that differs was replaced since
    has_null: bool

    def holds(self, blocks: list[CachedBlock]) -> bool:
        return self.pointers == tuple(tensor.data_ptr() for block in blocks for tensor in block.tensors())


def _children(module: nn.Module) -> dict[str, Any]:
    """A module's submodules by name, read from its dict (no nn.Module.__getattr__)."""
    children: dict[str, Any] = vars(module)["_modules"]
    return children


def _weight_bias(module: nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
    parameters = vars(module)["_parameters"]
    return parameters["weight"], parameters["bias"]


def pack_blocks(modules: nn.ModuleList, packed: PackedBlocks | None) -> PackedBlocks:
    blocks = [CachedBlock.of(block) for block in cast("Iterable[Block]", modules)]
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
    x: torch.Tensor,
    cache: RegularGPTCache,
    modules: nn.ModuleList,
    packed: PackedBlocks | None,
    config: RegularGPTConfig,
    settle: Callable[[torch.Tensor], torch.Tensor],
) -> torch.Tensor:
    """x (B, n, d) embeddings continuing each cache row -> hidden states before the final LayerNorm, each position read
    at its own depth; advances the cache by n. ``settle``: applied to every thick layer's output (RegularGPT's
    ``_settle``)."""
    if x.shape[1] == 0:
        return x
    chunk_size, length, start = config.chunk_size, x.shape[1], cache.lengths
    blocks = [CachedBlock.of(block) for block in cast("Iterable[Block]", modules)]
    first_depths = _reserve(cache, length, blocks, config, settle)  # each row's depth at its first new position
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
            assert packed is not None  # (_compiles_step holds)
            x = _compiled_thick_layer(x, layer, windows, step_positions, latest, packed, panels, config)  # (B, 1, d)
        else:
            x = _cached_thick_layer(x, chunk_size**layer, windows, plans[layer], blocks)  # (B, n, d)
        x = settle(x)
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


def _reserve(
    cache: RegularGPTCache,
    length: int,
    blocks: list[CachedBlock],
    config: RegularGPTConfig,
    settle: Callable[[torch.Tensor], torch.Tensor],
) -> list[int]:
    """Make room for ``length`` tokens, add the needed layers, and deepen each row by running its consumed positions
    through the new layers (there a pointwise continuation, then ``settle``); returns each row's depth at its first
    new position."""
    chunk_size, heads, lengths = config.chunk_size, config.n_heads, cache.lengths.tolist()
    old = [adaptive_depth(t - 1, chunk_size) if t else 0 for t in lengths]
    first = [adaptive_depth(t, chunk_size) for t in lengths]
    new = first if length == 1 else [adaptive_depth(t + length - 1, chunk_size) for t in lengths]
    room = capacity(max(lengths) + length)
    if room != cache.top_hidden.shape[1]:
        cache.top_hidden = resized(cache.top_hidden, 1, room)
        for layer_windows in cache.windows:  # one at a time: the old tensor goes before the next is copied
            for k, window in enumerate(layer_windows):
                layer_windows[k] = window.fit(room)
    while cache.depth < max(new):
        cache.windows.append(_new_layer(cache.batch_size, cache.depth, room, blocks, config))
    for layer in range(1, cache.depth):
        rows = [row for row, (held, needed) in enumerate(zip(old, new)) if 1 <= held <= layer < needed]
        if not rows:
            continue
        # Together, or each row alone where batch invariance is asked for (cpu_decode.row_invariant): rows run
        # together can differ in the last bits.
        for group in [[row] for row in rows] if cpu_decode.row_invariant() else [rows]:
            consumed = max(lengths[row] for row in group)
            index = torch.tensor(group, device=cache.top_hidden.device)  # (R,)
            allocated = [cache.windows[layer][0].kv.shape[2]]
            start = torch.zeros(len(group), dtype=torch.long)  # the consumed positions as one chunk
            (plan,) = plan_chunk(start, consumed, chunk_size, heads, allocated, index.device, index, layer)
            hidden = cache.top_hidden[index, :consumed]  # (R, t, d) after layer - 1; garbage past each t_b
            cache.top_hidden[index, :consumed] = settle(
                _cached_thick_layer(hidden, chunk_size**layer, cache.windows[layer], plan, blocks)
            )
    return first


def _new_layer(
    batch_size: int, layer: int, room: int, blocks: list[CachedBlock], config: RegularGPTConfig
) -> list[KVWindow]:
    dilation = config.chunk_size**layer
    ring = (config.chunk_size - 1) * dilation
    heads = config.n_heads
    shape = (batch_size, 2 * heads, dilation * ring_columns(ring, dilation, room), config.d_model // heads)
    weight = blocks[0].c_attn[0]
    return [KVWindow(ring, dilation, torch.zeros(shape, device=weight.device, dtype=weight.dtype)) for _ in blocks]


def _cached_thick_layer(
    x: torch.Tensor, dilation: int, windows: list[KVWindow], plan: Plan, blocks: list[CachedBlock]
) -> torch.Tensor:
    for block, window in zip(blocks, windows):
        x = block.forward(x, dilation, window, plan)
    return x


def _compiles_step(x: torch.Tensor, blocks: list[CachedBlock], packed: PackedBlocks | None) -> bool:
    """Whether a decode step over x (B, 1, d) runs each thick layer as one compiled call."""
    return (
        packed is not None
        and not blocks[0].dropout
        and not blocks[0].post_norm
        and cpu_decode.compiles_step(x)
        and packed.holds(blocks)
    )


def _compiled_thick_layer(
    x: torch.Tensor,
    layer: int,
    windows: list[KVWindow],
    positions: np.ndarray,
    latest: int,
    packed: PackedBlocks,
    panels: tuple[np.ndarray, ...],
    config: RegularGPTConfig,
) -> torch.Tensor:
    """One thick layer of a decode step as one compiled call, equal to :func:`_cached_thick_layer` up to rounding."""
    batch, _, width = x.shape
    chunk_size = config.chunk_size
    dilation = chunk_size**layer
    out = cpu_decode.regulargpt_layer_step(
        x.view(batch, width),
        tuple(window.entries for window in windows),
        positions,
        dilation,
        windows[0].ring,
        reachable_slots(chunk_size, dilation, latest),
        packed.packed,
        packed.starts,
        panels,
        packed.has_null,
        config.n_heads,
        config.layer_norm_eps,
    )
    return out.view(batch, 1, width)
