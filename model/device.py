"""Device and dtype selection: "auto" picks CUDA when it is there, else the CPU."""

from __future__ import annotations

import torch

DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float64": torch.float64,
    "fp64": torch.float64,
}


def resolve_device(name: str = "auto") -> torch.device:
    """Map "auto" | "cpu" | "cuda" | "cuda:N" to a device; asking for CUDA without it is an error."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cpu":
        return torch.device("cpu")
    if name == "cuda" or name.startswith("cuda:"):
        if not torch.cuda.is_available():
            raise ValueError(f"device {name!r} asked for, but this machine has no CUDA device")
        return torch.device(name)
    raise ValueError(f"unknown device {name!r}; use auto, cpu, cuda or cuda:N")


def resolve_dtype(name: str) -> torch.dtype:
    """Map a dtype name (float32/fp32, bfloat16/bf16, float64/fp64) to a torch dtype."""
    try:
        return DTYPES[name]
    except KeyError:
        raise ValueError(f"unknown dtype {name!r}; use one of {sorted(DTYPES)}") from None
