"""The delta rule per head, S_t = S_{t-1} (I - beta_t k_t k_t^T) + beta_t v_t k_t^T and o_t = S_t q_t: the reference
``delta_sequential`` and the chunked ``delta_chunked`` (the WY form of Yang et al. 2024: chunks in parallel, their
summaries through the log-depth ``scan_parallel``). Shapes: q, k, v (B, T, H, b), beta (B, T, H), state (B, H, b, b)
(S: value rows, key columns) -> outputs (B, T, H, b), final state (B, H, b, b)."""

from __future__ import annotations

import torch

from model.ops.scan.parallel import scan_parallel


def runs_sequential(impl: str, length: int) -> bool:
    """Whether a delta-rule layer runs :func:`delta_sequential` rather than :func:`delta_chunked`: for ``impl``
    "sequential" and for one token (a decode step)."""
    return impl == "sequential" or length == 1


def delta_step(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, beta: torch.Tensor, state: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """One token: q, k, v (B, H, b), beta (B, H), state (B, H, b, b) -> o (B, H, b), the next state."""
    error = v - torch.matmul(state, k.unsqueeze(-1)).squeeze(-1)  # (B, H, b): v - S k
    state = state + (beta.unsqueeze(-1) * error).unsqueeze(-1) * k.unsqueeze(-2)  # (B, H, b, b)
    return torch.matmul(state, q.unsqueeze(-1)).squeeze(-1), state


def delta_sequential(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, beta: torch.Tensor, state: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The reference: T steps of :func:`delta_step`. Shapes as in the module docstring."""
    outputs = []
    for step in zip(q.unbind(1), k.unbind(1), v.unbind(1), beta.unbind(1)):
        output, state = delta_step(*step, state)
        outputs.append(output)
    return torch.stack(outputs, dim=1), state


def delta_chunked(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
    chunk_size: int = 64,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Equal to :func:`delta_sequential` up to rounding, in float32 at least: whole chunks of ``chunk_size`` tokens,
    then what is left as one shorter chunk (so that the work grows with the length, never by a padded chunk)."""
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    length = q.shape[1]
    chunk = min(chunk_size, length)
    whole = length // chunk * chunk
    if whole == length:
        return _chunks(q, k, v, beta, state, chunk)
    first, state = _chunks(q[:, :whole], k[:, :whole], v[:, :whole], beta[:, :whole], state, chunk)
    rest, state = _chunks(q[:, whole:], k[:, whole:], v[:, whole:], beta[:, whole:], state, length - whole)
    return torch.cat([first, rest], dim=1), state


def _chunks(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, beta: torch.Tensor, state: torch.Tensor, chunk: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """The WY form over a length that ``chunk`` divides. In a chunk of C tokens from state S, with
    L = strictly lower(diag(beta) K K^T): W = (I + L)^-1 diag(beta) K, U = (I + L)^-1 diag(beta) V; then
    U' = U - W S^T, the outputs are Q S^T + lower(Q K^T) U' and the chunk ends at S + U'^T K, that is
    S (I - K^T W)^T + U^T K: one linear step per chunk, scanned."""
    dtype = q.dtype
    work = torch.promote_types(dtype, torch.float32)  # the triangular solve wants float32 or wider
    batch, length, heads, size = q.shape
    chunks = length // chunk

    def split(x: torch.Tensor) -> torch.Tensor:  # (B, T, H, ...) -> (B, H, n, C, ...)
        split: torch.Tensor = x.to(work).unflatten(1, (chunks, chunk)).movedim(3, 1)
        return split

    q, k, v = split(q), split(k), split(v)  # (B, H, n, C, b)
    beta = split(beta.unsqueeze(-1))  # (B, H, n, C, 1)
    lower = torch.tril(beta * torch.matmul(k, k.transpose(-1, -2)), diagonal=-1)  # (B, H, n, C, C)
    solved = torch.linalg.solve_triangular(
        lower + torch.eye(chunk, dtype=work, device=q.device), beta * torch.cat([k, v], dim=-1), upper=False
    )  # (B, H, n, C, 2b)
    w, u = solved.split(size, dim=-1)  # (B, H, n, C, b) each
    # the chunk as one step of every value row (a key-sized vector): S_row <- (I - K^T W) S_row + (U^T K)_row
    transition = torch.eye(size, dtype=work, device=q.device) - torch.matmul(k.transpose(-1, -2), w)  # (B, H, n, b, b)
    written = torch.matmul(u.transpose(-1, -2), k)  # (B, H, n, b, b): rows are value rows
    rows = (batch, chunks, heads * size, size)
    transitions = transition.unsqueeze(3).expand(-1, -1, -1, size, -1, -1).movedim(2, 1).reshape(*rows, size)
    ends, final = scan_parallel(
        transitions, written.movedim(2, 1).reshape(rows), state.to(work).flatten(1, 2)
    )  # (B, n, H b, b), (B, H b, b)
    starts = torch.cat([state.to(work).flatten(1, 2).unsqueeze(1), ends[:, :-1]], dim=1)  # (B, n, H b, b)
    starts = starts.unflatten(2, (heads, size)).movedim(1, 2)  # (B, H, n, b, b): S at each chunk's start
    corrected = u - torch.matmul(w, starts.transpose(-1, -2))  # (B, H, n, C, b): U' = U - W S^T
    within = torch.tril(torch.matmul(q, k.transpose(-1, -2)))  # (B, H, n, C, C)
    outputs = torch.matmul(q, starts.transpose(-1, -2)) + torch.matmul(within, corrected)  # (B, H, n, C, b)
    outputs = outputs.movedim(1, 3).flatten(1, 2)  # (B, T, H, b)
    return outputs.to(dtype), final.unflatten(1, (heads, size)).to(dtype)
