"""RegularGPT: adaptive depth, the three exact paths (parallel, shrinking, cached decoding) and the cache size,
with out-of-range keys masked and with null keys."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from model.config import RegularGPTConfig
from model.regulargpt import RegularGPT, adaptive_depth

VOCAB = 5
OUT_OF_RANGE = pytest.mark.parametrize("out_of_range", ["mask", "null"])


def make(
    chunk_size: int = 2, thickness: int = 1, impl: str = "auto", num_labels: int = 0, out_of_range: str = "mask"
) -> RegularGPT:
    config = RegularGPTConfig(
        vocab_size=VOCAB,
        num_labels=num_labels,
        d_model=8,
        n_heads=2,
        d_ff=16,
        chunk_size=chunk_size,
        thickness=thickness,
        attention_impl=impl,
        out_of_range=out_of_range,
    )
    return RegularGPT(config).double().eval()


def receptive_depth(position: int, chunk_size: int) -> int:
    """Layers of dilated attention until ``position`` sees position 0, by walking the pattern itself."""
    seen, layers = {position}, 0
    while 0 not in seen or layers == 0:
        dilation = chunk_size**layers
        seen = {p - j * dilation for p in seen for j in range(chunk_size) if p - j * dilation >= 0}
        layers += 1
    return layers


@pytest.mark.parametrize("chunk_size", [2, 3, 4])
def test_adaptive_depth(chunk_size: int) -> None:
    assert adaptive_depth(0, chunk_size) == 1
    assert adaptive_depth(chunk_size - 1, chunk_size) == 1
    for k in range(1, 40):  # integer arithmetic, exact where float logarithms round wrongly
        assert adaptive_depth(chunk_size**k - 1, chunk_size) == k  # length C**k
        assert adaptive_depth(chunk_size**k, chunk_size) == k + 1  # length C**k + 1
    for position in range(70):
        assert adaptive_depth(position, chunk_size) == receptive_depth(position, chunk_size)


@OUT_OF_RANGE
@pytest.mark.parametrize(("chunk_size", "thickness"), [(2, 1), (3, 2)])
def test_reference_and_fast_models_agree(chunk_size: int, thickness: int, out_of_range: str) -> None:
    fast = make(chunk_size, thickness, impl="fast", out_of_range=out_of_range)
    reference = make(chunk_size, thickness, impl="reference", out_of_range=out_of_range)
    reference.load_state_dict(fast.state_dict())
    tokens = torch.randint(0, VOCAB, (2, 41))
    lengths = torch.tensor([41, 28])
    for model in (fast, reference):
        (model(tokens).square().sum() + model.final_logits(tokens, lengths).square().sum()).backward()
    torch.testing.assert_close(fast(tokens), reference(tokens), rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(fast.final_logits(tokens, lengths), reference.final_logits(tokens, lengths))
    for (name, p_fast), p_reference in zip(fast.named_parameters(), reference.parameters()):
        torch.testing.assert_close(p_fast.grad, p_reference.grad, rtol=1e-9, atol=1e-10, msg=name)


def boundary_lengths(chunk_size: int, up_to: int) -> list[int]:
    lengths = {1, 2, up_to}
    power = chunk_size
    while power < up_to:
        lengths |= {power - 1, power, power + 1}
        power *= chunk_size
    return sorted(lengths)


@OUT_OF_RANGE
@pytest.mark.parametrize(("chunk_size", "thickness"), [(2, 1), (3, 1), (2, 2), (4, 2)])
def test_shrinking_final_logits_equal_parallel(chunk_size: int, thickness: int, out_of_range: str) -> None:
    model = make(chunk_size, thickness, num_labels=3, out_of_range=out_of_range)
    length = 70
    tokens = torch.randint(0, VOCAB, (3, length))
    with torch.no_grad():
        parallel = model(tokens)  # (B, T, 3)
        for n in boundary_lengths(chunk_size, length):
            torch.testing.assert_close(model.final_logits(tokens[:, :n]), parallel[:, n - 1], rtol=1e-9, atol=1e-9)
        for lengths in ([70, 1, 2], [chunk_size, chunk_size + 1, chunk_size**2 + 1], [64, 27, 16]):
            lengths = torch.tensor(lengths)
            expected = parallel[torch.arange(3), lengths - 1]
            torch.testing.assert_close(model.final_logits(tokens, lengths), expected, rtol=1e-9, atol=1e-9)


@OUT_OF_RANGE
def test_output_at_each_position_is_the_prefix_final_output(out_of_range: str) -> None:
    model = make(3, 2, out_of_range=out_of_range)
    tokens = torch.randint(0, VOCAB, (2, 30))
    with torch.no_grad():
        parallel = model(tokens)
        prefixes = torch.stack([model.final_logits(tokens[:, : i + 1]) for i in range(30)], dim=1)
    torch.testing.assert_close(prefixes, parallel, rtol=1e-9, atol=1e-9)


@OUT_OF_RANGE
@pytest.mark.parametrize(("chunk_size", "thickness"), [(2, 1), (3, 2)])
@pytest.mark.parametrize("prefill", [0, 1, 2, 3, 4, 9, 10])
def test_decoding_across_depth_growth_equals_parallel(
    chunk_size: int, thickness: int, prefill: int, out_of_range: str
) -> None:
    model = make(chunk_size, thickness, out_of_range=out_of_range)
    length = chunk_size**3 + 2
    tokens = torch.randint(0, VOCAB, (2, length))
    with torch.no_grad():
        parallel = model(tokens)
        cache = model.new_cache(batch_size=2)
        prefilled = [model(tokens[:, :prefill], cache=cache)] if prefill else []
        stepped = [model.step(tokens[:, t], cache)[:, None] for t in range(prefill, length)]
    assert cache.length == length
    assert cache.depth == adaptive_depth(length - 1, chunk_size)
    torch.testing.assert_close(torch.cat(prefilled + stepped, dim=1), parallel, rtol=1e-9, atol=1e-9)


def test_prefill_into_a_non_empty_cache_continues_it() -> None:
    model = make(2)
    tokens = torch.randint(0, VOCAB, (1, 19))
    with torch.no_grad():
        parallel = model(tokens)
        cache = model.new_cache(batch_size=1)
        first = model(tokens[:, :5], cache=cache)
        second = model(tokens[:, 5:], cache=cache)
    torch.testing.assert_close(torch.cat([first, second], dim=1), parallel, rtol=1e-9, atol=1e-9)


@pytest.mark.parametrize(("chunk_size", "thickness"), [(2, 1), (3, 2)])
def test_cache_keeps_only_what_the_dilated_pattern_needs(chunk_size: int, thickness: int) -> None:
    model = make(chunk_size, thickness)
    d_model, item = model.config.d_model, torch.finfo(torch.float64).bits // 8
    cache = model.new_cache(batch_size=1)
    with torch.no_grad():
        for t in range(chunk_size**3 + 1):
            model.step(torch.randint(0, VOCAB, (1,)), cache)
            depth = adaptive_depth(t, chunk_size)
            assert cache.depth == depth
            assert t + 1 <= cache.top_hidden.shape[1] == chunk_size**depth <= chunk_size * (t + 1)  # O(T) rows
            for layer, windows in enumerate(cache.windows):
                assert len(windows) == thickness
                for window in windows:  # K and V of the last (C-1) * C**l positions
                    assert window.keys.shape == window.values.shape == (1, 2, (chunk_size - 1) * chunk_size**layer, 4)
            window_rows = thickness * (chunk_size**depth - 1)  # sum over layers of (C-1) * C**l
            assert cache.memory_bytes() == (chunk_size**depth + 2 * window_rows) * d_model * item


def test_clone_is_deep() -> None:
    model = make(2)
    tokens = torch.randint(0, VOCAB, (1, 6))
    with torch.no_grad():
        cache = model.new_cache(batch_size=1)
        model(tokens, cache=cache)
        snapshot = cache.clone()
        for t in range(3):
            model.step(tokens[:, t], cache)  # the third step, at position 8 = C**3, grows the depth
    assert snapshot.length == 6 and snapshot.depth == 3 and cache.depth == 4
    assert snapshot.top_hidden.data_ptr() != cache.top_hidden.data_ptr()
    assert all(
        a.keys.data_ptr() != b.keys.data_ptr()
        for layer_a, layer_b in zip(snapshot.windows, cache.windows)
        for a, b in zip(layer_a, layer_b)
    )


def test_null_slots_have_their_own_parameters_and_change_the_output() -> None:
    """"null" adds a null key and value per block and head, and the first positions see them; "mask" has none."""
    masked, nulled = make(2, thickness=2), make(2, thickness=2, out_of_range="null")
    names = set(nulled.state_dict()) - set(masked.state_dict())
    assert names == {f"blocks.{k}.attention.{name}" for k in range(2) for name in ("null_key", "null_value")}
    assert nulled.blocks[0].attention.null_value.shape == (2, 4)  # (H, hd)
    nulled.load_state_dict(masked.state_dict(), strict=False)  # the same weights but for the null slots
    tokens = torch.randint(0, VOCAB, (1, 9))
    with torch.no_grad():
        assert not torch.allclose(nulled(tokens)[:, 0], masked(tokens)[:, 0])


def test_gpt2_initialisation() -> None:
    model = make(2, thickness=2)
    assert not any(block.attention.relative_bias.detach().any() for block in model.blocks)
    std = float(torch.cat([block.mlp.c_proj.weight.detach().flatten() for block in model.blocks]).std())
    assert 0.5 * 0.02 / 2 < std < 1.5 * 0.02 / 2  # 0.02 / sqrt(2 K)


def test_config_rejects_chunk_size_one() -> None:
    with pytest.raises(ValueError, match="chunk_size"):
        dataclasses.replace(make().config, chunk_size=1)
