"""The Triton kernels of ``model.ops.triton_scan``, imported by it on first use so that Triton stays optional (and
so that ``triton.jit`` here sees the TRITON_INTERPRET=1 a CPU test process sets first). Names: ``pid_rh`` =
row * H + head (the grid's second axis, chunks on the first: CUDA allows 2^31 - 1 programs there, 65,535 on the
others); a block is indexed [i, j], i the output (row) axis and j the input (column) one: A_t[i, j] sits at
a + row s_ab + t s_at + head s_ah + i s_ai + j s_aj. Everything is float32; offsets are 64-bit."""

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
    """Program (chunk, row * H + head): the chunk from a zero state; its final state goes to ``finals`` (B, H,
    n - 1, b) and the product A_C ... A_1 of its transitions to ``products`` (B, H, n - 1, b, b), both
    contiguous. Only whole chunks (every chunk but the last) come here."""
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
    """Program row * H + head: the start state of each of the ``chunks`` chunks into ``starts`` (B, H, n, b),
    contiguous: h0 for the first, then start_{c+1} = P_c start_c + s_c from ``chunk_summary_kernel``'s output."""
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
    """Program (chunk, row * H + head): the chunk's steps from its start state, each state written to ``states``
    (B, T, H, b). The start is h0[row, head] + chunk s_hc: with one chunk h0 is the initial state and s_hc 0,
    with several it is ``chunk_starts_kernel``'s (B, H, n, b). The last chunk may be short."""
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
