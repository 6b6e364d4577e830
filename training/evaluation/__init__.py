"""Evaluation: accuracy by length, text perplexity and retrieval probes, with their plots."""
