"""The numba kernels behind model/ops/cpu/cpu_decode.py, one family per module, each compiled by its
``build_*(numba)`` into a NamedTuple. Importing them imports neither numba nor llvmlite and compiles nothing."""
