"""Regular expressions as DFAs: ``python -m training compile --regex PATTERN --alphabet SYMBOLS``.

Python's own regex parser, a Thompson NFA, the subset construction over the alphabet only, then minimisation: the
DFA accepts exactly the strings ``re.fullmatch(pattern, ...)`` matches. Constructs that are not regular for a whole
match, and automata beyond the size limits, raise :class:`AutomatonError` naming them.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from typing import Any

from automata.automaton import DFA, AutomatonError, AutomatonTooLarge, MooreMachine

try:  # Python 3.11+ (typeshed has no stubs for re's private modules: they are Any here)
    from re import _compiler as regex_compiler  # type: ignore[attr-defined]
    from re import _constants as regex_constants  # type: ignore[attr-defined]
    from re import _parser as regex_parser  # type: ignore[attr-defined]
except ImportError:  # Python 3.10
    import sre_compile as regex_compiler
    import sre_constants as regex_constants
    import sre_parse as regex_parser

MAX_NFA_STATES = 200_000  # counted repetitions are unrolled: a{100000} would otherwise build a huge NFA
MAX_SUBSETS = 1 << 16  # DFA states before minimising

_SINGLE_CHARACTER = {regex_constants.LITERAL, regex_constants.NOT_LITERAL, regex_constants.ANY, regex_constants.IN}
_REPEATS = {regex_constants.MAX_REPEAT, regex_constants.MIN_REPEAT}
REFUSED_CONSTRUCTS = {  # what a pattern may not hold, and why (server/structured/regex.py refuses them too)
    "AT": "anchors and word boundaries (^, $, \\A, \\Z, \\b, \\B; a pattern is matched whole anyway)",
    "GROUPREF": "back-references (not regular)",
    "GROUPREF_EXISTS": "conditional groups (not regular in general)",
    "ASSERT": "look-ahead and look-behind",
    "ASSERT_NOT": "negative look-ahead and look-behind",
    "POSSESSIVE_REPEAT": "possessive quantifiers (*+, ++, ?+, {m,n}+)",
    "ATOMIC_GROUP": "atomic groups (?>...)",
}


def regex_dfa(pattern: str, alphabet: str, name: str = "regex") -> DFA:
    """The minimal DFA over ``alphabet`` accepting the strings ``re.fullmatch(pattern, ...)`` matches."""
    try:
        parsed = regex_parser.parse(pattern)
    except re.error as error:
        raise AutomatonError(f"invalid regular expression {pattern!r}: {error}") from None
    nfa = _NFA(pattern, alphabet, parsed.state.flags)
    start, accept = nfa.fragment(parsed)
    initial = nfa.closure({start})

    def step(subset: frozenset[int], symbol: str) -> frozenset[int]:
        return nfa.closure(nfa.move(subset, alphabet.index(symbol)))

    names: dict[frozenset[int], str] = {}

    def state_name(subset: frozenset[int]) -> str:  # subsets are numbered as the search meets them
        if subset not in names:
            if len(names) >= MAX_SUBSETS:
                raise AutomatonTooLarge(
                    f"regular expression {pattern!r}: more than {MAX_SUBSETS} states before minimising"
                )
            names[subset] = str(len(names))
        return names[subset]

    machine = MooreMachine.explore(
        name,
        alphabet,
        initial,
        step,
        lambda subset: "1" if accept in subset else "0",
        state_name,
        max_states=MAX_SUBSETS,
    )
    return DFA.from_moore(machine.minimal())


def single_character_item(op: Any, argument: Any, flags: int) -> object:
    """A parsed single-character item in a parser state of its own holding exactly ``flags`` (re's compiler ORs the
    state's flags in: the pattern's state would put a global (?i) back into a (?-i:...) group)."""
    state = regex_parser.State()
    state.flags = flags
    return regex_parser.SubPattern(state, [(op, argument)])


class _NFA:
    """A Thompson NFA under construction: epsilon edges, and symbol edges labelled by alphabet indices."""

    def __init__(self, pattern: str, alphabet: str, flags: int) -> None:
        self.pattern, self.alphabet, self.flags = pattern, alphabet, flags  # flags: those in force where it builds
        self.epsilon: list[list[int]] = []
        self.edges: list[list[tuple[frozenset[int], int]]] = []

    def new_state(self) -> int:
        if len(self.epsilon) >= MAX_NFA_STATES:
            raise AutomatonTooLarge(
                f"regular expression {self.pattern!r} unrolls to more than {MAX_NFA_STATES} NFA states"
            )
        self.epsilon.append([])
        self.edges.append([])
        return len(self.epsilon) - 1

    def fragment(self, items: Iterable[tuple[Any, Any]]) -> tuple[int, int]:
        """The (start, accept) of an NFA for the concatenation of parsed ``items``."""
        start = end = self.new_state()
        for op, argument in items:
            first, last = self._item(op, argument)
            self.epsilon[end].append(first)
            end = last
        return start, end

    def _item(self, op: Any, argument: Any) -> tuple[int, int]:
        if op in _SINGLE_CHARACTER:
            start, end = self.new_state(), self.new_state()
            self.edges[start].append((self._symbols(op, argument), end))
            return start, end
        if op is regex_constants.SUBPATTERN:  # its scoped flags, (?i:...) or (?-i:...), hold inside it only
            _group, add_flags, del_flags, items = argument
            outer, self.flags = self.flags, (self.flags | add_flags) & ~del_flags
            try:
                return self.fragment(items)
            finally:
                self.flags = outer
        if op is regex_constants.BRANCH:
            start, end = self.new_state(), self.new_state()
            for alternative in argument[1]:
                first, last = self.fragment(alternative)
                self.epsilon[start].append(first)
                self.epsilon[last].append(end)
            return start, end
        if op in _REPEATS:
            return self._repeat(*argument)
        reason = REFUSED_CONSTRUCTS.get(str(op), f"the construct {op}")
        raise AutomatonError(f"regular expression {self.pattern!r}: {reason} cannot be compiled into an automaton")

    def _repeat(self, least: int, most: int, body: Iterable[tuple[Any, Any]]) -> tuple[int, int]:
        """``body`` at least ``least`` and at most ``most`` times (MAXREPEAT: unbounded), unrolled."""
        start = end = self.new_state()
        unbounded = most is regex_constants.MAXREPEAT
        for index in range(least if unbounded else most):
            first, last = self.fragment(body)
            self.epsilon[end].append(first)
            if index >= least:  # an optional copy: it may be skipped (x{0,3} = x?x?x?)
                self.epsilon[end].append(last)
            end = last
        if unbounded:  # then any number more; the fragment's end must have no way out (Thompson)
            first, last = self.fragment(body)
            loop, exit = self.new_state(), self.new_state()
            self.epsilon[end].append(loop)
            self.epsilon[loop] += [first, exit]
            self.epsilon[last].append(loop)
            end = exit
        return start, end

    def _symbols(self, op: Any, argument: Any) -> frozenset[int]:
        """The alphabet indices one single-character item matches, decided by ``re`` itself."""
        matcher = regex_compiler.compile(single_character_item(op, argument, self.flags), self.flags)
        return frozenset(i for i, symbol in enumerate(self.alphabet) if matcher.fullmatch(symbol))

    def closure(self, states: Iterable[int]) -> frozenset[int]:
        reached, todo = set(states), list(states)
        while todo:
            for successor in self.epsilon[todo.pop()]:
                if successor not in reached:
                    reached.add(successor)
                    todo.append(successor)
        return frozenset(reached)

    def move(self, states: frozenset[int], symbol: int) -> set[int]:
        return {target for state in states for symbols, target in self.edges[state] if symbol in symbols}
