"""The published weights of the exact transformers, written as checkpoint folders (architecture "exact").

Constructions are written in their papers' coordinates (docs/api.md, Papers; dimensions 0-based, q.k the intended
logit); ``to_model`` pads the layers and scales the queries by sqrt(d). ``python -m training.exact_builders --out
checkpoints/ [--overwrite]`` writes ``<task>-exact`` for the four tasks.
"""

from __future__ import annotations

import argparse
import math
import sys
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Literal

import numpy as np
import torch

from model.checkpoint import CONFIG_FILE, save_checkpoint
from model.config import CheckpointConfig, ExactConstruction, ExactTransformerConfig, PositionFeature
from model.transformer.exact import ExactTransformer
from training.data.tasks import get_task

DEFAULT_CROSS_ENTROPY = 1e-3  # nats per string reached by the layer-norm (eps = 0) and mirror constructions
PUBLISHED_ZERO_TEST_TOLERANCE = 1e-7
"""|s| counted as 0 by the PALINDROME paper's code (the default of its --palindrome_error, in float32)."""

ExactOutput = Literal["logits", "zero_test"]  # ExactTransformerConfig.output
ComputeDtype = Literal["float32", "float64"]  # ExactTransformerConfig.compute_dtype


@dataclass
class LayerWeights:
    """One encoder layer in the papers' coordinates: query, key, value (H, d, d); FFN (f, d), (f,), (d, f), (d,)."""

    query: np.ndarray
    key: np.ndarray
    value: np.ndarray
    ffn_in: np.ndarray
    ffn_in_bias: np.ndarray
    ffn_out: np.ndarray
    ffn_out_bias: np.ndarray

    @classmethod
    def zeros(cls, width: int, heads: int = 1, ffn_width: int = 1) -> LayerWeights:
        attention = np.zeros((heads, width, width))
        return cls(
            attention,
            attention.copy(),
            attention.copy(),
            np.zeros((ffn_width, width)),
            np.zeros(ffn_width),
            np.zeros((width, ffn_width)),
            np.zeros(width),
        )


@dataclass
class Construction:
    """A whole construction: word embeddings (symbols, CLS, EOS?) x d, W_pos d x F, layers, and the output
    logit s = readout . a_L,0 + readout_bias (y = sigmoid(s), or y = I[s = 0] for ``output="zero_test"``)."""

    name: ExactConstruction
    word: np.ndarray
    position: np.ndarray
    position_features: tuple[PositionFeature, ...]
    layers: list[LayerWeights]
    readout: np.ndarray
    readout_bias: float = 0.0
    append_eos: bool = False
    output: ExactOutput = "logits"
    log_length_scaling: bool = False

    @property
    def width(self) -> int:
        return int(self.word.shape[1])


def _one_hots(rows: int, width: int) -> np.ndarray:
    """Word embeddings: token t (0, 1, CLS, EOS) -> e_t."""
    return np.eye(rows, width)


def _unit(width: int, index: int, scale: float = 1.0) -> np.ndarray:
    vector = np.zeros(width)
    vector[index] = scale
    return vector


def parity(c: float = 1.0) -> Construction:
    """Chiang & Cholak 2022, section 3.2: dims 0-4 I[0], I[1], I[CLS], i/n, cos(i pi); 5 k/n, 6 1/n (layer 1
    attention), 7 I[i = k]/n (layer 1 FFN), 8 s (layer 2: CLS weighs odd against even positions)."""
    d = 9
    position = np.zeros((d, 2))
    position[3, 0] = position[4, 1] = 1.0
    first = LayerWeights.zeros(d, heads=2, ffn_width=3)
    first.value[0, 5, 1] = first.value[0, 6, 2] = 1.0  # uniform attention averages I[1] and I[CLS]
    first.ffn_in[:, 3], first.ffn_in[:, 5], first.ffn_in[:, 6] = -1.0, 1.0, [-1.0, 0.0, 1.0]  # (k - i + {-1,0,1})/n
    first.ffn_out[7] = [1.0, -2.0, 1.0]
    second = LayerWeights.zeros(d, heads=2, ffn_width=3)
    for head, sign in enumerate((-1.0, 1.0)):
        second.query[head, 0, 2] = c
        second.key[head, 0, 4] = sign
        second.value[head, 8, 7] = -sign
    return Construction(
        "parity", _one_hots(3, d), position, ("fraction", "alternating"), [first, second], readout=_unit(d, 8)
    )


def first(c: float = 1.0) -> Construction:
    """Chiang & Cholak 2022, section 3.3: dims 0-3 I[0], I[1], I[CLS], I[i = 1]; 4 I[w_i = 1 and i = 1] (layer 1
    FFN); 5 s (layer 2: CLS attends to position 1)."""
    d = 6
    position = np.zeros((d, 1))
    position[3, 0] = 1.0
    layer = LayerWeights.zeros(d)
    layer.ffn_in[0] = [-1.0, 0.0, -1.0, 1.0, 0.0, 0.0]
    layer.ffn_out[4, 0] = 1.0
    second = LayerWeights.zeros(d)
    second.query[0, 0, 2] = c
    second.key[0, 0, 3] = 1.0
    second.value[0, 5, 3], second.value[0, 5, 4] = -0.5, 1.0
    return Construction("first", _one_hots(3, d), position, ("is_first_symbol",), [layer, second], readout=_unit(d, 5))


def first_log_scaled(cross_entropy: float = DEFAULT_CROSS_ENTROPY) -> Construction:
    """Chiang & Cholak 2022, Proposition 3, without layer norm: FIRST with c = 1 and attention logits scaled by
    log n, so that 1/4 < |s| <= 1/2 at every n; the readout is scaled to cross-entropy ``cross_entropy``."""
    construction = first(c=1.0)
    scale = 4.0 * _logit_for(cross_entropy)
    return replace(construction, readout=construction.readout * scale, log_length_scaling=True)


def one() -> Construction:
    """Nowak et al. 2022, section 3.1: dims 0-3 I[0], I[1], I[CLS], i/n; 4 k/n, 5 1/n (uniform attention);
    6 s = (I[k = 1] - 1/2) / n (FFN)."""
    d = 7
    position = np.zeros((d, 1))
    position[3, 0] = 1.0
    layer = LayerWeights.zeros(d, ffn_width=4)
    layer.value[0, 4, 1] = layer.value[0, 5, 2] = 1.0
    layer.ffn_in[:3, 4], layer.ffn_in[:, 5] = 1.0, [-2.0, -1.0, 0.0, 1.0]  # (k-2, k-1, k, 1) / n
    layer.ffn_out[6] = [1.0, -2.0, 1.0, -0.5]
    return Construction("one", _one_hots(3, d), position, ("fraction",), [layer], readout=_unit(d, 6))


def palindrome(c: float = math.log(2.0)) -> Construction:
    """Nowak et al. 2022, section 3.2: dims 0-7 I[0], I[1], I[CLS], I[EOS], i, n - i - 1, I[left half],
    I[right half]; 8, 9 I[w_i = 1] in the left / right half (layer 1 FFN); 10 s = sum over mismatches of
    +-2^i / (2^n - 1) (layer 2: two heads with softmax base 2 = e^c, one reading each half)."""
    d = 11
    position = np.zeros((d, 4))
    position[4:8, :] = np.eye(4)
    layer = LayerWeights.zeros(d, heads=2, ffn_width=2)
    layer.ffn_in[:, [0, 2, 3]] = -1.0
    layer.ffn_in[0, 6] = layer.ffn_in[1, 7] = 1.0
    layer.ffn_out[8, 0] = layer.ffn_out[9, 1] = 1.0
    second = LayerWeights.zeros(d, heads=2, ffn_width=2)
    for head, (key_dim, value_dim, sign) in enumerate(((4, 8, 1.0), (5, 9, -1.0))):
        second.query[head, 0, 2] = c
        second.key[head, 0, key_dim] = 1.0
        second.value[head, 10, value_dim] = sign
    return Construction(
        "palindrome",
        _one_hots(4, d),
        position,
        ("index", "mirror_index", "left_half", "right_half"),
        [layer, second],
        readout=_unit(d, 10),
        append_eos=True,
        output="zero_test",
    )


def palindrome_mirror(c: float = 20.0, cross_entropy: float = DEFAULT_CROSS_ENTROPY) -> Construction:
    """A PALINDROME that needs no n bits of precision: each position attends to its mirror (logit
    -c (j - (n - 1 - i))^2), an FFN flags a mismatch, and CLS attends to the flags (log-length scaled). Dims 0-3
    I[0], I[1], I[CLS], I[EOS]; 4-6 i, n - 1 - i, i^2; 7 I[w_mirror = 1]; 8 mismatch flag; 9 s."""
    d = 10
    position = np.zeros((d, 3))
    position[4:7, :] = np.eye(3)
    layer = LayerWeights.zeros(d, ffn_width=2)
    layer.query[0, 0, 5], layer.query[0, 1, :4] = 2.0 * c, -c  # q = c (2 (n - 1 - i), -1): the "1" is sum of I[.]
    layer.key[0, 0, 4] = layer.key[0, 1, 6] = 1.0  # k = (j, j^2): q.k = -c (j - (n - 1 - i))^2 + const
    layer.value[0, 7, 1] = 1.0
    # relu(+-2 (I[w_i = 1] - I[w_mirror = 1]) - 1), the -1 being minus the sum of the four indicators
    layer.ffn_in[0, [0, 1, 2, 3, 7]] = [-1.0, 1.0, -1.0, -1.0, -2.0]
    layer.ffn_in[1, [0, 1, 2, 3, 7]] = [-1.0, -3.0, -1.0, -1.0, 2.0]
    layer.ffn_out[8] = [1.0, 1.0]
    second = LayerWeights.zeros(d)
    second.query[0, 0, 2] = 2.0
    second.key[0, 0, 8] = 1.0
    second.value[0, 9, 8] = 1.0
    margin = _logit_for(cross_entropy)
    return Construction(
        "palindrome_mirror",
        _one_hots(4, d),
        position,
        ("index", "mirror_index", "index_squared"),
        [layer, second],
        readout=_unit(d, 9, -2.0 * margin),
        readout_bias=margin,
        append_eos=True,
        log_length_scaling=True,
    )


def _logit_for(cross_entropy: float) -> float:
    """The logit z with log(1 + e^-z) = cross_entropy (nats)."""
    return -math.log(math.expm1(cross_entropy))


def with_layer_norm(construction: Construction, cross_entropy: float = DEFAULT_CROSS_ENTROPY) -> Construction:
    """Chiang & Cholak 2022, section 4: carry [a; -a] so that LN does not re-centre (4.1), then add Proposition 2's
    last layer, which maps s to LN([s, -s, 0 ..]) = +-sqrt(d / 2) (eps = 0), scaled to ``cross_entropy``."""
    d = construction.width
    mirrored = [
        LayerWeights(
            query=_pad_attention(layer.query, 2 * d),
            key=_pad_attention(layer.key, 2 * d),
            value=np.concatenate(
                [_pad_attention(layer.value, d, columns=2 * d), -_pad_attention(layer.value, d, columns=2 * d)], axis=1
            ),
            ffn_in=np.pad(layer.ffn_in, ((0, 0), (0, d))),
            ffn_in_bias=layer.ffn_in_bias,
            ffn_out=np.concatenate([layer.ffn_out, -layer.ffn_out]),
            ffn_out_bias=np.concatenate([layer.ffn_out_bias, -layer.ffn_out_bias]),
        )
        for layer in construction.layers
    ]
    readout = np.pad(construction.readout, (0, d))  # (2d,)
    width = 2 * d
    last = LayerWeights.zeros(width, ffn_width=2 * width)
    identity = np.eye(width)
    last.ffn_in = np.concatenate([identity, -identity])  # relu(x), relu(-x)
    last.ffn_out = np.concatenate([-identity, identity], axis=1)  # cancels the residual x ...
    last.ffn_out[0] += np.concatenate([readout, -readout])  # ... and writes s, -s into dims 0, 1,
    last.ffn_out[1] -= np.concatenate([readout, -readout])  # which are I[0], I[1]: zero at CLS
    last.ffn_out_bias[:2] = construction.readout_bias, -construction.readout_bias
    return replace(
        construction,
        word=np.concatenate([construction.word, -construction.word], axis=1),
        position=np.concatenate([construction.position, -construction.position]),
        layers=[*mirrored, last],
        readout=_unit(width, 0, _logit_for(cross_entropy) / math.sqrt(width / 2)),
        readout_bias=0.0,
    )


def _pad_attention(weights: np.ndarray, rows: int, columns: int | None = None) -> np.ndarray:
    """(H, d, d) -> (H, rows, columns), zero-padded."""
    _, height, width = weights.shape
    return np.pad(weights, ((0, 0), (0, rows - height), (0, (columns or rows) - width)))


def to_model(
    construction: Construction,
    *,
    layer_norm: bool = False,
    layer_norm_eps: float = 0.0,
    log_length_scaling: bool | None = None,
    compute_dtype: ComputeDtype = "float32",
    zero_test_tolerance: float = 0.0,
) -> ExactTransformer:
    """The model computing ``construction`` (binary labels "0", "1"); layers are padded to one head count and
    FFN width. ``log_length_scaling`` None keeps the construction's own setting."""
    d = construction.width
    heads = max(layer.query.shape[0] for layer in construction.layers)
    ffn_width = max(layer.ffn_in.shape[0] for layer in construction.layers)
    config = ExactTransformerConfig(
        vocab_size=2,
        num_labels=2,
        d_model=d,
        construction=construction.name,
        n_layers=len(construction.layers),
        n_heads=heads,
        d_ff=ffn_width,
        position_features=construction.position_features,
        append_eos=construction.append_eos,
        layer_norm=layer_norm,
        layer_norm_eps=layer_norm_eps,
        log_length_scaling=construction.log_length_scaling if log_length_scaling is None else log_length_scaling,
        output=construction.output,
        zero_test_tolerance=zero_test_tolerance,
        compute_dtype=compute_dtype,
    )
    weights = {
        "word.weight": construction.word,
        "position.weight": construction.position,
        "head.weight": np.stack([-construction.readout / 2, construction.readout / 2]),
        "head.bias": np.array([-construction.readout_bias / 2, construction.readout_bias / 2]),
    }
    for index, layer in enumerate(construction.layers):
        extra_heads, extra_ffn = heads - layer.query.shape[0], ffn_width - layer.ffn_in.shape[0]
        for name in ("query", "key", "value"):
            padded = np.pad(getattr(layer, name), ((0, extra_heads), (0, 0), (0, 0)))
            weights[f"layers.{index}.{name}"] = padded * (math.sqrt(d) if name == "query" else 1.0)
        weights[f"layers.{index}.ffn_in.weight"] = np.pad(layer.ffn_in, ((0, extra_ffn), (0, 0)))
        weights[f"layers.{index}.ffn_in.bias"] = np.pad(layer.ffn_in_bias, (0, extra_ffn))
        weights[f"layers.{index}.ffn_out.weight"] = np.pad(layer.ffn_out, ((0, 0), (0, extra_ffn)))
        weights[f"layers.{index}.ffn_out.bias"] = layer.ffn_out_bias
    model = ExactTransformer(config)
    dtype = model.dtype
    model.load_state_dict({name: torch.tensor(value, dtype=dtype) for name, value in weights.items()}, strict=True)
    return model.eval()


@dataclass(frozen=True)
class Shipped:
    """One checkpoint folder of ``write_checkpoints``: the task, how its weights are built, and where from."""

    task: str
    construction: str
    layer_norm: bool
    compute_dtype: ComputeDtype
    source: str

    @property
    def folder_name(self) -> str:
        return f"{self.task}-exact"

    def build(self) -> ExactTransformer:
        construction = CONSTRUCTIONS[self.construction]()
        if self.layer_norm:
            construction = with_layer_norm(construction)
        return to_model(construction, layer_norm=self.layer_norm, compute_dtype=self.compute_dtype)

    def checkpoint(self) -> tuple[ExactTransformer, CheckpointConfig]:
        """The model and the config.json of its folder."""
        task, model = get_task(self.task), self.build()
        config = CheckpointConfig(
            architecture="exact",
            model=model.config,
            kind="transduce",
            task=task.name,
            alphabet=task.alphabet,
            labels=task.labels,
            metadata={"source": self.source, "built_by": "python -m training.exact_builders"},
        )
        return model, config


CONSTRUCTIONS = {
    "parity": parity,
    "first": first,
    "one": one,
    "palindrome": palindrome,
    "palindrome_mirror": palindrome_mirror,
}

SHIPPED = (
    Shipped(
        "parity_check",
        "parity",
        True,
        "float64",
        "exact-parity-first.txt 3.2 with layer norm (eps = 0) and Proposition 2's output layer (section 4); "
        "float64, as float32 sums of k/n fail on 1^n from n = 9225",
    ),
    Shipped(
        "first",
        "first",
        True,
        "float32",
        "exact-parity-first.txt 3.3 with layer norm (eps = 0) and Proposition 2's output layer (section 4)",
    ),
    Shipped(
        "one",
        "one",
        True,
        "float32",
        "exact-one-palindrome.txt 3.1 with exact-parity-first.txt section 4's layer norm (eps = 0)",
    ),
    Shipped(
        "palindrome",
        "palindrome_mirror",
        False,
        "float64",
        "mirror-attention PALINDROME (docs/exact_results.md): exact-one-palindrome.txt 3.2 needs n bits of "
        "precision and fails from n = 23 in float32",
    ),
)


def write_checkpoints(out: Path, tasks: Sequence[str] | None = None) -> list[Path]:
    """Write ``<task>-exact`` under ``out`` for each shipped task (all by default); returns the folders."""
    return [save_checkpoint(*shipped.checkpoint(), out / shipped.folder_name) for shipped in _chosen(tasks)]


def _chosen(tasks: Sequence[str] | None) -> list[Shipped]:
    return [shipped for shipped in SHIPPED if tasks is None or shipped.task in tasks]


def add_exact_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--out", type=Path, default=Path("checkpoints"), help="folder to write <task>-exact into")
    parser.add_argument(
        "--tasks",
        nargs="+",
        choices=[shipped.task for shipped in SHIPPED],
        default=None,
        help="tasks to write (default: all four)",
    )
    parser.add_argument("--overwrite", action="store_true", help="replace checkpoints already in the folders")


def run_exact(args: argparse.Namespace) -> int:
    """Write the folders; 0 on success, 2 with one line on stderr when --out is not a folder, a folder to write
    holds a checkpoint and --overwrite is not given (both checked before writing), or writing fails."""
    problem = _refusal(args.out, [shipped.folder_name for shipped in _chosen(args.tasks)], args.overwrite)
    if problem is None:
        try:
            for folder in write_checkpoints(args.out, args.tasks):
                print(folder)
            return 0
        except OSError as error:  # e.g. no permission, or a parent of --out that is a file
            problem = f"cannot write under {args.out}: {error}"
    print(f"error: {problem}", file=sys.stderr)
    return 2


def _refusal(out: Path, folder_names: Sequence[str], overwrite: bool) -> str | None:
    """Why the folders cannot be written under ``out``, or None."""
    if out.exists() and not out.is_dir():
        return f"--out {out} exists and is not a folder"
    for name in folder_names:
        folder = out / name
        if folder.exists() and not folder.is_dir():
            return f"{folder} exists and is not a folder"
        if (folder / CONFIG_FILE).exists() and not overwrite:
            return f"{folder} already holds a checkpoint; pass --overwrite to replace it"
    return None


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m training.exact_builders", description=__doc__.split("\n")[0])
    add_exact_arguments(parser)
    return run_exact(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
