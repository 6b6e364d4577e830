"""Structured outputs: constraints every generated text matches."""
