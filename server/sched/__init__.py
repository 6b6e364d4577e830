"""Scheduling: what runs when, the work units, their costs and the prompt-state cache."""
