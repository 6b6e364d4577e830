"""Hand-built transformer encoders that recognise PARITY, FIRST, ONE and PALINDROME exactly.

The architecture of exact-parity-first.txt section 2.2 (also exact-one-palindrome.txt section 2.2): a post-norm
encoder over CLS w_1 .. w_m (EOS), whose CLS vector after the last layer is read by a linear head:

    a_0,i = WE(w_i) + W_pos f(i, n)                        i = 0 .. n-1; n counts CLS (and EOS)
    c_l,i = LN(sum_h V_h^T softmax(s_n K_h q_h,i / sqrt(d)) + a_l-1,i)
    a_l,i = LN(W_F2 relu(W_F1 c_l,i + b_F1) + b_F2 + c_l,i)

with q = W_Q a, K = A W_K^T, V = A W_V^T per head (d x d maps, no output projection), s_n = log n under
``log_length_scaling`` (exact-parity-first.txt Eq. 2) and 1 otherwise, and LN(x) = (x - mean) / sqrt(var + eps)
without gain or bias (the identity without ``layer_norm``). f(i, n) are the position features below: the papers
allow PE to be any function of i and n. The weights are set by training/exact_builders.py; this module holds
the architecture only.

Per-position labels. The papers classify a whole string, while a transducer labels every prefix w_1 .. w_t
(SPEC section 1). A prefix is a different encoder input (n, hence every positional encoding and attention
weight, changes), so ``forward`` runs the encoder once per prefix length, batched over the rows, and
``final_logits`` once per row on the whole string. Only the CLS vector of the last layer is read, so the last
layer computes the CLS query alone; a head whose value map is zero adds exactly 0 and is skipped. The cost of
one encoder pass is O(n^2) when a layer before the last attends (PARITY, the mirror PALINDROME) and O(n)
otherwise; ``forward`` over T symbols costs the sum of its T prefixes' passes. Attention is computed in query
chunks that hold at most ``attention_block_elements`` weights, so memory stays O(n) per row.

Decoding has no incremental path: the cache holds the symbols read so far, and ``step`` re-runs the encoder
on the whole prefix, which gives exactly the logits of the parallel pass.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn
from torch.nn import functional as F

from model.base import InferenceCache, SequenceModel, check_lengths
from model.config import ExactTransformerConfig, PositionFeature

ZERO_TEST_LOGIT = 10.0  # an indicator output has no confidence: its decision is reported as logits -10 / +10
DTYPES = {"float32": torch.float32, "float64": torch.float64}


def position_features(
    names: tuple[PositionFeature, ...], n: int, dtype: torch.dtype, device: torch.device
) -> torch.Tensor:
    """The features f(i, n) of positions i = 0 .. n-1, (n, len(names)).

    fraction: i / n; alternating: cos(i pi); is_first_symbol: I[i = 1]; index: i; mirror_index: n - 1 - i;
    index_squared: i^2; left_half: I[i <= (n - 1) / 2]; right_half: I[i >= (n - 1) / 2].
    """
    i = torch.arange(n, device=device)
    features = {
        "fraction": lambda: i.to(dtype) / n,
        "alternating": lambda: 1 - 2 * (i % 2),
        "is_first_symbol": lambda: i == 1,
        "index": lambda: i,
        "mirror_index": lambda: n - 1 - i,
        "index_squared": lambda: i * i,
        "left_half": lambda: 2 * i <= n - 1,
        "right_half": lambda: 2 * i >= n - 1,
    }
    columns = [features[name]().to(dtype) for name in names]
    return torch.stack(columns, dim=1) if columns else torch.zeros(n, 0, dtype=dtype, device=device)


def encoder_attention(
    queries: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, logit_scale: float, block_elements: int
) -> torch.Tensor:
    """Bidirectional softmax attention, queries taken in chunks so that at most ``block_elements`` weights exist.

    queries: (B, H, Tq, d); keys, values: (B, H, n, d) -> (B, H, Tq, d), each query attending to all n keys with
    logits logit_scale * q.k / sqrt(d). Without autograd every chunk's weights are computed in place in one
    buffer (the same arithmetic): allocating a large block per chunk fragments glibc's heap, which then grows by
    gigabytes over a sweep of lengths.
    """
    batch, heads, n_queries, width = queries.shape
    n_keys = keys.shape[2]
    chunk = max(1, min(n_queries, block_elements // (batch * heads * n_keys)))
    queries = (queries * (logit_scale / math.sqrt(width))).flatten(0, 1)  # (BH, Tq, d)
    keys_t = keys.transpose(-1, -2).flatten(0, 1).contiguous()  # (BH, d, n), copied once, not per chunk
    values = values.flatten(0, 1).contiguous()  # (BH, n, d)
    in_place = not (torch.is_grad_enabled() and any(t.requires_grad for t in (queries, keys_t, values)))
    buffer = queries.new_empty(batch * heads * chunk * n_keys) if in_place else None
    outputs = []
    for start in range(0, n_queries, chunk):
        size = min(chunk, n_queries - start)
        scratch = None if buffer is None else buffer[: batch * heads * size * n_keys].view(-1, size, n_keys)
        logits = torch.bmm(queries[:, start : start + size], keys_t, out=scratch)  # (BH, size, n)
        outputs.append(torch.bmm(_softmax(logits, in_place), values))  # (BH, size, d)
    return torch.cat(outputs, dim=1).view(batch, heads, n_queries, -1)


def _softmax(logits: torch.Tensor, in_place: bool) -> torch.Tensor:
    """Softmax over the last dimension, overwriting ``logits`` when ``in_place``."""
    if in_place:
        logits.sub_(logits.amax(dim=-1, keepdim=True)).exp_()
        return logits.div_(logits.sum(dim=-1, keepdim=True))
    weights = (logits - logits.amax(dim=-1, keepdim=True)).exp()
    return weights / weights.sum(dim=-1, keepdim=True)


class ExactEncoderLayer(nn.Module):
    """One post-norm layer: multi-head attention (heads summed) + residual, LN, ReLU FFN + residual, LN."""

    def __init__(self, config: ExactTransformerConfig) -> None:
        super().__init__()
        d, dtype = config.d_model, DTYPES[config.compute_dtype]
        self.query = nn.Parameter(torch.randn(config.n_heads, d, d, dtype=dtype) / math.sqrt(d))  # (H, d, d)
        self.key = nn.Parameter(torch.randn(config.n_heads, d, d, dtype=dtype) / math.sqrt(d))
        self.value = nn.Parameter(torch.randn(config.n_heads, d, d, dtype=dtype) / math.sqrt(d))
        self.ffn_in = nn.Linear(d, config.d_ff, dtype=dtype)
        self.ffn_out = nn.Linear(config.d_ff, d, dtype=dtype)
        self.layer_norm = config.layer_norm
        self.eps = config.layer_norm_eps
        self.block_elements = config.attention_block_elements

    def active_heads(self) -> torch.Tensor:
        """(H,) bool: the heads whose value map is not all zero (the others add exactly 0)."""
        return self.value.detach().flatten(1).any(dim=1)

    def forward(self, x: torch.Tensor, logit_scale: float, cls_only: bool) -> torch.Tensor:
        """x: (B, n, d) -> (B, n, d), or (B, 1, d) at position 0 (CLS) alone with ``cls_only``; x may hold
        position 0 alone if no head is active."""
        residual = x[:, :1] if cls_only else x  # (B, Tq, d)
        active = self.active_heads()
        if bool(active.any()):
            q = torch.einsum("btd,hed->bhte", residual, self.query[active])  # (B, H', Tq, d)
            k = torch.einsum("btd,hed->bhte", x, self.key[active])  # (B, H', n, d)
            v = torch.einsum("btd,hed->bhte", x, self.value[active])  # (B, H', n, d)
            residual = encoder_attention(q, k, v, logit_scale, self.block_elements).sum(dim=1) + residual
        c = self._norm(residual)  # (B, Tq, d)
        return self._norm(self.ffn_out(F.relu(self.ffn_in(c))) + c)

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(x, x.shape[-1:], eps=self.eps) if self.layer_norm else x


@dataclass
class ExactCache(InferenceCache):
    """The symbols read so far, (B, length) int64: the encoder keeps no other state."""

    symbols: torch.Tensor

    def clone(self) -> ExactCache:
        return ExactCache(length=self.length, symbols=self.symbols.clone())

    def memory_bytes(self) -> int:
        return self.symbols.numel() * self.symbols.element_size()


class ExactTransformer(SequenceModel):
    """Symbols in, label logits out: CLS (and EOS) are added inside, from token ids vocab_size (and + 1)."""

    max_all_outputs_symbols = 256
    """``forward`` encodes every prefix, O(T^3) for PARITY and PALINDROME: on one CPU thread 256 symbols took at
    most 0.44 s per input, 512 up to 2.2 s (benchmarks/exact_sweeps.py all-outputs, docs/exact_results.md)."""

    def __init__(self, config: ExactTransformerConfig) -> None:
        super().__init__()
        self.config = config
        dtype = DTYPES[config.compute_dtype]
        self.cls_id = config.vocab_size
        self.word = nn.Embedding(config.vocab_size + 1 + int(config.append_eos), config.d_model, dtype=dtype)
        self.position = nn.Linear(len(config.position_features), config.d_model, bias=False, dtype=dtype)
        self.layers = nn.ModuleList(ExactEncoderLayer(config) for _ in range(config.n_layers))
        self.head = nn.Linear(config.d_model, config.num_labels, dtype=dtype)

    def encode(self, symbols: torch.Tensor) -> torch.Tensor:
        """One encoder pass per row over CLS symbols (EOS). symbols: (B, m), m >= 1 -> label logits (B, L)."""
        batch = symbols.shape[0]
        markers = [torch.full((batch, 1), self.cls_id, dtype=symbols.dtype, device=symbols.device), symbols]
        if self.config.append_eos:
            markers.append(torch.full_like(markers[0], self.cls_id + 1))
        tokens = torch.cat(markers, dim=1)  # (B, n)
        n = tokens.shape[1]
        features = position_features(self.config.position_features, n, self.dtype, tokens.device)  # (n, F)
        x = self.word(tokens) + self.position(features)  # (B, n, d)
        logit_scale = math.log(n) if self.config.log_length_scaling else 1.0
        for layer, cls_only in zip(self.layers, self._cls_only_layers()):
            x = layer(x, logit_scale, cls_only)
        return self._output(self.head(x[:, 0]))  # (B, L)

    def _cls_only_layers(self) -> list[bool]:
        """Per layer, whether only its CLS output is ever read: true for the last layer and, going back, for
        each layer whose successor is CLS-only and has no active head (so no attention reads other positions)."""
        cls_only, flags = True, []
        for layer in reversed(self.layers):
            flags.append(cls_only)
            cls_only = cls_only and not bool(layer.active_heads().any())
        return flags[::-1]

    def _output(self, logits: torch.Tensor) -> torch.Tensor:
        """logits: (B, L). "zero_test": label 1 iff the label-1 minus label-0 logit is 0 (within the tolerance)."""
        if self.config.output == "logits":
            return logits
        is_zero = (logits[:, 1] - logits[:, 0]).abs() <= self.config.zero_test_tolerance  # (B,)
        decision = torch.tensor([-ZERO_TEST_LOGIT, ZERO_TEST_LOGIT], dtype=logits.dtype, device=logits.device)
        return torch.where(is_zero[:, None], decision, -decision)  # (B, 2)

    def forward(self, tokens: torch.Tensor, cache: InferenceCache | None = None) -> torch.Tensor:
        """tokens: (B, T) symbol ids -> (B, T, L): at t the logits of the prefix ending at t (with ``cache``, of
        the cached symbols followed by tokens[:, :t + 1]). The encoder runs once per prefix length."""
        self._check_symbols(tokens)
        start = 0
        symbols = tokens
        if cache is not None:
            assert isinstance(cache, ExactCache)
            start = cache.length
            symbols = cache.symbols = torch.cat([cache.symbols, tokens], dim=1)  # (B, start + T)
            cache.length = symbols.shape[1]
        logits = [self.encode(symbols[:, :end]) for end in range(start + 1, symbols.shape[1] + 1)]
        if not logits:
            return torch.zeros(tokens.shape[0], 0, self.config.num_labels, dtype=self.dtype, device=tokens.device)
        return torch.stack(logits, dim=1)  # (B, T, L)

    def final_logits(self, tokens: torch.Tensor, lengths: torch.Tensor | None = None) -> torch.Tensor:
        """One encoder pass per row on its whole string (rows of one length together). Returns (B, L)."""
        self._check_symbols(tokens)
        if lengths is None:
            return self.encode(tokens)
        check_lengths(lengths, tokens.shape[0], tokens.shape[1])
        lengths = lengths.to(tokens.device)
        out = torch.empty(tokens.shape[0], self.config.num_labels, dtype=self.dtype, device=tokens.device)
        for length in lengths.unique().tolist():
            rows = (lengths == length).nonzero().squeeze(1)  # (rows,)
            out[rows] = self.encode(tokens[rows, :length])
        return out

    def new_cache(self, batch_size: int) -> ExactCache:
        return ExactCache(length=0, symbols=torch.zeros(batch_size, 0, dtype=torch.long, device=self.device))

    def step(self, tokens: torch.Tensor, cache: InferenceCache) -> torch.Tensor:
        return self.forward(tokens[:, None], cache)[:, 0]  # (B, L)

    def _check_symbols(self, tokens: torch.Tensor) -> None:
        if tokens.numel() and (int(tokens.min()) < 0 or int(tokens.max()) >= self.config.vocab_size):
            raise ValueError(f"symbol ids must lie in [0, {self.config.vocab_size}); CLS and EOS are added inside")
