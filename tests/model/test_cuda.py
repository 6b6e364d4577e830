"""The CUDA paths agree with the CPU: every architecture's parallel pass, the fast ops against their references
(values and gradients) and the shipped checkpoints. Skipped on a machine without CUDA (CI has none; run them where a
GPU is lent). Step-by-step decoding, final logits and bf16 on CUDA are tests/model/test_models.py's, run on DEVICES."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from model.checkpoint import load_checkpoint
from tests.model.helpers import (
    FAST_OPS,
    assert_agree,
    dilations,
    implementations,
    make_inputs,
    make_problem,
    outputs_and_gradients,
    step_loop,
)
from tests.model.tiny_models import MODEL_IDS, build_tiny

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

CUDA = torch.device("cuda")
VOCAB, LABELS = 5, 3
FLOAT32 = {"rtol": 1e-4, "atol": 1e-4}
CHECKPOINTS = Path(__file__).resolve().parents[2] / "checkpoints"


def on(tensors, device: torch.device):
    return tuple(t.detach().to(device).requires_grad_() for t in tensors)


@pytest.mark.parametrize("model_id", MODEL_IDS)
def test_parallel_pass_on_cuda_equals_cpu(model_id: str) -> None:
    model = build_tiny(model_id, VOCAB, LABELS).eval()
    tokens = torch.randint(0, VOCAB, (3, 37))
    with torch.no_grad():
        expected = model(tokens)
        actual = model.to(CUDA)(tokens.to(CUDA))
    torch.testing.assert_close(actual.cpu(), expected, **FLOAT32)


@FAST_OPS
@pytest.mark.parametrize(("chunk_size", "null"), [(2, False), (2, True), (3, False), (4, True)])
@pytest.mark.parametrize("length", [7, 500, 4097])
def test_fast_dilated_attention_on_cuda_equals_reference(op, chunk_size: int, null: bool, length: int) -> None:
    inputs = on(make_inputs(2, 2, length, chunk_size, torch.float64, null), CUDA)
    for dilation in dilations(length, chunk_size)[:4]:
        assert_agree(op, inputs, chunk_size, dilation, rtol=1e-9, atol=1e-9)


@pytest.mark.parametrize("length", [1, 7, 100, 4096, 10000])
def test_linear_scans_on_cuda_agree_with_the_cpu_step_loop(length: int) -> None:
    problem = make_problem(length, torch.float64)
    expected = outputs_and_gradients(step_loop, problem)
    problem = on(problem, CUDA)
    for name, scan in implementations():
        actual = outputs_and_gradients(scan, problem)
        for got, want in zip(actual, expected):
            torch.testing.assert_close(got.cpu(), want, rtol=1e-9, atol=1e-9, msg=lambda m, n=name: f"{n}: {m}")


SHIPPED = sorted(p.name for p in CHECKPOINTS.iterdir() if (p / "config.json").exists()) if CHECKPOINTS.exists() else []


@pytest.mark.parametrize("folder", SHIPPED)
def test_shipped_checkpoint_on_cuda_equals_cpu(folder: str) -> None:
    cpu = load_checkpoint(CHECKPOINTS / folder, device="cpu")
    cuda = load_checkpoint(CHECKPOINTS / folder, device="cuda")
    vocab = cpu.model.config.vocab_size
    tokens = torch.randint(0, vocab, (2, 64))
    with torch.no_grad():
        expected = cpu.model(tokens)
        actual = cuda.model(tokens.to(CUDA))
    tolerance = {"rtol": 1e-9, "atol": 1e-9} if expected.dtype == torch.float64 else {"rtol": 1e-3, "atol": 1e-3}
    torch.testing.assert_close(actual.cpu(), expected, **tolerance)
