"""RegularGPT: adaptive depth, the three exact paths (parallel, shrinking, cached chunks and steps), caches of
rows with different lengths and depths, the cache size, the memory of the cached path and the declared costs,
with out-of-range keys masked and with null keys."""

from __future__ import annotations

import dataclasses
import itertools
import math

import pytest
import torch
from torch.profiler import ProfilerActivity, profile

from model.config import RegularGPTConfig
from model.ops.cpu import cpu_decode
from model.regulargpt import cache as regulargpt_cache
from model.regulargpt import cost as regulargpt_cost
from model.regulargpt import model as regulargpt
from model.regulargpt.cache import (
    BandedPlan,
    ChunkPlan,
    RegularGPTCache,
    StepPlan,
    adaptive_depth,
    capacity,
    plan_chunk,
)
from model.regulargpt.minimal import regulargpt as regulargpt_minimal
from model.regulargpt.model import RegularGPT

VOCAB = 5
OUT_OF_RANGE = pytest.mark.parametrize("out_of_range", ["mask", "null"])
BLOCK_NORM = pytest.mark.parametrize("block_norm", ["pre", "post"])


@pytest.fixture(params=["by policy", "all banded"])
def cached_attention(request, monkeypatch) -> str:
    """Cached chunks attend as ``cached_attention_impl`` decides (for these tiny models: gathered, and one query
    per row through StepPlan), or every chunk of two or more positions through attend_banded."""
    if request.param == "all banded":
        for module in (regulargpt_cost, regulargpt_cache):  # the cost model and the plans
            monkeypatch.setattr(module, "cached_attention_impl", lambda length, slots, prefix: "banded")
    return request.param


def make(
    chunk_size: int = 2,
    thickness: int = 1,
    impl: str = "auto",
    num_labels: int = 0,
    out_of_range: str = "mask",
    vocab_size: int = VOCAB,
    block_norm: str = "pre",
) -> RegularGPT:
    config = RegularGPTConfig(
        vocab_size=vocab_size,
        num_labels=num_labels,
        d_model=8,
        n_heads=2,
        d_ff=16,
        chunk_size=chunk_size,
        thickness=thickness,
        attention_impl=impl,
        out_of_range=out_of_range,
        block_norm=block_norm,
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
@pytest.mark.parametrize("impl", ["fast", "banded"])
@pytest.mark.parametrize(("chunk_size", "thickness"), [(2, 1), (3, 2), (5, 2)])
def test_reference_and_fast_models_agree(chunk_size: int, thickness: int, out_of_range: str, impl: str) -> None:
    """Values and gradients of the parallel and shrinking passes; "banded" is the op's, set on the modules."""
    fast = make(chunk_size, thickness, out_of_range=out_of_range)
    for block in fast.blocks:
        block.attention.impl = impl
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
@BLOCK_NORM
@pytest.mark.parametrize(("chunk_size", "thickness"), [(2, 1), (3, 1), (2, 2), (4, 2)])
def test_shrinking_final_logits_equal_parallel(
    chunk_size: int, thickness: int, out_of_range: str, block_norm: str
) -> None:
    model = make(chunk_size, thickness, num_labels=3, out_of_range=out_of_range, block_norm=block_norm)
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


@pytest.mark.parametrize("chunk_size", [2, 3])
def test_extra_levels_read_each_position_that_many_layers_higher_in_training_only(chunk_size: int) -> None:
    """Position m is read after D(m) + k thick layers (k pointwise continuations more: the state a long input's
    early positions carry up); outside training the parallel pass ignores it."""
    model = make(chunk_size, out_of_range="null")
    tokens = torch.randint(0, VOCAB, (2, 20))
    with torch.no_grad():
        plain = model(tokens)
        model.extra_levels = 2
        assert torch.equal(model(tokens), plain)
        model.train()  # no dropout in this config: training mode changes nothing else
        raised = model(tokens)
        x = model.embedding(tokens)
        states = []
        for layer in range(regulargpt.adaptive_depth(19, chunk_size) + 2):
            x = model._thick_layer(x, chunk_size**layer)
            states.append(x)
        expected = torch.stack([states[regulargpt.adaptive_depth(m, chunk_size) + 1][:, m] for m in range(20)], dim=1)
    torch.testing.assert_close(raised, model._logits(expected), rtol=1e-12, atol=1e-12)
    assert not torch.allclose(raised, plain)


@OUT_OF_RANGE
@BLOCK_NORM
@pytest.mark.parametrize(("chunk_size", "thickness"), [(2, 1), (3, 2), (5, 1)])  # C 5: the windows' runs grow
@pytest.mark.parametrize("prefill", [0, 1, 2, 3, 4, 9, 10])
def test_decoding_across_depth_growth_equals_parallel(
    chunk_size: int, thickness: int, prefill: int, out_of_range: str, block_norm: str, cached_attention: str
) -> None:
    model = make(chunk_size, thickness, out_of_range=out_of_range, block_norm=block_norm)
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


def test_prefill_into_a_non_empty_cache_continues_it(cached_attention: str) -> None:
    model = make(2)
    tokens = torch.randint(0, VOCAB, (1, 19))
    with torch.no_grad():
        parallel = model(tokens)
        cache = model.new_cache(batch_size=1)
        first = model(tokens[:, :5], cache=cache)
        second = model(tokens[:, 5:], cache=cache)
    torch.testing.assert_close(torch.cat([first, second], dim=1), parallel, rtol=1e-9, atol=1e-9)


@pytest.mark.parametrize(("chunk_size", "thickness"), [(2, 1), (3, 2), (5, 1)])
def test_cache_keeps_only_what_the_dilated_pattern_needs(chunk_size: int, thickness: int) -> None:
    model = make(chunk_size, thickness)
    d_model, item = model.config.d_model, torch.finfo(torch.float64).bits // 8
    cache = model.new_cache(batch_size=1)
    assert cache.nbytes == model.cache_nbytes(0) == 0
    with torch.no_grad():
        for t in range(chunk_size**4 + 1):
            model.step(torch.randint(0, VOCAB, (1,)), cache)
            depth, room = adaptive_depth(t, chunk_size), capacity(t + 1)
            assert cache.depth == depth and cache.depths.tolist() == [depth]
            assert t + 1 <= cache.top_hidden.shape[1] == room <= 2 * (t + 1)  # every consumed position, O(T) room
            for layer, windows in enumerate(cache.windows):
                assert len(windows) == thickness
                # K and V of the last (C-1) * C**l positions, as reached: C**l runs of min(C - 1, ceil(room / C**l))
                dilation = chunk_size**layer
                slots = dilation * min(chunk_size - 1, -(-room // dilation))
                assert slots < min((chunk_size - 1) * dilation, room) + dilation
                shape = (1, 2 * model.config.n_heads, slots, d_model // model.config.n_heads)
                assert all(window.kv.shape == shape for window in windows)
            assert cache.nbytes == model.cache_nbytes(t + 1)
            # O(T), not O(C T): fewer than 4 (t + 1) slots per window over all layers (2 (t + 1) for C 2, 3 for C 3)
            assert cache.nbytes <= (2 + 8 * thickness) * (t + 1) * d_model * item


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
        a.kv.data_ptr() != b.kv.data_ptr()
        for layer_a, layer_b in zip(snapshot.windows, cache.windows)
        for a, b in zip(layer_a, layer_b)
    )


def prefill(model: RegularGPT, tokens: torch.Tensor, chunk: int = 3) -> RegularGPTCache:
    """A cache of the rows ``tokens`` (B, n), filled through chunks of ``chunk`` tokens."""
    cache = model.new_cache(tokens.shape[0])
    for start in range(0, tokens.shape[1], chunk):
        model(tokens[:, start : start + chunk], cache=cache)
    return cache


@OUT_OF_RANGE
@BLOCK_NORM
@pytest.mark.parametrize(("chunk_size", "thickness"), [(2, 1), (3, 2)])
@pytest.mark.parametrize("chunks", [[5, 3, 1, 8, 13, 2], [7, 9, 11, 6], [1, 2, 3, 4, 5, 6, 7], [9, 18, 5], [32]])
def test_chunked_cached_forward_equals_parallel(
    chunk_size: int, thickness: int, chunks: list[int], out_of_range: str, block_norm: str, cached_attention: str
) -> None:
    """Chunks of odd lengths, several crossing C**L (4, 8, 16, 32 for C = 2; 3, 9, 27 for C = 3)."""
    model = make(chunk_size, thickness, out_of_range=out_of_range, block_norm=block_norm)
    tokens = torch.randint(0, VOCAB, (2, sum(chunks)))
    with torch.no_grad():
        parallel = model(tokens)
        cache, outputs, start = model.new_cache(2), [], 0
        for chunk in chunks:
            outputs.append(model(tokens[:, start : start + chunk], cache=cache))
            start += chunk
    assert cache.lengths.tolist() == [start, start] and cache.depth == adaptive_depth(start - 1, chunk_size)
    torch.testing.assert_close(torch.cat(outputs, dim=1), parallel, rtol=1e-9, atol=1e-9)


@OUT_OF_RANGE
def test_a_long_prompt_through_the_cache_attends_banded_and_equals_parallel(out_of_range: str) -> None:
    """With C = 16 the policy sends a long chunk through attend_banded (the layers reaching J >= 8 keys), a short
    one through gathered keys and a step through the ring alone; prompts prefilled so, and steps after them, give
    the parallel pass's logits, rows of different lengths too."""
    model = make(16, thickness=2, out_of_range=out_of_range)
    lengths, chunks = [300, 211], [100, 150, 3, 1, 60]
    tokens = torch.randint(0, VOCAB, (2, max(lengths) + sum(chunks)))
    kinds = {  # (n, start): per layer; banded once J >= 4 and n J >= max(1024, 2 (prefix + n))
        (100, 0): [BandedPlan],  # J = 16, no prefix
        (1, 250): [StepPlan] * 3,
        (3, 250): [ChunkPlan] * 3,
        (60, 300): [ChunkPlan] * 3,  # n J = 960
        (150, 100): [BandedPlan, BandedPlan, ChunkPlan],  # J = 16, 16, 1
        (200, 300): [BandedPlan, BandedPlan, ChunkPlan],  # J = 16, 16, 2
    }
    for (length, start), expected in kinds.items():
        plans = plan_chunk(torch.tensor([start]), length, 16, 2, [16**3] * len(expected), torch.device("cpu"))
        assert [type(plan) for plan in plans] == expected, (length, start)
    with torch.no_grad():
        parallel = model(tokens)
        caches = [model.new_cache(1) for _ in lengths]
        for row, (cache, length) in enumerate(zip(caches, lengths)):
            row_tokens = tokens[row : row + 1, :length]
            prefilled = [model(row_tokens[:, first : first + 100], cache=cache) for first in range(0, length, 100)]
            torch.testing.assert_close(torch.cat(prefilled, dim=1)[0], parallel[row, :length], rtol=1e-9, atol=1e-9)
        cache, done, rows = RegularGPTCache.stack(caches), 0, torch.arange(2)[:, None]
        for chunk in chunks:
            positions = torch.tensor(lengths)[:, None] + done + torch.arange(chunk)  # (B, n)
            got = model(tokens[rows, positions], cache=cache)  # (B, n, V)
            torch.testing.assert_close(got, parallel[rows, positions], rtol=1e-9, atol=1e-9)
            done += chunk


# depths 0..4 (C = 2), 0..3 (C = 3) and 0..3 (C = 5, whose rows alone hold 1-4 columns per run at layer 1)
MIXED_LENGTHS = {2: [0, 1, 3, 7, 8, 14], 3: [0, 2, 7, 9, 25, 26], 5: [0, 3, 6, 11, 26, 40]}


@OUT_OF_RANGE
@pytest.mark.parametrize(("chunk_size", "thickness"), [(2, 1), (3, 2), (5, 1)])
def test_mixed_length_rows_step_together_as_each_alone(
    chunk_size: int, thickness: int, out_of_range: str, cached_attention: str
) -> None:
    """Rows at different lengths and depths, each prefilled alone, stacked into one cache and stepped together:
    every step equals each row stepped alone and the parallel pass, while rows cross C**L (4, 8, 16; 3, 9, 27)."""
    model = make(chunk_size, thickness, out_of_range=out_of_range)
    lengths, steps = MIXED_LENGTHS[chunk_size], 6
    tokens = torch.randint(0, VOCAB, (len(lengths), max(lengths) + steps))
    rows = torch.arange(len(lengths))
    with torch.no_grad():
        alone = [prefill(model, tokens[row : row + 1, :n]) for row, n in enumerate(lengths)]
        stacked = RegularGPTCache.stack(alone)
        assert stacked.lengths.tolist() == lengths
        assert stacked.depths.tolist() == [adaptive_depth(n - 1, chunk_size) if n else 0 for n in lengths]
        for step in range(steps):
            position = torch.tensor(lengths) + step
            batched = model.step(tokens[rows, position], stacked)  # (B, V)
            single = torch.cat([model.step(tokens[row : row + 1, p], alone[row]) for row, p in enumerate(position)])
            torch.testing.assert_close(batched, single, rtol=1e-9, atol=1e-9)
            parallel = torch.stack([model(tokens[row : row + 1, : p + 1])[0, -1] for row, p in enumerate(position)])
            torch.testing.assert_close(batched, parallel, rtol=1e-9, atol=1e-9)
        for split, row in zip(stacked.split(), alone):  # each row back alone, as if it had never been stacked
            assert split.lengths.tolist() == row.lengths.tolist() and split.depth == row.depth
            assert split.nbytes == row.nbytes
            torch.testing.assert_close(model.step(tokens[:, 0][:1], split), model.step(tokens[:, 0][:1], row))


@OUT_OF_RANGE
@pytest.mark.parametrize(("chunk_size", "thickness"), [(2, 1), (3, 2), (5, 1)])
def test_chunks_on_a_stacked_mixed_length_cache_equal_each_row_alone(
    chunk_size: int, thickness: int, out_of_range: str, cached_attention: str
) -> None:
    model = make(chunk_size, thickness, out_of_range=out_of_range)
    lengths, chunks = MIXED_LENGTHS[chunk_size], [5, 1, 3]
    tokens = torch.randint(0, VOCAB, (len(lengths), max(lengths) + sum(chunks)))
    rows = torch.arange(len(lengths))[:, None]
    with torch.no_grad():
        cache = RegularGPTCache.stack([prefill(model, tokens[row : row + 1, :n], 4) for row, n in enumerate(lengths)])
        done = 0
        for chunk in chunks:
            positions = torch.tensor(lengths)[:, None] + done + torch.arange(chunk)  # (B, n)
            batched = model(tokens[rows, positions], cache=cache)  # (B, n, V)
            for row, n in enumerate(lengths):
                parallel = model(tokens[row : row + 1, : n + done + chunk])[0, n + done :]
                torch.testing.assert_close(batched[row], parallel, rtol=1e-9, atol=1e-9)
            done += chunk
    assert cache.lengths.tolist() == [n + done for n in lengths]


def test_stack_select_and_split_round_trip() -> None:
    model = make(2, thickness=2, out_of_range="null")
    lengths = [0, 5, 1, 12]
    tokens = torch.randint(0, VOCAB, (len(lengths), max(lengths)))
    with torch.no_grad():
        caches = [prefill(model, tokens[row : row + 1, :n]) for row, n in enumerate(lengths)]
    sizes = [cache.nbytes for cache in caches]
    stacked = RegularGPTCache.stack(caches)
    assert [cache.nbytes for cache in caches] == sizes  # the inputs are left as they were
    assert stacked.nbytes == sum(model.cache_nbytes(max(lengths)) for _ in lengths)  # all rows at the longest's room
    for split, cache in zip(stacked.split(), caches):
        assert split.lengths.tolist() == cache.lengths.tolist() and split.nbytes == cache.nbytes
        assert torch.equal(split.top_hidden, cache.top_hidden)
        for layer_a, layer_b in zip(split.windows, cache.windows, strict=True):
            assert all(torch.equal(a.kv, b.kv) for a, b in zip(layer_a, layer_b, strict=True))
    picked = stacked.select([3, 1])
    assert picked.lengths.tolist() == [12, 5] and picked.nbytes == RegularGPTCache.stack([caches[3], caches[1]]).nbytes
    assert picked.top_hidden.data_ptr() != stacked.top_hidden.data_ptr()
    with torch.no_grad():
        token = torch.tensor([2, 4])
        torch.testing.assert_close(model.step(token, picked), model.step(token, stacked.select([3, 1])))
    assert stacked.lengths.tolist() == lengths  # stepping a selection leaves the source as it was
    empty = RegularGPTCache.stack([model.new_cache(2), model.new_cache(1)])
    assert empty.lengths.tolist() == [0, 0, 0] and empty.depth == 0 and empty.nbytes == 0


def peak_bytes(call, setup=lambda: None) -> int:
    """Peak bytes that ``call(setup())`` allocates beyond what was live when it started, from the CPU profiler's
    allocation records (``setup`` runs inside the profile so that the frees of what it made are seen)."""
    mark = 7_777_777  # a marker allocation's size: the call starts when it is freed
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        state = setup()
        torch.empty(mark, dtype=torch.uint8)
        call(state)
    events = prof.profiler.kineto_results.events()
    records = sorted((e.start_ns(), e.nbytes()) for e in events if e.name() == "[memory]")
    total, start, peak = 0, None, 0
    for _, size in records:
        total += size
        if start is None and size == -mark:
            start = peak = total
        elif start is not None:
            peak = max(peak, total)
    assert start is not None
    return peak - start


def test_a_chunk_after_a_long_context_allocates_o_of_the_chunk() -> None:
    """A chunk of 64 after 4,100 tokens: no T x T tensor (134 MB at float64) nor O(T) per position; the declared
    cost bounds what it allocates and does not grow with the context."""
    model = make(2, thickness=2)
    context, chunk = 4_100, 64
    tokens = torch.randint(0, VOCAB, (1, context + chunk))
    filled = []

    def run_chunk(cache: RegularGPTCache) -> None:
        model(tokens[:, context:], cache=cache)
        filled.append(cache)

    with torch.no_grad():
        measured = peak_bytes(run_chunk, lambda: prefill(model, tokens[:, :context], 512))
        stepped = peak_bytes(lambda cache: model.step(tokens[:, 0], cache), lambda: filled[0])  # no room to grow
    declared = model.cost("cached", 1, chunk, context).nbytes
    assert 0 < measured <= declared < 2**20
    assert 0 < stepped <= model.cost("cached", 1, 1, context + chunk).nbytes < 2**16
    assert model.cost("cached", 1, chunk, 4 * context).nbytes <= 2 * declared


@pytest.mark.parametrize(
    ("chunk_size", "impl", "out_of_range"),
    [(2, "fast", "null"), (3, "reference", "mask"), (16, "banded", "mask"), (16, "auto", "null")],
)
def test_declared_bytes_bound_what_each_path_allocates(chunk_size: int, impl: str, out_of_range: str) -> None:
    """Each path's declared peak bytes bound what it allocates, within a small factor; with C = 16 the parallel
    passes (auto beyond 64 positions) and the longer cached chunks attend banded."""
    model = make(chunk_size, thickness=2, impl="auto" if impl == "banded" else impl, out_of_range=out_of_range)
    for block in model.blocks:
        block.attention.impl = impl  # "banded" is the op's, not the configuration's: "auto" picks it
    with torch.no_grad():
        longer = chunk_size == 16  # banded: its parallel passes beyond 64 positions, its longer cached chunks
        for length in (1, 9, 70, 150) if longer else (1, 9, 70):
            tokens = torch.randint(0, VOCAB, (2, length))
            for path, call in (("forward", model), ("final", model.final_logits)):
                measured = peak_bytes(lambda _, call=call, tokens=tokens: call(tokens))
                assert measured <= model.cost(path, 2, length).nbytes <= 4 * measured, (path, length)
        chunks = ((0, 30), (5, 1), (8, 1), (26, 2), (27, 6), (40, 25)) + (((40, 120), (250, 130)) if longer else ())
        for context, length in chunks:  # the room or depth grows
            tokens = torch.randint(0, VOCAB, (2, context + length))
            measured = peak_bytes(
                lambda cache, chunk=tokens[:, context:]: model(chunk, cache=cache),
                lambda context_tokens=tokens[:, :context]: prefill(model, context_tokens),
            )
            declared = model.cost("cached", 2, length, context).nbytes
            assert measured <= declared <= 8 * measured + 2**14, (context, length)  # + fixed overheads


def test_costs_grow_with_length_and_follow_the_attention_impl() -> None:
    fast, reference = make(2, impl="fast"), make(2, impl="reference")
    for model in (fast, reference):
        for path in ("forward", "final", "cached"):
            flops = [model.cost(path, 3, n, context=10).flops for n in range(1, 130)]
            assert all(a < b for a, b in itertools.pairwise(flops)), path
            assert model.cost(path, 6, 50, context=10).flops == 2 * model.cost(path, 3, 50, context=10).flops
    for n in (256, 1024):  # the reference's T x T scores: 4x the bytes for 2x the length; the fast op's ~2x
        assert reference.cost("forward", 1, 2 * n).nbytes > 3.5 * reference.cost("forward", 1, n).nbytes
        assert fast.cost("forward", 1, 2 * n).nbytes < 2.5 * fast.cost("forward", 1, n).nbytes
        assert reference.cost("cached", 1, 2 * n).nbytes == fast.cost("cached", 1, 2 * n).nbytes  # never T x T
    chunks = [fast.cost("cached", 1, n, context=1000) for n in range(1, 300)]
    assert all(a.nbytes <= b.nbytes for a, b in itertools.pairwise(chunks))
    sizes = [fast.cache_nbytes(n) for n in range(200)]
    assert all(a <= b for a, b in itertools.pairwise(sizes))


def test_the_cached_path_counts_its_fixed_work_at_the_depth_it_reaches() -> None:
    """``FixedCosts``: a chunk of two or more positions does K block passes at each thick layer its last position
    needs, and K more at each new layer for the positions it has consumed; a one-position call one layer step per
    thick layer. Here C = 4, K = 2: positions < 4 need one layer, < 16 two, < 64 three, < 256 four."""
    model = make(chunk_size=4, thickness=2)
    shapes = [(3, 0), (3, 20), (3, 62), (1, 20), (1, 64)]  # (chunk, context)
    without = {shape: model.cost("cached", 1, *shape).flops for shape in shapes}
    model.fixed_costs = regulargpt_cost.FixedCosts(block=1000.0, layer_step=10.0)
    fixed = {shape: model.cost("cached", 1, *shape).flops - without[shape] for shape in shapes}
    assert fixed == {
        (3, 0): 2 * 1 * 1000,  # positions 0-2: one layer
        (3, 20): 2 * 3 * 1000,  # 20-22: three
        (3, 62): 2 * 4 * 1000 + 2 * 1 * 1000,  # 62-64: four, the 62 consumed positions through the fourth
        (1, 20): 3 * 10,
        (1, 64): 4 * 10 + 2 * 1 * 1000,
    }
    assert model.cost("cached", 1, 3, 62).nbytes == make(chunk_size=4, thickness=2).cost("cached", 1, 3, 62).nbytes


def test_fixed_costs_are_measured_for_a_language_model_and_not_for_a_transducer() -> None:
    language_model, transducer = make(chunk_size=4, thickness=2), make(chunk_size=4, thickness=2, num_labels=2)
    language_model.measure_fixed_costs()
    transducer.measure_fixed_costs()
    measured = language_model.fixed_costs
    assert math.isfinite(measured.block) and measured.block >= 0
    assert math.isfinite(measured.layer_step) and measured.layer_step >= 0
    assert transducer.fixed_costs == regulargpt_cost.FixedCosts()


def test_for_serving_stores_a_wide_tied_head_transposed() -> None:
    """A language model whose vocabulary is wider than d_model gets its tied head stored (d, V) in memory, shape and
    values unchanged: the parallel pass, the cached prefill and the steps give what they gave before."""
    model = make(3, thickness=2, vocab_size=40)
    tokens = torch.randint(0, 40, (2, 20))
    with torch.no_grad():
        before = model(tokens)
        assert model.for_serving() == ["the tied head stored transposed for one-token products (CPU)"]
        head = model.embedding.embed.weight
        assert head.shape == (40, 8) and head.stride() == (1, 40)
        torch.testing.assert_close(model(tokens), before, rtol=1e-12, atol=1e-12)
        cache = model.new_cache(2)
        stepped = [model(tokens[:, :10], cache=cache)]
        stepped += [model.step(tokens[:, t], cache)[:, None] for t in range(10, 20)]
        torch.testing.assert_close(torch.cat(stepped, dim=1), before, rtol=1e-9, atol=1e-9)
    assert model.for_serving() == []  # nothing left to switch
    assert make(3, vocab_size=40, num_labels=3).for_serving() == []  # a transducer's head is not the embedding


def test_for_serving_switches_the_reference_attention_to_auto() -> None:
    model = make(2, impl="reference")
    tokens = torch.randint(0, VOCAB, (1, 100))
    with torch.no_grad():
        before = model(tokens)
        notes = model.for_serving()
        assert len(notes) == 1 and notes[0].startswith("attention_impl reference -> auto")
        assert all(block.attention.impl == "auto" for block in model.blocks)
        assert model.config.attention_impl == "reference"  # the configuration (and checkpoint) stay as they were
        torch.testing.assert_close(model(tokens), before, rtol=1e-10, atol=1e-10)
    assert model.cost("forward", 1, 10_000).nbytes < make(2, impl="reference").cost("forward", 1, 10_000).nbytes / 100
    assert model.for_serving() == []  # nothing left to switch
    assert make(2, impl="auto").for_serving() == [] and make(2, impl="fast").for_serving() == []


def test_null_slots_have_their_own_parameters_and_change_the_output() -> None:
    """ "null" adds a null key and value per block and head, and the first positions see them; "mask" has none."""
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


@pytest.mark.parametrize(
    ("chunk_size", "thickness", "out_of_range", "invariant"),
    [(2, 1, "null", False), (2, 2, "null", True), (3, 2, "mask", False)],
)
def test_run_in_slices_with_final_outputs_is_the_shrinking_path_in_pieces(
    chunk_size, thickness, out_of_range, invariant, request
) -> None:
    """Outputs "final" run ``final_logits``'s O(T) path one thick layer at a time, in pieces down to one position
    (each recomputing the K (C - 1) positions before it): the same logits, slices within their budget, and the
    multiply-adds of the "final" path that ``slices_cost`` declares (the server's limits and job times read it).
    ``invariant``: under the server's batch invariance (its CPU default), whose head product takes rows."""
    cpu_decode.set_row_invariant(invariant)
    request.addfinalizer(lambda: cpu_decode.set_row_invariant(False))
    torch.manual_seed(0)
    config = RegularGPTConfig(
        vocab_size=5,
        num_labels=3,
        d_model=16,
        n_heads=2,
        d_ff=32,
        chunk_size=chunk_size,
        thickness=thickness,
        out_of_range=out_of_range,
    )
    model = RegularGPT(config).eval()
    for length in (1, 2, 7, 100, 513):
        tokens = torch.randint(0, 5, (1, length))
        with torch.no_grad():
            expected = model.final_logits(tokens)[0]
            whole = model.cost("final", 1, length).flops
            for slice_flops in (1.0, whole / 10, 10 * whole):
                slices = model.run_in_slices(tokens, False, slice_flops)
                done = []
                while True:
                    try:
                        done.append(next(slices))
                    except StopIteration as stop:
                        final, labels = stop.value
                        break
                assert labels is None and torch.allclose(final, expected, atol=1e-5), (length, slice_flops)
                halo = thickness * (chunk_size - 1)  # positions a piece recomputes: all of them at one a piece
                assert whole * (1 - 1e-9) <= sum(done) <= (1 + halo) * whole * (1 + 1e-9)
                if slice_flops == 10 * whole:
                    assert len(done) == 1
        declared = model.slices_cost(length, False, whole / 10)
        assert declared.flops == whole and declared.nbytes >= 2 * length * 16 * 4
    assert model.slices_cost(513, True, 1e6) == super(RegularGPT, model).slices_cost(513, True, 1e6)


def with_level_codes(chunk_size: int, thickness: int, out_of_range: str, block_norm: str) -> RegularGPT:
    """A 3-label model whose thick layers hand on codes (random rows, so that the label read decides them)."""
    model = make(chunk_size, thickness, num_labels=3, out_of_range=out_of_range, block_norm=block_norm)
    coded = RegularGPT(dataclasses.replace(model.config, level_codes=True)).double().eval()
    codes = torch.randn(3, model.config.d_model, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    coded.load_state_dict({**model.state_dict(), "level_codes": codes})
    return coded


@OUT_OF_RANGE
@BLOCK_NORM
@pytest.mark.parametrize(("chunk_size", "thickness"), [(2, 1), (3, 2)])
def test_level_codes_hold_on_every_path(chunk_size: int, thickness: int, out_of_range: str, block_norm: str) -> None:
    """With level codes the parallel pass, the minimal reference, the shrinking path, cached chunks and steps all
    hand the same codes on; and the codes change the outputs (each position reads one of them)."""
    model = with_level_codes(chunk_size, thickness, out_of_range, block_norm)
    length = chunk_size**3 + 2
    tokens = torch.randint(0, VOCAB, (2, length), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        parallel = model(tokens)  # (B, T, 3)
        reference = regulargpt_minimal(
            tokens,
            model.state_dict(),
            model.config.n_heads,
            chunk_size,
            thickness,
            model.config.layer_norm_eps,
            post_norm=block_norm == "post",
        )
        torch.testing.assert_close(reference, parallel, rtol=1e-9, atol=1e-9)
        for n in boundary_lengths(chunk_size, length):
            torch.testing.assert_close(model.final_logits(tokens[:, :n]), parallel[:, n - 1], rtol=1e-9, atol=1e-9)
        cache = model.new_cache(batch_size=2)
        chunked = [model(tokens[:, :5], cache=cache), model(tokens[:, 5:9], cache=cache)]
        stepped = [model.step(tokens[:, t], cache)[:, None] for t in range(9, length)]
        torch.testing.assert_close(torch.cat(chunked + stepped, dim=1), parallel, rtol=1e-9, atol=1e-9)
        codes = model.level_codes
        assert codes is not None
        read = model._logits(codes)  # (3, 3): what the head reads from each code
        deep = parallel[:, chunk_size:]  # positions read after a thick layer that handed on codes
        assert all(any(torch.allclose(row, code) for code in read) for row in deep.reshape(-1, 3))
        plain = RegularGPT(dataclasses.replace(model.config, level_codes=False)).double().eval()
        plain.load_state_dict({name: value for name, value in model.state_dict().items() if name != "level_codes"})
        assert not torch.allclose(plain(tokens), parallel)
