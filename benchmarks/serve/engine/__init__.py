"""The engine's own cost: under many clients, alone without HTTP, in a process of its own, with structured outputs."""
