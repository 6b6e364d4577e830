"""Transformer baseline: each position handling against its formula (also with an offset per row), log-length
scaling, the KV cache (padded per row)."""

from __future__ import annotations

import math

import pytest
import torch
from torch.nn import functional as F

from model.config import ConfigError, TransformerConfig
from model.ops.positions import (
    ALiBi,
    KerpleLog,
    T5Buckets,
    XLRelative,
    alibi_slopes,
    sinusoidal_encoding,
    t5_bucket,
)
from model.transformer.model import CausalSelfAttention, Transformer, TransformerCache

HEADS, HEAD_DIM = 2, 4
PAIRS = [(0, 0), (3, 0), (3, 3), (7, 2), (9, 1)]  # (query position i, key position j), j <= i


def heads_qk(length: int) -> tuple[torch.Tensor, torch.Tensor]:
    q = torch.randn(2, HEADS, length, HEAD_DIM, dtype=torch.float64)  # (B, H, T, hd)
    k = torch.randn(2, HEADS, length, HEAD_DIM, dtype=torch.float64)
    return q, k


def test_sinusoidal_encoding_matches_vaswani() -> None:
    encoding = sinusoidal_encoding(torch.arange(50), 6)  # (T, 6)
    for position, index in [(0, 0), (0, 1), (7, 2), (13, 3), (49, 4), (49, 5)]:
        angle = position / 10000 ** (2 * (index // 2) / 6)
        expected = math.sin(angle) if index % 2 == 0 else math.cos(angle)
        assert encoding[position, index].item() == pytest.approx(expected, abs=1e-5)


@pytest.mark.parametrize(
    "n_heads, expected",
    [
        (2, [2**-4, 2**-8]),
        (4, [2**-2, 2**-4, 2**-6, 2**-8]),
        (8, [2**-1, 2**-2, 2**-3, 2**-4, 2**-5, 2**-6, 2**-7, 2**-8]),
        (6, [2**-2, 2**-4, 2**-6, 2**-8, 2**-1, 2**-3]),  # 4 heads' slopes, then every other of 8 heads'
    ],
)
def test_alibi_slopes_are_the_papers_geometric_sequence(n_heads: int, expected: list[float]) -> None:
    assert alibi_slopes(n_heads) == pytest.approx(expected, rel=1e-12)


def test_alibi_bias_matches_formula() -> None:
    bias = ALiBi(HEADS).bias(0, 10, 10)  # (H, T, T)
    slopes = alibi_slopes(HEADS)
    for i, j in PAIRS:
        for h in range(HEADS):
            assert bias[h, i, j].item() == pytest.approx(-slopes[h] * (i - j))


def test_kerple_bias_matches_formula() -> None:
    kerple = KerpleLog(HEADS).double()
    bias = kerple.bias(0, 10, 10)  # (H, T, T)
    r1, r2 = F.softplus(kerple.raw_r1), F.softplus(kerple.raw_r2)
    assert (r1 > 0).all() and (r2 > 0).all()
    for i, j in PAIRS:
        for h in range(HEADS):
            expected = -r1[h].item() * math.log(1 + r2[h].item() * (i - j))
            assert bias[h, i, j].item() == pytest.approx(expected, rel=1e-12)


def test_t5_buckets_exact_then_logarithmic_then_saturated() -> None:
    # 8 buckets up to distance 20: distances 0..3 exact, then 4 + floor(4 log(d / 4) / log(20 / 4)), at most 7
    distance = torch.tensor([0, 1, 3, 4, 5, 9, 10, 19, 20, 1000])
    expected = [0, 1, 3, 4, 4, 6, 6, 7, 7, 7]
    assert t5_bucket(distance, num_buckets=8, max_distance=20).tolist() == expected


@pytest.mark.parametrize("num_buckets, max_distance", [(2, 2), (8, 20), (32, 128), (33, 500)])
def test_t5_buckets_monotone_and_bounded(num_buckets: int, max_distance: int) -> None:
    buckets = t5_bucket(torch.arange(3 * max_distance), num_buckets, max_distance)
    assert buckets.min().item() == 0 and buckets.max().item() == num_buckets - 1
    assert (buckets.diff() >= 0).all()


def test_t5_bias_reads_the_table_at_the_bucket() -> None:
    t5 = T5Buckets(HEADS, num_buckets=8, max_distance=20)
    bias = t5.bias(0, 10, 10)  # (H, T, T)
    for i, j in PAIRS:
        bucket = t5_bucket(torch.tensor(i - j), 8, 20).item()
        assert bias[:, i, j].tolist() == t5.bucket_bias[bucket].tolist()


def test_xl_bias_matches_formula() -> None:
    d_model = HEADS * HEAD_DIM
    xl = XLRelative(d_model, HEADS).double()
    q, k = heads_qk(10)
    bias = xl(q, k, query_offset=0)  # (B, H, T, T)
    encodings = sinusoidal_encoding(torch.arange(10), d_model).double()  # (T, d_model)
    for i, j in PAIRS:
        relative = (xl.relative_proj.weight @ encodings[i - j]).view(HEADS, HEAD_DIM)  # W_r R_{i-j}: (H, hd)
        for b in range(2):
            for h in range(HEADS):
                u, v = xl.content_bias[h], xl.position_bias[h]
                expected = q[b, h, i] @ relative[h] + u @ k[b, h, j] + v @ relative[h]
                assert bias[b, h, i, j].item() == pytest.approx(expected.item() / math.sqrt(HEAD_DIM), rel=1e-9)


def position_module(kind: str) -> torch.nn.Module:
    """A float64 relative position handling of HEADS heads of width HEAD_DIM."""
    modules = {
        "alibi": lambda: ALiBi(HEADS),
        "kerple": lambda: KerpleLog(HEADS),
        "t5": lambda: T5Buckets(HEADS, num_buckets=8, max_distance=20),
        "xl": lambda: XLRelative(HEADS * HEAD_DIM, HEADS),
    }
    return modules[kind]().double()


@pytest.mark.parametrize("kind", ["alibi", "kerple", "t5", "xl"])
def test_bias_at_an_offset_is_the_rows_of_the_full_bias(kind: str) -> None:
    """Cached decoding (queries [offset, offset + Tq), keys [0, Tk)) sees the full pass's bias rows."""
    module = position_module(kind)
    q, k = heads_qk(30)
    full = module(q, k, query_offset=0)  # (1 or B, H, 30, 30)
    for offset, length in [(0, 1), (13, 1), (13, 17), (29, 1)]:
        part = module(q[:, :, offset : offset + length], k[:, :, : offset + length], query_offset=offset)
        torch.testing.assert_close(part, full[:, :, offset : offset + length, : offset + length])


@pytest.mark.parametrize("kind", ["alibi", "kerple", "t5", "xl"])
def test_bias_with_an_offset_per_row_gives_each_row_its_own_offsets_bias(kind: str) -> None:
    """Rows of a cache holding different lengths: a (B,) offset gives (B, H, Tq, Tk), row b that of offset b."""
    module = position_module(kind)
    q, k = heads_qk(30)
    offsets = torch.tensor([13, 4])
    per_row = module(q[:, :, :5], k[:, :, :18], query_offset=offsets)  # (B, H, 5, 18)
    assert per_row.shape == (2, HEADS, 5, 18)
    for row, offset in enumerate(offsets.tolist()):
        alone = module(q[row : row + 1, :, :5], k[row : row + 1, :, :18], query_offset=offset)  # (1, H, 5, 18)
        torch.testing.assert_close(per_row[row : row + 1], alone, rtol=1e-12, atol=1e-12)


def test_sinusoidal_encoding_of_per_row_positions_is_each_rows() -> None:
    positions = torch.tensor([[3, 4, 5], [0, 1, 2]])  # (B, T)
    encoding = sinusoidal_encoding(positions, 6)  # (B, T, 6)
    torch.testing.assert_close(encoding[0], sinusoidal_encoding(positions[0], 6), rtol=0, atol=0)
    torch.testing.assert_close(encoding[1], sinusoidal_encoding(torch.arange(3), 6), rtol=0, atol=0)


def reference_attention(layer: CausalSelfAttention, x: torch.Tensor, log_length_scaling: bool) -> torch.Tensor:
    """softmax_j(s_m (q_m.k_j / sqrt(hd) + bias[m, j])) over j <= m, s_m = log(m + 1) or 1, written out."""
    q, k, v = layer.heads.qkv(x)  # (B, H, T, hd)
    length = x.shape[1]
    logits = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])  # (B, H, T, T)
    if layer.position_bias is not None:
        logits = logits + layer.position_bias(q, k, 0)
    if log_length_scaling:
        logits = logits * torch.log(torch.arange(1, length + 1, dtype=x.dtype))[:, None]
    future = torch.ones(length, length, dtype=torch.bool).triu(1)
    weights = logits.masked_fill(future, float("-inf")).softmax(-1)  # (B, H, T, T)
    return layer.heads.merge(weights @ v)


@pytest.mark.parametrize("log_length_scaling", [False, True], ids=["plain", "log-scaled"])
@pytest.mark.parametrize("position", ["sinusoidal", "alibi", "kerple", "t5", "xl"])
def test_attention_equals_written_out_softmax(position: str, log_length_scaling: bool) -> None:
    config = TransformerConfig(
        vocab_size=5, d_model=8, n_heads=HEADS, position=position, log_length_scaling=log_length_scaling
    )
    layer = CausalSelfAttention(config).double().eval()
    x = torch.randn(2, 21, 8, dtype=torch.float64)
    with torch.no_grad():
        torch.testing.assert_close(layer(x, offset=0, kv=None), reference_attention(layer, x, log_length_scaling))


def test_log_length_scaling_leaves_position_zero_alone_and_changes_the_rest() -> None:
    plain_config = TransformerConfig(vocab_size=5, d_model=16, n_heads=2, d_ff=32, position="alibi")
    scaled_config = TransformerConfig(
        vocab_size=5, d_model=16, n_heads=2, d_ff=32, position="alibi", log_length_scaling=True
    )
    plain = Transformer(plain_config).double().eval()
    scaled = Transformer(scaled_config).double().eval()
    scaled.load_state_dict(plain.state_dict())
    tokens = torch.randint(0, 5, (2, 12))
    with torch.no_grad():
        plain_logits, scaled_logits = plain(tokens), scaled(tokens)  # (B, T, V)
    torch.testing.assert_close(scaled_logits[:, 0], plain_logits[:, 0], rtol=1e-12, atol=1e-12)
    assert not torch.allclose(scaled_logits[:, 1:], plain_logits[:, 1:])


@pytest.mark.parametrize("position", ["alibi", "xl"])
def test_chunked_prefill_equals_parallel(position: str) -> None:
    config = TransformerConfig(vocab_size=5, d_model=16, n_heads=2, d_ff=32, position=position)
    model = Transformer(config).double().eval()
    tokens = torch.randint(0, 5, (2, 20))
    with torch.no_grad():
        parallel = model(tokens)
        cache = model.new_cache(batch_size=2)
        chunks = [model(chunk, cache=cache) for chunk in tokens.split([5, 1, 7, 7], dim=1)]
    torch.testing.assert_close(torch.cat(chunks, dim=1), parallel, rtol=1e-9, atol=1e-9)


def test_kv_cache_memory_grows_linearly_with_length() -> None:
    config = TransformerConfig(vocab_size=5, d_model=16, n_heads=2, d_ff=32, n_layers=3)
    model = Transformer(config).eval()
    bytes_per_token = 3 * 2 * 2 * 16 * 4  # layers * (keys, values) * batch * d_model * float32
    with torch.no_grad():
        for length in (8, 16, 32):
            cache = model.new_cache(batch_size=2)
            model(torch.randint(0, 5, (2, length)), cache=cache)
            assert cache.nbytes == length * bytes_per_token
        cache = model.new_cache(batch_size=2)
        for length in range(1, 40):
            model.step(torch.randint(0, 5, (2,)), cache)
            assert length * bytes_per_token <= cache.nbytes <= 2 * length * bytes_per_token


def test_cache_clone_survives_the_original_decoding_other_tokens() -> None:
    """The KV buffers are written in place, so a clone must own its storage."""
    model = Transformer(TransformerConfig(vocab_size=5, d_model=16, n_heads=2, d_ff=32)).double().eval()
    tokens = torch.randint(0, 5, (1, 12))
    with torch.no_grad():
        parallel = model(tokens)
        cache = model.new_cache(batch_size=1)
        model(tokens[:, :6], cache=cache)
        model.step(tokens[:, 6], cache)  # the buffers double to 12 positions, 7 filled
        snapshot = cache.clone()
        continued = []
        for t in range(7, 12):  # interleaved: each writes position t in place before the other reads it
            continued.append(model.step(tokens[:, t], snapshot))
            model.step((tokens[:, t] + 1) % 5, cache)
    torch.testing.assert_close(torch.stack(continued, dim=1), parallel[:, 7:], rtol=1e-9, atol=1e-9)


def test_stack_pads_to_the_largest_capacity_and_select_drops_the_padding() -> None:
    model = Transformer(TransformerConfig(vocab_size=5, d_model=16, n_heads=2, d_ff=32)).double().eval()
    caches = [model.new_cache(batch_size=1) for _ in range(2)]
    with torch.no_grad():
        for cache, length in zip(caches, (3, 20)):
            model(torch.randint(0, 5, (1, length)), cache=cache)  # capacities 3 and 20
    stacked = TransformerCache.stack(caches)
    assert stacked.layers[0].keys.shape == (2, 2, 20, 8) and stacked.nbytes == 2 * caches[1].nbytes
    assert torch.equal(stacked.layers[0].keys[0, :, 3:], torch.zeros(2, 17, 8, dtype=torch.float64))  # padding
    short = stacked.select([0])
    assert short.layers[0].keys.shape == (1, 2, 6, 8)  # twice its length
    torch.testing.assert_close(short.layers[0].keys[:, :, :3], caches[0].layers[0].keys, rtol=0, atol=0)


@pytest.mark.parametrize("num_buckets, max_distance", [(1, 128), (32, 16)])
def test_config_refuses_t5_buckets_without_a_log_range(num_buckets: int, max_distance: int) -> None:
    with pytest.raises(ConfigError, match="t5_"):
        TransformerConfig(vocab_size=5, t5_num_buckets=num_buckets, t5_max_distance=max_distance)
