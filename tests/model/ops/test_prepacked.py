"""Weights packed for oneDNN (model/ops/prepacked.py): equal to F.linear, used only while valid, and what served
models multiply by for many rows."""

from __future__ import annotations

import copy
import gc

import pytest
import torch
import torch.nn.functional as F

from model.ops import prepacked
from model.ops.cpu import cpu_decode
from tests.model.tiny_models import build_tiny

pytestmark = pytest.mark.skipif(
    not torch.backends.mkldnn.is_available() or not hasattr(torch.ops.mkldnn, "_linear_pointwise"),
    reason="this torch build has no oneDNN linear",
)


@pytest.fixture
def products(monkeypatch) -> list[tuple[int, ...]]:
    """The weight shape of every product that ran through a pack; every weight size qualifies for packing."""
    monkeypatch.setattr(prepacked, "MIN_ELEMENTS", 1)
    calls: list[tuple[int, ...]] = []
    original = prepacked.product

    def counted(x, weight, bias):
        result = original(x, weight, bias)
        if result is not None:
            calls.append(tuple(weight.shape))
        return result

    monkeypatch.setattr(prepacked, "product", counted)
    return calls


def packed_weight(out: int = 300, width: int = 70) -> torch.Tensor:
    weight = torch.nn.Parameter(torch.randn(out, width))
    assert prepacked.prepack(weight) == out * width * 4
    return weight


@pytest.mark.parametrize("shape", [(1, 70), (5, 70), (33, 70), (3, 7, 70)])
@pytest.mark.parametrize("bias", [True, False])
def test_a_packed_product_equals_f_linear(products, shape: tuple[int, ...], bias: bool) -> None:
    weight, offset = packed_weight(), torch.randn(300) if bias else None
    x = torch.randn(shape)
    with torch.no_grad():
        result = prepacked.product(x, weight, offset)
    assert result is not None and result.shape == (*shape[:-1], 300)
    torch.testing.assert_close(result, F.linear(x, weight, offset), rtol=1e-5, atol=1e-4)
    columns = torch.randn(70, 9).t()  # rows that are not contiguous
    with torch.no_grad():
        torch.testing.assert_close(prepacked.product(columns, weight, offset), F.linear(columns, weight, offset))


def test_a_pack_is_used_only_while_its_weight_is_unchanged(products) -> None:
    weight, x = packed_weight(), torch.randn(8, 70)
    with torch.no_grad():
        assert prepacked.product(x, weight, None) is not None
        assert prepacked.product(x.double(), weight, None) is None  # another dtype
        assert prepacked.product(x[:0], weight, None) is None  # no rows
        assert prepacked.product(x, torch.randn(300, 70), None) is None  # never packed
        assert prepacked.product(x, weight[:, :35], None) is None  # a view of another shape
        weight.mul_(2)  # in place: its version counter moves
        assert prepacked.product(x, weight, None) is None
        torch.testing.assert_close(cpu_decode.linear(x, weight), F.linear(x, weight))  # the new values
        assert prepacked.prepack(weight) and prepacked.product(x, weight, None) is not None  # packed anew
        weight.data = weight.data.clone()  # moved to other memory
        assert prepacked.product(x, weight, None) is None
    assert prepacked.product(x, packed_weight(), None) is None  # gradients enabled: autograd's path


def test_a_pack_goes_with_its_weight(products) -> None:
    weight = packed_weight()
    key = prepacked._key(weight)
    assert key in prepacked._packs
    del weight
    gc.collect()
    assert key not in prepacked._packs


def test_small_and_other_weights_are_not_packed() -> None:
    assert prepacked.prepack(torch.randn(300, 70)) == 0  # under MIN_ELEMENTS
    assert prepacked.prepack(torch.randn(1024, 512, dtype=torch.float64)) == 0
    assert prepacked.prepack(torch.randn(2, 512, 512)) == 0


def test_linear_multiplies_by_the_pack_except_in_the_reference_path(products) -> None:
    weight, x = packed_weight(), torch.randn(8, 70)
    with torch.no_grad():
        cpu_decode.linear(x, weight)
        assert products == [(300, 70)]
        with cpu_decode.torch_products():
            cpu_decode.linear(x, weight)
        assert products == [(300, 70)]


@pytest.mark.parametrize("model_id", ["lrnn", "lrnn-rank3", "regulargpt-c3-k2", "transformer-alibi", "lstm"])
def test_served_models_multiply_many_rows_by_their_packs_and_agree_with_the_unserved(products, model_id: str) -> None:
    torch.manual_seed(0)
    built = build_tiny(model_id, vocab_size=7, num_labels=3).eval()
    served = copy.deepcopy(built)
    notes = served.for_serving()
    weights = served.product_weights()
    assert any("oneDNN" in note for note in notes) and weights
    if model_id == "lrnn":  # g and B multiply by their stacked matrix, packed instead of either
        recurrences = [block.recurrence for block in served.blocks]
        stacked = [(r.transition.weight, r.input_proj.weight) for r in recurrences]
        assert not {id(w) for pair in stacked for w in pair} & {id(weight) for weight, _ in weights}
        assert [owners for _, owners in weights if len(owners) == 2] == stacked
    tokens = torch.randint(0, 7, (6, 11))
    with torch.no_grad():
        expected, result = built(tokens), served(tokens)
        products.clear()
        cache_built, cache_served = built.new_cache(6), served.new_cache(6)
        built(tokens[:, :5], cache=cache_built)
        served(tokens[:, :5], cache=cache_served)
        steps = [(built.step(tokens[:, t], cache_built), served.step(tokens[:, t], cache_served)) for t in range(5, 11)]
    torch.testing.assert_close(result, expected, rtol=1e-4, atol=1e-5)
    for step_built, step_served in steps:
        torch.testing.assert_close(step_served, step_built, rtol=1e-4, atol=1e-5)
    assert products  # six rows: more than the streaming kernel takes, so the packs ran
