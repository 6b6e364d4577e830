"""The CPU decode kernels (model/ops/cpu/cpu_decode.py) against F.linear and the torch steps; where they must not
apply."""

from __future__ import annotations

import contextlib
import dataclasses
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from model.config import LRNNConfig
from model.lrnn.model import BlockDiagonalLRNN
from model.ops.cpu import cpu_decode
from model.ops.cpu.kernels.panels import build_panels
from model.ops.scan.constraints import column_sparsemax
from model.regulargpt.model import RegularGPT
from tests.model.tiny_models import build_tiny, tiny_configs

pytestmark = pytest.mark.skipif(not cpu_decode.kernel_available(), reason="numba is not importable")


def compiled_kernel(path: str):
    """The compiled function at ``path``, "family.name" of ``cpu_decode._kernels`` (e.g. "steps.lrnn")."""
    family, name = path.split(".")
    return getattr(getattr(cpu_decode._kernels, family), name)


def replace_kernel(monkeypatch, path: str, function) -> None:
    """For this test, ``function`` runs where cpu_decode calls the compiled function at ``path`` ("family.name")."""
    family, name = path.split(".")
    kernels = cpu_decode._kernels
    replaced = dataclasses.replace(kernels, **{family: getattr(kernels, family)._replace(**{name: function})})
    monkeypatch.setattr(cpu_decode, "_kernels", replaced)


def record_calls(monkeypatch, path: str) -> list[tuple[int, ...]]:
    """Wrap the compiled function at ``path`` ("family.name" of ``cpu_decode._kernels``) to record the shape of its
    first argument at every call."""
    calls: list[tuple[int, ...]] = []
    compiled = compiled_kernel(path)

    def counted(x, *args):
        calls.append(x.shape)
        compiled(x, *args)

    replace_kernel(monkeypatch, path, counted)
    return calls


@pytest.fixture
def kernel_calls(monkeypatch) -> list[tuple[int, ...]]:
    """The (rows, in) shape of every x the kernel multiplies, in order; every weight size qualifies."""
    monkeypatch.setattr(cpu_decode, "MIN_ELEMENTS", 1)
    return record_calls(monkeypatch, "ops.dots")


@pytest.fixture
def layer_calls(kernel_calls, monkeypatch) -> list[tuple[int, ...]]:
    """The (rows, d_model) shape of every x the compiled LRNN layer step takes, in order."""
    return record_calls(monkeypatch, "steps.lrnn")


@pytest.mark.parametrize("rows", [1, 2, 3, 4])
@pytest.mark.parametrize(("out", "width"), [(1, 1), (7, 5), (33, 64), (300, 129), (64, 513)])
@pytest.mark.parametrize("bias", [True, False])
def test_equals_f_linear(kernel_calls, rows: int, out: int, width: int, bias: bool) -> None:
    weight, offset = torch.randn(out, width), torch.randn(out) if bias else None
    x = torch.randn(rows, width)
    with torch.no_grad():
        result = cpu_decode.linear(x, weight, offset)
    assert kernel_calls == [(rows, width)] and result.shape == (rows, out) and result.dtype == torch.float32
    torch.testing.assert_close(result, F.linear(x, weight, offset), rtol=1e-5, atol=1e-5 * width**0.5)


def test_leading_dimensions_non_contiguous_rows_and_special_values(kernel_calls) -> None:
    weight, bias = torch.randn(9, 6), torch.randn(9)
    x = torch.randn(2, 1, 12)[..., ::2]  # (2, 1, 6), not contiguous
    x[1, 0, 2] = float("nan")
    weight[4, 0] = float("inf")
    with torch.no_grad():
        result = cpu_decode.linear(x, weight, bias)  # (2, 1, 9)
    expected = F.linear(x, weight, bias)
    assert kernel_calls == [(2, 6)] and result.shape == (2, 1, 9)
    torch.testing.assert_close(result, expected, equal_nan=True)
    assert result[1].isnan().all() and result[0, 0, 4] == expected[0, 0, 4]  # NaN and inf keep their meaning


def test_a_row_comes_out_the_same_whatever_rows_go_with_it(kernel_calls) -> None:
    weight, bias, x = torch.randn(50, 40), torch.randn(50), torch.randn(4, 40)
    with torch.no_grad():
        together = cpu_decode.linear(x, weight, bias)
        alone = torch.cat([cpu_decode.linear(x[i : i + 1], weight, bias) for i in range(4)])
    assert len(kernel_calls) == 5 and torch.equal(together, alone)


@pytest.fixture
def invariant():
    with cpu_decode.row_invariance():
        yield


@pytest.mark.parametrize(("out", "width"), [(1, 1), (31, 5), (32, 16), (33, 64), (300, 129)])
@pytest.mark.parametrize("bias", [True, False])
def test_row_invariant_products_run_across_outputs_equal_f_linear_and_give_a_row_the_same_bits_in_any_batch(
    monkeypatch, invariant, out: int, width: int, bias: bool
) -> None:
    """Under set_row_invariant a decode step's product goes through the panel kernel (outputs in panels of PANEL, the
    last one padded): equal to F.linear up to rounding, at 1 to 70 rows, and each row the same bits as alone."""
    calls = record_calls(monkeypatch, "panels.product")
    weight, offset = torch.randn(out, width), torch.randn(out) if bias else None
    x = torch.randn(70, width)
    with torch.no_grad():
        together = cpu_decode.linear(x, weight, offset)
        alone = torch.cat([cpu_decode.linear(x[i : i + 1], weight, offset) for i in range(70)])
        some = cpu_decode.linear(x[3:7, None], weight, offset)  # (4, 1, out): one position per row
    assert calls == [(70, width)] + [(1, width)] * 70 + [(4, width)]
    assert together.shape == (70, out) and some.shape == (4, 1, out)
    torch.testing.assert_close(together, F.linear(x, weight, offset), rtol=1e-5, atol=1e-5 * width**0.5)
    assert torch.equal(together, alone) and torch.equal(some[:, 0], together[3:7])


@pytest.fixture
def panel_builds(monkeypatch) -> list[tuple[int, ...]]:
    """The (out, in) shape of each weight whose panels cpu_decode._panels makes (not those it finds made), in order."""
    builds: list[tuple[int, ...]] = []
    make = cpu_decode._panels

    def counted(weight):
        held = getattr(weight, "_row_invariant_panels", None)
        result = make(weight)
        if held is None or held[1] is not result:
            builds.append(tuple(weight.shape))
        return result

    monkeypatch.setattr(cpu_decode, "_panels", counted)
    return builds


def test_row_invariant_panels_follow_the_weight_and_keep_nan_and_inf(panel_builds, invariant) -> None:
    """The panels are made once per weight and made again when it changes in place or gets new storage; NaN and
    inf keep their meaning (no fastmath)."""
    weight, x = torch.randn(40, 6), torch.randn(3, 6)
    with torch.no_grad():
        first = cpu_decode.linear(x, weight)
        assert panel_builds == [(40, 6)]
        assert torch.equal(cpu_decode.linear(x, weight), first) and panel_builds == [(40, 6)]  # not made again
        weight.mul_(2)
        torch.testing.assert_close(cpu_decode.linear(x, weight), 2 * first)
        assert len(panel_builds) == 2
        weight.data = torch.randn(40, 6)
        torch.testing.assert_close(cpu_decode.linear(x, weight), F.linear(x, weight), rtol=1e-5, atol=1e-5)
        assert len(panel_builds) == 3
        x[1, 2] = float("nan")
        weight[4, 0] = float("inf")
        result, expected = cpu_decode.linear(x, weight), F.linear(x, weight)
    torch.testing.assert_close(result, expected, equal_nan=True)
    assert result[1].isnan().all() and result[0, 4] == expected[0, 4]


def test_a_served_lrnn_makes_each_weight_s_panels_once(panel_builds, invariant) -> None:
    """Row-invariant steps of a layer that runs the torch step (spectral norm) multiply by the stacked generator, a
    view for_serving set up: the same tensor every step, so its panels are made once, not once a step."""
    model = BlockDiagonalLRNN(dataclasses.replace(tiny_configs(40, 0)["lrnn-spectral-b2"], vocab_size=40)).eval()
    tokens = torch.randint(0, 40, (3, 9))
    with torch.no_grad():
        model.for_serving()
        cache = model.new_cache(batch_size=3)
        for t in range(9):
            model.step(tokens[:, t], cache)
    assert len(panel_builds) == 2 * 4 + 1  # per layer the stacked generator, readout and MLP (2); the head: each once


@pytest.mark.parametrize("model_id", ["lrnn", "lrnn-stochastic"])
def test_row_invariant_compiled_layer_steps_multiply_by_panels_and_step_as_the_parallel_pass(
    monkeypatch, invariant, model_id: str
) -> None:
    """Under set_row_invariant the compiled LRNN layer step gets its four matrices as panels (3-d) and multiplies
    them as linear does: the steps of 7 rows equal the parallel pass, and row 0 gets the same bits decoded alone."""
    dimensions = []
    step = compiled_kernel("steps.lrnn")

    def spy(x, state, ln_1, joint, *args):
        dimensions.append(joint.ndim)
        step(x, state, ln_1, joint, *args)

    replace_kernel(monkeypatch, "steps.lrnn", spy)
    model = BlockDiagonalLRNN(dataclasses.replace(tiny_configs(40, 0)[model_id], vocab_size=40)).eval()
    tokens = torch.randint(0, 40, (7, 20))
    with torch.no_grad():
        with cpu_decode.torch_products():
            expected = model(tokens)
        model.for_serving()
        cache, alone = model.new_cache(7), model.new_cache(1)
        stepped = torch.stack([model.step(tokens[:, t], cache) for t in range(20)], dim=1)
        first = torch.stack([model.step(tokens[:1, t], alone) for t in range(20)], dim=1)
    assert dimensions and set(dimensions) == {3}
    torch.testing.assert_close(stepped, expected, rtol=1e-5, atol=1e-5)
    assert torch.equal(first[0], stepped[0])


def test_where_it_does_not_apply_it_is_f_linear(kernel_calls, monkeypatch) -> None:
    weight, x = torch.randn(8, 6), torch.randn(5, 6)
    cases = {  # name: (x, weight, grad enabled, threads, inside torch_products)
        "more rows than MAX_ROWS": (x, weight, False, 1, False),
        "gradients enabled": (x[:1], weight.clone().requires_grad_(), True, 1, False),
        "float64": (x[:1].double(), weight.double(), False, 1, False),
        "weight stored (in, out)": (x[:1], weight.t().contiguous().t(), False, 1, False),
        "two threads": (x[:1], weight, False, 2, False),
        "inside torch_products": (x[:1], weight, False, 1, True),
    }
    before = torch.get_num_threads()
    for name, (rows, matrix, grad, threads, reference) in cases.items():
        torch.set_num_threads(threads)
        try:
            with torch.set_grad_enabled(grad), cpu_decode.torch_products() if reference else contextlib.nullcontext():
                if name in ("two threads", "inside torch_products"):
                    assert not cpu_decode.streams(), name
                result = cpu_decode.linear(rows, matrix)
        finally:
            torch.set_num_threads(before)
        assert kernel_calls == [], name
        assert torch.equal(result, F.linear(rows, matrix)), name
    monkeypatch.setattr(cpu_decode, "MIN_ELEMENTS", weight.numel() + 1)  # a weight too small to gain
    assert torch.equal(cpu_decode.linear(x[:1], weight), F.linear(x[:1], weight)) and kernel_calls == []
    assert cpu_decode.streams() and not cpu_decode.streams(rows=cpu_decode.MAX_ROWS + 1)


def test_the_gradient_path_is_untouched() -> None:
    weight, x = torch.randn(8, 6, requires_grad=True), torch.randn(1, 6)
    cpu_decode.linear(x, weight).sum().backward()
    torch.testing.assert_close(weight.grad, x.expand(8, 6))


@pytest.mark.parametrize(
    "model_id", ["lrnn", "lrnn-spectral-b2", "lrnn-rank3", "lrnn-stochastic", "lrnn-stochastic-rank2"]
)
def test_a_served_lrnn_streams_its_one_token_products_and_steps_as_its_parallel_pass(
    kernel_calls, layer_calls, model_id: str
) -> None:
    """One thread, float32: for_serving keeps every weight (out, in) (the full generator stacks g and B into one
    matrix); at batch 1-4 a column-constrained or stochastic layer with the full generator steps as one compiled
    call, the other layers' products and the head go through the kernel, and the steps equal the parallel pass."""
    config = dataclasses.replace(tiny_configs(40, 0)[model_id], vocab_size=40)
    model = BlockDiagonalLRNN(config).eval()
    tokens = torch.randint(0, 40, (3, 17))
    with torch.no_grad():
        with cpu_decode.torch_products():
            expected = model(tokens)
        notes = model.for_serving()
        assert all(weight.is_contiguous() for weight in model.parameters())
        assert notes[-1] == "one-token products through the streaming matrix-vector kernel (CPU, one thread)"
        kernel_calls.clear()
        cache = model.new_cache(batch_size=3)
        stepped = torch.stack([model.step(tokens[:, t], cache) for t in range(17)], dim=1)
    fused = model_id in ("lrnn", "lrnn-stochastic")
    assert ("2 layers step as one compiled call each at 1-4 rows (CPU)" in notes) == fused
    assert layer_calls == ([(3, 16)] * 2 * 17 if fused else [])
    per_layer = {"lrnn-spectral-b2": 4, "lrnn-rank3": 5, "lrnn-stochastic-rank2": 5}.get(model_id, 0)
    products_per_step = 2 * per_layer + 1  # per layer g and B (1 or 2; rank: [U; B] and V), readout, MLP (2); the head
    assert len(kernel_calls) == 17 * products_per_step and {rows for rows, _ in kernel_calls} == {3}
    torch.testing.assert_close(stepped, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("p", [1.0, 1.2, 2.0])
@pytest.mark.parametrize("rows", [1, 2, 4])
def test_the_compiled_layer_step_equals_the_torch_step(layer_calls, p: float, rows: int) -> None:
    """Weights and states large enough that layer norms, the p-norm divisors (> 1 for most columns) and the GELU's
    both sides all matter; 5 blocks of 3, d_model 24, d_ff 40."""
    config = LRNNConfig(vocab_size=10, d_model=24, n_layers=1, num_blocks=5, block_size=3, d_ff=40, p_norm=p)
    model = BlockDiagonalLRNN(config).eval()
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.normal_(0, 0.7)
        model.for_serving()
    block = model.blocks[0]
    x, state = 2 * torch.randn(rows, 24), 3 * torch.randn(rows, 5, 3)
    with torch.no_grad():
        x_out, state_out = block.step(x, state)
        with cpu_decode.torch_products():
            x_expected, state_expected = block.step(x, state)
    assert layer_calls == [(rows, 24)]
    torch.testing.assert_close(state_out, state_expected, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(x_out, x_expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("p", [1.0, 1.2, 3.7])
def test_the_compiled_column_norm_holds_over_float32s_range_and_keeps_nan(layer_calls, p: float) -> None:
    """The step's |g(u)| ** p and GELU are its own vectorised code, not libm's: g(u) = its bias (the generator's
    weight zero) with columns of zeros, subnormals, and magnitudes from 1e-30 to 1e30 (their ** p near both ends of
    float32's range), each column's divisor then max(1, ||column||_p); the state and the output equal the torch step's
    (whose pow is within 3.4e-6 of the float64 power at these magnitudes, the kernel's within 6e-8). An entry whose
    power passes float32's range (1e36 for p > 1) makes its column's divisor inf, so that column adds nothing. A NaN
    in a column makes its divisor NaN, as torch's clamp does: that block's state is NaN. An inf makes it inf: the
    state entry of the inf's row is inf x 0, NaN, and no other."""
    config = LRNNConfig(vocab_size=10, d_model=8, n_layers=1, num_blocks=4, block_size=4, d_ff=16, p_norm=p)
    model = BlockDiagonalLRNN(config).eval()
    generator = torch.Generator().manual_seed(0)
    exponents = torch.empty(4 * 16).uniform_(-30, 30 / p, generator=generator)
    signs = torch.randint(0, 2, (4 * 16,), generator=generator) * 2 - 1
    bias = signs * 10.0**exponents  # (H b^2,): magnitudes 1e-30 .. 1e30 / p
    bias[:4] = 0.0  # block 0, row 0: and column 0 of block 0 is all zeros below
    bias[[4, 8, 12]] = torch.tensor([1e-40, -1e-39, 0.0])
    bias[16 + 4 * 1 + 2] = float("nan")  # block 1, row 1, column 2
    bias[32 + 4 * 0 + 1] = 1e36  # block 2, row 0, column 1
    bias[48 + 4 * 2 + 3] = float("-inf")  # block 3, row 2, column 3
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.normal_(0, 0.7)
        recurrence = model.blocks[0].recurrence
        recurrence.transition.weight.zero_()
        recurrence.transition.bias.copy_(bias)
        model.for_serving()
    block = model.blocks[0]
    x, state = torch.randn(2, 8), torch.randn(2, 4, 4)
    with torch.no_grad():
        x_out, state_out = block.step(x, state)
        with cpu_decode.torch_products():
            x_expected, state_expected = block.step(x, state)
    assert layer_calls == [(2, 8)]
    assert state_out[:, 1].isnan().all() and state_out[:, 3, 2].isnan().all()  # the NaN's block, the inf's row
    assert state_out.isnan().sum() == 2 * (4 + 1)
    torch.testing.assert_close(state_out, state_expected, rtol=1e-5, atol=1e-6, equal_nan=True)
    torch.testing.assert_close(x_out.isnan(), x_expected.isnan())


@pytest.mark.parametrize("transitions", ["column", "stochastic"])
def test_a_layer_keeps_its_step_arrays_until_a_parameter_or_the_invariance_changes(
    layer_calls, monkeypatch, transitions: str
) -> None:
    """The compiled layer step's arrays are made once and kept between steps; an in-place change of any parameter,
    new storage for one, or row invariance turned on makes them again, and every step still equals the torch step."""
    made = []
    monkeypatch.setattr(
        cpu_decode,
        "layer_step_arrays",
        lambda weights, make=cpu_decode.layer_step_arrays: made.append(len(weights)) or make(weights),
    )
    config = LRNNConfig(
        vocab_size=10, d_model=24, n_layers=1, num_blocks=5, block_size=3, d_ff=40, transition_norm=transitions
    )
    model = BlockDiagonalLRNN(config).eval()
    block = model.blocks[0]
    x, state = torch.randn(2, 24), torch.rand(2, 5, 3)

    def equals_the_torch_step() -> None:
        x_out, state_out = block.step(x, state)
        with cpu_decode.torch_products():
            x_expected, state_expected = block.step(x, state)
        torch.testing.assert_close(x_out, x_expected, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(state_out, state_expected, rtol=1e-5, atol=1e-5)

    with torch.no_grad():
        for parameter in model.parameters():
            parameter.normal_(0, 0.7)
        model.for_serving()
        equals_the_torch_step()
        equals_the_torch_step()
        assert len(made) == 1
        block.mlp.c_proj.weight.mul_(-2)  # in place
        equals_the_torch_step()
        assert len(made) == 2
        block.ln_1.bias.data = torch.randn(24)  # new storage
        equals_the_torch_step()
        assert len(made) == 3
        with cpu_decode.row_invariance():
            equals_the_torch_step()
        assert len(made) == 4 and len(layer_calls) == 5  # every step compiled


def stochastic_layer(spread: float) -> BlockDiagonalLRNN:
    """One stochastic layer, 5 blocks of 4, d_model 24, d_ff 40, its weights N(0, 0.7) but g's, whose entries
    spread by about ``spread`` (0.05: flat columns, every entry in the sparsemax's support; 5: sharp, one or two);
    block 0's generator rows all 0.3, so that its columns are exact ties."""
    config = LRNNConfig(
        vocab_size=10, d_model=24, n_layers=1, num_blocks=5, block_size=4, d_ff=40, transition_norm="stochastic"
    )
    model = BlockDiagonalLRNN(config).eval()
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.normal_(0, 0.7)
        generator = model.blocks[0].recurrence.transition
        generator.weight.normal_(0, spread / 24**0.5 / 0.7)  # u = LN(x) has entries of spread ~0.7
        generator.bias.normal_(0, spread)
        generator.weight[:16] = 0
        generator.bias[:16] = 0.3
        model.for_serving()
    return model


@pytest.mark.parametrize(("spread", "zeros"), [(0.05, (0.0, 0.05)), (0.7, (0.3, 0.65)), (5.0, (0.68, 0.75))])
@pytest.mark.parametrize("rows", [1, 2, 3, 4])
def test_the_compiled_stochastic_layer_step_equals_the_torch_step(
    layer_calls, spread: float, zeros: tuple[float, float], rows: int
) -> None:
    """Each column of A(u) the sparsemax of g(u)'s (no B u): flat, mixed and sharp columns (``zeros``: the range
    the share of A(u)'s zero entries must fall in, to show the case is what it says), and tied ones."""
    block = stochastic_layer(spread).blocks[0]
    x, state = 2 * torch.randn(rows, 24), torch.randn(rows, 5, 4).softmax(dim=-1)
    with torch.no_grad():
        x_out, state_out = block.step(x, state)
        with cpu_decode.torch_products():
            x_expected, state_expected = block.step(x, state)
            transitions = block.recurrence.transitions(block.ln_1(x))  # (rows, 5, 4, 4)
    assert layer_calls == [(rows, 24)]
    share = (transitions[:, 1:] == 0).float().mean().item()
    assert zeros[0] <= share <= zeros[1], share
    assert torch.equal(transitions[:, 0], torch.full_like(transitions[:, 0], 0.25))  # tied columns: uniform
    torch.testing.assert_close(state_out, state_expected, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(x_out, x_expected, rtol=1e-5, atol=1e-5)


def test_a_stochastic_model_decoded_through_the_compiled_step_gives_its_parallel_pass(layer_calls) -> None:
    """Two stochastic layers with mixed columns (random weights, not the near-identity of a new model): three rows
    decoded from the learned h_0 one token at a time, every layer step compiled, give the parallel pass's logits."""
    config = dataclasses.replace(tiny_configs(40, 0)["lrnn-stochastic"], vocab_size=40, block_size=4)
    model = BlockDiagonalLRNN(config).eval()
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.normal_(0, 0.5)
    tokens = torch.randint(0, 40, (3, 23))
    with torch.no_grad():
        with cpu_decode.torch_products():
            expected = model(tokens)
        model.for_serving()
        cache = model.new_cache(batch_size=3)
        stepped = torch.stack([model.step(tokens[:, t], cache) for t in range(23)], dim=1)
    assert layer_calls == [(3, 16)] * 2 * 23
    torch.testing.assert_close(stepped, expected, rtol=1e-5, atol=1e-5)


@pytest.fixture
def thick_layer_calls(kernel_calls, monkeypatch) -> list[tuple[int, ...]]:
    """The (rows, d_model) shape of every x the compiled RegularGPT thick layer step takes, in order."""
    return record_calls(monkeypatch, "steps.regulargpt")


def sharp_regulargpt(model_id: str) -> RegularGPT:
    """A tiny RegularGPT language model (vocabulary 40) with its matrices scaled by 4: attention far from uniform."""
    model = RegularGPT(dataclasses.replace(tiny_configs(40, 0)[model_id], vocab_size=40)).eval()
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if "weight" in name and parameter.dim() == 2:
                parameter.mul_(4)
    return model


COMPILED_LAYERS = "thick layers step as one compiled call each at 1-4 rows (CPU)"


@pytest.mark.parametrize("model_id", ["regulargpt-c2", "regulargpt-c2-null", "regulargpt-c3-k2", "regulargpt-c5"])
def test_a_served_regulargpt_keeps_its_head_as_stored_and_steps_each_thick_layer_compiled(
    kernel_calls, thick_layer_calls, model_id: str
) -> None:
    """for_serving packs the K blocks' parameters into one buffer (values unchanged) and leaves the head as stored;
    every thick layer of a decode step (D(t) of them) is one compiled call, the head goes through the kernel, and
    the steps equal the parallel pass: masked and null out-of-range slots, C 2 and 3, K 1 and 2, weights scaled up
    so that attention is far from uniform."""
    model = sharp_regulargpt(model_id)
    before = {name: tensor.clone() for name, tensor in model.state_dict().items()}
    tokens = torch.randint(0, 40, (2, 30))
    with torch.no_grad():
        with cpu_decode.torch_products():
            expected = model(tokens)
        assert model.for_serving() == [COMPILED_LAYERS]
        assert model.embedding.embed.weight.is_contiguous()  # the head is not transposed for the kernel
        for name, tensor in model.state_dict().items():
            assert torch.equal(tensor, before[name]), name
        packed = model.packed.packed
        for parameter in model.blocks.parameters():
            assert parameter.untyped_storage().data_ptr() == packed.ctypes.data
        kernel_calls.clear()
        cache = model.new_cache(2)
        stepped = []
        for t in range(30):
            calls = len(thick_layer_calls)
            stepped.append(model.step(tokens[:, t], cache))
            assert len(thick_layer_calls) - calls == cache.depth, t  # every thick layer
    assert set(thick_layer_calls) == {(2, 16)}
    assert kernel_calls.count((2, 16)) == 30  # the head; the rest are chunks where the depth grows
    torch.testing.assert_close(torch.stack(stepped, dim=1), expected, rtol=1e-5, atol=1e-5)


def test_a_served_regulargpt_with_level_codes_hands_them_on_after_each_compiled_thick_layer(thick_layer_calls) -> None:
    """A transducer with level codes: each compiled thick layer of a decode step is followed by its codes, and the
    steps give the parallel pass's labels (the codes' readings, the same at every position that reads one code)."""
    model = sharp_regulargpt("regulargpt-c2-null")
    config = dataclasses.replace(model.config, num_labels=3, level_codes=True)
    coded = RegularGPT(config).eval()
    state = {name: value for name, value in model.state_dict().items() if name in coded.state_dict()}
    codes = torch.randn(3, config.d_model, generator=torch.Generator().manual_seed(3))
    coded.load_state_dict({**coded.state_dict(), **state, "level_codes": codes})
    tokens = torch.randint(0, 40, (2, 30), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        with cpu_decode.torch_products():
            expected = coded(tokens)
        assert COMPILED_LAYERS in coded.for_serving()
        cache = coded.new_cache(2)
        stepped = torch.stack([coded.step(tokens[:, t], cache) for t in range(30)], dim=1)
    assert thick_layer_calls  # the compiled thick layer ran
    assert torch.equal(stepped.argmax(-1), expected.argmax(-1))
    torch.testing.assert_close(stepped, expected, rtol=1e-5, atol=1e-5)


def test_a_served_post_norm_regulargpt_steps_through_torch_and_equals_its_parallel_pass(
    kernel_calls, thick_layer_calls
) -> None:
    """The compiled thick layer is pre-norm only: for_serving packs nothing for block_norm="post", and its decode
    steps run the torch blocks (post-norm) and still give the parallel pass."""
    model = sharp_regulargpt("regulargpt-c2-null")
    model = RegularGPT(dataclasses.replace(model.config, block_norm="post")).eval()
    tokens = torch.randint(0, 40, (2, 20))
    with torch.no_grad():
        with cpu_decode.torch_products():
            expected = model(tokens)
        assert COMPILED_LAYERS not in model.for_serving() and model.packed is None
        cache = model.new_cache(2)
        stepped = torch.stack([model.step(tokens[:, t], cache) for t in range(20)], dim=1)
    assert thick_layer_calls == []
    torch.testing.assert_close(stepped, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("model_id", ["regulargpt-c2", "regulargpt-c2-null", "regulargpt-c3-k2", "regulargpt-c5"])
def test_compiled_steps_of_rows_at_different_lengths_equal_the_torch_steps(monkeypatch, model_id: str) -> None:
    """Two rows decoded together from 11 and 2 tokens: the short row's far slots are out of range (masked or null)
    while the long row's are not, the case where a step's plan carries a valid mask."""
    monkeypatch.setattr(cpu_decode, "MIN_ELEMENTS", 1)
    masks = []
    layer_step = compiled_kernel("steps.regulargpt")

    def spy(x, windows, positions, dilation, ring, slots, *args):
        farthest = positions - (slots - 1) * dilation  # each row's farthest slot's position
        masks.append(farthest.min() < 0 <= farthest.max())
        layer_step(x, windows, positions, dilation, ring, slots, *args)

    replace_kernel(monkeypatch, "steps.regulargpt", spy)
    model = sharp_regulargpt(model_id)
    tokens = torch.randint(0, 40, (2, 20))

    def decode() -> torch.Tensor:
        long, short = model.new_cache(1), model.new_cache(1)
        model(tokens[:1, :11], cache=long)
        model(tokens[1:, :2], cache=short)
        cache = type(long).stack([long, short])
        return torch.stack([model.step(tokens[:, t], cache) for t in range(11, 20)], dim=1)

    with torch.no_grad():
        with cpu_decode.torch_products():
            expected = decode()
        model.for_serving()
        stepped = decode()
    assert any(masks)  # some step ran with slots out of range for one row only
    torch.testing.assert_close(stepped, expected, rtol=1e-5, atol=1e-5)


def test_replaced_parameters_fall_back_to_the_torch_step_and_in_place_changes_are_seen(thick_layer_calls) -> None:
    """After for_serving, an in-place change to a block's parameter is a change to the packed buffer (the compiled
    step sees it); a parameter whose tensor is replaced (here ``.data =``, as ``.to``, ``.half`` or
    ``load_state_dict(assign=True)`` do) is no longer packed, and the steps run the torch path with the new values."""
    model = sharp_regulargpt("regulargpt-c2-null")
    tokens = torch.randint(0, 40, (1, 12))

    def decode() -> torch.Tensor:
        cache = model.new_cache(1)
        return torch.stack([model.step(tokens[:, t], cache) for t in range(12)], dim=1)

    with torch.no_grad():
        model.for_serving()
        mlp = model.blocks[0].mlp.c_fc.weight
        mlp.mul_(1.5)
        compiled = decode()
        assert len(thick_layer_calls) > 0
        with cpu_decode.torch_products():
            torch.testing.assert_close(compiled, model(tokens), rtol=1e-5, atol=1e-5)
        thick_layer_calls.clear()
        mlp.data = mlp.data * 2  # a new tensor
        replaced = decode()
        assert thick_layer_calls == []
        with cpu_decode.torch_products():
            torch.testing.assert_close(replaced, model(tokens), rtol=1e-5, atol=1e-5)
        assert not torch.allclose(replaced, compiled)


@pytest.mark.parametrize("model_id", ["regulargpt-c2-null", "regulargpt-c3-k2"])
def test_row_invariant_regulargpt_steps_multiply_panels_that_follow_in_place_changes(
    monkeypatch, invariant, model_id: str
) -> None:
    """Under set_row_invariant the compiled thick layer takes its K blocks' four matrices as panels (block_panels),
    equal to the torch steps up to rounding, and an in-place change to a weight after a step reaches the next one."""
    given = []
    layer_step = compiled_kernel("steps.regulargpt")

    def spy(x, windows, positions, dilation, ring, slots, packed, starts, panels, *args):
        given.append(len(panels))
        layer_step(x, windows, positions, dilation, ring, slots, packed, starts, panels, *args)

    replace_kernel(monkeypatch, "steps.regulargpt", spy)
    model = sharp_regulargpt(model_id)
    tokens = torch.randint(0, 40, (5, 16))

    def decode() -> torch.Tensor:
        cache = model.new_cache(5)
        model(tokens[:, :4], cache=cache)
        return torch.stack([model.step(tokens[:, t], cache) for t in range(4, 16)], dim=1)

    with torch.no_grad():
        model.for_serving()
        for _ in range(2):
            stepped = decode()
            with cpu_decode.torch_products():
                expected = decode()
            torch.testing.assert_close(stepped, expected, rtol=1e-5, atol=1e-5)
            model.blocks[0].mlp.c_fc.weight.mul_(1.5)  # after the panels were made
    assert given and set(given) == {4 * len(model.blocks)}


@pytest.mark.parametrize(
    "model_id", ["lrnn", "lrnn-spectral-b2", "lrnn-stochastic", "regulargpt-c2-null", "regulargpt-c5"]
)
@pytest.mark.parametrize("threads", [1, 2])
def test_row_invariant_steps_give_a_row_the_same_bits_in_any_batch(model_id: str, threads: int) -> None:
    """set_row_invariant (the server's batch_invariant): a row decoded alone and beside six rows, two as long as it
    (a RegularGPT's rows then reach new thick layers together) and four longer, gets the same logits bit for bit, at
    one thread and two; by default the batch past MAX_ROWS changes them."""
    torch.manual_seed(0)
    model = build_tiny(model_id, vocab_size=40, num_labels=0).eval()
    tokens = torch.randint(0, 40, (7, 40))

    def decode(rows: int) -> torch.Tensor:  # row 0's logits: (steps, V)
        caches = [model.new_cache(1) for _ in range(rows)]
        for row, cache in enumerate(caches):
            model(tokens[row : row + 1, : [5, 5, 5, 9, 13, 17, 23][row]], cache=cache)
        cache = caches[0] if rows == 1 else type(caches[0]).stack(caches)
        return torch.stack([model.step(tokens[:rows, 23 + t], cache)[0] for t in range(14)])  # row 0 past 16 tokens

    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        with torch.no_grad():
            cpu_decode.set_row_invariant(True)
            model.for_serving()
            assert torch.equal(decode(7), decode(1))
            cpu_decode.set_row_invariant(False)
            assert not torch.equal(decode(7), decode(1))  # what it changes (MKL's products past MAX_ROWS)
    finally:
        cpu_decode.set_row_invariant(False)
        torch.set_num_threads(before)


@pytest.mark.parametrize("block", [1, 2, 3, 8, 16])
def test_the_compiled_column_sparsemax_equals_the_reference(monkeypatch, block: int) -> None:
    """``column_sparsemax`` on float32 CPU blocks runs the compiled loop (a block at a time, no branch per entry),
    equal to the torch reference up to float rounding: random columns, tied entries, columns far apart in scale and an
    all-equal block; with a gradient asked for, its compiled backward equals autograd through the reference's sort."""
    calls = record_calls(monkeypatch, "sparsemax.columns")
    generator = torch.Generator().manual_seed(block)
    matrices = torch.randn(5, 7, block, block, generator=generator) * torch.tensor([0.1, 1.0, 10.0, 3.0, 0.5]).view(
        5, 1, 1, 1
    )  # (5, 7, b, b)
    matrices[0, 0] = 0.25  # every entry tied
    # two tied groups in one column, the lower one off the support, not at its edge (where the Jacobian is not defined)
    matrices[1, 1, :, 0] = torch.arange(block).float().div(block).round() * 3
    with cpu_decode.torch_products():
        reference = column_sparsemax(matrices)
    compiled = column_sparsemax(matrices)
    assert calls == [(5 * 7 * block * block,)]
    assert compiled.shape == matrices.shape and compiled.dtype == torch.float32
    torch.testing.assert_close(compiled, reference, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(compiled.sum(dim=-2), torch.ones(5, 7, block), rtol=1e-5, atol=1e-5)
    weights = torch.randn(matrices.shape, generator=generator)  # a loss that weighs every output

    def gradient() -> torch.Tensor:
        trained = matrices.clone().requires_grad_()
        (column_sparsemax(trained) * weights).sum().backward()
        return trained.grad

    compiled_gradient = gradient()
    assert len(calls) == 2
    with cpu_decode.torch_products():
        torch.testing.assert_close(compiled_gradient, gradient(), rtol=1e-5, atol=1e-5)


def test_the_compiled_column_sparsemax_keeps_a_nan_in_its_column() -> None:
    """A NaN entry makes its column NaN (as the compiled decode step's sparsemax does), so the row's logits come out
    NaN and the server fails that row alone; the other columns are untouched."""
    matrices = torch.randn(2, 4, 4)
    matrices[1, 2, 1] = float("nan")
    compiled = column_sparsemax(matrices)
    assert bool(compiled[1, :, 1].isnan().all()) and not bool(compiled[1, :, [0, 2, 3]].isnan().any())
    with cpu_decode.torch_products():
        torch.testing.assert_close(compiled[0], column_sparsemax(matrices[:1])[0], rtol=1e-6, atol=1e-6)


def test_the_panel_products_tile_height_does_not_change_a_rows_bits(invariant) -> None:
    """The panel kernel takes ``tile_rows`` rows at a time (4 with AVX-512, else 2): each row's sums are the same
    fused multiply-adds in the same order either way, so both kernels give the same bits."""
    import numba

    weight, bias = torch.randn(70, 37), torch.randn(70)
    x = torch.randn(7, 37)
    panels = cpu_decode._panels(weight)
    outs, picks = [], []
    for rows in (2, 4):
        kernel, argmax, _ = build_panels(numba, rows)
        out = np.empty((7, panels.shape[0] * cpu_decode.PANEL), dtype=np.float32)
        kernel(x.numpy(), panels, bias.numpy(), True, out)
        outs.append(out[:, :70])
        index, value = np.empty(7, dtype=np.int64), np.empty(7, dtype=np.float32)
        argmax(x.numpy(), panels, bias.numpy(), True, 70, index, value)
        picks.append((index, value))
    assert np.array_equal(outs[0], outs[1])
    for index, value in picks:
        assert np.array_equal(index, outs[0].argmax(-1)) and np.array_equal(value, outs[0].max(-1))
    torch.testing.assert_close(torch.from_numpy(outs[0]), F.linear(x, weight, bias), rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 9, 64])
@pytest.mark.parametrize(("out", "width"), [(1, 1), (31, 5), (32, 16), (70, 37), (8192, 16)])
@pytest.mark.parametrize("bias", [True, False])
def test_greedy_picks_without_the_logits_are_the_logits_argmax_and_value(invariant, rows, out, width, bias) -> None:
    """``linear_argmax`` under invariance compares the panel product's sums in registers and never writes the logits:
    its picks and their values are the logits' (``rows_argmax`` of ``linear``) bit for bit, whatever the rows, the
    panel count (the last one partial) and the bias; a row's pick is the same alone."""
    torch.manual_seed(rows * 1000 + out)
    weight, x = torch.randn(out, width), torch.randn(rows, width)
    offsets = torch.randn(out) if bias else None
    with torch.inference_mode():
        index, value = cpu_decode.linear_argmax(x, weight, offsets)
        expected_index, expected_value = cpu_decode.rows_argmax(cpu_decode.linear(x, weight, offsets))
        alone = cpu_decode.linear_argmax(x[-1:], weight, offsets)
    assert index.dtype == torch.int64 and torch.equal(index, expected_index) and torch.equal(value, expected_value)
    assert alone[0].item() == index[-1].item() and alone[1].item() == value[-1].item()


def test_greedy_picks_take_the_first_of_ties_and_the_first_nan_as_numpy_does(invariant) -> None:
    """With one input per row the logits are x[r] * w[o] exactly: ties (the first), infinities, NaN (the first NaN
    wins over any number: numpy's and torch's argmax), and a row of -inf (the first output), across panels and
    within one, each the same pick and value as ``rows_argmax`` of the logits."""
    w = torch.linspace(-1.0, 1.0, 100)
    w[[3, 45, 90]] = 5.0  # the largest, tied: across panels (3, 45) and within the last (90)
    w[60] = -7.0  # the smallest
    w[70] = 0.0
    w[[20, 80]] = float("nan")
    x = torch.tensor([[1.0], [-1.0], [0.0], [float("inf")], [float("-inf")], [float("nan")]])
    weight = w[:, None].clone()
    for rows in (x, x[:, :], torch.cat([x[:1], x[:1]])):
        with torch.inference_mode():
            index, value = cpu_decode.linear_argmax(rows, weight)
            expected = cpu_decode.rows_argmax(cpu_decode.linear(rows, weight))
        assert torch.equal(index, expected[0]) and torch.equal(value.isnan(), expected[1].isnan())
        assert torch.equal(value.nan_to_num(), expected[1].nan_to_num())
    clean = weight.clone()
    clean[[20, 80]] = 1.0
    with torch.inference_mode():
        index, value = cpu_decode.linear_argmax(x, clean)
    logits = x * clean[:, 0]  # (6, 100): exact, one product each
    assert index.tolist() == logits.numpy().argmax(-1).tolist() == [3, 60, 0, 70, 70, 0]  # inf x 0 is NaN
    assert value[:3].tolist() == [5.0, 7.0, 0.0] and value[3:].isnan().all()
    with torch.inference_mode():
        minus = cpu_decode.linear_argmax(torch.full((1, 1), float("-inf")), torch.ones(40, 1))
    assert minus[0].item() == 0 and minus[1].item() == float("-inf")


def test_importing_the_kernels_compiles_nothing() -> None:
    """cpu_decode and its kernel families (model/ops/cpu/kernels/) import neither numba nor llvmlite: the kernels are
    built on first use, once (``_build``)."""
    code = (
        "import sys, model.ops.cpu.cpu_decode as cpu_decode; "
        "sys.exit(cpu_decode._kernels is not None or bool({'numba', 'llvmlite'} & set(sys.modules)))"
    )
    root = Path(__file__).resolve().parents[4]
    assert subprocess.run([sys.executable, "-c", code], cwd=root, check=False).returncode == 0
