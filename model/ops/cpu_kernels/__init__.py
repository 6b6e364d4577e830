"""The numba kernels behind model/ops/cpu_decode.py, one module per family, each built by its ``build_*`` function
from the imported ``numba`` module into a NamedTuple of compiled callables: the row-invariant panel product and its
greedy picks (panels.py), the dot-product kernel and the layer steps' shared pieces (layer_ops.py), the LRNN and
RegularGPT layer steps (layer_steps.py), the column sparsemax (sparsemax.py) and the linear scan (scan.py), with the
LLVM intrinsics and jit options they share in helpers.py. Importing them imports neither numba nor llvmlite and
compiles nothing; model/ops/cpu_decode.py builds them once, under its lock."""
