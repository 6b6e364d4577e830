"""Execution: the model calls the scheduler planned, generation, sampling and detokenizing."""
