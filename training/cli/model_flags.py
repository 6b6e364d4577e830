"""The architecture flags of ``python -m training train`` and their explicit mapping onto the config dataclasses.

Every flag defaults to "not given": the model then takes its config dataclass's default (model/config.py).
A flag that the chosen architecture has no field for is refused rather than silently ignored.
"""

from __future__ import annotations

import argparse
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from model.config import ARCHITECTURE_CONFIGS, BaseModelConfig
from training.data.tasks import Task


@dataclass(frozen=True)
class ModelFlag:
    dest: str  # the argparse destination; the flag is --dest with "-" for "_"
    type: type
    help: str
    choices: tuple[str, ...] | None = None


DELTA_SHORT_CONV = 4  # --short-conv when --transition-norm delta comes without it: DeltaNet's, and faster to bind

MODEL_FLAGS = (
    ModelFlag("d_model", int, "width of the residual stream (every architecture)"),
    ModelFlag("dropout", float, "dropout probability (every architecture)"),
    ModelFlag("layers", int, "layers (lrnn, diagonal_lrnn, transformer, lstm)"),
    ModelFlag("heads", int, "attention heads (regulargpt, transformer)"),
    ModelFlag("d_ff", int, "hidden width of the MLPs (regulargpt, lrnn, diagonal_lrnn, transformer)"),
    ModelFlag("chunk_size", int, "RegularGPT chunk size C: layer l attends m - j*C**l, j in [C]"),
    ModelFlag("thickness", int, "RegularGPT thickness K: distinct blocks per thick layer, shared over depth"),
    ModelFlag("attention_impl", str, "RegularGPT attention implementation", ("auto", "reference", "fast")),
    ModelFlag(
        "out_of_range",
        str,
        "RegularGPT: a dilated key before position 0 is masked out, or is a learned null "
        "key/value (the paper's padding; lets a layer tell 'no partner' from 'equal partner')",
        ("mask", "null"),
    ),
    ModelFlag(
        "block_norm",
        str,
        "RegularGPT: LayerNorm before each block's attention and MLP (pre, GPT-2's) or after "
        "each residual sum (post, the authors' code)",
        ("pre", "post"),
    ),
    ModelFlag("block_size", int, "LRNN block size b of the block-diagonal transition"),
    ModelFlag("num_blocks", int, "LRNN number of blocks H (state size H*b; delta: heads, state H*b*b)"),
    ModelFlag("p_norm", float, "LRNN p of the column p-norm constraint"),
    ModelFlag(
        "transition_norm",
        str,
        "LRNN constraint on A: the paper's column p-norm, each block's spectral norm "
        "<= 1 (stable at any length, rotations allowed), or columns projected onto the simplex (sparsemax) with "
        "no input term and a learned initial state (a probabilistic automaton), or each block orthogonal (its polar "
        "factor) with no input term and a learned initial state (a group's elements held exactly at any length), "
        "or the delta rule: per head (--num-blocks) a b x b matrix state, I - beta k k^T transitions that write each "
        "value under its key (associative recall)",
        ("column", "spectral", "stochastic", "orthogonal", "delta"),
    ),
    ModelFlag("transition_rank", int, "LRNN: rank r of the transition generator, d -> r -> H*b*b (default: full)"),
    ModelFlag("state_size", int, "diagonal LRNN state size"),
    ModelFlag("scan_impl", str, "LRNN scan implementation", ("auto", "sequential", "parallel", "chunked")),
    ModelFlag("scan_chunk_size", int, "LRNN chunk length of the chunked scan"),
    ModelFlag(
        "short_conv",
        int,
        "LRNN with --transition-norm delta: q, k and v as each channel's causal convolution over the last K "
        f"positions, then SiLU (DeltaNet's short convolution; default {DELTA_SHORT_CONV} with delta; 0: none)",
    ),
    ModelFlag("position", str, "transformer position handling", ("sinusoidal", "alibi", "kerple", "t5", "xl")),
    ModelFlag("log_length_scaling", bool, "transformer: scale attention logits by log(m + 1)"),
    ModelFlag("hidden_size", int, "LSTM hidden size"),
)

_COMMON_FIELDS = {"d_model": "d_model", "dropout": "dropout"}

# flag dest -> config field, per architecture
CONFIG_FIELDS: dict[str, dict[str, str]] = {
    "regulargpt": {
        **_COMMON_FIELDS,
        "heads": "n_heads",
        "d_ff": "d_ff",
        "chunk_size": "chunk_size",
        "thickness": "thickness",
        "attention_impl": "attention_impl",
        "out_of_range": "out_of_range",
        "block_norm": "block_norm",
    },
    "lrnn": {
        **_COMMON_FIELDS,
        "layers": "n_layers",
        "block_size": "block_size",
        "num_blocks": "num_blocks",
        "p_norm": "p_norm",
        "transition_norm": "transition_norm",
        "transition_rank": "transition_rank",
        "d_ff": "d_ff",
        "scan_impl": "scan_impl",
        "scan_chunk_size": "scan_chunk_size",
        "short_conv": "short_conv",
    },
    "diagonal_lrnn": {
        **_COMMON_FIELDS,
        "layers": "n_layers",
        "state_size": "state_size",
        "d_ff": "d_ff",
        "scan_impl": "scan_impl",
        "scan_chunk_size": "scan_chunk_size",
    },
    "transformer": {
        **_COMMON_FIELDS,
        "layers": "n_layers",
        "heads": "n_heads",
        "d_ff": "d_ff",
        "position": "position",
        "log_length_scaling": "log_length_scaling",
    },
    "lstm": {**_COMMON_FIELDS, "layers": "n_layers", "hidden_size": "hidden_size"},
}
TRAINABLE_ARCHITECTURES = tuple(CONFIG_FIELDS)  # the others (e.g. "exact") have hand-built weights
assert set(TRAINABLE_ARCHITECTURES) <= set(ARCHITECTURE_CONFIGS)


def add_model_flags(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("architecture hyper-parameters (default: the config dataclass's)")
    for flag in MODEL_FLAGS:
        name = "--" + flag.dest.replace("_", "-")
        if flag.type is bool:
            group.add_argument(name, dest=flag.dest, action="store_const", const=True, default=None, help=flag.help)
        else:
            group.add_argument(name, dest=flag.dest, type=flag.type, choices=flag.choices, default=None, help=flag.help)


def given_model_flags(args: argparse.Namespace) -> dict[str, Any]:
    """The architecture flags present on the command line, by dest; with --transition-norm delta, --short-conv
    defaults to :data:`DELTA_SHORT_CONV`."""
    given = {flag.dest: getattr(args, flag.dest) for flag in MODEL_FLAGS if getattr(args, flag.dest) is not None}
    if given.get("transition_norm") == "delta":
        given.setdefault("short_conv", DELTA_SHORT_CONV)
    return given


def model_config(architecture: str, task: Task, flags: Mapping[str, Any]) -> BaseModelConfig:
    """The config of a transducer for ``task``; ValueError (ConfigError) for a flag or value that does not fit."""
    fields = CONFIG_FIELDS[architecture]
    foreign = sorted(set(flags) - set(fields))
    if foreign:
        names = ", ".join("--" + dest.replace("_", "-") for dest in foreign)
        raise ValueError(f"{names} does not apply to --arch {architecture}")
    values = {fields[dest]: value for dest, value in flags.items()}
    return ARCHITECTURE_CONFIGS[architecture](vocab_size=len(task.alphabet), num_labels=len(task.labels), **values)
