"""The systems benchmarks/comparisons/peers.py compares, and how each is driven.

Ours (LRNN, RegularGPT, transformer) run through the calls the server makes: ``model.for_serving()``, then
``model.forward(chunk, cache)`` in chunks of the server's default ``prefill_chunk_tokens`` (2048) and
``model.step``. Hugging Face's are built from configs with random weights, nothing downloaded:
``GPT2LMHeadModel`` (sdpa attention, its ``DynamicCache``) and ``MambaForCausalLM`` (without the mamba_ssm /
causal_conv1d kernels it runs its PyTorch path, the comparison intended on the CPU); their prefill is one call over
the whole prompt, their step one call with the cache. ``transformers`` is the ``bench`` extra, imported only for them.

A system is ``FAMILY`` at a size's width, or ``OURS=PEER`` (e.g. ``lrnn=mamba``): OURS at the width whose parameter
count is closest to PEER's at that size. Parameters count each tied weight once; GPT-2's position table (a lookup,
one row read per token) is left out.
"""

from __future__ import annotations

import functools
import importlib
import inspect
import os
import types
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from model.base import parameter_count
from model.config import LRNNConfig, RegularGPTConfig, TransformerConfig
from model.cuda_graphs import capture_sizes, decoder_for
from model.registry import build_model
from model.serving import largest_fitting

OURS = ("lrnn", "regulargpt", "transformer")
PEERS = ("gpt2", "mamba")
NAMES = {"lrnn": "LRNN", "regulargpt": "RegularGPT", "transformer": "transformer", "gpt2": "GPT-2", "mamba": "Mamba"}
PREFILL_CHUNK = 2048  # server/settings.py prefill_chunk_tokens


@dataclass(frozen=True)
class Size:
    """One model size: the width and heads every system shares, and each family's layers (blocks for RegularGPT)."""

    d_model: int
    heads: int
    layers: dict[str, int]
    vocab: int = 8192


SIZES = {
    # the shipped text models (checkpoints/text-lrnn, checkpoints/text-regulargpt); the others at RegularGPT's 4
    "s": Size(128, 4, {"lrnn": 2, "regulargpt": 4, "transformer": 4, "gpt2": 4, "mamba": 4}),
    "L": Size(512, 8, dict.fromkeys(OURS + PEERS, 8)),
    "tiny": Size(32, 2, dict.fromkeys(OURS + PEERS, 2), vocab=256),  # --quick
}


def family_config(family: str, size: Size, d_model: int, positions: int = 0) -> object:
    """The config of ``family`` at ``size`` with width ``d_model`` (d_ff 4 d_model, LRNN blocks of 8)."""
    layers, heads, vocab = size.layers[family], size.heads, size.vocab
    if family == "lrnn":
        return LRNNConfig(
            vocab_size=vocab, d_model=d_model, n_layers=layers, block_size=8, num_blocks=d_model // 8, d_ff=4 * d_model
        )
    if family == "regulargpt":  # as shipped: mask, reference attention (for_serving switches it to auto)
        return RegularGPTConfig(
            vocab_size=vocab,
            d_model=d_model,
            n_heads=heads,
            d_ff=4 * d_model,
            chunk_size=64,
            thickness=layers,
            attention_impl="reference",
            out_of_range="mask",
        )
    if family == "transformer":
        return TransformerConfig(vocab_size=vocab, d_model=d_model, n_layers=layers, n_heads=heads, d_ff=4 * d_model)
    if family == "gpt2":
        return transformers().GPT2Config(
            vocab_size=vocab,
            n_positions=max(positions, 1),
            n_embd=d_model,
            n_layer=layers,
            n_head=heads,
            bos_token_id=0,
            eos_token_id=0,
        )
    if family == "mamba":
        return transformers().MambaConfig(
            vocab_size=vocab,
            hidden_size=d_model,
            num_hidden_layers=layers,
            bos_token_id=0,
            eos_token_id=0,
            pad_token_id=0,
        )
    raise ValueError(f"unknown family {family!r}; known: {OURS + PEERS}")


def build(family: str, config: object) -> nn.Module:
    """A freshly initialised model of ``family``."""
    if family in OURS:
        return build_model(family, config)
    return (transformers().GPT2LMHeadModel if family == "gpt2" else transformers().MambaForCausalLM)(config)


def transformers() -> types.ModuleType:
    """The transformers package (the ``bench`` extra), imported offline: a config-built model needs no hub."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    return importlib.import_module("transformers")


def parameters(family: str, model: nn.Module) -> int:
    """Parameters, tied ones once; GPT-2's position table (a lookup of one row per token) left out."""
    position_table = model.transformer.wpe.weight.numel() if family == "gpt2" else 0
    return parameter_count(model) - position_table


@functools.cache
def system_config(system: str, size_name: str, positions: int = 0) -> tuple[str, object]:
    """(family, config) of a system name: ``FAMILY`` at the size's width, or ``OURS=PEER``: OURS at the width (a
    multiple of 16) whose parameter count is closest to PEER's at the size's width."""
    size = SIZES[size_name]
    family, _, peer = system.partition("=")
    if family not in OURS + PEERS:
        raise ValueError(f"unknown system {system!r}; known: {OURS + PEERS} and OURS=PEER")
    if not peer:
        return family, family_config(family, size, size.d_model, positions)
    if family not in OURS or peer not in PEERS:
        raise ValueError(f"{system!r}: a matched system is OURS=PEER with OURS in {OURS} and PEER in {PEERS}")
    target = count_parameters(peer, family_config(peer, size, size.d_model, positions))
    count = functools.cache(lambda width: count_parameters(family, family_config(family, size, width)))
    below = largest_fitting(lambda n: count(16 * n) <= target, 4 * size.d_model // 16)  # counts grow with width
    width = min((16 * below, 16 * below + 16), key=lambda width: abs(count(width) - target))
    return family, family_config(family, size, width, positions)


def count_parameters(family: str, config: object) -> int:
    """:func:`parameters` of the model ``config`` describes, built without memory."""
    with torch.device("meta"):  # no memory, no initialisation cost
        return parameters(family, build(family, config))


def describe(family: str, config: object) -> str:
    """The config's shape in a few words."""
    c = config
    if family == "lrnn":
        return f"d {c.d_model}, {c.n_layers} layers, {c.num_blocks}x{c.block_size} blocks, d_ff {c.d_ff}"
    if family == "regulargpt":
        return f"d {c.d_model}, K {c.thickness} blocks, C {c.chunk_size}, {c.n_heads} heads, d_ff {c.d_ff}"
    if family == "transformer":
        return f"d {c.d_model}, {c.n_layers} layers, {c.n_heads} heads, d_ff {c.d_ff}, {c.position}"
    if family == "gpt2":
        return f"d {c.n_embd}, {c.n_layer} layers, {c.n_head} heads, d_ff {4 * c.n_embd}"
    return f"d {c.hidden_size}, {c.num_hidden_layers} layers, state {c.state_size}, expand {c.expand}"


class Ours:
    """Our model through the server's calls: cached prefill in chunks, then its decode step as the server runs it
    (model/cuda_graphs.py: on CUDA, graphs captured at the server's default batch sizes where the cache allows)."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        model.for_serving()
        with torch.inference_mode():
            self.decoder = decoder_for(model, capture_sizes(64))

    def prefill(self, tokens: torch.Tensor) -> object:
        """tokens: (B, T) -> a cache holding them."""
        cache = self.model.new_cache(tokens.shape[0])
        for start in range(0, tokens.shape[1], PREFILL_CHUNK):
            self.model(tokens[:, start : start + PREFILL_CHUNK], cache=cache)  # (B, chunk, V)
        return cache

    def step(self, tokens: torch.Tensor, cache: object) -> tuple[torch.Tensor, object]:
        """tokens: (B,) -> logits (B, V) and the advanced cache."""
        return self.decoder.step(tokens, cache), cache

    def repeat(self, cache: object, rows: int) -> object:
        """A cache of ``rows`` copies of a one-row cache."""
        return type(cache).stack([cache] * rows)

    def cache_bytes(self, cache: object) -> int:
        return cache.nbytes


class HuggingFace:
    """A Hugging Face causal LM: one call over the prompt with ``use_cache``, then a call per token with its cache,
    under the name its ``forward`` takes: ``cache`` (transformers 5.24 on; the older names are deprecated there and
    removed in 5.40), else ``legacy`` (``past_key_values`` for GPT-2, ``cache_params`` for Mamba)."""

    def __init__(self, model: nn.Module, legacy: str) -> None:
        takes_cache = "cache" in inspect.signature(model.forward).parameters
        self.model, self.cache_argument, self.length = model, "cache" if takes_cache else legacy, 0

    def prefill(self, tokens: torch.Tensor) -> object:
        """tokens: (B, T) -> a cache holding them."""
        self.length = tokens.shape[1]
        output = self.model(tokens, use_cache=True, cache_position=self._positions(self.length, 0))
        return getattr(output, self.cache_argument)

    def step(self, tokens: torch.Tensor, cache: object) -> tuple[torch.Tensor, object]:
        """tokens: (B,) -> logits (B, V) and the advanced cache."""
        positions = self._positions(1, self.length)
        output = self.model(tokens[:, None], use_cache=True, cache_position=positions, **{self.cache_argument: cache})
        self.length += 1
        return output.logits[:, -1], getattr(output, self.cache_argument)

    def repeat(self, cache: object, rows: int) -> object:
        """A cache of ``rows`` copies of a one-row cache."""
        return map_cache(cache, lambda tensor: tensor.repeat(rows, *[1] * (tensor.dim() - 1)))  # (rows, ...)

    def cache_bytes(self, cache: object) -> int:
        sizes: list[int] = []
        map_cache(cache, lambda tensor: sizes.append(tensor.numel() * tensor.element_size()) or tensor)
        return sum(sizes)

    def _positions(self, length: int, start: int) -> torch.Tensor:
        return torch.arange(start, start + length, device=next(self.model.parameters()).device)


def map_cache(value: object, change: Callable[[torch.Tensor], torch.Tensor], seen: set[int] | None = None) -> object:
    """``value``, a Hugging Face cache of any transformers version (a legacy tuple of tuples, a cache object of
    layer objects), with every tensor it holds replaced by ``change(tensor)``: lists, tuples and dicts are rebuilt,
    transformers' own objects changed in place (each once)."""
    seen = set() if seen is None else seen
    if isinstance(value, torch.Tensor):
        return change(value)
    if isinstance(value, (list, tuple)):
        return type(value)(map_cache(item, change, seen) for item in value)
    if isinstance(value, dict):
        return {key: map_cache(item, change, seen) for key, item in value.items()}
    if type(value).__module__.startswith("transformers.") and id(value) not in seen:
        seen.add(id(value))
        for key, item in list(vars(value).items()):
            setattr(value, key, map_cache(item, change, seen))
    return value


def build_system(system: str, size: str, positions: int, device: torch.device) -> tuple[Ours | HuggingFace, int]:
    """The system's runner on ``device`` and its parameter count."""
    family, config = system_config(system, size, positions)
    model = build(family, config).to(device).eval()
    runner = (
        Ours(model) if family in OURS else HuggingFace(model, "past_key_values" if family == "gpt2" else "cache_params")
    )
    return runner, parameters(family, model)


def label(system: str) -> str:
    """A system's name in a table."""
    family, _, peer = system.partition("=")
    return f"{NAMES[family]} at {NAMES[peer]}'s parameters" if peer else NAMES[family]
