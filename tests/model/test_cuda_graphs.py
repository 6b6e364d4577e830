"""The decode step through CUDA graphs (model/cuda_graphs.py) equals the eager one. On the CPU (CI) the graphs are
stood in for by a replay that runs the eager step on the captured buffers, which checks the padding and the copies
in and out; on CUDA (where a GPU is lent) real graphs are captured and replayed."""

from __future__ import annotations

import pytest
import torch

from model.cache import long_tensor
from model.cuda_graphs import Decoder, GraphedDecoder, _Captured, capture_sizes, decoder_for
from model.lrnn.model import LRNNCache
from tests.model.tiny_models import MODEL_IDS, build_tiny

VOCAB, LABELS = 7, 3
GROWING = [model_id for model_id in MODEL_IDS if model_id.startswith(("regulargpt", "transformer"))]
FIXED = [model_id for model_id in MODEL_IDS if model_id not in GROWING]  # the LRNNs and the LSTM
UNCAPTURABLE = {"lrnn-spectral-b3"}  # the spectral norm of 3 x 3 blocks is an SVD, which syncs with the host
CLOSE = {torch.float32: {"rtol": 1e-5, "atol": 1e-5}, torch.bfloat16: {"rtol": 2e-2, "atol": 2e-2}}
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def test_capture_sizes() -> None:
    assert capture_sizes(64) == [1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64]
    assert capture_sizes(3) == [1, 2, 3]
    assert capture_sizes(20) == [1, 2, 4, 8, 16, 20]
    assert capture_sizes(1) == [1]


@pytest.mark.parametrize("model_id", MODEL_IDS)
def test_step_state_is_fixed_exactly_for_fixed_size_caches(model_id: str) -> None:
    model = build_tiny(model_id, VOCAB, LABELS).eval()
    with torch.inference_mode():
        cache = model.new_cache(3)
        state = cache.step_state()
        if model_id in GROWING:
            assert state is None
            return
        shapes = [tuple(tensor.shape) for tensor in state]
        model.step(torch.tensor([1, 2, 3]), cache)
        assert [tensor.shape[0] for tensor in cache.step_state()] == [3] * len(shapes)
        assert [tuple(tensor.shape) for tensor in cache.step_state()] == shapes


def test_eager_on_the_cpu_says_why() -> None:
    model = build_tiny("lrnn", VOCAB, LABELS).eval()
    decoder = decoder_for(model, [1, 2, 4])
    assert type(decoder) is Decoder and decoder.path.mode == "eager"
    assert "CUDA graphs need a CUDA device" in decoder.path.reason
    assert "turned off" in decoder_for(model, [1, 2, 4], enabled=False).path.reason


class ReplayEagerly:
    """A CUDA graph's stand-in on the CPU: ``replay`` runs the eager step of every captured row on the input buffers
    and writes the output buffers and the logits, as a replay does."""

    def __init__(self, model, captured: _Captured) -> None:
        self.model, self.captured = model, captured

    def replay(self) -> None:
        captured = self.captured
        size = captured.tokens.shape[0]
        cache = LRNNCache(long_tensor(0, size), [buffer.clone() for buffer in captured.inputs])
        captured.logits.copy_(self.model.step(captured.tokens, cache))
        for buffer, state in zip(captured.outputs, cache.states):
            buffer.copy_(state)


def stand_in(model, sizes: list[int]) -> GraphedDecoder:
    captured = {}
    for size in sizes:
        cache = model.new_cache(size)
        inputs = [state.clone() for state in cache.states]  # as captured: a new cache's (padded rows keep valid states)
        outputs = [torch.full_like(state, float("nan")) for state in cache.states]
        logits = torch.empty(size, LABELS)
        captured[size] = _Captured(None, torch.zeros(size, dtype=torch.long), inputs, outputs, logits)
        captured[size].graph = ReplayEagerly(model, captured[size])
    return GraphedDecoder(model, captured)


def assert_decodes_alike(model, decoder: Decoder, close: dict) -> None:
    """Batches of 1-9 rows through ``decoder`` and ``model.step`` (rows joining and leaving between steps; past the
    largest captured size, eager): the same logits, states and lengths at every step."""
    generator = torch.Generator().manual_seed(0)
    with torch.inference_mode():
        graphed, eager = model.new_cache(3), model.new_cache(3)
        for rows in [3, 3, 4, 1, 6, 9, 2, 8]:
            if rows != graphed.batch_size:
                keep = [row % graphed.batch_size for row in range(rows)]
                graphed, eager = graphed.select(keep), eager.select(keep)
            tokens = torch.randint(VOCAB, (rows,), generator=generator)  # on the CPU, as the engine passes them
            expected = model.step(tokens.to(model.device), eager)
            torch.testing.assert_close(decoder.step(tokens, graphed), expected, **close)
            for mine, theirs in zip(graphed.step_state(), eager.step_state()):
                torch.testing.assert_close(mine, theirs, **close)
            assert graphed.lengths.tolist() == eager.lengths.tolist()


@pytest.mark.parametrize("model_id", ["lrnn", "lrnn-stochastic"])
def test_padded_replays_equal_the_eager_step(model_id: str) -> None:
    model = build_tiny(model_id, VOCAB, LABELS).eval()
    assert_decodes_alike(model, stand_in(model, [2, 4, 8]), CLOSE[torch.float32])  # padded: other product shapes


@needs_cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("model_id", FIXED)
def test_cuda_graphs_equal_the_eager_step(model_id: str, dtype: torch.dtype) -> None:
    model = build_tiny(model_id, VOCAB, LABELS).eval().to("cuda", dtype)
    decoder = decoder_for(model, [1, 2, 4, 8])
    if model_id in UNCAPTURABLE:  # decodes eagerly, and says why
        assert decoder.path.mode == "eager" and decoder.path.reason.startswith("capture failed"), decoder.path
    else:
        assert decoder.path.mode == "cuda_graphs", decoder.path.reason
        assert decoder.path.batch_sizes == (1, 2, 4, 8)
    assert_decodes_alike(model, decoder, CLOSE[dtype])


@needs_cuda
@pytest.mark.parametrize("model_id", GROWING)
def test_growing_caches_decode_eagerly_on_cuda(model_id: str) -> None:
    decoder = decoder_for(build_tiny(model_id, VOCAB, LABELS).eval().cuda(), [1, 2])
    assert decoder.path.mode == "eager" and "grows with the context" in decoder.path.reason
