"""Causal GPT-2 transformer baseline with a choice of position handling (model.ops.positions).

Attention at query position m (0-based, counted from the start of the sequence) is

    softmax_j( s_m * (q_m.k_j / sqrt(hd) + bias[m, j]) ) over keys j <= m,

with s_m = log(m + 1) when ``log_length_scaling`` is on and 1 otherwise. The paper (exact-parity-first.txt
section 5.3, Eq. 2) scales "the logits of each attention layer by log n", n counting the positions attended
over; a causal query at m attends over m + 1 of them, so the scale depends only on the query's own position
and stays causal. At m = 0 the scale is 0, which leaves the single visible key with weight 1, as unscaled.

Decoding keeps per layer the keys and values seen so far in a buffer that doubles when full, so a step
writes in place (amortised O(1) copying) and the cache holds at most twice the bytes it needs.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from torch.nn import functional as F

from model.base import InferenceCache, SequenceModel, TokenEmbedding, gather_last
from model.config import TransformerConfig
from model.layers import Block, HeadProjections, init_gpt2
from model.ops.positions import (
    ALiBi,
    KerpleLog,
    T5Buckets,
    XLRelative,
    relative_distance,
    sinusoidal_encoding,
)


@dataclass
class KVBuffer:
    """One layer's keys and values, (B, H, capacity, hd), of which the first ``length`` positions are filled
    (the length is the owning cache's)."""

    keys: torch.Tensor
    values: torch.Tensor

    def extend(self, k: torch.Tensor, v: torch.Tensor, start: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Write k, v (B, H, T, hd) at positions [start, start + T); return all keys and values so far,
        (B, H, start + T, hd) each."""
        end = start + k.shape[2]
        capacity = self.keys.shape[2]
        if end > capacity:
            grown = max(end, 2 * capacity)
            self.keys = _grow(self.keys[:, :, :start], grown)
            self.values = _grow(self.values[:, :, :start], grown)
        self.keys[:, :, start:end] = k
        self.values[:, :, start:end] = v
        return self.keys[:, :, :end], self.values[:, :, :end]


def _grow(filled: torch.Tensor, capacity: int) -> torch.Tensor:
    """filled: (B, H, T, hd) -> (B, H, capacity, hd) with filled at the front."""
    batch, heads, length, head_dim = filled.shape
    grown = filled.new_empty(batch, heads, capacity, head_dim)
    grown[:, :, :length] = filled
    return grown


@dataclass
class TransformerCache(InferenceCache):
    layers: list[KVBuffer]

    def clone(self) -> TransformerCache:
        layers = [KVBuffer(layer.keys.clone(), layer.values.clone()) for layer in self.layers]
        return TransformerCache(length=self.length, layers=layers)

    def memory_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for layer in self.layers for t in (layer.keys, layer.values))


class CausalSelfAttention(nn.Module):
    """Multi-head causal attention with the configured relative position bias and optional log-length scaling."""

    def __init__(self, config: TransformerConfig) -> None:
        super().__init__()
        self.heads = HeadProjections(config.d_model, config.n_heads, config.dropout)
        self.position_bias = build_position_bias(config)
        self.log_length_scaling = config.log_length_scaling
        self.attention_dropout = config.dropout

    def forward(self, x: torch.Tensor, offset: int, kv: KVBuffer | None) -> torch.Tensor:
        """x: (B, T, d_model) at positions [offset, offset + T) -> (B, T, d_model). With ``kv``, the keys and
        values of positions [0, offset) come from it and those of x are appended."""
        q, k, v = self.heads.qkv(x)  # (B, H, T, hd) each
        if kv is not None:
            k, v = kv.extend(k, v, offset)  # (B, H, Tk, hd), Tk = offset + T
        query_length, key_length = q.shape[2], k.shape[2]
        if self.position_bias is None:
            bias = q.new_zeros(query_length, key_length)  # (T, Tk)
        else:
            bias = self.position_bias(q, k, offset)  # (1 or B, H, T, Tk)
        if self.log_length_scaling:
            positions = torch.arange(offset, offset + query_length, device=q.device, dtype=torch.float32)
            scale = torch.log1p(positions).to(q.dtype)[:, None]  # (T, 1): log(m + 1)
            q = q * scale  # scales q.k / sqrt(hd)
            bias = bias * scale
        future = relative_distance(offset, query_length, key_length, q.device) < 0  # (T, Tk)
        mask = bias.masked_fill(future, float("-inf"))
        dropout = self.attention_dropout if self.training else 0.0
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout)  # (B, H, T, hd)
        return self.heads.merge(y)


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
    """Embedding (+ sinusoidal positions) -> n_layers pre-norm blocks -> LayerNorm -> head.

    Every layer owns its position parameters (T5 itself shares one bucket table across layers)."""

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
        """tokens: (B, T) -> final hidden states (B, T, d_model); advances ``cache`` by T."""
        offset = 0 if cache is None else cache.length
        x = self.embedding(tokens)  # (B, T, d_model)
        if self.config.position == "sinusoidal":
            positions = torch.arange(offset, offset + tokens.shape[1], device=tokens.device)
            x = x + sinusoidal_encoding(positions, self.config.d_model).to(x.dtype)  # (B, T, d_model)
        x = self.dropout(x)
        for index, block in enumerate(self.blocks):
            x = block(x, offset=offset, kv=None if cache is None else cache.layers[index])
        if cache is not None:
            cache.length += tokens.shape[1]
        return self.ln_f(x)

    def forward(self, tokens: torch.Tensor, cache: InferenceCache | None = None) -> torch.Tensor:
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
        return TransformerCache(length=0, layers=layers)

    def step(self, tokens: torch.Tensor, cache: InferenceCache) -> torch.Tensor:
        return self.forward(tokens[:, None], cache)[:, 0]  # (B, output_size)

    def final_logits(self, tokens: torch.Tensor, lengths: torch.Tensor | None = None) -> torch.Tensor:
        """The head runs on the last real positions only, not on all B * T."""
        return self.embedding.logits(gather_last(self.hidden(tokens), lengths))  # (B, output_size)
