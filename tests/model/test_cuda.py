"""The CUDA paths agree with the CPU: every architecture's parallel pass, its step-by-step decoding and its
final-position logits, the fast ops against their references (values and gradients), bf16 against float32, and
the shipped checkpoints. Skipped on a machine without CUDA (CI has none; run them where a GPU is lent)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from model.checkpoint import load_checkpoint
from model.ops.dilated_attention import dilated_attention_fast, dilated_attention_reference
from model.ops.linear_scan import scan_chunked, scan_parallel, scan_sequential
from tests.model.test_dilated_attention import dilations, make_inputs, values_and_grads
from tests.model.test_linear_scan import make_problem, outputs_and_gradients, step_loop
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


@pytest.mark.parametrize("model_id", MODEL_IDS)
def test_step_by_step_on_cuda_equals_parallel(model_id: str) -> None:
    model = build_tiny(model_id, VOCAB, 0).to(device=CUDA, dtype=torch.float64).eval()
    tokens = torch.randint(0, VOCAB, (2, 30), device=CUDA)
    with torch.no_grad():
        parallel = model(tokens)
        cache = model.new_cache(batch_size=2)
        prefilled = model(tokens[:, :11], cache=cache)
        stepped = torch.stack([model.step(tokens[:, t], cache) for t in range(11, 30)], dim=1)
    torch.testing.assert_close(prefilled, parallel[:, :11], rtol=1e-9, atol=1e-9)
    torch.testing.assert_close(stepped, parallel[:, 11:], rtol=1e-9, atol=1e-9)


@pytest.mark.parametrize("model_id", MODEL_IDS)
def test_final_logits_on_cuda_equal_gathered_parallel_logits(model_id: str) -> None:
    model = build_tiny(model_id, VOCAB, LABELS).to(device=CUDA, dtype=torch.float64).eval()
    tokens = torch.randint(0, VOCAB, (3, 25), device=CUDA)
    lengths = torch.tensor([25, 9, 1], device=CUDA)
    with torch.no_grad():
        parallel = model(tokens)
        final = model.final_logits(tokens, lengths)
    expected = parallel[torch.arange(3, device=CUDA), lengths - 1]
    torch.testing.assert_close(final, expected, rtol=1e-9, atol=1e-9)


@pytest.mark.parametrize("model_id", MODEL_IDS)
def test_bfloat16_on_cuda_close_to_float32(model_id: str) -> None:
    model = build_tiny(model_id, VOCAB, LABELS).to(CUDA).eval()
    tokens = torch.randint(0, VOCAB, (2, 19), device=CUDA)
    with torch.no_grad():
        reference = model(tokens)
        low = model.to(torch.bfloat16)(tokens)
    assert low.dtype == torch.bfloat16
    torch.testing.assert_close(low.float(), reference, rtol=0.1, atol=0.1)


@pytest.mark.parametrize(("chunk_size", "null"), [(2, False), (2, True), (3, False), (4, True)])
@pytest.mark.parametrize("length", [7, 500, 4097])
def test_fast_dilated_attention_on_cuda_equals_reference(chunk_size: int, null: bool, length: int) -> None:
    inputs = on(make_inputs(2, 2, length, chunk_size, torch.float64, null), CUDA)
    for dilation in dilations(length, chunk_size)[:4]:
        fast = values_and_grads(dilated_attention_fast, inputs, chunk_size, dilation)
        reference = values_and_grads(dilated_attention_reference, inputs, chunk_size, dilation)
        for got, want in zip((fast[0], *fast[1]), (reference[0], *reference[1])):
            torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-9)


@pytest.mark.parametrize("length", [1, 7, 100, 4096, 10000])
def test_linear_scans_on_cuda_agree_with_the_cpu_step_loop(length: int) -> None:
    problem = make_problem(length, torch.float64)
    expected = outputs_and_gradients(step_loop, problem)
    problem = on(problem, CUDA)
    scans = {"sequential": scan_sequential, "parallel": scan_parallel, "chunked-64": scan_chunked}
    for name, scan in scans.items():
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
