"""Finite automata and the exact weights built from them: DFAs and Moore machines (automaton.py), regular
expression -> minimal DFA (regex.py), the compiler of a DFA into LRNN and RegularGPT weights (compiler.py), the
machines of the regular tasks and their DFA files under tasks/ (task_automata.py), and sample automata and
strings that exercise compiled models (samples.py). Imports only model/; training/ and server/ import it.
"""
