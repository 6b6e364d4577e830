"""The decode step through CUDA graphs (issue 18, point 4).

On a GPU a decode step of few rows is launch-bound: the text LRNN's step is some forty small kernels, 2.0-2.2 ms of
eager PyTorch on an H100 (docs/benchmarks.md) for microseconds of work. A CUDA graph records the launches once and
replays them as one. A graph runs on fixed addresses and shapes, so, as vLLM does, :func:`decoder_for` captures
``model.step`` once per batch size of a set, and a batch of B rows replays the graph of the smallest captured size
>= B: the tokens and the cache's state are copied into that graph's buffers, the graph replays, and the first B rows
of what it wrote are copied back into the batch's own cache, which the step updates in place as an eager one does.
Rows past B hold what an earlier replay left there; every row of a step is computed on its own (no op mixes rows),
so they never reach the real ones. The copies are the state's bytes twice per step: 1 KiB per row for the text LRNN.

Only a cache of fixed shape can be captured (:meth:`model.base.InferenceCache.step_state`): the LRNNs' and the
LSTM's. A cache that grows with the context (the transformer's KV cache, RegularGPT's windows) changes shape every
step; those models, a CPU, sizes past the largest captured one, and a capture that fails or whose replay disagrees
with the eager step (checked once, at capture) decode eagerly, and :attr:`Decoder.path` says so (served in
/v1/models; a failure is logged).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from model.base import InferenceCache, SequenceModel
from model.ops.cpu_decode import rows_argmax

logger = logging.getLogger(__name__)


def capture_sizes(max_rows: int) -> list[int]:
    """The batch sizes to capture for batches of up to ``max_rows`` rows: 1, 2, 4, then every multiple of 8, and
    ``max_rows`` itself (vLLM's set): a batch is padded by at most 7 rows, or by less than half its size."""
    sizes = {size for size in (1, 2, 4) if size <= max_rows} | set(range(8, max_rows + 1, 8)) | {max_rows}
    return sorted(sizes)


@dataclass(frozen=True)
class DecodePath:
    """How a model's decode step runs: ``cuda_graphs`` at ``batch_sizes`` (a batch pads to the next one; larger
    ones run eagerly), or ``eager`` and ``reason``."""

    mode: str  # "cuda_graphs" | "eager"
    batch_sizes: tuple[int, ...] = ()
    reason: str | None = None


class Decoder:
    """The decode step as the model runs it (``model.step``)."""

    def __init__(self, model: SequenceModel, reason: str) -> None:
        self.model = model
        self.path = DecodePath("eager", reason=reason)

    def step(self, tokens: torch.Tensor, cache: InferenceCache) -> torch.Tensor:
        """tokens: (B,) on any device -> logits (B, output_size); advances ``cache`` by one token
        (``SequenceModel.step``). The logits may be a view that the next step overwrites: read them before."""
        return self.model.step(tokens.to(self.model.device, non_blocking=True), cache)

    def greedy_step(self, tokens: torch.Tensor, cache: InferenceCache) -> tuple[torch.Tensor, torch.Tensor]:
        """``step``, then each row's largest logit: (ids (B,) int64, their logits (B,)), where the model runs
        (``SequenceModel.step_greedy``: on the CPU, without the logits where it can)."""
        return self.model.step_greedy(tokens.to(self.model.device, non_blocking=True), cache)

    def advance(self, tokens: torch.Tensor, cache: InferenceCache) -> None:
        """``step`` without the logits (``SequenceModel.advance``), eagerly on every path: prompt tokens run so in a
        decode batch only under the CPU's batch invariance (server/execution/generation.py)."""
        self.model.advance(tokens.to(self.model.device, non_blocking=True), cache)


@dataclass
class _Captured:
    """One captured step: its graph, and the buffers it reads (tokens, state) and writes (state, logits)."""

    graph: torch.cuda.CUDAGraph
    tokens: torch.Tensor  # (size,) int64
    inputs: list[torch.Tensor]  # the state the step reads, each (size, ...)
    outputs: list[torch.Tensor]  # the state it writes, each (size, ...)
    logits: torch.Tensor  # (size, output_size)


class GraphedDecoder(Decoder):
    """The decode step replayed from CUDA graphs (``captured``: one per batch size)."""

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
                logger.warning("decode step of %d rows: past the largest captured size %d, run eagerly", rows,
                               self.sizes[-1])  # fmt: skip
            return super().step(tokens, cache)
        captured = self.captured[size]
        state = cache.step_state()
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
    """The fastest decode step ``model`` supports here: CUDA graphs at ``batch_sizes`` where it runs on CUDA with a
    cache of fixed shape, else eager, saying why."""
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
            logger.warning("CUDA graph capture of the decode step failed, decoding eagerly: %s: %s",
                           type(error).__name__, error)  # fmt: skip
            return Decoder(model, f"capture failed: {type(error).__name__}: {error}")
    if disagreement is not None:
        logger.warning("the captured decode step disagrees with the eager one, decoding eagerly: %s", disagreement)
        return Decoder(model, f"the captured step disagreed with the eager one: {disagreement}")
    return decoder


def _capture(model: SequenceModel, sizes: list[int]) -> dict[int, _Captured]:
    """One graph per size, largest first, all in one memory pool (a replay's activations are dead after it, and
    one replay runs at a time)."""
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
        inputs = list(cache.step_state())
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool):
            logits = model.step(tokens, cache)
        pool = graph.pool()
        captured[size] = _Captured(graph, tokens, inputs, list(cache.step_state()), logits)
    torch.cuda.synchronize(device)
    return captured


def _check(decoder: GraphedDecoder) -> str | None:
    """Three steps through the graphs and eagerly from the same random tokens, of one row less than the third
    captured size (3 rows in the size-4 graph when the sizes start 1, 2, 4); None when the logits agree."""
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
