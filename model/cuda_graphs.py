"""The decode step through CUDA graphs captured per batch size (:func:`decoder_for`); a batch replays the smallest graph
that holds it, state copied in and out. Otherwise decoding is eager and :attr:`Decoder.path` says why."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from model.base import SequenceModel
from model.cache import InferenceCache
from model.ops.cpu.cpu_decode import rows_argmax

logger = logging.getLogger(__name__)


def capture_sizes(max_rows: int) -> list[int]:
    """Sizes to capture up to ``max_rows``: 1, 2, 4, every multiple of 8, and ``max_rows``."""
    sizes = {size for size in (1, 2, 4) if size <= max_rows} | set(range(8, max_rows + 1, 8)) | {max_rows}
    return sorted(sizes)


@dataclass(frozen=True)
class DecodePath:
    """``cuda_graphs`` at ``batch_sizes`` (larger batches run eagerly), or ``eager`` and ``reason``."""

    mode: str  # "cuda_graphs" | "eager"
    batch_sizes: tuple[int, ...] = ()
    reason: str | None = None


class Decoder:
    """The decode step as the model runs it (``model.step``)."""

    def __init__(self, model: SequenceModel, reason: str) -> None:
        self.model = model
        self.path = DecodePath("eager", reason=reason)

    def step(self, tokens: torch.Tensor, cache: InferenceCache) -> torch.Tensor:
        """tokens (B,) on any device -> logits (B, output_size), advancing ``cache``; the logits may be a view the next
        step overwrites."""
        return self.model.step(tokens.to(self.model.device, non_blocking=True), cache)

    def greedy_step(self, tokens: torch.Tensor, cache: InferenceCache) -> tuple[torch.Tensor, torch.Tensor]:
        return self.model.step_greedy(tokens.to(self.model.device, non_blocking=True), cache)

    def advance(self, tokens: torch.Tensor, cache: InferenceCache) -> None:
        self.model.advance(tokens.to(self.model.device, non_blocking=True), cache)


@dataclass
class _Captured:
    graph: torch.cuda.CUDAGraph
    tokens: torch.Tensor  # (size,) int64
    inputs: list[torch.Tensor]  # the state the step reads, each (size, ...)
    outputs: list[torch.Tensor]  # the state it writes, each (size, ...)
    logits: torch.Tensor  # (size, output_size)


class GraphedDecoder(Decoder):
    def __init__(self, model: SequenceModel, captured: dict[int, _Captured]) -> None:
        self.model, self.captured = model, captured
        self.sizes = sorted(captured)
        self.path = DecodePath("cuda_graphs", batch_sizes=tuple(self.sizes))
        self._warned: set[int] = set()  # batch sizes past the largest captured one, logged once each

    def step(self, tokens: torch.Tensor, cache: InferenceCache) -> torch.Tensor:
        rows = tokens.shape[0]
        size = next((size for size in self.sizes if size >= rows), None)
        if size is None:
            if rows not in self._warned:
                self._warned.add(rows)
                logger.warning(
                    "decode step of %d rows: past the largest captured size %d, run eagerly", rows, self.sizes[-1]
                )
            return super().step(tokens, cache)
        captured = self.captured[size]
        state = cache.step_state()
        assert state is not None  # (decoder_for captured only a cache of fixed shapes)
        with torch.inference_mode():  # few ops: on a GPU each costs a launch, as many as the graph saves
            captured.tokens[:rows].copy_(tokens, non_blocking=True)
            torch._foreach_copy_([buffer[:rows] for buffer in captured.inputs], state)
            captured.graph.replay()
            torch._foreach_copy_(state, [buffer[:rows] for buffer in captured.outputs])
        cache.lengths = cache.lengths + 1
        return captured.logits[:rows]  # a view of the graph's buffer, valid until the next replay

    def greedy_step(self, tokens: torch.Tensor, cache: InferenceCache) -> tuple[torch.Tensor, torch.Tensor]:
        return rows_argmax(self.step(tokens, cache))  # the replayed logits' picks, on the GPU


def decoder_for(model: SequenceModel, batch_sizes: Sequence[int], enabled: bool = True) -> Decoder:
    """CUDA graphs at ``batch_sizes`` where the model and its cache allow, else an eager decoder saying why."""
    if not enabled:
        return Decoder(model, "CUDA graphs are turned off (cuda_graphs false)")
    if model.device.type != "cuda":
        return Decoder(model, f"the model runs on {model.device.type}; CUDA graphs need a CUDA device")
    if not batch_sizes:
        return Decoder(model, "no batch size to capture")
    with torch.inference_mode():
        if model.new_cache(1).step_state() is None:
            name = type(model.new_cache(1)).__name__
            return Decoder(model, f"its cache ({name}) grows with the context; a CUDA graph needs fixed shapes")
        try:
            decoder = GraphedDecoder(model, _capture(model, sorted(set(batch_sizes), reverse=True)))
            disagreement = _check(decoder)
        except Exception as error:  # any op that cannot be captured: serve eagerly, and say why
            logger.warning(
                "CUDA graph capture of the decode step failed, decoding eagerly: %s: %s", type(error).__name__, error
            )
            return Decoder(model, f"capture failed: {type(error).__name__}: {error}")
    if disagreement is not None:
        logger.warning("the captured decode step disagrees with the eager one, decoding eagerly: %s", disagreement)
        return Decoder(model, f"the captured step disagreed with the eager one: {disagreement}")
    return decoder


def _capture(model: SequenceModel, sizes: list[int]) -> dict[int, _Captured]:
    """One graph per size, largest first, sharing one memory pool (one replay runs at a time)."""
    device, pool, captured = model.device, None, {}
    side = torch.cuda.Stream(device)
    for size in sizes:
        tokens = torch.zeros(size, dtype=torch.long, device=device)
        warm = model.new_cache(size)
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side):  # lazy initialisations (cuBLAS handles, workspaces) happen outside the capture
            for _ in range(2):
                model.step(tokens, warm)
        torch.cuda.current_stream(device).wait_stream(side)
        cache = model.new_cache(size)
        state = cache.step_state()
        assert state is not None  # (decoder_for checked)
        inputs = list(state)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool):
            logits = model.step(tokens, cache)
        pool = graph.pool()
        outputs = cache.step_state()
        assert outputs is not None
        captured[size] = _Captured(graph, tokens, inputs, list(outputs), logits)
    torch.cuda.synchronize(device)
    return captured


def _check(decoder: GraphedDecoder) -> str | None:
    """Three steps through the graphs and eagerly from the same random tokens; None when the logits agree, else how they
    differ."""
    model = decoder.model
    rows = max(1, decoder.sizes[min(2, len(decoder.sizes) - 1)] - 1)
    generator = torch.Generator(device="cpu").manual_seed(0)
    graphed, eager = model.new_cache(rows), model.new_cache(rows)
    for _ in range(3):
        tokens = torch.randint(model.config.vocab_size, (rows,), generator=generator).to(model.device)
        expected = model.step(tokens, eager).float()
        got = decoder.step(tokens, graphed).float()
        if not torch.allclose(got, expected, rtol=1e-2, atol=1e-2 * float(expected.abs().max()) + 1e-5):
            return f"largest logit difference {float((got - expected).abs().max()):.3g} at {rows} rows"
    return None
