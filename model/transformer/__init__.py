"""Transformer baselines (ALiBi, KERPLE, T5 bias) and the hand-built exact transformers."""
