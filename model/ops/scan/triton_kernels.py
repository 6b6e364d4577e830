"""The Triton kernels of model/ops/scan/triton.py, imported on first use (Triton stays optional). ``pid_rh`` = row * H +
head (grid axis 1; chunks on axis 0); A_t[i, j] (i output, j input) sits at a + row s_ab + t s_at + head s_ah + i s_ai +
j s_aj. Float32, 64-bit offsets."""

import triton
import triton.language as tl


@triton.jit
def _head_pointers(a, x, row, head, i, s_ab, s_ah, s_ai, s_aj, s_xb, s_xh, s_xi):
    """The pointers of one (row, head)'s transition block (BLOCK, BLOCK) and input (BLOCK,) at t = 0."""
    a_base = a + row * s_ab + head * s_ah + i[:, None] * s_ai + i[None, :] * s_aj
    x_base = x + row * s_xb + head * s_xh + i * s_xi
    return a_base, x_base


@triton.jit
def _affine_step(transition, state, input):
    """transition (BLOCK, BLOCK) @ state (BLOCK,) + input (BLOCK,)."""
    return tl.sum(transition * state[None, :], axis=1) + input


@triton.jit
def chunk_summary_kernel(
    a,
    x,
    products,
    finals,
    heads,
    length,
    block,
    chunk_size,
    s_ab,
    s_at,
    s_ah,
    s_ai,
    s_aj,
    s_xb,
    s_xt,
    s_xh,
    s_xi,
    BLOCK: tl.constexpr,
):
    """Program (chunk, row * H + head), whole chunks only: the chunk from a zero state; its final state to ``finals``
    (B, H, n - 1, b), its transitions' product to ``products`` (B, H, n - 1, b, b)."""
    chunk, pid_rh = tl.program_id(0).to(tl.int64), tl.program_id(1).to(tl.int64)
    row, head = pid_rh // heads, pid_rh % heads
    i = tl.arange(0, BLOCK)
    inside = i < block
    square = inside[:, None] & inside[None, :]
    a_base, x_base = _head_pointers(a, x, row, head, i, s_ab, s_ah, s_ai, s_aj, s_xb, s_xh, s_xi)
    first = chunk * chunk_size
    product = tl.where(i[:, None] == i[None, :], 1.0, 0.0)  # (BLOCK, BLOCK): I
    state = tl.zeros((BLOCK,), dtype=tl.float32)
    for step in range(chunk_size):
        t = first + step
        transition = tl.load(a_base + t * s_at, mask=square, other=0.0)  # (BLOCK, BLOCK)
        state = _affine_step(transition, state, tl.load(x_base + t * s_xt, mask=inside, other=0.0))
        product = tl.sum(transition[:, :, None] * product[None, :, :], axis=1)  # A_t times the product so far
    summary = pid_rh * tl.num_programs(0) + chunk  # (row, head, chunk) in (B, H, n - 1)
    tl.store(products + summary * block * block + i[:, None] * block + i[None, :], product, mask=square)
    tl.store(finals + summary * block + i, state, mask=inside)


@triton.jit
def chunk_starts_kernel(products, finals, h0, s_hb, s_hh, s_hi, starts, heads, chunks, block, BLOCK: tl.constexpr):
    """Program row * H + head: each chunk's start state into ``starts`` (B, H, n, b): h0, then P_c start_c + s_c."""
    pid_rh = tl.program_id(0).to(tl.int64)
    row, head = pid_rh // heads, pid_rh % heads
    i = tl.arange(0, BLOCK)
    inside = i < block
    square = inside[:, None] & inside[None, :]
    state = tl.load(h0 + row * s_hb + head * s_hh + i * s_hi, mask=inside, other=0.0)
    out = starts + pid_rh * chunks * block + i  # (BLOCK,)
    tl.store(out, state, mask=inside)
    summaries = pid_rh * (chunks - 1)
    for chunk in range(chunks - 1):
        summary = summaries + chunk
        product = tl.load(
            products + summary * block * block + i[:, None] * block + i[None, :], mask=square, other=0.0
        )  # (BLOCK, BLOCK)
        final = tl.load(finals + summary * block + i, mask=inside, other=0.0)
        state = _affine_step(product, state, final)
        tl.store(out + (chunk + 1) * block, state, mask=inside)


@triton.jit
def chunk_states_kernel(
    a,
    x,
    h0,
    s_hb,
    s_hh,
    s_hc,
    s_hi,
    states,
    s_sb,
    s_st,
    s_sh,
    s_si,
    heads,
    length,
    block,
    chunk_size,
    s_ab,
    s_at,
    s_ah,
    s_ai,
    s_aj,
    s_xb,
    s_xt,
    s_xh,
    s_xi,
    BLOCK: tl.constexpr,
):
    """Program (chunk, row * H + head): the chunk's states from its start h0[row, head] + chunk s_hc (the initial state,
    or ``chunk_starts_kernel``'s), written to ``states`` (B, T, H, b); the last chunk may be short."""
    chunk, pid_rh = tl.program_id(0).to(tl.int64), tl.program_id(1).to(tl.int64)
    row, head = pid_rh // heads, pid_rh % heads
    i = tl.arange(0, BLOCK)
    inside = i < block
    a_base, x_base = _head_pointers(a, x, row, head, i, s_ab, s_ah, s_ai, s_aj, s_xb, s_xh, s_xi)
    out_base = states + row * s_sb + head * s_sh + i * s_si  # (BLOCK,)
    state = tl.load(h0 + row * s_hb + head * s_hh + chunk * s_hc + i * s_hi, mask=inside, other=0.0)
    first = chunk * chunk_size
    for step in range(chunk_size):
        t = first + step
        live = i < tl.where(t < length, block, 0)  # (BLOCK,): none past the end (the last chunk only)
        transition = tl.load(a_base + t * s_at, mask=live[:, None] & live[None, :], other=0.0)  # (BLOCK, BLOCK)
        input = tl.load(x_base + t * s_xt, mask=live, other=0.0)  # (BLOCK,)
        state = _affine_step(transition, state, input)
        tl.store(out_base + t * s_st, state, mask=live)
