"""Ours against other systems: Hugging Face GPT-2 and Mamba, and the token-level constraint libraries."""
