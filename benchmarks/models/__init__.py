"""Whole models: decode steps, prefill passes and training steps, against floors and thread counts."""
