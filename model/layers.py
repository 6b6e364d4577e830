"""Building blocks: the token embedding and head every architecture shares, and GPT-2's blocks (RegularGPT and the
transformer baselines)."""

from __future__ import annotations

import math

import torch
from torch import nn
from torch.nn import functional as F

from model.config import BaseModelConfig
from model.ops.cpu.cpu_decode import linear, linear_argmax


class MLP(nn.Module):
    """GPT-2 feed-forward: Linear -> GELU -> Linear."""

    def __init__(self, d_model: int, d_ff: int, dropout: float = 0.0) -> None:
        super().__init__()
        self.c_fc = nn.Linear(d_model, d_ff)
        self.c_proj = nn.Linear(d_ff, d_model)
        self.dropout = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hidden = F.gelu(linear(x, self.c_fc.weight, self.c_fc.bias))  # (..., d_ff)
        out: torch.Tensor = self.dropout(linear(hidden, self.c_proj.weight, self.c_proj.bias))
        return out


class HeadProjections(nn.Module):
    """Multi-head attention's q/k/v projection into heads and output projection back."""

    def __init__(self, d_model: int, n_heads: int, dropout: float = 0.0) -> None:
        super().__init__()
        self.n_heads = n_heads
        self.head_dim = d_model // n_heads
        self.c_attn = nn.Linear(d_model, 3 * d_model)
        self.c_proj = nn.Linear(d_model, d_model)
        self.dropout = nn.Dropout(dropout)

    def qkv(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x: (B, T, d_model) -> q, k, v each (B, n_heads, T, head_dim)."""
        batch, length, _ = x.shape
        q, k, v = self.c_attn(x).split(self.n_heads * self.head_dim, dim=-1)
        shape = (batch, length, self.n_heads, self.head_dim)
        return q.view(shape).transpose(1, 2), k.view(shape).transpose(1, 2), v.view(shape).transpose(1, 2)

    def merge(self, heads: torch.Tensor) -> torch.Tensor:
        """heads: (B, n_heads, T, head_dim) -> (B, T, d_model), through the output projection."""
        batch, _, length, _ = heads.shape
        merged = heads.transpose(1, 2).reshape(batch, length, self.n_heads * self.head_dim)
        out: torch.Tensor = self.dropout(self.c_proj(merged))
        return out


class Block(nn.Module):
    """Around an attention module: x + f(LN(x)) for attention, then MLP; with ``post_norm`` LN(x + f(x))."""

    def __init__(
        self, d_model: int, d_ff: int, attention: nn.Module, eps: float, dropout: float = 0.0, post_norm: bool = False
    ) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(d_model, eps=eps)
        self.attention = attention
        self.ln_2 = nn.LayerNorm(d_model, eps=eps)
        self.mlp = MLP(d_model, d_ff, dropout)
        self.post_norm = post_norm

    def forward(self, x: torch.Tensor, **attention_kwargs: object) -> torch.Tensor:
        if self.post_norm:
            x = self.ln_1(x + self.attention(x, **attention_kwargs))
            out: torch.Tensor = self.ln_2(x + self.mlp(x))
            return out
        x = x + self.attention(self.ln_1(x), **attention_kwargs)
        out = x + self.mlp(self.ln_2(x))
        return out


def init_gpt2(model: nn.Module, n_residual_layers: int) -> None:
    """GPT-2 init: Linear and Embedding weights N(0, 0.02), biases 0, ``c_proj`` N(0, 0.02 / sqrt(2
    n_residual_layers))."""
    for module in model.modules():
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)
    for name, parameter in model.named_parameters():
        if name.endswith("c_proj.weight"):
            nn.init.normal_(parameter, std=0.02 / math.sqrt(2 * n_residual_layers))


class TokenEmbedding(nn.Module):
    """Token embedding plus the output head: tied for a language model, a separate linear map for labels."""

    def __init__(self, config: BaseModelConfig) -> None:
        super().__init__()
        self.embed = nn.Embedding(config.vocab_size, config.d_model)
        self.label_head = None if config.is_language_model else nn.Linear(config.d_model, config.num_labels)
        nn.init.normal_(self.embed.weight, std=0.02)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """tokens: (B, T) -> (B, T, d_model)."""
        embedded: torch.Tensor = self.embed(tokens)
        return embedded

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden: (..., d_model) -> (..., output_size)."""
        if self.label_head is None:
            return linear(hidden, self.embed.weight)  # tied: hidden @ embed.weight^T
        return linear(hidden, self.label_head.weight, self.label_head.bias)

    def greedy(self, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """hidden (B, d_model) -> (ids (B,) int64, values (B,)) of each row's largest logit."""
        if self.label_head is None:
            return linear_argmax(hidden, self.embed.weight)
        return linear_argmax(hidden, self.label_head.weight, self.label_head.bias)
