"""Measured figures: each script prints a markdown table recorded in docs/benchmarks.md."""
