"""RegularGPT (regulargpt.txt section 3): GPT-2 blocks with Sliding-Dilated-Attention, adaptive depth and
weight sharing.

Thick layer l (0-indexed) applies the ``thickness`` (K) distinct pre-norm GPT-2 blocks in order, all with
dilation C**l (C = chunk_size): position m attends to m - j * C**l for j in [C], plus a learnable scalar per
head and j (eq. 1). The same K blocks serve every thick layer, so the depth can grow past the training length.
There is no absolute position embedding; a final LayerNorm precedes the head.

Adaptive depth per prefix: the output at position m is read after D(m) = max(1, ceil(log_C(m + 1))) thick
layers, the fewest whose dilated receptive field reaches position 0. For the last position of a length-T
input this is the paper's ceil(log_C T). The parallel pass runs D(T - 1) thick layers over every position and
reads each position at its own depth, so the model is strictly causal: output i is the final output of the
prefix s[0..i], and decoding one token at a time gives the parallel pass's logits. At a layer l >= D(m) every
key of position m but its own is out of range (m - j * C**l < 0): masked, or the block's null key and value
(``config.out_of_range``). Either way position m is there a pointwise function of its own hidden state.

Three exact paths:

- ``forward``: every position, D(T - 1) thick layers over all T positions, O(T * C * K * log T);
- ``final_logits``: the shrinking path, O(T * C * K): thick layer l needs outputs only at the positions
  T-1, T-1-C**(l+1), ..., whose keys are the positions S_l = [..., T-1-C**l, T-1], layer l-1's outputs. In
  S_l the dilation is 1, and S_{l+1} is every C-th element of S_l counting from its end. Rows of a mixed-
  length batch are shifted to end at the same index (left padding masked through ``key_offset``), and each
  row is read after its own depth;
- ``forward(chunk, cache)`` and ``step`` (the chunk of one) through :class:`RegularGPTCache`: each block keeps
  the keys and values of only the last (C-1) * C**l positions its dilated pattern can reach, in a ring buffer,
  plus each row's hidden states at its top thick layer, needed to grow its depth when it reaches C**L. A chunk
  of n new positions per row runs every thick layer over them at once: the key t - j * C**l of a new position t
  comes from the chunk itself if it is at or after the row's first new position, else from the ring, else it is
  out of range (:class:`ChunkPlan`); O(n * J * d) memory per block, J <= C the slots in reach, never T x T and
  never O(T) per position. Rows of one batch may hold different lengths and depths: every row runs through all
  of the batch's layers (above a row's own depth that is the pointwise continuation) and is read at its own
  D(t); a row first reaches the depth its chunk needs by running its consumed positions through the new layers.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from torch import nn

from model.base import CallPath, Cost, InferenceCache, SequenceModel, TokenEmbedding, check_lengths, lengths_tensor
from model.config import RegularGPTConfig
from model.layers import Block, HeadProjections, init_gpt2
from model.ops.dilated_attention import (
    AUTO_REFERENCE_MAX_T,
    attend_gathered,
    dilated_attention,
    reachable_slots,
    resolve_impl,
)


def adaptive_depth(position: int, chunk_size: int) -> int:
    """D(m) = max(1, ceil(log_C(m + 1))): the fewest thick layers for position m to see position 0."""
    depth, reach = 1, chunk_size
    while reach < position + 1:
        depth, reach = depth + 1, reach * chunk_size
    return depth


def adaptive_depths(positions: torch.Tensor, chunk_size: int) -> torch.Tensor:
    """:func:`adaptive_depth` of every element of an integer tensor of positions >= 0: 1 + #{k >= 1: C**k <= m}."""
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
    """Positions a cache allocates room for while its longest row holds ``length`` tokens: the smallest power of
    two >= length (0 for 0), so that growing the room one token at a time copies O(1) per token amortised."""
    return 0 if length == 0 else 1 << (length - 1).bit_length()


def _fit(tensor: torch.Tensor, dim: int, size: int) -> torch.Tensor:
    """``tensor`` cut to, or zero-padded up to, ``size`` along ``dim`` (itself when it already has that size)."""
    have = tensor.shape[dim]
    if have == size:
        return tensor
    if have > size:
        return tensor.narrow(dim, 0, size)
    room = list(tensor.shape)
    room[dim] = size - have
    return torch.cat([tensor, tensor.new_zeros(room)], dim=dim)


@dataclass
class ChunkPlan:
    """Where the dilated keys of a chunk's new positions come from at one thick layer (shared by its K blocks;
    :meth:`build` makes those of several layers at once, sharing what they have in common).

    Row b's chunk holds positions start[b] + i, i in [n]. The key of slot j, at position start[b] + i - j * C**l,
    comes from the chunk itself at index i - j * C**l when that is >= 0 (the same index for every row), else from
    the block's ring window when the position is >= 0, else it is out of range (masked or null, whatever was
    gathered there). Only the J slots some query of the batch can reach are gathered (``reachable_slots``), so a
    block's gathered keys and values take O(B * n * J * d_model) memory.
    """

    chunk_index: torch.Tensor  # (n, J) index into the chunk, clamped at 0
    valid: torch.Tensor  # (B, 1, n, J) bool: the key lies at a position >= 0
    window_source: torch.Tensor | None  # (B * m,) rows of the flat window holding the m keys before each row's chunk
    window_target: torch.Tensor | None  # (m,) their entries in the flat (n * J) slots of a row
    write_index: torch.Tensor  # (B * w,) rows of the flat window for the chunk's last w = min(n, ring) positions

    @classmethod
    def build(
        cls, start: torch.Tensor, length: int, chunk_size: int, allocated: list[int], device: torch.device,
        rows: torch.Tensor | None = None, first_layer: int = 0,
    ) -> list[ChunkPlan]:
        """The plans of thick layers first_layer, first_layer + 1, ... whose windows hold ``allocated`` slots per
        row (room for every position < start + n). start: (B,) int64 on the CPU, each row's first new position;
        length: n; rows: (B,) the cache rows that the chunk's rows are, or None for all in order."""
        last, has_context, batch = int(start.max()) + length - 1, bool(start.any()), start.shape[0]
        start = start.to(device)
        rows = torch.arange(batch, device=device) if rows is None else rows.to(device)
        own = start[:, None] + torch.arange(length, device=device)  # (B, n) the chunk's positions
        plans = []
        for layer, slots_per_row in enumerate(allocated, start=first_layer):
            dilation = chunk_size**layer
            ring = (chunk_size - 1) * dilation
            relative, chunk_index, before, before_offset = _relative_keys(
                length, dilation, reachable_slots(chunk_size, dilation, last), device
            )
            first = (rows * slots_per_row)[:, None]  # (B, 1) each row's first slot in the flat window
            window_source = window_target = None
            if has_context and before.numel():  # key % ring < allocated for every key < start + n
                key = (start[:, None] + before_offset).clamp(min=0)  # (B, m) the position, 0 when out of range
                window_source, window_target = (key % ring + first).flatten(), before
            plans.append(cls(
                chunk_index=chunk_index,
                valid=(start[:, None, None] + relative >= 0)[:, None],
                window_source=window_source,
                window_target=window_target,
                write_index=(own[:, length - min(length, ring) :] % ring + first).flatten(),  # the last w positions
            ))
        return plans


@functools.lru_cache(maxsize=64)
def _relative_keys(length: int, dilation: int, slots: int, device: torch.device) -> tuple[torch.Tensor, ...]:
    """For a chunk of n positions: the chunk-relative key indices i - j * dilation (n, J), the same clamped at 0,
    and the flat (n * J) entries where they are negative (before the chunk) with their values. The same for every
    call with these sizes (every decode step), so kept (read-only)."""
    with torch.inference_mode(False):  # plain tensors, usable in and out of inference mode
        relative = torch.arange(length, device=device)[:, None] - dilation * torch.arange(slots, device=device)
        before = (relative.flatten() < 0).nonzero().flatten()  # (m,)
        return relative, relative.clamp(min=0), before, relative.flatten()[before]


@dataclass
class KVWindow:
    """One block's keys and values at one thick layer l, side by side (keys | values, heads in order): a ring of
    ``ring`` = (C-1) * C**l positions per row, position p at slot p % ring. Only the first ``capacity`` slots are
    allocated: min(ring, :func:`capacity` of the longest row), which holds every slot a row's positions occupy."""

    ring: int
    kv: torch.Tensor  # (B, capacity, 2 * d_model) contiguous

    def gather(self, plan: ChunkPlan, kv: torch.Tensor, heads: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The chunk's dilated keys and values: kv (B, n, 2 d) of the chunk -> (B, H, n, J, hd) each (the halves
        of one contiguous (B, 2 H, n, J, hd) tensor)."""
        batch, length, width = kv.shape
        head_dim = width // (2 * heads)
        gathered = kv.view(batch, length, 2 * heads, head_dim).transpose(1, 2)[:, :, plan.chunk_index]  # in the chunk
        if plan.window_source is not None:  # the keys before the chunk, from the ring
            ring = self.kv.view(-1, width).index_select(0, plan.window_source)  # (B * m, 2 d)
            ring = ring.view(batch, -1, 2 * heads, head_dim).transpose(1, 2)  # (B, 2 H, m, hd)
            gathered.view(batch, 2 * heads, -1, head_dim).index_copy_(2, plan.window_target, ring)
        keys, values = gathered.split(heads, dim=1)
        return keys, values

    def write(self, plan: ChunkPlan, kv: torch.Tensor) -> None:
        """Store the chunk's last positions (at most ``ring``: distinct slots). kv: (B, n, 2 d)."""
        kept = plan.write_index.shape[0] // kv.shape[0]
        kv = kv[:, kv.shape[1] - kept :].reshape(-1, kv.shape[-1])  # (B * w, 2 d)
        self.kv.view(-1, kv.shape[-1]).index_copy_(0, plan.write_index, kv)

    def zeros(self, batch_size: int, room: int) -> KVWindow:
        """An empty window like this one for ``batch_size`` rows, with ``min(ring, room)`` allocated slots."""
        return KVWindow(self.ring, self.kv.new_zeros(batch_size, min(self.ring, room), self.kv.shape[2]))

    def fit(self, room: int, rows: torch.Tensor | None = None) -> KVWindow:
        """A window with ``min(ring, room)`` allocated slots (itself when unchanged), of ``rows`` only (copies)."""
        kv = _fit(self.kv, 1, min(self.ring, room))
        if rows is not None:
            kv = kv[rows]
        return KVWindow(self.ring, kv) if kv is not self.kv else self


@dataclass
class RegularGPTCache(InferenceCache):
    """Decoding state of B rows, row b holding ``lengths[b]`` = t_b tokens and D_b = D(t_b - 1) thick layers
    (:func:`row_depths`; 0 when empty).

    ``windows[l][k]`` is the :class:`KVWindow` of block k at thick layer l, for l < ``depth``, the deepest row's
    D_b. Row b's windows are meaningful at its own layers l < D_b; above them they are never read (there every key
    of the row's positions but their own is out of range) and are filled when the row reaches that depth.
    ``top_hidden`` (B, capacity, d_model) holds in row b, at positions [0, t_b), the hidden states after the row's
    own top layer D_b - 1: running them through layer D_b when the row's next position needs it (t = C**D_b) is a
    pointwise continuation (module docstring). The allocated room grows with the longest row (:func:`capacity`).
    """

    chunk_size: int
    top_hidden: torch.Tensor
    windows: list[list[KVWindow]] = field(default_factory=list)

    @property
    def depth(self) -> int:
        """Thick layers held: the deepest row's."""
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
        windows = []
        for layer, blocks in enumerate(deepest.windows):
            windows.append([])
            for k, template in enumerate(blocks):
                parts = [
                    cache.windows[layer][k].fit(room) if cache.depth > layer else template.zeros(cache.batch_size, room)
                    for cache in caches
                ]
                windows[-1].append(KVWindow(template.ring, torch.cat([part.kv for part in parts])))
        top_hidden = torch.cat([_fit(cache.top_hidden, 1, room) for cache in caches])
        return cls(lengths=lengths, chunk_size=caches[0].chunk_size, top_hidden=top_hidden, windows=windows)

    def select(self, rows: Sequence[int]) -> RegularGPTCache:
        rows = torch.as_tensor(list(rows), dtype=torch.long)
        lengths = self.lengths[rows]
        longest = int(lengths.max()) if lengths.numel() else 0
        depth = int(row_depths(lengths, self.chunk_size).max()) if longest else 0
        room, index = capacity(longest), rows.to(self.top_hidden.device)
        windows = [[window.fit(room, index) for window in layer] for layer in self.windows[:depth]]
        top_hidden = _fit(self.top_hidden, 1, room)[index]
        return RegularGPTCache(lengths=lengths, chunk_size=self.chunk_size, top_hidden=top_hidden, windows=windows)

    @property
    def nbytes(self) -> int:
        tensors = [self.top_hidden, *(window.kv for layer in self.windows for window in layer)]
        return sum(t.numel() * t.element_size() for t in tensors)


class DilatedSelfAttention(nn.Module):
    """Multi-head Sliding-Dilated-Attention with per-head relative scalars r_j (eq. 1).

    With ``out_of_range="null"`` it also holds a learned null key and value per head (H, hd), which fill the
    slots whose key lies before position 0; with "mask" those slots are masked and there are no such parameters.
    """

    def __init__(self, config: RegularGPTConfig) -> None:
        super().__init__()
        self.heads = HeadProjections(config.d_model, config.n_heads, config.dropout)
        self.relative_bias = nn.Parameter(torch.zeros(config.n_heads, config.chunk_size))
        null_shape = (config.n_heads, config.d_model // config.n_heads)
        for name in ("null_key", "null_value"):  # N(0, 0.02) like the projections whose outputs they stand for
            null = nn.Parameter(torch.randn(null_shape) * 0.02) if config.out_of_range == "null" else None
            self.register_parameter(name, null)
        self.chunk_size = config.chunk_size
        self.impl = config.attention_impl

    def forward(
        self,
        x: torch.Tensor,
        dilation: int,
        key_offset: torch.Tensor | None = None,
        window: KVWindow | None = None,
        plan: ChunkPlan | None = None,
    ) -> torch.Tensor:
        """x: (B, T, d_model) -> (B, T, d_model).

        Without ``window``, x holds positions 0..T-1 (the parallel pass, through ``self.impl``). With a window and
        its ``plan``, x is a chunk of new positions: they attend through the window and the chunk (ChunkPlan), and
        the window then stores them.
        """
        if window is None:
            q, k, v = self.heads.qkv(x)  # (B, H, T, hd) each
            out = dilated_attention(
                q, k, v, self.relative_bias, self.chunk_size, dilation, key_offset,
                self.null_key, self.null_value, self.impl,
            )  # (B, H, T, hd)
            return self.heads.merge(out)
        batch, length, d_model = x.shape
        heads = self.heads.n_heads
        qkv = self.heads.c_attn(x)  # (B, T, 3 d): q | k | v, heads in order (as HeadProjections.qkv splits it)
        q = qkv[..., :d_model].view(batch, length, heads, -1).transpose(1, 2)  # (B, H, T, hd)
        keys, values = window.gather(plan, qkv[..., d_model:], heads)  # (B, H, T, J, hd) each
        out = attend_gathered(q, keys, values, self.relative_bias, plan.valid, self.null_key, self.null_value)
        window.write(plan, qkv[..., d_model:])
        return self.heads.merge(out)


class RegularGPT(SequenceModel):
    def __init__(self, config: RegularGPTConfig) -> None:
        super().__init__()
        self.config = config
        self.embedding = TokenEmbedding(config)
        self.blocks = nn.ModuleList(
            Block(config.d_model, config.d_ff, DilatedSelfAttention(config), config.layer_norm_eps, config.dropout)
            for _ in range(config.thickness)
        )
        self.ln_f = nn.LayerNorm(config.d_model, eps=config.layer_norm_eps)
        init_gpt2(self, n_residual_layers=config.thickness)  # scaled over the K distinct blocks

    def forward(self, tokens: torch.Tensor, cache: RegularGPTCache | None = None) -> torch.Tensor:
        """tokens: (B, T) -> (B, T, output_size).

        With ``cache``, the tokens continue each row's cached sequence, T new positions per row processed in
        parallel per layer (the chunk path, module docstring), and the cache advances by T.
        """
        if cache is not None:
            return self._forward_chunk(tokens, cache)
        chunk_size = self.config.chunk_size
        x = self.embedding(tokens)  # (B, T, d)
        outputs = []
        for layer in range(adaptive_depth(tokens.shape[1] - 1, chunk_size)):
            x = self._thick_layer(x, chunk_size**layer)  # (B, T, d)
            first = 0 if layer == 0 else chunk_size**layer
            outputs.append(x[:, first : chunk_size ** (layer + 1)])  # the positions with D(m) = layer + 1
        return self._logits(torch.cat(outputs, dim=1))

    def final_logits(self, tokens: torch.Tensor, lengths: torch.Tensor | None = None) -> torch.Tensor:
        """The shrinking path (module docstring). tokens: (B, T) right-padded; lengths: (B,) -> (B, output_size)."""
        batch, length = tokens.shape
        chunk_size = self.config.chunk_size
        if lengths is None:
            lengths = torch.full((batch,), length, dtype=torch.long)
        check_lengths(lengths, batch, length)
        key_offset = (length - lengths).to(tokens.device)  # (B,) left padding once each row ends at T - 1
        source = torch.arange(length, device=tokens.device) - key_offset[:, None]  # (B, T)
        x = self.embedding(tokens.gather(1, source.clamp(min=0)))  # (B, T, d) rows right-aligned
        depths = torch.tensor([adaptive_depth(n - 1, chunk_size) for n in lengths.tolist()], device=x.device)
        final = x[:, -1]  # (B, d) replaced at each row's depth
        for layer in range(int(depths.max())):
            x = self._thick_layer(x, dilation=1, key_offset=key_offset)  # (B, |S_l|, d)
            first = (x.shape[1] - 1) % chunk_size
            x = x[:, first::chunk_size]  # (B, |S_{l+1}|, d) the last element of each chunk
            key_offset = torch.div(key_offset - first + chunk_size - 1, chunk_size, rounding_mode="floor").clamp(min=0)
            final = torch.where((depths == layer + 1)[:, None], x[:, -1], final)  # (B, d)
        return self._logits(final)

    def new_cache(self, batch_size: int) -> RegularGPTCache:
        return RegularGPTCache(
            lengths=lengths_tensor(0, batch_size),
            chunk_size=self.config.chunk_size,
            top_hidden=self._zeros((batch_size, 0, self.config.d_model)),
        )

    def step(self, tokens: torch.Tensor, cache: RegularGPTCache) -> torch.Tensor:
        """tokens: (B,) -> (B, output_size): the chunk of one position per row, each read after its own D(t_b).

        Costs O(K * D * (J + d_model) * d_model) per row for the batch's depth D; a step that takes a row to
        t = C**L first runs the row's t consumed positions through the new thick layer, once.
        """
        return self.forward(tokens[:, None], cache)[:, 0]

    def for_serving(self) -> list[str]:
        """The reference attention builds a T x T mask (18.7 GB at ~20k positions): switch it to "auto", which is
        the reference only up to AUTO_REFERENCE_MAX_T positions (where it is faster) and the fast gather beyond.
        The cached path never uses either. The configuration and the checkpoint are left as they are."""
        if not any(block.attention.impl == "reference" for block in self.blocks):
            return []
        for block in self.blocks:
            block.attention.impl = "auto"
        return [
            f"attention_impl reference -> auto (the T x T mask would not fit long inputs; the reference is kept up to "
            f"{AUTO_REFERENCE_MAX_T} positions)"
        ]

    def cost(self, path: CallPath, rows: int, length: int, context: int = 0) -> Cost:
        """Multiply-adds and peak bytes (under no_grad, beyond the weights and the given cache) of one call.

        With d = d_model, f = d_ff, K blocks, C, V = output_size, e bytes per element, D(m) the adaptive depth,
        per position and block F = 4 d^2 + 2 d f (q, k, v and output projections, MLP) plus the attention: 2 J d
        over J gathered slots (+ d for the null scores), J_l = min(C, last_position // C**l + 1) at layer l; or,
        for the reference, 2 T d (the T x T scores and weighted sum). Per read position d V for the head.

        - "forward" (B, T): D(T - 1) layers over all T positions, attention by the impl chosen for T;
          bytes: activations B T ((12 + D) d + 2 f) e (the per-layer outputs stay alive until the final cat),
          logits B T (V + 2 d) e, and the attention's: reference 6 B H T^2 e + H T^2 e (mask, scores, softmax,
          null columns), fast 3 B T J d e (gathered keys and values) + 6 B H T C e (scores).
        - "final" (B, T): the shrinking path, layer l over n_l positions (n_0 = T, n_{l+1} = (n_l - 1) // C + 1)
          at dilation 1, attention by the impl chosen for n_l; the bytes of its largest layer and the logits of
          the last positions.
        - "cached" (B, n, context c): D(c + n - 1) layers over the n new positions, gathered attention (window
          and chunk) with J_l as above; plus, when the chunk needs a deeper layer than the rows hold (c >= 1 and
          D(c - 1) < D(c + n - 1)), each new layer over the c consumed positions with J = 1 (every other key is
          out of range). Bytes: the cache's growth B (cache_nbytes(c + n) - cache_nbytes(c)), plus the largest
          of: the room's copy (one tensor at a time: 3 B capacity(c + n) d e, when the room or the depth
          changes), the depth growth's pass over c positions, the chunk's pass (activations, 8 B n J d e
          gathered, 6 B H n C e scores, 3 * 8 B n J index bytes, logits B n (V + 2 d) e).
        """
        if path == "forward":
            layers = [length] * adaptive_depth(length - 1, self.config.chunk_size)
            dilations = [self.config.chunk_size**layer for layer in range(len(layers))]
            flops, nbytes = self._pass_cost(rows, layers, dilations, self._impl, kept=len(layers))
            return Cost(flops + rows * length * self._head_flops(), nbytes + self._logits_nbytes(rows, length))
        if path == "final":
            layers = [length]
            while len(layers) < adaptive_depth(length - 1, self.config.chunk_size):
                layers.append((layers[-1] - 1) // self.config.chunk_size + 1)
            flops, nbytes = self._pass_cost(rows, layers, [1] * len(layers), self._impl)
            return Cost(flops + rows * self._head_flops(), nbytes + self._logits_nbytes(rows, 1))
        if path != "cached":
            raise ValueError(f"unknown call path {path!r}")
        return self._cached_cost(rows, length, context)

    def cache_nbytes(self, length: int) -> int:
        """One row after ``length`` tokens: e d (P + 2 K sum_{l < D(length - 1)} min((C - 1) C**l, P)), P =
        capacity(length): ``top_hidden``'s room and every block's keys and values at each layer, as allocated."""
        if length == 0:
            return 0
        chunk_size, room = self.config.chunk_size, capacity(length)
        slots = sum(
            min((chunk_size - 1) * chunk_size**layer, room) for layer in range(adaptive_depth(length - 1, chunk_size))
        )
        return (room + 2 * self.config.thickness * slots) * self.config.d_model * self.dtype.itemsize

    def _cached_cost(self, rows: int, length: int, context: int) -> Cost:
        """The "cached" path of :meth:`cost`."""
        chunk_size, d, item = self.config.chunk_size, self.config.d_model, self.dtype.itemsize
        last = context + length - 1
        depth = adaptive_depth(last, chunk_size)
        dilations = [chunk_size**layer for layer in range(depth)]
        flops, nbytes = self._pass_cost(rows, [length] * depth, dilations, "gathered", last=last)
        flops += rows * length * self._head_flops()
        nbytes += self._logits_nbytes(rows, length)
        held = adaptive_depth(context - 1, chunk_size) if context else 0
        if context and held < depth:  # the consumed positions through each new layer, J = 1
            grow_flops, grow_nbytes = self._pass_cost(rows, [context] * (depth - held), dilations[held:], "gathered")
            flops += grow_flops
            nbytes = max(nbytes, grow_nbytes + 2 * rows * context * d * item)
        if capacity(context + length) > capacity(context) or held < depth:  # one tensor's copy at a time
            nbytes = max(nbytes, 3 * rows * capacity(context + length) * d * item)
        growth = rows * (self.cache_nbytes(context + length) - self.cache_nbytes(context))
        return Cost(float(flops), int(nbytes + growth))

    def _pass_cost(
        self, rows: int, positions: list[int], dilations: list[int], impl: str, kept: int = 0, last: int | None = None
    ) -> tuple[float, int]:
        """Multiply-adds and peak bytes of thick layers l over ``positions[l]`` positions at ``dilations[l]``,
        with attention ``impl`` (an attention_impl, resolved per layer, or "gathered": the cached path's), the last
        query at ``last`` (default positions[l] - 1); ``kept`` layers' outputs stay alive. See :meth:`cost`."""
        config, item = self.config, self.dtype.itemsize
        d, heads, chunk_size = config.d_model, config.n_heads, config.chunk_size
        linear = 4 * d * d + 2 * d * config.d_ff + (d if config.out_of_range == "null" else 0)
        flops, peak = 0.0, 0
        for count, dilation in zip(positions, dilations):
            chosen = impl if impl == "gathered" else resolve_impl(impl, count)
            slots = reachable_slots(chunk_size, dilation, count - 1 if last is None else last)
            attention = 2 * count * d if chosen == "reference" else 2 * slots * d
            flops += rows * count * config.thickness * (linear + attention)
            if chosen == "reference":
                scratch = 6 * rows * heads * count * count * item + heads * count * count * item
            else:  # gathered keys and values: the fast op's stacked pair (and a copy), or the cache's chunk,
                gathered = 3 if chosen == "fast" else 8  # window and selected pairs (and the einsum's copies)
                scratch = gathered * rows * count * slots * d * item + 6 * rows * heads * count * chunk_size * item
                scratch += 3 * 8 * rows * count * slots
            activations = rows * count * ((12 + kept) * d + 2 * config.d_ff) * item
            peak = max(peak, activations + scratch)
        return flops, peak

    @property
    def _impl(self) -> str:
        """The parallel passes' attention implementation, as configured or switched by :meth:`for_serving`."""
        return self.blocks[0].attention.impl

    def _head_flops(self) -> int:
        return self.config.d_model * self.config.output_size

    def _logits_nbytes(self, rows: int, positions: int) -> int:
        return rows * positions * (self.config.output_size + 2 * self.config.d_model) * self.dtype.itemsize

    def _forward_chunk(self, tokens: torch.Tensor, cache: RegularGPTCache) -> torch.Tensor:
        """tokens: (B, n) continuing each row of ``cache`` -> (B, n, output_size); advances the cache by n.

        Every row first reaches the depth its last new position needs (:meth:`_reserve`), then all the batch's
        thick layers run over the n positions of every row; position t's output is read at its own D(t), and row
        b's hidden states after its own top layer go to ``top_hidden``.
        """
        if tokens.shape[1] == 0:
            return self._logits(self.embedding(tokens))
        chunk_size, length, start = self.config.chunk_size, tokens.shape[1], cache.lengths
        self._reserve(cache, length)
        positions = start[:, None] + torch.arange(length)  # (B, n)
        position_depths = adaptive_depths(positions, chunk_size)  # (B, n) nondecreasing along n
        mixed = bool((position_depths[:, 0] < cache.depth).any())  # some outputs are read below the top layer
        position_depths = position_depths.to(tokens.device)
        x = self.embedding(tokens)  # (B, n, d)
        out = top = x
        allocated = [windows[0].kv.shape[1] for windows in cache.windows]
        plans = ChunkPlan.build(start, length, chunk_size, allocated, tokens.device)
        for layer, (windows, plan) in enumerate(zip(cache.windows, plans)):
            x = self._thick_layer(x, chunk_size**layer, windows=windows, plan=plan)  # (B, n, d)
            if mixed:
                out = torch.where(position_depths[..., None] == layer + 1, x, out)  # (B, n, d)
                top = torch.where(position_depths[:, -1:, None] == layer + 1, x, top)  # each row's own top layer
        if not mixed:
            out = top = x
        rows = torch.arange(cache.batch_size, device=tokens.device)[:, None]  # (B, 1)
        cache.top_hidden[rows, positions.to(tokens.device)] = top
        cache.lengths = start + length
        return self._logits(out)

    def _reserve(self, cache: RegularGPTCache, length: int) -> None:
        """Make room for ``length`` more tokens per row, add the thick layers the batch will need and bring every
        row to the depth its last new position needs: row b at depth D_b < D(t_b + n - 1) runs its t_b consumed
        positions (``top_hidden``) through layers D_b, D_b + 1, ...; there every key but a position's own is out of
        range (t_b <= C**D_b), so this is the parallel pass's pointwise continuation, and it fills the row's
        windows at those layers. Rows that reach a layer together run it as one chunk of context 0."""
        chunk_size, lengths = self.config.chunk_size, cache.lengths.tolist()
        old = [adaptive_depth(t - 1, chunk_size) if t else 0 for t in lengths]
        new = [adaptive_depth(t + length - 1, chunk_size) for t in lengths]
        room = capacity(max(lengths) + length)
        if room != cache.top_hidden.shape[1]:
            cache.top_hidden = _fit(cache.top_hidden, 1, room)
            for layer in cache.windows:  # one at a time: the old tensor goes before the next is copied
                for k, window in enumerate(layer):
                    layer[k] = window.fit(room)
        while cache.depth < max(new):
            cache.windows.append(self._new_layer(cache.batch_size, cache.depth, room))
        for layer in range(1, cache.depth):
            rows = [row for row, (held, needed) in enumerate(zip(old, new)) if 1 <= held <= layer < needed]
            if rows:
                consumed = max(lengths[row] for row in rows)
                index = torch.tensor(rows, device=cache.top_hidden.device)  # (R,)
                allocated = [cache.windows[layer][0].kv.shape[1]]
                start = torch.zeros(len(rows), dtype=torch.long)  # the consumed positions as one chunk
                (plan,) = ChunkPlan.build(start, consumed, chunk_size, allocated, index.device, index, layer)
                hidden = cache.top_hidden[index, :consumed]  # (R, t, d) after layer - 1; garbage past each t_b
                cache.top_hidden[index, :consumed] = self._thick_layer(
                    hidden, chunk_size**layer, windows=cache.windows[layer], plan=plan
                )

    def _new_layer(self, batch_size: int, layer: int, room: int) -> list[KVWindow]:
        """Empty windows of thick layer ``layer``'s K blocks, with room for ``room`` positions."""
        ring = (self.config.chunk_size - 1) * self.config.chunk_size**layer
        shape = (batch_size, min(ring, room), 2 * self.config.d_model)
        return [KVWindow(ring, self._zeros(shape)) for _ in self.blocks]

    def _zeros(self, shape: tuple[int, ...]) -> torch.Tensor:
        return torch.zeros(shape, device=self.device, dtype=self.dtype)

    def _thick_layer(
        self,
        x: torch.Tensor,
        dilation: int,
        key_offset: torch.Tensor | None = None,
        windows: list[KVWindow] | None = None,
        plan: ChunkPlan | None = None,
    ) -> torch.Tensor:
        """The K blocks in order, all at ``dilation``. x: (B, T, d) -> (B, T, d)."""
        for k, block in enumerate(self.blocks):
            window = windows[k] if windows else None
            x = block(x, dilation=dilation, key_offset=key_offset, window=window, plan=plan)
        return x

    def _logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden: (..., d) -> (..., output_size)."""
        return self.embedding.logits(self.ln_f(hidden))
