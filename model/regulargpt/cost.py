"""RegularGPT's call costs and cache bytes (formulas: docs/models.md, "RegularGPT's costs")."""

from __future__ import annotations

import functools
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch

from model.cache import InferenceCache
from model.config import RegularGPTConfig
from model.ops.attention.banded import banded_block
from model.ops.attention.dispatch import cached_attention_impl, resolve_impl
from model.ops.attention.slots import reachable_slots
from model.regulargpt.cache import adaptive_depth, capacity, ring_columns
from model.serving import CallPath, Cost

FIXED_COST_CHUNKS = (2, 8, 32, 128)  # the chunks :func:`measure_fixed_costs` times: from fixed work to products
FIXED_COST_REPEATS = 9  # the fastest of this many timings of each call counts


@dataclass(frozen=True)
class FixedCosts:
    """The cached path's work beyond its multiply-adds, in multiply-add equivalents: per block pass over a chunk
    (``block``), per thick layer of a decode step (``layer_step``)."""

    block: float = 0.0
    layer_step: float = 0.0


def cost(
    config: RegularGPTConfig,
    itemsize: int,
    impl: str,
    path: CallPath,
    rows: int,
    length: int,
    context: int = 0,
    fixed: FixedCosts = FixedCosts(),
) -> Cost:
    """Multiply-adds and peak bytes of one call; ValueError for an unknown path."""
    if path == "forward":
        layers = [length] * adaptive_depth(length - 1, config.chunk_size)
        dilations = [config.chunk_size**layer for layer in range(len(layers))]
        flops, nbytes = _pass_cost(config, itemsize, rows, layers, dilations, impl, kept=len(layers))
        flops += rows * length * _head_flops(config)
        return Cost(flops, nbytes + _logits_nbytes(config, itemsize, rows, length))
    if path == "final":
        layers = final_layers(config, length)
        flops, nbytes = _pass_cost(config, itemsize, rows, layers, [1] * len(layers), impl)
        return Cost(flops + rows * _head_flops(config), nbytes + _logits_nbytes(config, itemsize, rows, 1))
    if path != "cached":
        raise ValueError(f"unknown call path {path!r}")
    return _cached_cost(config, itemsize, rows, length, context, fixed)


def final_layers(config: RegularGPTConfig, length: int) -> list[int]:
    """Positions per thick layer of the shrinking path: n_0 = T, n_{l+1} = (n_l - 1) // C + 1."""
    layers = [length]
    while len(layers) < adaptive_depth(length - 1, config.chunk_size):
        layers.append((layers[-1] - 1) // config.chunk_size + 1)
    return layers


def cache_nbytes(config: RegularGPTConfig, itemsize: int, length: int) -> int:
    """One row's bytes after ``length`` tokens: e d (P + 2 K sum_l C**l min(C - 1, ceil(P / C**l))), P = capacity."""
    if length == 0:
        return 0
    chunk_size, room = config.chunk_size, capacity(length)
    dilations = [chunk_size**layer for layer in range(adaptive_depth(length - 1, chunk_size))]
    slots: int = sum(dilation * ring_columns((chunk_size - 1) * dilation, dilation, room) for dilation in dilations)
    return (room + 2 * config.thickness * slots) * config.d_model * itemsize


def _cached_cost(
    config: RegularGPTConfig, itemsize: int, rows: int, length: int, context: int, fixed: FixedCosts
) -> Cost:
    chunk_size, d, item = config.chunk_size, config.d_model, itemsize
    last = context + length - 1
    depth = adaptive_depth(last, chunk_size)
    dilations = [chunk_size**layer for layer in range(depth)]
    flops, nbytes = _pass_cost(config, item, rows, [length] * depth, dilations, "cached", last=last, context=context)
    flops += rows * length * _head_flops(config)
    nbytes += _logits_nbytes(config, item, rows, length)
    held = adaptive_depth(context - 1, chunk_size) if context else 0
    flops += fixed.layer_step * depth if length == 1 else fixed.block * config.thickness * depth
    if context and held < depth:  # the consumed positions through each new layer, J = 1
        grow_flops, grow_nbytes = _pass_cost(config, item, rows, [context] * (depth - held), dilations[held:], "cached")
        flops += grow_flops + fixed.block * config.thickness * (depth - held)
        nbytes = max(nbytes, grow_nbytes + 2 * rows * context * d * item)
    if capacity(context + length) > capacity(context) or held < depth:  # one tensor's copy at a time
        nbytes = max(nbytes, 3 * rows * capacity(context + length) * d * item)
    growth = rows * (cache_nbytes(config, item, context + length) - cache_nbytes(config, item, context))
    return Cost(float(flops), int(nbytes + growth))


def _pass_cost(
    config: RegularGPTConfig,
    itemsize: int,
    rows: int,
    positions: list[int],
    dilations: list[int],
    impl: str,
    kept: int = 0,
    last: int | None = None,
    context: int = 0,
) -> tuple[float, int]:
    """Cost of thick layers over ``positions[l]`` at ``dilations[l]``, attention by ``impl``."""
    item = itemsize
    d, heads, chunk_size = config.d_model, config.n_heads, config.chunk_size
    linear = 4 * d * d + 2 * d * config.d_ff + (d if config.out_of_range == "null" else 0)
    flops, peak = 0.0, 0
    for count, dilation in zip(positions, dilations):
        slots = reachable_slots(chunk_size, dilation, count - 1 if last is None else last)
        prefix = min(slots - 1, -(-context // dilation)) * dilation
        if impl == "cached":
            chosen = "gathered" if count == 1 else cached_attention_impl(count, slots, prefix)
        else:
            chosen, prefix = resolve_impl(impl, count, slots), 0
        attention: float
        if chosen == "reference":
            attention = 2 * count * d
            scratch = 6 * rows * heads * count * count * item + heads * count * count * item
            scratch += 4 * rows * heads * count * chunk_size * item + 3 * 8 * count * chunk_size  # the C slots
        elif chosen == "banded":
            class_rows = -(-count // dilation)  # queries per residue class
            block = banded_block(slots, class_rows)
            window, padded = slots - 1 + block, count + block * dilation  # W + P keys per query
            # the queries of each class padded to whole blocks also get scores (and null scores)
            padding = -(-class_rows // block) * block * dilation / count
            attention = 2 * window * d * padding + (padding - 1) * (d if config.out_of_range == "null" else 0)
            copies = (4 if impl == "cached" else 2) * (prefix + padded) * d + 2 * padded * d * window // block
            scratch = rows * item * (copies + 4 * padded * d + 3 * heads * padded * window)
            scratch += rows * padded * window * 2 + 8 * (padded // block + 2 * block + 4) * window  # masks, indices
            scratch += heads * block * window * item  # the band's bias
        else:  # gathered keys and values: the fast op's stacked pair (and a copy), or the cache's chunk,
            attention = 2 * slots * d
            gathered = 3 if chosen == "fast" else 8  # window and selected pairs (and the products' copies)
            scratch = gathered * rows * count * slots * d * item + 6 * rows * heads * count * chunk_size * item
            scratch += 3 * 8 * rows * count * slots
        flops += rows * count * config.thickness * (linear + attention)
        activations = rows * count * ((12 + kept) * d + 2 * config.d_ff) * item
        peak = max(peak, activations + scratch)
    return flops, peak


def _head_flops(config: RegularGPTConfig) -> int:
    return config.d_model * config.output_size


def _logits_nbytes(config: RegularGPTConfig, itemsize: int, rows: int, positions: int) -> int:
    return rows * positions * (config.output_size + 2 * config.d_model) * itemsize


class Measured(Protocol):
    """What :func:`measure_fixed_costs` uses of a ``RegularGPT`` (model/regulargpt/model.py, which imports this
    module)."""

    @property
    def config(self) -> RegularGPTConfig: ...

    @property
    def dtype(self) -> torch.dtype: ...

    @property
    def device(self) -> torch.device: ...

    @property
    def _impl(self) -> str: ...

    def new_cache(self, batch_size: int) -> InferenceCache: ...

    def forward(self, tokens: torch.Tensor, cache: InferenceCache | None = None) -> torch.Tensor: ...

    def step(self, tokens: torch.Tensor, cache: InferenceCache) -> torch.Tensor: ...


@torch.inference_mode()
def measure_fixed_costs(model: Measured, repeats: int = FIXED_COST_REPEATS) -> FixedCosts:
    """Time a served language model's chunks and a decode step and fit seconds per multiply-add and the
    :class:`FixedCosts` (zeros for transducers)."""
    config, itemsize = model.config, model.dtype.itemsize
    chunk_size, thickness = config.chunk_size, config.thickness
    if not config.is_language_model:  # a transducer's cache takes only long inputs' chunks (outputs "all")
        return FixedCosts()

    def flops(length: int, context: int = 0) -> float:
        return cost(config, itemsize, model._impl, "cached", 1, length, context).flops

    def fastest(call: Callable[[], object]) -> float:
        call()  # a warm-up: a first call builds what later ones reuse (kernels, the compiled step)
        return min(_timed(model, call) for _ in range(repeats))

    lengths = list(FIXED_COST_CHUNKS)
    while adaptive_depth(lengths[-1] - 1, chunk_size) != adaptive_depth(lengths[-1], chunk_size):
        lengths[-1] += 1  # the step after the longest chunk then needs no new layer
    caches: dict[int, InferenceCache] = {}

    def chunk(length: int) -> None:
        caches[length] = model.new_cache(1)
        model.forward(_zeros(model, length), cache=caches[length])

    # per chunk (f multiply-adds, P block passes, t seconds): (f / t, P / t), with s f / t + s B P / t = 1
    rows: list[tuple[float, float]] = []
    for length in lengths:
        seconds = fastest(functools.partial(chunk, length))
        rows.append((flops(length) / seconds, thickness * adaptive_depth(length - 1, chunk_size) / seconds))
    aa, ab, bb = sum(a * a for a, _ in rows), sum(a * b for a, b in rows), sum(b * b for _, b in rows)
    determinant = aa * bb - ab * ab
    if determinant <= 0:
        return FixedCosts()
    per_flop = (bb * sum(a for a, _ in rows) - ab * sum(b for _, b in rows)) / determinant
    per_pass = (aa * sum(b for _, b in rows) - ab * sum(a for a, _ in rows)) / determinant  # s B: seconds
    if not per_flop > 0:
        return FixedCosts()
    block = max(0.0, per_pass / per_flop)
    longest = lengths[-1]
    step = _zeros(model, 1)[:, 0]  # (1,)
    seconds = fastest(lambda: model.step(step, caches[longest].clone()))
    clone = fastest(lambda: caches[longest].clone())
    layer_step = max(0.0, (seconds - clone) / per_flop - flops(1, longest)) / adaptive_depth(longest, chunk_size)
    return FixedCosts(block=block, layer_step=layer_step)


def _zeros(model: Measured, length: int) -> torch.Tensor:
    return torch.zeros(1, length, dtype=torch.long, device=model.device)


def _timed(model: Measured, call: Callable[[], object]) -> float:
    """Seconds ``call`` takes: this thread's CPU time on the CPU, wall time to completion on CUDA."""
    if model.device.type != "cuda":
        started = time.thread_time()
        call()
        return time.thread_time() - started
    started = time.perf_counter()
    call()
    torch.cuda.synchronize(model.device)
    return time.perf_counter() - started
