"""Serving benchmarks: a real ``python -m server`` process driven over HTTP (see harness.py)."""
