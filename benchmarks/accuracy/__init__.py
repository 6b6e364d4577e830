"""Accuracy, not speed: the exact constructions' and the compiler's sweeps, and the trained checkpoints' result rows."""
