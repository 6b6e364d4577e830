"""Long contexts: decoding at growing context, a million tokens, short requests beside long work."""
