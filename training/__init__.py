"""Tasks, data, training loops, evaluation and the automaton compiler."""
