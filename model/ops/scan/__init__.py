"""The block-diagonal linear scan h_t = A_t h_{t-1} + b_t: its reference, torch, compiled and Triton paths, the
dispatch, and the constraints on the transitions A_t."""
