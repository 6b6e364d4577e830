"""The compiled CPU kernels (numba): ``cpu_decode``, their public face, and the kernel families it builds (kernels/)."""
