"""Causal GPT-2 transformer baseline (positions: model/ops/positions.py). Query m's logits are s_m (q_m.k_j / sqrt(hd) +
bias[m, j]), s_m = log(m + 1) under ``log_length_scaling`` else 1. The KV cache doubles when full."""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn
from torch.nn import functional as F

from model.base import SequenceModel, gather_last, parameter_count
from model.cache import InferenceCache, long_tensor
from model.config import TransformerConfig
from model.layers import Block, HeadProjections, TokenEmbedding, init_gpt2
from model.ops.positions import (
    ALiBi,
    KerpleLog,
    QueryOffset,
    T5Buckets,
    XLRelative,
    last_query_position,
    query_positions,
    relative_distance,
    sinusoidal_encoding,
)
from model.serving import CallPath, Cost


@dataclass
class KVBuffer:
    """One layer's keys and values (B, H, capacity, hd): row b's first ``lengths[b]`` positions, then zeros."""

    keys: torch.Tensor
    values: torch.Tensor

    @property
    def capacity(self) -> int:
        return self.keys.shape[2]

    def extend(self, k: torch.Tensor, v: torch.Tensor, start: QueryOffset) -> tuple[torch.Tensor, torch.Tensor]:
        """Write k, v (B, H, T, hd) at each row's positions from ``start`` (int or (B,)); returns keys and values up to
        the longest row's end. A full buffer at least doubles."""
        length = k.shape[2]
        end = last_query_position(start, length) + 1
        if end > self.capacity:
            capacity = max(end, 2 * self.capacity)
            self.keys, self.values = _pad_capacity(self.keys, capacity), _pad_capacity(self.values, capacity)
        positions = query_positions(start, length, k.device)  # (T,) or (B, T)
        index = positions.view(-1, 1, length, 1).expand_as(k)  # (B, H, T, hd)
        self.keys.scatter_(2, index, k)
        self.values.scatter_(2, index, v)
        return self.keys[:, :, :end], self.values[:, :, :end]

    def select(self, rows: torch.Tensor, capacity: int) -> KVBuffer:
        """Copies of ``rows`` (int64 on the buffer's device), keeping the first ``capacity`` positions."""
        return KVBuffer(self.keys[:, :, :capacity][rows], self.values[:, :, :capacity][rows])

    @staticmethod
    def stack(buffers: Sequence[KVBuffer], capacity: int) -> KVBuffer:
        """The rows of ``buffers`` in order, each padded to ``capacity`` positions."""
        return KVBuffer(
            torch.cat([_pad_capacity(buffer.keys, capacity) for buffer in buffers]),
            torch.cat([_pad_capacity(buffer.values, capacity) for buffer in buffers]),
        )


def _pad_capacity(buffer: torch.Tensor, capacity: int) -> torch.Tensor:
    """buffer (B, H, T, hd) -> a zero-padded copy (B, H, capacity, hd)."""
    return F.pad(buffer, (0, 0, 0, capacity - buffer.shape[2]))


@dataclass
class TransformerCache(InferenceCache):
    """Every layer's :class:`KVBuffer` at one capacity; :meth:`select` keeps at most twice the longest row's length."""

    layers: list[KVBuffer]

    @classmethod
    def stack(cls, caches: Sequence[TransformerCache]) -> TransformerCache:
        capacity = max(cache.layers[0].capacity for cache in caches)
        layers = [KVBuffer.stack(buffers, capacity) for buffers in zip(*(cache.layers for cache in caches))]
        return TransformerCache(torch.cat([cache.lengths for cache in caches]), layers)

    def select(self, rows: Sequence[int]) -> TransformerCache:
        index = torch.tensor(list(rows), dtype=torch.long)  # (rows,)
        lengths = self.lengths[index]
        capacity = min(self.layers[0].capacity, 2 * int(lengths.max())) if len(index) else 0
        index = index.to(self.layers[0].keys.device)
        return TransformerCache(lengths, [layer.select(index, capacity) for layer in self.layers])

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for layer in self.layers for t in (layer.keys, layer.values))


class CausalSelfAttention(nn.Module):
    """Multi-head causal attention with the configured position bias and log-length scaling."""

    def __init__(self, config: TransformerConfig) -> None:
        super().__init__()
        self.heads = HeadProjections(config.d_model, config.n_heads, config.dropout)
        self.position_bias = build_position_bias(config)
        self.log_length_scaling = config.log_length_scaling
        self.attention_dropout = config.dropout

    def forward(self, x: torch.Tensor, offset: QueryOffset, kv: KVBuffer | None) -> torch.Tensor:
        """x (B, T, d_model) at positions from ``offset`` (int or (B,) int64 on the CPU) -> (B, T, d_model); with
        ``kv``, earlier keys and values come from it and x's are appended."""
        q, k, v = self.heads.qkv(x)  # (B, H, T, hd) each
        if kv is not None:
            k, v = kv.extend(k, v, offset)  # (B, H, Tk, hd), Tk = max(offset) + T
        query_length, key_length = q.shape[2], k.shape[2]
        if self.position_bias is None:
            bias = q.new_zeros(1, 1, query_length, key_length)  # (1, 1, T, Tk)
        else:
            bias = self.position_bias(q, k, offset)  # (1 or B, H, T, Tk)
        if self.log_length_scaling:
            positions = query_positions(offset, query_length, q.device).to(torch.float32)  # (T,) or (B, T)
            scale = torch.log1p(positions).to(q.dtype).view(-1, 1, query_length, 1)  # (1 or B, 1, T, 1): log(m + 1)
            q = q * scale  # scales q.k / sqrt(hd)
            bias = bias * scale
        future = relative_distance(offset, query_length, key_length, q.device) < 0  # (T, Tk) or (B, T, Tk)
        mask = bias.masked_fill(future.unsqueeze(-3), float("-inf"))  # (1 or B, H, T, Tk)
        dropout = self.attention_dropout if self.training else 0.0
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout)  # (B, H, T, hd)
        return self.heads.merge(y)


def _query_offset(lengths: torch.Tensor) -> QueryOffset:
    """The rows' first query position: an int if all rows hold the same length, else the (B,) lengths."""
    return int(lengths[0]) if bool((lengths == lengths[0]).all()) else lengths


def build_position_bias(config: TransformerConfig) -> nn.Module | None:
    """The attention bias module of ``config.position``; None for absolute sinusoidal positions."""
    if config.position == "sinusoidal":
        return None
    if config.position == "alibi":
        return ALiBi(config.n_heads)
    if config.position == "kerple":
        return KerpleLog(config.n_heads)
    if config.position == "t5":
        return T5Buckets(config.n_heads, config.t5_num_buckets, config.t5_max_distance)
    if config.position == "xl":
        return XLRelative(config.d_model, config.n_heads)
    raise ValueError(f"unknown position handling {config.position!r}")


class Transformer(SequenceModel):
    """Embedding (+ sinusoids) -> n_layers pre-norm blocks -> LayerNorm -> head."""

    config: TransformerConfig

    def __init__(self, config: TransformerConfig) -> None:
        super().__init__()
        self.config = config
        self.embedding = TokenEmbedding(config)
        self.dropout = nn.Dropout(config.dropout)
        self.blocks = nn.ModuleList(
            Block(config.d_model, config.d_ff, CausalSelfAttention(config), config.layer_norm_eps, config.dropout)
            for _ in range(config.n_layers)
        )
        self.ln_f = nn.LayerNorm(config.d_model, eps=config.layer_norm_eps)
        init_gpt2(self, n_residual_layers=config.n_layers)

    def hidden(self, tokens: torch.Tensor, cache: TransformerCache | None = None) -> torch.Tensor:
        """tokens (B, T) -> final hidden states (B, T, d_model); continues and advances ``cache``."""
        offset = 0 if cache is None else _query_offset(cache.lengths)
        x = self.embedding(tokens)  # (B, T, d_model)
        if self.config.position == "sinusoidal":
            positions = query_positions(offset, tokens.shape[1], tokens.device)  # (T,) or (B, T)
            x = x + sinusoidal_encoding(positions, self.config.d_model).to(x.dtype)  # (B, T, d_model)
        x = self.dropout(x)
        for index, block in enumerate(self.blocks):
            x = block(x, offset=offset, kv=None if cache is None else cache.layers[index])
        if cache is not None:
            cache.lengths = cache.lengths + tokens.shape[1]
        hidden: torch.Tensor = self.ln_f(x)
        return hidden

    def forward(self, tokens: torch.Tensor, cache: InferenceCache | None = None) -> torch.Tensor:
        assert cache is None or isinstance(cache, TransformerCache)
        return self.embedding.logits(self.hidden(tokens, cache))  # (B, T, output_size)

    def new_cache(self, batch_size: int) -> TransformerCache:
        head_dim = self.config.d_model // self.config.n_heads
        shape = (batch_size, self.config.n_heads, 0, head_dim)
        layers = [
            KVBuffer(
                torch.empty(shape, device=self.device, dtype=self.dtype),
                torch.empty(shape, device=self.device, dtype=self.dtype),
            )
            for _ in self.blocks
        ]
        return TransformerCache(long_tensor(0, batch_size), layers)

    def step(self, tokens: torch.Tensor, cache: InferenceCache) -> torch.Tensor:
        return self.forward(tokens[:, None], cache)[:, 0]  # (B, output_size)

    def final_logits(self, tokens: torch.Tensor, lengths: torch.Tensor | None = None) -> torch.Tensor:
        """The head runs on each row's last real position only."""
        return self.embedding.logits(gather_last(self.hidden(tokens), lengths))  # (B, output_size)

    def cost(self, path: CallPath, rows: int, length: int, context: int = 0) -> Cost:
        """T queries against Tk = context + T keys. flops: the blocks' weights per token, 2 T Tk d attention per layer
        (XL: + H T Tk d + Tk d), the head per logit. nbytes: activations, logits and the largest layer transient."""
        config = self.config
        context = context if path == "cached" else 0
        keys, item, xl = context + length, self.dtype.itemsize, config.position == "xl"
        per_token = self._block_weights
        attention = (2 * length + (config.n_heads * length + 1 if xl else 0)) * keys * config.d_model
        logit_positions = rows if path == "final" else rows * length
        head = logit_positions * config.d_model * config.output_size
        offset_rows = rows if path == "cached" else 1  # rows with their own query positions
        pairs = config.n_heads * length * keys
        scores = rows * pairs * item
        bias = (4 * rows if xl else 2 * offset_rows) * pairs * item
        distances = 2 * offset_rows * length * keys * 8
        cached = (2 * rows * keys + 4 * rows * context) * config.d_model * item if path == "cached" else 0
        activations = rows * length * (8 * config.d_model + 2 * config.d_ff) * item
        return Cost(
            flops=float(rows * (length * per_token + config.n_layers * attention) + head),
            nbytes=activations + scores + bias + distances + cached + logit_positions * config.output_size * item,
        )

    @functools.cached_property
    def _block_weights(self) -> int:
        return parameter_count(self.blocks)

    def cache_nbytes(self, length: int) -> int:
        """Keys and values of every layer for up to 2 ``length`` positions (buffers double)."""
        return self.config.n_layers * 2 * 2 * length * self.config.d_model * self.dtype.itemsize
