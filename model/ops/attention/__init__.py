"""Sliding-Dilated-Attention: the T x T reference, the gathered and banded fast paths, and the dispatch."""
