"""``python -m training compile DFA.json --arch lrnn|regulargpt --out DIR`` (docs/api.md, Command line): compile a
DFA file or a Moore machine file (automata/compiler.py), a regular expression (``--regex PATTERN --alphabet
SYMBOLS``: "1" where a prefix fully matches) or a regular task's machine (``--task NAME``) into a checkpoint folder.

Exit codes: 0 written; 2 with one line on stderr: a DFA file that does not validate, an automaton the architecture
cannot take, or an --out folder that holds a checkpoint (without --overwrite).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from automata.automaton import DFA, AutomatonError, MooreMachine, read_automaton
from automata.compiler import COMPILERS, CompileError
from automata.regex import regex_dfa
from automata.task_automata import task_machines
from model.checkpoint import CONFIG_FILE, save_checkpoint


def add_compile_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "dfa", type=Path, nargs="?", help="DFA (or Moore machine) JSON file (docs/api.md, Automaton files)"
    )
    parser.add_argument("--regex", help="instead of a DFA file: a regular expression (Python syntax, matched whole)")
    parser.add_argument("--alphabet", help="with --regex: the input symbols, one character each, e.g. 01")
    parser.add_argument("--name", default="regex", help="with --regex: the automaton's name (default: regex)")
    parser.add_argument("--task", help="instead of a DFA file: a regular task's automaton, e.g. induction_heads")
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
    automaton = _automaton(args)
    model, config = COMPILERS[args.arch](automaton)
    save_checkpoint(model, config, args.out)
    task = f"task {config.task}" if config.task else "no task"
    print(f"wrote {args.out}: {args.arch} for {automaton.name} ({len(automaton.states)} states, {task})")
    return 0


def _automaton(args: argparse.Namespace) -> DFA | MooreMachine:
    """The automaton of the command line: a JSON file, a regular expression over an alphabet, or a task's."""
    if [args.dfa, args.regex, args.task].count(None) != 2:
        raise CompileError("give a DFA JSON file, --regex PATTERN or --task NAME, one of the three")
    if args.regex is None and args.alphabet is not None:
        raise CompileError("--alphabet goes with --regex; a DFA file or a task names its own alphabet")
    if args.task is not None:
        machines = task_machines()
        if args.task not in machines:
            raise CompileError(f"no regular task {args.task!r}; the regular tasks: {', '.join(machines)}")
        return machines[args.task]
    if args.regex is None:
        return read_automaton(args.dfa)
    if not args.alphabet:
        raise CompileError("--regex needs --alphabet: the symbols the model reads, e.g. --alphabet 01")
    return regex_dfa(args.regex, args.alphabet, args.name)
