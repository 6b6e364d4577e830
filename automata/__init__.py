"""Finite automata (DFAs, Moore machines, regular expressions), the regular tasks' machines, and the compiler of
an automaton into exact LRNN and RegularGPT weights. Imports only model/.
"""
