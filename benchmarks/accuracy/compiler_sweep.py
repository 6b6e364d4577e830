"""Measured figures of the automaton compiler (docs/exact_results.md, "Automaton compiler"): compile shipped DFA
files and a 16-state counter into both architectures and check the labels against the DFA on one random string
of --length symbols (10^5 by default), reporting wrong labels and the smallest logit margin (logit of the right
label minus the wrong one; the construction aims at automata.compiler.LABEL_MARGIN = 20).

    python -m benchmarks.accuracy.compiler_sweep [--length 100000] [--automata tomita3 tomita5 d4 parity_check
        even_pair_mod5 counter16] [--archs lrnn regulargpt] [--regulargpt-path auto|forward|final]
        [--forward-budget-mib 1024] [--seed 0]

What is checked, per row (the table's "checked" column says which):

- LRNN: ``forward``, the label at every position;
- RegularGPT: ``forward`` (every position) when --regulargpt-path is "forward", or "auto" and the MLP's hidden
  activations for the whole string (length x d_ff float32) fit in --forward-budget-mib; otherwise
  ``final_logits`` (the shrinking path) on the prefixes of FINAL_PREFIXES lengths (the whole string, just past
  the depth steps at 2^16 and 2^12, and short ones). The compiled RegularGPT has d_ff = 2 n^3 + 4 n^2, so a
  per-position pass over 10^5 symbols of a 16-state DFA would hold ~3.7 GB per activation and take tens of
  minutes on one thread.

Strings are random walks that never enter a state from which no accepting state is reachable
(``automata.samples.live_string``): uniform strings of most Tomita and Dyck languages fall into a rejecting sink
within a few symbols, after which every label is "0" and the check says little. Seconds are wall time of the
model calls, on whatever CPU runs it.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Sequence

import numpy as np
import torch

from automata.automaton import DFA
from automata.compiler import COMPILERS
from automata.samples import counter, live_string
from automata.task_automata import AUTOMATA_DIR

COUNTER_STATES = 16  # automata.compiler.MAX_REGULARGPT_STATES: the largest DFA of RegularGPT's matrix construction
FINAL_PREFIXES = (100_000, 65_537, 4_097, 1_000, 1)


def load_automaton(name: str) -> DFA:
    """A file under automata/tasks, or ``counter<n>``."""
    if name.startswith("counter"):
        return DFA.from_json(counter(int(name.removeprefix("counter"))))
    return DFA.from_json(AUTOMATA_DIR / f"{name}.json")


def signed_margins(logits: torch.Tensor, accepted: Sequence[bool]) -> torch.Tensor:
    """logits (N, 2) -> (N,): right-label logit minus wrong-label logit (negative = a wrong label)."""
    sign = torch.where(torch.tensor(list(accepted)), 1.0, -1.0)
    return (logits[:, 1] - logits[:, 0]).double() * sign


def check(model, dfa: DFA, string: str, path: str) -> tuple[str, torch.Tensor]:
    """(what was checked, signed margins) of ``path`` "forward" (every position) or "final" (FINAL_PREFIXES)."""
    tokens = torch.tensor([[dfa.alphabet.index(symbol) for symbol in string]])  # (1, T)
    accepted = dfa.run(string)
    with torch.no_grad():
        if path == "forward":
            return f"forward, all {len(string)} positions", signed_margins(model(tokens)[0], accepted)
        prefixes = sorted({length for length in FINAL_PREFIXES if length <= len(string)} | {len(string)})
        margins = [
            signed_margins(model.final_logits(tokens[:, :length]), accepted[length - 1 : length]) for length in prefixes
        ]
    return f"final_logits, {len(prefixes)} prefixes", torch.cat(margins)


def choose_path(arch: str, model, length: int, args: argparse.Namespace) -> str:
    if arch == "lrnn" or args.regulargpt_path == "forward":
        return "forward"
    if args.regulargpt_path == "final":
        return "final"
    activation_mib = length * model.config.d_ff * 4 / 2**20
    return "forward" if activation_mib <= args.forward_budget_mib else "final"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.accuracy.compiler_sweep", description=__doc__.split("\n")[0]
    )
    parser.add_argument("--length", type=int, default=100_000, help="symbols of the random string")
    parser.add_argument(
        "--automata",
        nargs="+",
        default=["tomita3", "tomita5", "d4", "parity_check", "even_pair_mod5", f"counter{COUNTER_STATES}"],
        help="DFA files under automata/tasks, or counter<n>",
    )
    parser.add_argument("--archs", nargs="+", default=sorted(COMPILERS), choices=sorted(COMPILERS))
    parser.add_argument("--regulargpt-path", choices=["auto", "forward", "final"], default="auto")
    parser.add_argument(
        "--forward-budget-mib",
        type=float,
        default=1024.0,
        help="'auto': RegularGPT per position only if length x d_ff float32 fits in this",
    )
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)

    print(f"{args.length} symbols per string, seed {args.seed}, torch threads {torch.get_num_threads()}\n")
    print(
        "| automaton | states | symbols | arch | parameters | checked | labels | errors | smallest margin | seconds |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    for name in args.automata:
        dfa = load_automaton(name)
        string = live_string(dfa, args.length, np.random.default_rng(args.seed))
        for arch in args.archs:
            model, _ = COMPILERS[arch](dfa)
            path = choose_path(arch, model, len(string), args)
            start = time.perf_counter()
            checked, margins = check(model, dfa, string, path)
            seconds = time.perf_counter() - start
            parameters = sum(parameter.numel() for parameter in model.parameters())
            print(
                f"| {name} | {len(dfa.states)} | {len(dfa.alphabet)} | {arch} | {parameters:,} | {checked} "
                f"| {margins.numel()} | {int((margins <= 0).sum())} | {float(margins.min()):.6f} "
                f"| {seconds:.1f} |",
                flush=True,
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
