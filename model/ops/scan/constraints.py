"""The LRNN's transition constraints on blocks (..., b, b): column norms, column sparsemax, the orthogonal polar factor
and the spectral norm, each in at least float32 and returned in the input dtype."""

from __future__ import annotations

from typing import Literal

import torch

from model.ops.cpu import cpu_decode
from model.ops.scan.signature import compute_dtype


def column_norm_constraint(matrices: torch.Tensor, p: float = 1.2) -> torch.Tensor:
    """Scale every column v (along dim -2) of every block of matrices (..., b, b) by 1 / max(1, ||v||_p)."""
    return (matrices / column_divisors(matrices, p)).to(matrices.dtype)  # (..., b, b)


def column_divisors(matrices: torch.Tensor, p: float = 1.2) -> torch.Tensor:
    """matrices (..., b, b) -> max(1, ||v||_p) per column, (..., 1, b), in at least float32, as max(1, sum
    |v_i|^p)^(1/p): gradient 0, never NaN, inside the ball."""
    powered = matrices.to(compute_dtype(matrices.dtype)).abs().pow(p)  # (..., b, b)
    return powered.sum(dim=-2, keepdim=True).clamp(min=1.0).pow(1.0 / p)  # (..., 1, b)


def column_sparsemax(matrices: torch.Tensor) -> torch.Tensor:
    """Project every column (along dim -2) of matrices (..., b, b) onto the simplex: max(v - tau, 0) summing to 1, with
    exact zeros (sparsemax, Martins & Astudillo 2016). In at least float32."""
    compiled = cpu_decode.column_sparsemax(matrices)  # float32 on the CPU with numba (its own backward), else None
    if compiled is not None:
        return compiled
    values = matrices.to(compute_dtype(matrices.dtype))  # (..., b, b)
    ordered = values.sort(dim=-2, descending=True).values  # (..., b, b)
    ranks = torch.arange(1, values.shape[-2] + 1, device=values.device, dtype=values.dtype).unsqueeze(-1)  # (b, 1)
    cumulative = ordered.cumsum(dim=-2) - 1  # (..., b, b)
    support = (ordered * ranks > cumulative).sum(dim=-2, keepdim=True)  # (..., 1, b): k, at least 1
    tau = cumulative.gather(-2, support - 1) / support.to(values.dtype)  # (..., 1, b)
    return (values - tau).clamp(min=0).to(matrices.dtype)  # (..., b, b)


OrthogonalImpl = Literal["newton_schulz", "svd"]
POLAR_ITERATIONS = 32  # at most: singular values from 1e-4 of the Frobenius norm reach 1 in float32
POLAR_TOLERANCE = 1e-6  # a block's Newton-Schulz stops once every |X^T X - I| entry of it is below this


def orthogonal_constraint(matrices: torch.Tensor, impl: OrthogonalImpl = "newton_schulz") -> torch.Tensor:
    """The orthogonal polar factor U V^T of every block of matrices (..., b, b) = U S V^T: the nearest orthogonal
    matrix (reflections included), so products of any length keep norms. In at least float32. "svd": from the
    decomposition (the reference; its gradient is undefined where singular values repeat); "newton_schulz": X <- X (3 I
    - X^T X) / 2 from X sqrt(3) 0.99 / ||X||_F, smooth, equal to it within 1e-5 for blocks whose smallest singular
    value is above 1e-4 of their Frobenius norm."""
    blocks = matrices.to(compute_dtype(matrices.dtype))  # (..., b, b)
    if impl == "svd":
        left, _, right = torch.linalg.svd(blocks)
        polar: torch.Tensor = left @ right  # (..., b, b)
        return polar.to(matrices.dtype)
    if impl != "newton_schulz":
        raise ValueError(f"unknown orthogonal impl {impl!r}; choose newton_schulz or svd")
    size = blocks.shape[-1]
    polar = blocks.reshape(-1, size, size).permute(1, 2, 0).contiguous()  # (b, b, N): one vector op per entry
    polar = polar * (3**0.5 * 0.99 / polar.square().sum(dim=(0, 1)).sqrt().clamp(min=1e-12))  # singular values < sqrt 3
    identity = torch.eye(size, dtype=polar.dtype, device=polar.device).unsqueeze(-1)  # (b, b, 1)
    for _ in range(POLAR_ITERATIONS):  # a block stops once it has converged: its bits never depend on the others
        gram = _blocks_product(polar.transpose(0, 1), polar)  # X^T X (b, b, N)
        moving = (gram.detach() - identity).abs().amax(dim=(0, 1)) >= POLAR_TOLERANCE  # (N,)
        if not bool(moving.any()):
            break
        polar = torch.where(moving, 1.5 * polar - 0.5 * _blocks_product(polar, gram), polar)
    return polar.permute(2, 0, 1).reshape(blocks.shape).to(matrices.dtype)  # (..., b, b)


def _blocks_product(left: torch.Tensor, right: torch.Tensor) -> torch.Tensor:
    """left @ right for N pairs of b x b blocks laid out (b, b, N): b broadcast products (batched matmul of tiny
    blocks costs ~10x more on the CPU)."""
    product = left[:, :1] * right[:1]
    for j in range(1, left.shape[1]):
        product = product + left[:, j : j + 1] * right[j : j + 1]
    return product


SpectralImpl = Literal["auto", "svd", "closed_form"]


def spectral_norm_constraint(matrices: torch.Tensor, impl: SpectralImpl = "auto") -> torch.Tensor:
    """Scale every block of matrices (..., b, b) by 1 / max(1, ||A||_2): products never expand, rotations stay exact.
    ``impl``: "svd", "closed_form" (b = 2 only: sigma_max^2 = (F + sqrt(F^2 - 4 det^2)) / 2, F = ||A||_F^2) or "auto".
    """
    if impl == "auto":
        impl = "closed_form" if matrices.shape[-1] == 2 else "svd"
    blocks = matrices.to(compute_dtype(matrices.dtype))  # (..., b, b)
    if impl == "svd":
        squared: torch.Tensor = torch.linalg.matrix_norm(blocks, ord=2).square()  # (...,)
    elif impl == "closed_form":
        if blocks.shape[-2:] != (2, 2):
            raise ValueError(f"the closed form is for 2 x 2 blocks, got {tuple(blocks.shape[-2:])}")
        a, b, c, d = blocks[..., 0, 0], blocks[..., 0, 1], blocks[..., 1, 0], blocks[..., 1, 1]  # each (...,)
        # F^2 - 4 det^2 = (sigma_1^2 - sigma_2^2)^2, written as a product of sums of squares (no cancellation);
        # the floor keeps sqrt's gradient finite where the singular values are equal (e.g. a scaled rotation)
        gap = (((a - d).square() + (b + c).square()) * ((a + d).square() + (b - c).square())).clamp(min=1e-30).sqrt()
        squared = (blocks.square().sum(dim=(-2, -1)) + gap) / 2  # (F + gap) / 2
    else:
        raise ValueError(f"unknown spectral norm impl {impl!r}; choose auto, svd or closed_form")
    divisors = squared.clamp(min=1.0).sqrt()[..., None, None]  # (..., 1, 1)
    return (matrices / divisors).to(matrices.dtype)  # (..., b, b)
