"""The core ops, one folder per op (scan/, attention/: the reference beside fast paths of one signature, a dispatch);
the numba CPU kernels (cpu/), positional encodings and oneDNN-prepacked weights beside them."""
