"""Hand-built post-norm transformer encoders recognising PARITY, FIRST, ONE and PALINDROME exactly (Chiang & Cholak
2022; Nowak et al. 2022); training/exact_builders.py sets the weights. With s_n = log n under ``log_length_scaling``
else 1, and LN without gain or bias:

    a_0,i = WE(w_i) + W_pos f(i, n)                    i = 0 .. n-1 over CLS, symbols (, EOS)
    c_l,i = LN(sum_h V_h^T softmax(s_n K_h q_h,i / sqrt(d)) + a_l-1,i)
    a_l,i = LN(W_F2 relu(W_F1 c_l,i + b_F1) + b_F2 + c_l,i)
"""

from __future__ import annotations

import math
from collections.abc import Callable, Generator, Sequence
from dataclasses import dataclass
from typing import TypeVar

import torch
from torch import nn
from torch.nn import functional as F

from model.base import SequenceModel, check_lengths
from model.cache import InferenceCache, long_tensor
from model.config import ExactTransformerConfig, PositionFeature
from model.ops.positions import query_positions
from model.serving import CallPath, Cost

R = TypeVar("R")

ZERO_TEST_LOGIT = 10.0  # an indicator output has no confidence: its decision is reported as logits -10 / +10
DTYPES = {"float32": torch.float32, "float64": torch.float64}
LOG2_E = math.log2(math.e)  # softmax in base 2: exp(x) = 2 ** (x * log2(e))


def position_features(
    names: tuple[PositionFeature, ...], n: int, dtype: torch.dtype, device: torch.device
) -> torch.Tensor:
    """f(i, n) for i = 0 .. n-1, (n, len(names)): fraction i / n, alternating cos(i pi), is_first_symbol I[i = 1], index
    i, mirror_index n - 1 - i, index_squared i^2, left_half I[2i <= n - 1], right_half I[2i >= n - 1]."""
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


Pieces = Generator[float, None, R]
"""A computation run piece by piece: it yields the multiply-adds of its next piece before doing it, and returns its
result. :func:`drain` runs one at once, :func:`in_slices` in slices of bounded work."""


def drain(pieces: Pieces[R]) -> R:
    while True:
        try:
            next(pieces)
        except StopIteration as stop:
            result: R = stop.value
            return result


def in_slices(pieces: Pieces[R], slice_flops: float) -> Generator[float, None, R]:
    """Run ``pieces`` in slices of at most ``slice_flops``, yielding each slice's multiply-adds."""
    done = 0.0
    while True:
        try:
            flops = next(pieces)  # the next piece's multiply-adds; it runs at the following next()
        except StopIteration as stop:
            yield done
            result: R = stop.value
            return result
        if done and done + flops > slice_flops:
            yield done
            done = 0.0
        done += flops


def attention_flops(rows: int, n_queries: int, n_keys: int, width: int) -> int:
    """Multiply-adds of attention over ``rows`` (batch x heads): q.k and the weighted values."""
    return 2 * rows * n_queries * n_keys * width


def encoder_attention(
    queries: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, logit_scale: float, block_elements: int
) -> torch.Tensor:
    """Bidirectional attention in query chunks of at most ``block_elements`` weights: queries (B, H, Tq, d), keys,
    values (B, H, n, d) -> (B, H, Tq, d)."""
    return drain(encoder_attention_pieces(queries, keys, values, logit_scale, block_elements, math.inf))


def encoder_attention_pieces(
    queries: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    logit_scale: float,
    block_elements: int,
    piece_flops: float,
) -> Pieces[torch.Tensor]:
    batch, heads, n_queries, width = queries.shape
    n_keys = keys.shape[2]
    query_flops = attention_flops(batch * heads, 1, n_keys, width)
    chunk = max(1, int(min(n_queries, block_elements // (batch * heads * n_keys), piece_flops // query_flops)))
    queries = (queries * (logit_scale / math.sqrt(width))).flatten(0, 1)  # (BH, Tq, d)
    keys_t = keys.transpose(-1, -2).flatten(0, 1).contiguous()  # (BH, d, n), copied once, not per chunk
    values = values.flatten(0, 1).contiguous()  # (BH, n, d)
    in_place = not (torch.is_grad_enabled() and any(t.requires_grad for t in (queries, keys_t, values)))
    buffer = queries.new_empty(batch * heads * chunk * n_keys) if in_place else None
    outputs = []
    for start in range(0, n_queries, chunk):
        size = min(chunk, n_queries - start)
        yield size * query_flops
        scratch = None if buffer is None else buffer[: batch * heads * size * n_keys].view(-1, size, n_keys)
        logits = torch.bmm(queries[:, start : start + size], keys_t, out=scratch)  # (BH, size, n)
        outputs.append(torch.bmm(_softmax(logits, in_place), values))  # (BH, size, d)
    return torch.cat(outputs, dim=1).view(batch, heads, n_queries, -1)


def _softmax(logits: torch.Tensor, in_place: bool) -> torch.Tensor:
    """Softmax over the last dim (in place if ``in_place``), in base 2: exp2 is far faster deep in underflow."""
    if in_place:
        logits.sub_(logits.amax(dim=-1, keepdim=True)).mul_(LOG2_E).exp2_()
        return logits.div_(logits.sum(dim=-1, keepdim=True))
    weights = ((logits - logits.amax(dim=-1, keepdim=True)) * LOG2_E).exp2()
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
        """(H,) bool: heads whose value map is nonzero (the others add exactly 0)."""
        return self.value.detach().flatten(1).any(dim=1)

    def forward(self, x: torch.Tensor, logit_scale: float, cls_only: bool) -> torch.Tensor:
        """x (B, n, d) -> (B, n, d), or (B, 1, d) for CLS alone with ``cls_only``."""
        return drain(self.pieces(x, logit_scale, cls_only, math.inf))

    def pieces(self, x: torch.Tensor, logit_scale: float, cls_only: bool, piece_flops: float) -> Pieces[torch.Tensor]:
        residual = x[:, :1] if cls_only else x  # (B, Tq, d)
        active = self.active_heads()
        if bool(active.any()):
            yield x.shape[0] * self.projection_flops(residual.shape[1], x.shape[1])
            q = torch.einsum("btd,hed->bhte", residual, self.query[active])  # (B, H', Tq, d)
            k = torch.einsum("btd,hed->bhte", x, self.key[active])  # (B, H', n, d)
            v = torch.einsum("btd,hed->bhte", x, self.value[active])  # (B, H', n, d)
            attention = yield from encoder_attention_pieces(q, k, v, logit_scale, self.block_elements, piece_flops)
            residual = attention.sum(dim=1) + residual
        yield x.shape[0] * self.ffn_flops(residual.shape[1])
        c = self._norm(residual)  # (B, Tq, d)
        return self._norm(self.ffn_out(F.relu(self.ffn_in(c))) + c)

    def projection_flops(self, n_queries: int, n_keys: int) -> int:
        """Multiply-adds of one row's query, key and value maps: H' d^2 (Tq + 2 n), H' the active heads."""
        return int(self.active_heads().sum()) * self.query.shape[-1] ** 2 * (n_queries + 2 * n_keys)

    def ffn_flops(self, n_queries: int) -> int:
        return 2 * n_queries * self.ffn_in.in_features * self.ffn_in.out_features

    def flops(self, n_queries: int, n_keys: int) -> int:
        """Multiply-adds of the layer on one row: projections, attention 2 H' Tq n d, FFN."""
        heads = int(self.active_heads().sum())
        attention = attention_flops(heads, n_queries, n_keys, self.query.shape[-1])
        return self.projection_flops(n_queries, n_keys) + attention + self.ffn_flops(n_queries)

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(x, x.shape[-1:], eps=self.eps) if self.layer_norm else x


@dataclass
class ExactCache(InferenceCache):
    """The symbols each row has read, (B, longest) int64, zero-padded; no other state."""

    symbols: torch.Tensor

    @classmethod
    def stack(cls, caches: Sequence[ExactCache]) -> ExactCache:
        width = max(cache.symbols.shape[1] for cache in caches)
        symbols = torch.cat([F.pad(cache.symbols, (0, width - cache.symbols.shape[1])) for cache in caches])
        return ExactCache(torch.cat([cache.lengths for cache in caches]), symbols)  # symbols: (B, width)

    def select(self, rows: Sequence[int]) -> ExactCache:
        index = torch.tensor(list(rows), dtype=torch.long)  # (rows,)
        lengths = self.lengths[index]
        width = int(lengths.max()) if len(index) else 0
        return ExactCache(lengths, self.symbols[index.to(self.symbols.device), :width])

    @property
    def nbytes(self) -> int:
        return self.symbols.numel() * self.symbols.element_size()

    def append(self, tokens: torch.Tensor) -> torch.Tensor:
        ends = self.lengths + tokens.shape[1]  # (B,)
        symbols = F.pad(self.symbols, (0, int(ends.max()) - self.symbols.shape[1]))  # (B, longest)
        positions = query_positions(self.lengths, tokens.shape[1], symbols.device)  # (B, T)
        self.symbols, self.lengths = symbols.scatter_(1, positions, tokens), ends
        return self.symbols


class ExactTransformer(SequenceModel):
    """Symbols in, label logits out; CLS (and EOS) are token ids vocab_size (and + 1)."""

    config: ExactTransformerConfig
    max_all_outputs_symbols = 256
    """``forward`` encodes every prefix, O(T^3) for PARITY and PALINDROME (timings: docs/exact_results.md)."""

    def __init__(self, config: ExactTransformerConfig) -> None:
        super().__init__()
        self.config = config
        dtype = DTYPES[config.compute_dtype]
        self.cls_id = config.vocab_size
        self.word = nn.Embedding(config.vocab_size + 1 + int(config.append_eos), config.d_model, dtype=dtype)
        self.position = nn.Linear(len(config.position_features), config.d_model, bias=False, dtype=dtype)
        self.layers = nn.ModuleList(ExactEncoderLayer(config) for _ in range(config.n_layers))
        self.head = nn.Linear(config.d_model, config.num_labels, dtype=dtype)

    @property
    def markers(self) -> int:
        return 1 + int(self.config.append_eos)

    def encode(self, symbols: torch.Tensor) -> torch.Tensor:
        """symbols (B, m), m >= 1 -> label logits (B, L), one encoder pass per row."""
        return drain(self._encode_pieces(symbols, math.inf))

    def _encode_pieces(self, symbols: torch.Tensor, piece_flops: float) -> Pieces[torch.Tensor]:
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
            assert isinstance(layer, ExactEncoderLayer)
            x = yield from layer.pieces(x, logit_scale, cls_only, piece_flops)
        return self._output(self.head(x[:, 0]))  # (B, L)

    def _cls_only_layers(self) -> list[bool]:
        """Per layer, whether only its CLS output is ever read."""
        cls_only, flags = True, []
        for layer in reversed(self.layers):
            assert isinstance(layer, ExactEncoderLayer)
            flags.append(cls_only)
            cls_only = cls_only and not bool(layer.active_heads().any())
        return flags[::-1]

    def _output(self, logits: torch.Tensor) -> torch.Tensor:
        """logits (B, L) -> the output; "zero_test": label 1 iff the logit difference is ~0."""
        if self.config.output == "logits":
            return logits
        is_zero = (logits[:, 1] - logits[:, 0]).abs() <= self.config.zero_test_tolerance  # (B,)
        decision = torch.tensor([-ZERO_TEST_LOGIT, ZERO_TEST_LOGIT], dtype=logits.dtype, device=logits.device)
        return torch.where(is_zero[:, None], decision, -decision)  # (B, 2)

    def forward(self, tokens: torch.Tensor, cache: InferenceCache | None = None) -> torch.Tensor:
        """At t, the logits of the prefix ending at t: one encoder pass per prefix."""
        self._check_symbols(tokens)
        if cache is None:
            starts, symbols = long_tensor(0, tokens.shape[0]), tokens
        else:
            assert isinstance(cache, ExactCache)
            starts, symbols = cache.lengths, cache.append(tokens)  # (B,), (B, longest)
        logits = [self._encode_rows(symbols, starts + end) for end in range(1, tokens.shape[1] + 1)]
        if not logits:
            return torch.zeros(tokens.shape[0], 0, self.config.num_labels, dtype=self.dtype, device=tokens.device)
        return torch.stack(logits, dim=1)  # (B, T, L)

    def final_logits(self, tokens: torch.Tensor, lengths: torch.Tensor | None = None) -> torch.Tensor:
        """One encoder pass per row on its whole string."""
        self._check_symbols(tokens)
        if lengths is None:
            return self.encode(tokens)
        check_lengths(lengths, tokens.shape[0], tokens.shape[1])
        return self._encode_rows(tokens, lengths)

    def _encode_rows(self, symbols: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        lengths = lengths.to(symbols.device)
        out = torch.empty(symbols.shape[0], self.config.num_labels, dtype=self.dtype, device=symbols.device)
        for length in lengths.unique().tolist():
            rows = (lengths == length).nonzero().squeeze(1)  # (rows,)
            out[rows] = self.encode(symbols[rows, :length])
        return out

    def run_in_slices(
        self, tokens: torch.Tensor, all_outputs: bool, slice_flops: float
    ) -> Generator[float, None, tuple[torch.Tensor, torch.Tensor | None]]:
        self._check_symbols(tokens)
        pieces = self._prefix_pieces(tokens, slice_flops) if all_outputs else self._final_pieces(tokens, slice_flops)
        return (yield from in_slices(pieces, slice_flops))

    def _final_pieces(self, tokens: torch.Tensor, piece_flops: float) -> Pieces[tuple[torch.Tensor, None]]:
        logits = yield from self._encode_pieces(tokens, piece_flops)  # (1, L)
        return logits[0], None

    def _prefix_pieces(self, tokens: torch.Tensor, piece_flops: float) -> Pieces[tuple[torch.Tensor, torch.Tensor]]:
        logits = []
        for end in range(1, tokens.shape[1] + 1):
            logits.append((yield from self._encode_pieces(tokens[:, :end], piece_flops))[0])  # (L,)
        stacked = torch.stack(logits)  # (T, L)
        return stacked[-1], stacked.argmax(-1)

    def cost(self, path: CallPath, rows: int, length: int, context: int = 0) -> Cost:
        """A pass over n positions costs per row n F d + per layer [H' d^2 (Tq + 2 n) + 2 H' Tq n d + 2 Tq d d_ff] + d L
        (H' active heads, Tq = 1 if CLS-only else n); "final" runs one pass, the other paths one per prefix."""
        start = context if path == "cached" else 0
        first = length if path == "final" else start + 1
        flops = rows * self._prefix_flops(first, start + length)
        nbytes = self._pass_nbytes(rows, start + length + self.markers)
        if path != "final":
            nbytes += 2 * rows * length * self.config.num_labels * self.dtype.itemsize
        if path == "cached":
            nbytes += rows * self.cache_nbytes(start)
        return Cost(flops=float(flops), nbytes=nbytes)

    def cache_nbytes(self, length: int) -> int:
        return 8 * length

    def slices_cost(
        self, length: int, all_outputs: bool, slice_flops: float, cost: Callable[..., Cost] | None = None
    ) -> Cost:
        return (cost or self.cost)("forward" if all_outputs else "final", 1, length)

    def _pass_flops(self, n: int) -> int:
        flops = n * self.position.in_features * self.position.out_features
        positions = n
        for layer, cls_only in zip(self.layers, self._cls_only_layers()):
            assert isinstance(layer, ExactEncoderLayer)
            queries = 1 if cls_only else positions
            flops += layer.flops(queries, positions)
            positions = queries
        return flops + self.head.in_features * self.head.out_features

    def _prefix_flops(self, first: int, last: int) -> int:
        """Multiply-adds of the passes over prefixes of ``first`` .. ``last`` symbols, exact by Newton's forward
        differences (a pass's cost is quadratic in n)."""
        p0, p1, p2 = (self._pass_flops(n) for n in range(3))

        def below(count: int) -> int:
            return count * p0 + math.comb(count, 2) * (p1 - p0) + math.comb(count, 3) * (p2 - 2 * p1 + p0)

        return below(last + self.markers + 1) - below(first + self.markers)

    def _pass_nbytes(self, rows: int, n: int) -> int:
        """Peak bytes of one pass of ``rows`` rows over n positions."""
        config = self.config
        heads, weights, positions = 0, 0, n
        for layer, cls_only in zip(self.layers, self._cls_only_layers()):
            assert isinstance(layer, ExactEncoderLayer)
            queries, layer_heads = 1 if cls_only else positions, int(layer.active_heads().sum())
            one_query = rows * layer_heads * positions  # weights of one query against every key
            weights = max(weights, min(one_query * queries, max(one_query, config.attention_block_elements)))
            heads, positions = max(heads, layer_heads), queries
        activations = rows * n * (6 * config.d_model + 8 * heads * config.d_model + 3 * config.d_ff)
        return 16 * rows * n + self.dtype.itemsize * (n * len(config.position_features) + activations + weights)

    def new_cache(self, batch_size: int) -> ExactCache:
        symbols = torch.zeros(batch_size, 0, dtype=torch.long, device=self.device)
        return ExactCache(long_tensor(0, batch_size), symbols)

    def step(self, tokens: torch.Tensor, cache: InferenceCache) -> torch.Tensor:
        return self.forward(tokens[:, None], cache)[:, 0]  # (B, L)

    def _check_symbols(self, tokens: torch.Tensor) -> None:
        if tokens.numel() and (int(tokens.min()) < 0 or int(tokens.max()) >= self.config.vocab_size):
            raise ValueError(f"symbol ids must lie in [0, {self.config.vocab_size}); CLS and EOS are added inside")
