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
- ``step`` through :class:`RegularGPTCache`: each block keeps the keys and values of only the last
  (C-1) * C**l positions its dilated pattern can reach, in a ring buffer, plus the hidden states of all
  consumed positions at the top thick layer, needed to grow the depth when t reaches C**L.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from model.base import InferenceCache, SequenceModel, TokenEmbedding, check_lengths
from model.config import RegularGPTConfig
from model.layers import Block, HeadProjections, init_gpt2
from model.ops.dilated_attention import attend_gathered, dilated_attention


def adaptive_depth(position: int, chunk_size: int) -> int:
    """D(m) = max(1, ceil(log_C(m + 1))): the fewest thick layers for position m to see position 0."""
    depth, reach = 1, chunk_size
    while reach < position + 1:
        depth, reach = depth + 1, reach * chunk_size
    return depth


@dataclass
class KVWindow:
    """One block's keys and values at the last (C-1) * dilation positions: position p sits in slot p % slots."""

    dilation: int
    keys: torch.Tensor  # (B, H, (C-1) * dilation, hd)
    values: torch.Tensor  # (B, H, (C-1) * dilation, hd)
    length: int = 0  # positions consumed

    def fill(self, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store positions 0..T-1 from a parallel pass. k, v: (B, H, T, hd)."""
        slots = self.keys.shape[2]
        first = max(0, k.shape[2] - slots)
        index = torch.arange(first, k.shape[2], device=k.device) % slots  # (min(T, slots),)
        self.keys[:, :, index] = k[:, :, first:]
        self.values[:, :, index] = v[:, :, first:]
        self.length = k.shape[2]

    def push(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Gather the C dilated keys of the next position t and store its own.

        k, v: (B, H, 1, hd) at position t. Returns keys, values (B, H, 1, C, hd) and valid (C,) bool.
        """
        slots = self.keys.shape[2]
        chunk_size = slots // self.dilation + 1
        back = [self.length - j * self.dilation for j in range(1, chunk_size)]  # positions t - j * dilation
        index = torch.tensor([p % slots for p in back], device=k.device)  # (C-1,)
        keys = torch.cat([k, self.keys[:, :, index]], dim=2).unsqueeze(2)  # (B, H, 1, C, hd)
        values = torch.cat([v, self.values[:, :, index]], dim=2).unsqueeze(2)  # (B, H, 1, C, hd)
        valid = torch.tensor([True] + [p >= 0 for p in back], device=k.device)  # (C,)
        self.keys[:, :, self.length % slots] = k[:, :, 0]
        self.values[:, :, self.length % slots] = v[:, :, 0]
        self.length += 1
        return keys, values, valid

    def clone(self) -> KVWindow:
        return KVWindow(self.dilation, self.keys.clone(), self.values.clone(), self.length)


@dataclass
class RegularGPTCache(InferenceCache):
    """Decoding state: ``windows[l][k]`` is the :class:`KVWindow` of block k at thick layer l, and
    ``top_hidden`` (B, C**depth, d_model) holds in rows [0, length) every consumed position's hidden state
    after the top thick layer (the other rows are room until the depth next grows, at length C**depth)."""

    top_hidden: torch.Tensor
    windows: list[list[KVWindow]] = field(default_factory=list)

    @property
    def depth(self) -> int:
        """Thick layers computed so far."""
        return len(self.windows)

    def clone(self) -> RegularGPTCache:
        windows = [[w.clone() for w in layer] for layer in self.windows]
        return RegularGPTCache(self.length, self.top_hidden.clone(), windows)

    def memory_bytes(self) -> int:
        tensors = [self.top_hidden, *(t for layer in self.windows for w in layer for t in (w.keys, w.values))]
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
    ) -> torch.Tensor:
        """x: (B, T, d_model) -> (B, T, d_model).

        With an empty ``window``, x holds positions 0..T-1 and the window is filled; with a non-empty one,
        x is the single next position (T = 1) and attends through the window.
        """
        q, k, v = self.heads.qkv(x)  # (B, H, T, hd) each
        if window is not None and window.length > 0:
            keys, values, valid = window.push(k, v)  # (B, H, 1, C, hd) x2, (C,)
            out = attend_gathered(
                q, keys, values, self.relative_bias, valid, self.null_key, self.null_value
            )  # (B, H, 1, hd)
        else:
            out = dilated_attention(
                q, k, v, self.relative_bias, self.chunk_size, dilation, key_offset,
                self.null_key, self.null_value, self.impl,
            )  # (B, H, T, hd)
            if window is not None:
                window.fill(k, v)
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

        With an empty ``cache``, the parallel pass also fills it; with a non-empty one, the tokens are
        consumed by ``step`` one at a time (exact, T steps).
        """
        if cache is not None and cache.length > 0:
            return torch.stack([self.step(tokens[:, t], cache) for t in range(tokens.shape[1])], dim=1)
        chunk_size = self.config.chunk_size
        x = self.embedding(tokens)  # (B, T, d)
        outputs = []
        for layer in range(adaptive_depth(tokens.shape[1] - 1, chunk_size)):
            windows = self._new_layer(cache, x.shape[0]) if cache is not None else None
            x = self._thick_layer(x, chunk_size**layer, windows=windows)  # (B, T, d)
            first = 0 if layer == 0 else chunk_size**layer
            outputs.append(x[:, first : chunk_size ** (layer + 1)])  # the positions with D(m) = layer + 1
        if cache is not None:
            self._set_top_hidden(cache, x)
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
        top_hidden = torch.zeros(batch_size, 0, self.config.d_model, device=self.device, dtype=self.dtype)
        return RegularGPTCache(length=0, top_hidden=top_hidden)

    def step(self, tokens: torch.Tensor, cache: RegularGPTCache) -> torch.Tensor:
        """tokens: (B,) -> (B, output_size), read after D(t) thick layers for the new position t.

        Costs O(K * D(t) * (C + d_model) * d_model); the step at t = C**L that grows the depth also runs the
        t consumed positions through the new thick layer, once.
        """
        if cache.length == 0:
            return self.forward(tokens[:, None], cache)[:, 0]
        while adaptive_depth(cache.length, self.config.chunk_size) > cache.depth:
            self._grow(cache)
        x = self.embedding(tokens[:, None])  # (B, 1, d)
        for layer, windows in enumerate(cache.windows):
            x = self._thick_layer(x, self.config.chunk_size**layer, windows=windows)  # (B, 1, d)
        cache.top_hidden[:, cache.length] = x[:, 0]
        cache.length += 1
        return self._logits(x[:, 0])

    def _grow(self, cache: RegularGPTCache) -> None:
        """Add thick layer L at length t = C**L. Every consumed position p < C**L has no key in range there
        but its own (the others are masked or null), so its layer-L output is a pointwise continuation of
        ``top_hidden``: running the new layer over the consumed positions alone gives it."""
        dilation = self.config.chunk_size**cache.depth
        consumed = cache.top_hidden[:, : cache.length]  # (B, t, d)
        windows = self._new_layer(cache, consumed.shape[0])
        self._set_top_hidden(cache, self._thick_layer(consumed, dilation, windows=windows))

    def _new_layer(self, cache: RegularGPTCache, batch_size: int) -> list[KVWindow]:
        """Append empty windows for the next thick layer's K blocks to the cache; returns them."""
        dilation = self.config.chunk_size**cache.depth
        head_dim = self.config.d_model // self.config.n_heads
        shape = (batch_size, self.config.n_heads, (self.config.chunk_size - 1) * dilation, head_dim)
        windows = [KVWindow(dilation, self._zeros(shape), self._zeros(shape)) for _ in self.blocks]
        cache.windows.append(windows)
        return windows

    def _set_top_hidden(self, cache: RegularGPTCache, top: torch.Tensor) -> None:
        """top: (B, t, d), every consumed position after the top thick layer; room up to C**depth rows."""
        room = self._zeros((top.shape[0], self.config.chunk_size**cache.depth - top.shape[1], top.shape[2]))
        cache.top_hidden = torch.cat([top, room], dim=1)  # (B, C**depth, d)
        cache.length = top.shape[1]

    def _zeros(self, shape: tuple[int, ...]) -> torch.Tensor:
        return torch.zeros(shape, device=self.device, dtype=self.dtype)

    def _thick_layer(
        self,
        x: torch.Tensor,
        dilation: int,
        key_offset: torch.Tensor | None = None,
        windows: list[KVWindow] | None = None,
    ) -> torch.Tensor:
        """The K blocks in order, all at ``dilation``. x: (B, T, d) -> (B, T, d)."""
        for k, block in enumerate(self.blocks):
            x = block(x, dilation=dilation, key_offset=key_offset, window=windows[k] if windows else None)
        return x

    def _logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden: (..., d) -> (..., output_size)."""
        return self.embedding.logits(self.ln_f(hidden))

