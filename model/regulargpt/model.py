"""RegularGPT (Chi, Fan, Rudnicky, Ramadge 2023): thick layer l runs the K = ``thickness`` shared blocks with
Sliding-Dilated-Attention at dilation C**l, and position m is read after max(1, ceil(log_C(m + 1))) thick layers, so the
model is causal and decoding reproduces the parallel pass (docs/models.md)."""

from __future__ import annotations

from collections.abc import Callable, Generator
from typing import cast

import torch
from torch import nn

from model.base import SequenceModel, check_lengths
from model.cache import InferenceCache, long_tensor
from model.config import RegularGPTConfig
from model.layers import Block, HeadProjections, TokenEmbedding, init_gpt2
from model.ops.attention.dispatch import AUTO_REFERENCE_MAX_T, dilated_attention
from model.ops.cpu import cpu_decode
from model.regulargpt import cost as regulargpt_cost
from model.regulargpt.cache import RegularGPTCache, adaptive_depth
from model.regulargpt.decode import PackedBlocks, forward_chunk, pack_blocks
from model.serving import CallPath, Cost
from model.transformer.exact import Pieces, in_slices


class DilatedSelfAttention(nn.Module):
    """Multi-head Sliding-Dilated-Attention with per-head scalars r_j, and for ``out_of_range="null"`` a learned null
    key and value per head."""

    null_key: nn.Parameter | None
    null_value: nn.Parameter | None

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

    def forward(self, x: torch.Tensor, dilation: int, key_offset: torch.Tensor | None = None) -> torch.Tensor:
        """The parallel pass: x (B, T, d_model), positions 0..T-1 -> (B, T, d_model), through ``self.impl``."""
        q, k, v = self.heads.qkv(x)  # (B, H, T, hd) each
        out = dilated_attention(
            q,
            k,
            v,
            self.relative_bias,
            self.chunk_size,
            dilation,
            key_offset,
            self.null_key,
            self.null_value,
            self.impl,
        )  # (B, H, T, hd)
        return self.heads.merge(out)


class RegularGPT(SequenceModel):
    config: RegularGPTConfig
    level_codes: nn.Parameter | None

    def __init__(self, config: RegularGPTConfig) -> None:
        super().__init__()
        self.config = config
        self.embedding = TokenEmbedding(config)
        self.blocks = nn.ModuleList(
            Block(
                config.d_model,
                config.d_ff,
                DilatedSelfAttention(config),
                config.layer_norm_eps,
                config.dropout,
                post_norm=config.block_norm == "post",
            )
            for _ in range(config.thickness)
        )
        self.ln_f = nn.LayerNorm(config.d_model, eps=config.layer_norm_eps)
        init_gpt2(self, n_residual_layers=config.thickness)  # scaled over the K distinct blocks
        codes = nn.Parameter(torch.zeros(config.output_size, config.d_model)) if config.level_codes else None
        self.register_parameter("level_codes", codes)  # (labels, d): set by ``python -m training snap``
        self.packed: PackedBlocks | None = None  # set by for_serving where decode steps run compiled
        self.fixed_costs = regulargpt_cost.FixedCosts()  # the cached path's, once measured (measure_fixed_costs)
        # Training only (set by the trainer): read every position this many thick layers above its depth D(m).
        self.extra_levels = 0

    def forward(self, tokens: torch.Tensor, cache: InferenceCache | None = None) -> torch.Tensor:
        """tokens (B, T) -> (B, T, output_size); with ``cache``, continue each row and advance the cache by T."""
        assert cache is None or isinstance(cache, RegularGPTCache)
        x = self.embedding(tokens)  # (B, T, d)
        if cache is not None:
            return self._logits(forward_chunk(x, cache, self.blocks, self.packed, self.config, self._settle))
        chunk_size = self.config.chunk_size
        extra = self.extra_levels if self.training else 0
        outputs = []
        for layer in range(adaptive_depth(tokens.shape[1] - 1, chunk_size) + extra):
            x = self._thick_layer(x, chunk_size**layer)  # (B, T, d)
            depth = layer - extra + 1  # read the positions with D(m) = depth
            if depth >= 1:
                first = 0 if depth == 1 else chunk_size ** (depth - 1)
                outputs.append(x[:, first : chunk_size**depth])
        return self._logits(torch.cat(outputs, dim=1))

    def final_logits(self, tokens: torch.Tensor, lengths: torch.Tensor | None = None) -> torch.Tensor:
        """The shrinking path (docs/models.md): tokens (B, T) right-padded, lengths (B,) -> (B, output_size)."""
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
            lengths=long_tensor(0, batch_size),
            chunk_size=self.config.chunk_size,
            top_hidden=torch.zeros((batch_size, 0, self.config.d_model), device=self.device, dtype=self.dtype),
        )

    def step(self, tokens: torch.Tensor, cache: InferenceCache) -> torch.Tensor:
        """tokens: (B,) -> (B, output_size): a chunk of one position per row, each read after its own depth."""
        return self.forward(tokens[:, None], cache)[:, 0]

    def for_serving(self) -> list[str]:
        """Switch to what scales and decodes fast ("reference" attention -> "auto"; on the CPU, packed blocks for the
        compiled step or a transposed tied head, then oneDNN packs); returns a note per change."""
        notes = []
        if any(cast(DilatedSelfAttention, block.attention).impl == "reference" for block in self.blocks):
            for block in self.blocks:
                cast(DilatedSelfAttention, block.attention).impl = "auto"
            notes.append(
                f"attention_impl reference -> auto (the T x T mask would not fit long inputs; the reference is kept "
                f"up to {AUTO_REFERENCE_MAX_T} positions)"
            )
        if self.device.type != "cpu":
            return notes
        if cpu_decode.streams(dtype=self.dtype) and self.config.block_norm == "pre":  # the compiled layer's blocks
            self.packed = pack_blocks(self.blocks, self.packed)
            notes.append(f"thick layers step as one compiled call each at {cpu_decode.rows_note()} (CPU)")
            return [*notes, *super().for_serving()]
        head = self.embedding.embed.weight  # (V, d): the tied head multiplies by its transpose
        wide = head.shape[0] > head.shape[1] and head.stride() != (1, head.shape[0])
        if self.config.is_language_model and wide:
            head.data = head.data.t().contiguous().t()  # (V, d) with (d, V) in memory
            notes.append("the tied head stored transposed for one-token products (CPU)")
        return [*notes, *super().for_serving()]

    def cost(self, path: CallPath, rows: int, length: int, context: int = 0) -> Cost:
        """Multiply-adds and peak bytes of one call (:func:`model.regulargpt.cost.cost`)."""
        return regulargpt_cost.cost(
            self.config, self.dtype.itemsize, self._impl, path, rows, length, context, self.fixed_costs
        )

    def measure_fixed_costs(self) -> None:
        """Measure the cached path's fixed work on this device, for :meth:`cost`."""
        self.fixed_costs = regulargpt_cost.measure_fixed_costs(self)

    def cache_nbytes(self, length: int) -> int:
        """One row after ``length`` tokens, as allocated."""
        return regulargpt_cost.cache_nbytes(self.config, self.dtype.itemsize, length)

    def run_in_slices(
        self, tokens: torch.Tensor, all_outputs: bool, slice_flops: float
    ) -> Generator[float, None, tuple[torch.Tensor, torch.Tensor | None]]:
        """tokens (1, T) in slices of about ``slice_flops``: "final" by the shrinking path, each layer in pieces of
        positions (with a halo of K (C - 1)); ``all_outputs`` through the cache."""
        if all_outputs:
            return (yield from super().run_in_slices(tokens, all_outputs, slice_flops))
        return (yield from in_slices(self._final_pieces(tokens, slice_flops), slice_flops))

    def _final_pieces(self, tokens: torch.Tensor, piece_flops: float) -> Pieces[tuple[torch.Tensor, None]]:
        """tokens: (1, T) -> (final logits (output_size,), None), :meth:`final_logits` for one unpadded row."""
        chunk_size, halo = self.config.chunk_size, self.config.thickness * (self.config.chunk_size - 1)
        per_position = self._final_flops_per_position(tokens.shape[1])
        piece = max(1, int(piece_flops // per_position) - halo)  # with its halo, within ``piece_flops``
        x = self.embedding(tokens)  # (1, T, d)
        for _ in range(adaptive_depth(tokens.shape[1] - 1, chunk_size)):
            length = x.shape[1]
            first = (length - 1) % chunk_size  # the last element of each chunk is kept, as final_logits keeps it
            kept = torch.empty(1, (length - 1) // chunk_size + 1, x.shape[2], dtype=x.dtype, device=x.device)
            for start in range(0, length, piece):
                end, low = min(length, start + piece), max(0, start - halo)
                yield per_position * (end - low)
                y = self._thick_layer(x[:, low:end], dilation=1)  # (1, end - low, d); the halo's own keys are cut
                own = start + (first - start) % chunk_size  # the first kept position of the piece
                if own < end:
                    kept[:, (own - first) // chunk_size : (end - 1 - first) // chunk_size + 1] = y[
                        :, own - low : end - low : chunk_size
                    ]
            x = kept
        return self._logits(x[:, -1])[0], None  # (1, d) -> (output_size,)

    def _final_flops_per_position(self, length: int, cost: Callable[..., Cost] | None = None) -> float:
        """The shrinking path's multiply-adds per thick-layer position."""
        final = (cost or self.cost)("final", 1, length)
        return final.flops / sum(regulargpt_cost.final_layers(self.config, length))

    def slices_cost(
        self, length: int, all_outputs: bool, slice_flops: float, cost: Callable[..., Cost] | None = None
    ) -> Cost:
        """The cost of :meth:`run_in_slices`."""
        if all_outputs:
            return super().slices_cost(length, all_outputs, slice_flops, cost)
        cost = cost or self.cost
        final = cost("final", 1, length)
        piece = max(1, int(slice_flops // self._final_flops_per_position(length, cost)))  # with its halo: at most
        hidden = length * self.config.d_model * self.dtype.itemsize
        return Cost(flops=final.flops, nbytes=2 * hidden + cost("final", 1, min(length, piece)).nbytes)

    @property
    def _impl(self) -> str:
        """The parallel passes' attention implementation, as configured or switched by :meth:`for_serving`."""
        return cast(DilatedSelfAttention, self.blocks[0].attention).impl

    def _thick_layer(self, x: torch.Tensor, dilation: int, key_offset: torch.Tensor | None = None) -> torch.Tensor:
        """The K blocks in order, all at ``dilation``, over positions 0..T-1, then :meth:`_settle`. x: (B, T, d) ->
        (B, T, d)."""
        for block in self.blocks:
            x = block(x, dilation=dilation, key_offset=key_offset)
        return self._settle(x)

    def _settle(self, x: torch.Tensor) -> torch.Tensor:
        """A thick layer's output x (..., d) as the next one reads it: with ``level_codes``, each position's code of
        the label the head reads from it; else x."""
        if self.level_codes is None:
            return x
        return self.level_codes[self._logits(x).argmax(dim=-1)]

    def _logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden: (..., d) -> (..., output_size)."""
        return self.embedding.logits(self.ln_f(hidden))
