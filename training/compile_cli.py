"""``python -m training compile DFA.json --arch lrnn|regulargpt --out DIR`` (SPEC section 3): compile a DFA file
into a checkpoint folder (automata/compiler.py). ``compile --regex PATTERN --alphabet SYMBOLS`` compiles a regular
expression instead: its minimal DFA over the alphabet (automata/regex.py), labelling each prefix "1" when it fully
matches, else "0".

Exit codes: 0 written; 2 bad input, with one line on stderr: a DFA file that does not parse or validate (the
:class:`~automata.automaton.AutomatonError` message, which names the problem), a DFA the architecture cannot take,
or an --out folder that already holds a checkpoint (without --overwrite).

The compiled checkpoints shipped under checkpoints/ are written by this command, never by hand; from the
repository root::

    for task in tomita3 tomita4 tomita5 tomita6 d2 d3 d4; do
      for arch in lrnn regulargpt; do
        python -m training compile automata/tasks/$task.json --arch $arch \\
          --out checkpoints/$task-$arch-compiled --overwrite
      done
    done

tests/training/test_compile_cli.py checks that each of them equals a fresh compilation.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from automata.automaton import DFA, AutomatonError
from automata.compiler import COMPILERS, CompileError
from automata.regex import regex_dfa
from model.checkpoint import CONFIG_FILE, save_checkpoint


def add_compile_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("dfa", type=Path, nargs="?", help="DFA JSON file (SPEC section 2)")
    parser.add_argument("--regex", help="instead of a DFA file: a regular expression (Python syntax, matched whole)")
    parser.add_argument("--alphabet", help="with --regex: the input symbols, one character each, e.g. 01")
    parser.add_argument("--name", default="regex", help="with --regex: the automaton's name (default: regex)")
    parser.add_argument("--arch", required=True, choices=sorted(COMPILERS), help="architecture to compile into")
    parser.add_argument("--out", required=True, type=Path, help="checkpoint folder to write")
    parser.add_argument("--overwrite", action="store_true", help="replace a checkpoint already in --out")


def run_compile(args: argparse.Namespace) -> int:
    """Compile ``args.dfa`` into ``args.out``; 0 on success, 2 (one line on stderr) on bad input."""
    try:
        return _compile(args)
    except (AutomatonError, CompileError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2


def _compile(args: argparse.Namespace) -> int:
    if (args.out / CONFIG_FILE).exists() and not args.overwrite:
        raise CompileError(f"{args.out} already holds a checkpoint; pass --overwrite to replace it")
    if args.out.exists() and not args.out.is_dir():
        raise CompileError(f"--out {args.out} exists and is not a folder")
    dfa = _automaton(args)
    model, config = COMPILERS[args.arch](dfa)
    save_checkpoint(model, config, args.out)
    task = f"task {config.task}" if config.task else "no task"
    print(f"wrote {args.out}: {args.arch} for {dfa.name} ({len(dfa.states)} states, {task})")
    return 0


def _automaton(args: argparse.Namespace) -> DFA:
    """The DFA of the command line: a JSON file, or a regular expression over an alphabet."""
    if (args.dfa is None) == (args.regex is None):
        raise CompileError("give a DFA JSON file or --regex PATTERN, one of the two")
    if args.regex is None:
        if args.alphabet is not None:
            raise CompileError("--alphabet goes with --regex; a DFA file names its own alphabet")
        return DFA.from_json(args.dfa)
    if not args.alphabet:
        raise CompileError("--regex needs --alphabet: the symbols the model reads, e.g. --alphabet 01")
    return regex_dfa(args.regex, args.alphabet, args.name)
