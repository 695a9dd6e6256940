"""Chunked Mamba-2 SSD scan in Triton (the state-space-duality form), state in its pages.

One program per (sequence, head, tile of ``BLOCK_P`` head channels) carries ``h[tile, :]``
(BLOCK_P x N, float32) across the sequence's chunks of ``BLOCK_C`` tokens. With ``a_l =
dt_l A``, ``Acum_l = a_1 + .. + a_l`` and ``L_ls = exp(Acum_l - Acum_s)`` (``s <= l``), a
chunk with entry state ``h0`` gives (the algebra of ``ssd_chunked``)::

    Y     = ((C B^T) * L) (dt x) + diag(exp(Acum)) C h0^T + D x      (intra + carried)
    h_end = exp(Acum_C) h0 + (dt x * exp(Acum_C - Acum))^T B         (state passing)

all as ``tl.dot`` over the chunk (tensor cores on a GPU). B and C are those of the head's
group. Padded rows (past the sequence, or before it when the grid is shifted by
``start_pos``) load ``dt = x = B = C = 0``: they decay by ``exp(0)`` and add nothing.

Captures as :mod:`pagefold.ops.gdn.triton_chunked`: ``chunk_states`` (M, H, P, N) rows
``chunk_offsets[s] + c`` (:func:`~pagefold.ops.common.triton.chunk_layout`), the
state after each chunk; ``intermediate`` (T, H, P, N), the state after every token (rank-1
replay within the chunk); ``captures``, the state after given tokens (``h_end``'s formula cut
at the capture row).

:func:`ssd_chunked_triton` has the signature of ``ssd_naive`` (plus the captures);
:func:`ssd_chunked_paged` is the in-place form the layer uses.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from pagefold.ops.common.triton import (
    INTERPRET,
    Captures,
    PagedState,
    block_chunk,
    chunk_args,
    chunk_prec,
    dense_chunk_offsets,
    gate,
    load_state,
    pow2,
    seq_args,
    store_state,
    tile_row,
)
from pagefold.ops.ssd.reference import check_inputs, discretize_dt, seq_bounds


@triton.jit
def ssd_chunk_kernel(x_ptr, x_st, x_sh, dt_ptr, dt_st, a_ptr, b_ptr, c_ptr, bc_st, bc_sg,
                      d_ptr, cu_ptr, pos_ptr, init_ptr, st_ptr, pages_ptr, pps, pe, off,
                      y_ptr, y_st, y_sh, inter_ptr, cst_ptr, coff_ptr, cap_ptr, capcu_ptr,
                      cb_ptr, cpages_ptr, cpps, cpe, coffs, H, HG, P, N,
                      HAS_D: tl.constexpr, HAS_INIT: tl.constexpr, HAS_POS: tl.constexpr,
                      STORE_INTER: tl.constexpr, STORE_CHUNKS: tl.constexpr,
                      CAPTURE: tl.constexpr,
                      PREC: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_P: tl.constexpr,
                      BLOCK_N: tl.constexpr):
    s = tl.program_id(0)
    h = tl.program_id(1)
    pt = tl.program_id(2)
    grp = h // HG
    r = tl.arange(0, BLOCK_C)
    p = pt * BLOCK_P + tl.arange(0, BLOCK_P)
    n = tl.arange(0, BLOCK_N)
    pm = p < P
    nm = n < N
    m2 = pm[:, None] & nm[None, :]
    e = (h * P + p[:, None]) * N + n[None, :]
    S, live = load_state(st_ptr, pages_ptr, init_ptr, s, pps, pe, off, e, m2, HAS_INIT)
    A = tl.load(a_ptr + h).to(tl.float32)
    if HAS_D:
        Dh = tl.load(d_ptr + h).to(tl.float32)
    c0 = tl.load(cu_ptr + s)
    c1 = tl.load(cu_ptr + s + 1)
    shift = 0
    if HAS_POS:
        shift = tl.load(pos_ptr + s) % BLOCK_C
    base = c0 - shift  # token of row 0 of chunk 0 (rows before c0 are padding)
    n_chunks = tl.where(c1 > c0, (c1 - base + BLOCK_C - 1) // BLOCK_C, 0)
    causal = r[:, None] >= r[None, :]
    if STORE_CHUNKS:
        crow = tl.load(coff_ptr + s)
    if CAPTURE:
        cap_lo = tl.load(capcu_ptr + s)
        cap_hi = tl.load(capcu_ptr + s + 1)
    for ci in range(0, n_chunks):
        t = base + ci * BLOCK_C + r
        tm = (t >= c0) & (t < c1)
        xm = tm[:, None] & pm[None, :]
        X = tl.load(x_ptr + t[:, None] * x_st + h * x_sh + p[None, :], mask=xm,
                    other=0.0).to(tl.float32)
        dt = tl.load(dt_ptr + t * dt_st + h, mask=tm, other=0.0).to(tl.float32)
        bm = tm[:, None] & nm[None, :]
        bc_off = t[:, None] * bc_st + grp * bc_sg + n[None, :]
        Bc = tl.load(b_ptr + bc_off, mask=bm, other=0.0).to(tl.float32)
        Cc = tl.load(c_ptr + bc_off, mask=bm, other=0.0).to(tl.float32)
        a = dt * A
        Acum = tl.cumsum(a, 0)
        L = tl.where(causal, tl.exp(tl.where(causal, Acum[:, None] - Acum[None, :], 0.0)), 0.0)
        CB = tl.dot(Cc, tl.trans(Bc), input_precision=PREC) * L
        Xdt = X * dt[:, None]
        Y = tl.dot(CB, Xdt, input_precision=PREC) \
            + tl.exp(Acum)[:, None] * tl.dot(Cc, tl.trans(S), input_precision=PREC)
        if HAS_D:
            Y = Y + Dh * X
        tl.store(y_ptr + t[:, None] * y_st + h * y_sh + p[None, :],
                 Y.to(y_ptr.dtype.element_ty), mask=xm)
        if STORE_INTER:
            Si = S
            for m in range(0, BLOCK_C):
                tt = base + ci * BLOCK_C + m
                xdt_m = tile_row(Xdt, r, m)
                b_m = tile_row(Bc, r, m)
                a_m = tl.sum(tl.where(r == m, a, 0.0), 0)
                Si = Si * tl.exp(a_m) + xdt_m[:, None] * b_m[None, :]
                ok = (tt >= c0) & (tt < c1)
                tl.store(inter_ptr + (tt * H + h) * P * N + p[:, None] * N + n[None, :], Si,
                         mask=gate(m2, ok))
        if CAPTURE:
            # The state after row ``row`` of this chunk: h_end's formula cut there (rows l <= row).
            for mi in range(cap_lo, cap_hi):
                row = tl.load(cap_ptr + mi) - (base + ci * BLOCK_C)
                if (row >= 0) & (row < BLOCK_C):
                    upto = r <= row
                    a_m = tl.sum(tl.where(r == row, Acum, 0.0), 0)
                    Xm = Xdt * tl.where(upto, tl.exp(tl.where(upto, a_m - Acum, 0.0)),
                                        0.0)[:, None]
                    Sm = S * tl.exp(a_m) + tl.dot(tl.trans(Xm), Bc, input_precision=PREC)
                    store_state(cb_ptr, cpages_ptr, mi, cpps, cpe, coffs, e, m2, live, Sm)
        a_end = tl.sum(a, 0)
        Xd = Xdt * tl.exp(a_end - Acum)[:, None]
        S = S * tl.exp(a_end) + tl.dot(tl.trans(Xd), Bc, input_precision=PREC)
        if STORE_CHUNKS:
            tl.store(cst_ptr + ((crow + ci) * H + h) * P * N + p[:, None] * N + n[None, :], S,
                     mask=m2)
    store_state(st_ptr, pages_ptr, s, pps, pe, off, e, m2, live, S)


def ssd_chunked_paged(x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor,
                      C: torch.Tensor, D: torch.Tensor | None, state: PagedState,
                      cu_seqlens: torch.Tensor, has_initial_state: torch.Tensor | None,
                      out: torch.Tensor, *, chunk_size: int = 64,
                      start_pos: torch.Tensor | None = None,
                      intermediate: torch.Tensor | None = None,
                      chunk_states: torch.Tensor | None = None,
                      chunk_offsets: torch.Tensor | None = None,
                      captures: Captures | None = None) -> None:
    """The scan over a varlen batch in chunks, states (H, P, N) updated in place.

    Layouts as :func:`pagefold.ops.ssd.triton.ssd_paged` (x (T, H, P); B/C (T, G, N) with
    one stride layout; dt (T, H) discretised; A, D (H,)). ``chunk_size`` becomes
    ``block_chunk(chunk_size)`` (a power of two in [16, 64]); ``chunk_states`` needs
    ``chunk_offsets`` (``chunk_layout``); ``captures`` as in ``gdn_chunked_paged``."""
    t, h, p = x.shape
    g, nst = B.shape[1], B.shape[2]
    ns = cu_seqlens.shape[0] - 1
    if ns == 0:
        return
    if h % g:
        raise ValueError(f"num heads {h} must be divisible by num groups {g}")
    assert B.stride() == C.stride() and B.stride(2) == 1 and x.stride(2) == 1
    dt = dt.float().contiguous()
    cu, init = seq_args(cu_seqlens, has_initial_state, x.device)
    pos, coff = chunk_args(cu, start_pos, chunk_offsets, chunk_states, x.device)
    block_p = pow2(p, 16) if INTERPRET else min(pow2(p, 16), 32)
    ssd_chunk_kernel[(ns, h, triton.cdiv(p, block_p))](
        x, x.stride(0), x.stride(1), dt, dt.stride(0), A.float().contiguous(), B, C,
        B.stride(0), B.stride(1), D.contiguous() if D is not None else dt, cu, pos, init,
        state.base, state.pages, state.pages.shape[1], state.page_elems, state.offset, out,
        out.stride(0), out.stride(1), intermediate if intermediate is not None else dt,
        chunk_states if chunk_states is not None else dt, coff, *Captures.args(captures, cu),
        h, h // g, p, nst, HAS_D=D is not None, HAS_INIT=has_initial_state is not None,
        HAS_POS=start_pos is not None, STORE_INTER=intermediate is not None,
        STORE_CHUNKS=chunk_states is not None, CAPTURE=captures is not None,
        PREC=chunk_prec(x.dtype),
        BLOCK_C=block_chunk(chunk_size), BLOCK_P=block_p, BLOCK_N=pow2(nst, 16),
        num_warps=4 if INTERPRET else 8)


def ssd_chunked_triton(x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor,
                       C: torch.Tensor, D: torch.Tensor | None, initial_state: torch.Tensor,
                       cu_seqlens: torch.Tensor, *, dt_bias: torch.Tensor | None,
                       dt_softplus: bool = True, dt_min: float = 0.0, dt_max: float = math.inf,
                       chunk_size: int = 64, start_pos: torch.Tensor | None = None,
                       intermediate: torch.Tensor | None = None,
                       chunk_states: torch.Tensor | None = None,
                       capture: tuple[torch.Tensor, torch.Tensor] | None = None
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """The signature of :func:`pagefold.ops.ssd.reference.ssd_naive`: ``(y (T, H, P) in x's
    dtype, final_state (S, H, P, N) float32)``; ``initial_state`` is not modified. Captures
    as the module docstring."""
    coff = dense_chunk_offsets(cu_seqlens, chunk_size, start_pos, chunk_states)
    seq_bounds(cu_seqlens, check_inputs(x, dt, A, B, C, D, initial_state, cu_seqlens)[0])
    dtf = discretize_dt(dt, dt_bias, dt_softplus, dt_min, dt_max)
    final = initial_state.float().contiguous().clone()
    y = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    ssd_chunked_paged(x.contiguous(), dtf, A, B.contiguous(), C.contiguous(), D,
                      PagedState.dense(final), cu_seqlens, None, y, chunk_size=chunk_size,
                      start_pos=start_pos, intermediate=intermediate,
                      chunk_states=chunk_states, chunk_offsets=coff,
                      captures=Captures.dense(cu_seqlens, capture, final))
    return y, final
