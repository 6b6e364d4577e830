"""Tasks, data, training loops, evaluation, the exact transformers' builders and the ``python -m training`` CLI
(its ``compile`` command runs the automaton compiler of automata/)."""
