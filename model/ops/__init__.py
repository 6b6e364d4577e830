"""Reference and fast implementations of the core ops, one signature per op."""
