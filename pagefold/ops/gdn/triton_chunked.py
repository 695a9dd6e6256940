"""Chunked (WY-form) Gated DeltaNet prefill in Triton, the recurrent state in its pages.

One program per (sequence, value head, tile of ``BLOCK_V`` value channels) carries its slice
``S[:, tile]`` (Dk x BLOCK_V, float32) across the sequence's chunks of ``BLOCK_C`` tokens. In a
chunk with entry state ``S0``, cumulative log-decay ``G_i = g_1 + .. + g_i`` and
``D_ij = exp(G_i - G_j)`` (``j <= i``), the recurrence of
:mod:`pagefold.ops.gdn.reference` unrolls to (the algebra of ``gdn_chunked``)::

    A     = strict_lower(diag(beta) K K^T * D)            X = (I + A)^-1 (unit lower)
    U     = X diag(beta) V                                W = X diag(beta exp(G)) K
    Delta = U - W S0                                      (the per-token corrections d_t)
    O     = diag(exp(G)) Q S0 + ((Q K^T) * D) Delta       (causal, diagonal included)
    S_end = exp(G_C) S0 + (K * exp(G_C - G))^T Delta

Every product above is a ``tl.dot`` over the chunk (tensor cores on a GPU); ``X`` comes from
a forward substitution within 16-row blocks joined by products (:func:`_inv_unit_lower`);
chunks are at most 64 tokens (the join covers 4 blocks). Padded rows (past the sequence, or
before it when the chunk grid is shifted, see ``start_pos``) load ``k = v = q = 0`` and
``beta = g = 0``: they neither write nor decay, so padding never changes a state or an
output. No ``exp`` of a positive number is taken (``D`` is masked before ``exp``, ``G`` is
non-increasing), so long chunks cannot overflow.

Captures, for prefix-cache checkpoints and speculative verification:

* ``chunk_states`` (M, H, Dk, Dv) float32: row ``chunk_offsets[s] + c`` receives the state
  after chunk ``c`` of sequence ``s`` (free: it is the carried state). With ``start_pos``
  (each sequence's absolute position of its first token) the grid is aligned to absolute
  positions: chunk boundaries fall on multiples of ``chunk_size`` (the first chunk is
  shortened), i.e. on page boundaries whenever ``chunk_size`` is a multiple of the page size.
  :func:`~pagefold.ops.common.triton.chunk_layout` gives the offsets and ``M``.
* ``intermediate`` (T, H, Dk, Dv) float32: the state after every token, replayed from
  ``Delta`` as rank-1 updates within each chunk (``S_t = exp(g_t) S_{t-1} + k_t d_t^T``).
* ``captures`` (:class:`~pagefold.ops.common.triton.Captures`): the state right after
  given tokens, written to their rows of a target (a checkpoint's pages): for a capture at
  row ``m`` of a chunk, ``S_m = exp(G_m) S0 + (K * exp(G_m - G) [j <= m])^T Delta``, the
  exit-state formula cut at ``m`` (one more ``tl.dot``; the carried state is untouched).

:func:`gdn_chunked_triton` has the signature of ``gdn_naive`` (plus the captures);
:func:`gdn_chunked_paged` is the in-place form over a :class:`PagedState`, GQA included
(value head ``h`` reads key head ``h // (H / Hk)``).
"""

from __future__ import annotations

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
from pagefold.ops.gdn.reference import prepare


@triton.jit
def _inv_unit_lower(A, r, eye, PREC: tl.constexpr, BLOCK_C: tl.constexpr, SUB: tl.constexpr):
    """``(I + A)^-1`` for a strictly lower triangular (BLOCK_C, BLOCK_C) ``A``.

    Diagonal SUB x SUB blocks by forward substitution, all blocks at once (step ``m`` sets row
    ``m`` of every block from the rows above it: ``X_i = e_i - A_i X``), then the blocks are
    joined: with ``A = Ad + Ao`` (block diagonal + strictly block lower) and ``Xd = (I +
    Ad)^-1``, ``(I + A)^-1 = (I + N)^-1 Xd`` for ``N = Xd Ao``, which is nilpotent (``N^b = 0``
    for ``b`` blocks): ``(I + N)^-1 = (I - N)(I + N^2)`` for up to 4 blocks. SUB - 1 serial
    steps instead of BLOCK_C - 1, every step and join a ``tl.dot``."""
    inblk = (r // SUB)[:, None] == (r // SUB)[None, :]
    Ad = tl.where(inblk, A, 0.0)
    X = eye
    for m in range(1, SUB):
        sel = (r % SUB) == m
        X = X - tl.dot(tl.where(sel[:, None], Ad, 0.0), X, input_precision=PREC)
    if BLOCK_C > SUB:
        N = tl.dot(X, A - Ad, input_precision=PREC)
        X = X - tl.dot(N, X, input_precision=PREC)
        if BLOCK_C > 2 * SUB:
            N2 = tl.dot(N, N, input_precision=PREC)
            X = X + tl.dot(N2, X, input_precision=PREC)
    return X


@triton.jit
def gdn_chunk_kernel(q_ptr, k_ptr, qk_st, qk_sh, v_ptr, v_st, v_sh, g_ptr, beta_ptr, gb_st,
                      cu_ptr, pos_ptr, init_ptr, st_ptr, pages_ptr, pps, pe, off,
                      o_ptr, o_st, o_sh, inter_ptr, cst_ptr, coff_ptr, cap_ptr, capcu_ptr,
                      cb_ptr, cpages_ptr, cpps, cpe, coffs, scale, H, REP, DK, DV,
                      HAS_INIT: tl.constexpr, HAS_POS: tl.constexpr, L2NORM: tl.constexpr,
                      STORE_INTER: tl.constexpr, STORE_CHUNKS: tl.constexpr,
                      CAPTURE: tl.constexpr,
                      PREC: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_K: tl.constexpr,
                      BLOCK_V: tl.constexpr):
    s = tl.program_id(0)
    h = tl.program_id(1)
    vt = tl.program_id(2)
    hk = h // REP
    r = tl.arange(0, BLOCK_C)
    i = tl.arange(0, BLOCK_K)
    j = vt * BLOCK_V + tl.arange(0, BLOCK_V)
    im = i < DK
    jm = j < DV
    m2 = im[:, None] & jm[None, :]
    e = (h * DK + i[:, None]) * DV + j[None, :]
    S, live = load_state(st_ptr, pages_ptr, init_ptr, s, pps, pe, off, e, m2, HAS_INIT)
    c0 = tl.load(cu_ptr + s)
    c1 = tl.load(cu_ptr + s + 1)
    shift = 0
    if HAS_POS:
        shift = tl.load(pos_ptr + s) % BLOCK_C
    base = c0 - shift  # token of row 0 of chunk 0 (rows before c0 are padding)
    n_chunks = tl.where(c1 > c0, (c1 - base + BLOCK_C - 1) // BLOCK_C, 0)
    causal = r[:, None] >= r[None, :]
    strict = r[:, None] > r[None, :]
    eye = (r[:, None] == r[None, :]).to(tl.float32)
    if STORE_CHUNKS:
        crow = tl.load(coff_ptr + s)
    if CAPTURE:
        cap_lo = tl.load(capcu_ptr + s)
        cap_hi = tl.load(capcu_ptr + s + 1)
    for ci in range(0, n_chunks):
        t = base + ci * BLOCK_C + r
        tm = (t >= c0) & (t < c1)
        qk_off = t[:, None] * qk_st + hk * qk_sh + i[None, :]
        km = tm[:, None] & im[None, :]
        Q = tl.load(q_ptr + qk_off, mask=km, other=0.0).to(tl.float32)
        K = tl.load(k_ptr + qk_off, mask=km, other=0.0).to(tl.float32)
        vm = tm[:, None] & jm[None, :]
        V = tl.load(v_ptr + t[:, None] * v_st + h * v_sh + j[None, :], mask=vm,
                    other=0.0).to(tl.float32)
        if L2NORM:
            Q = Q * tl.rsqrt(tl.sum(Q * Q, 1) + 1e-6)[:, None]
            K = K * tl.rsqrt(tl.sum(K * K, 1) + 1e-6)[:, None]
        Q = Q * scale
        gc = tl.load(g_ptr + t * gb_st + h, mask=tm, other=0.0).to(tl.float32)
        bc = tl.load(beta_ptr + t * gb_st + h, mask=tm, other=0.0).to(tl.float32)
        G = tl.cumsum(gc, 0)
        Dm = tl.where(causal, tl.exp(tl.where(causal, G[:, None] - G[None, :], 0.0)), 0.0)
        KK = tl.dot(K, tl.trans(K), input_precision=PREC)
        A = tl.where(strict, KK * Dm * bc[:, None], 0.0)
        X = _inv_unit_lower(A, r, eye, PREC, BLOCK_C, 16)
        eG = tl.exp(G)
        U = tl.dot(X, V * bc[:, None], input_precision=PREC)
        W = tl.dot(X, K * (bc * eG)[:, None], input_precision=PREC)
        Delta = U - tl.dot(W, S, input_precision=PREC)
        QK = tl.where(causal, tl.dot(Q, tl.trans(K), input_precision=PREC) * Dm, 0.0)
        Oc = tl.dot(Q * eG[:, None], S, input_precision=PREC) \
            + tl.dot(QK, Delta, input_precision=PREC)
        tl.store(o_ptr + t[:, None] * o_st + h * o_sh + j[None, :],
                 Oc.to(o_ptr.dtype.element_ty), mask=vm)
        if STORE_INTER:
            Si = S
            for m in range(0, BLOCK_C):
                tt = base + ci * BLOCK_C + m
                k_m = tile_row(K, r, m)
                d_m = tile_row(Delta, r, m)
                g_m = tl.sum(tl.where(r == m, gc, 0.0), 0)
                Si = Si * tl.exp(g_m) + k_m[:, None] * d_m[None, :]
                ok = (tt >= c0) & (tt < c1)
                tl.store(inter_ptr + (tt * H + h) * DK * DV + i[:, None] * DV + j[None, :], Si,
                         mask=gate(m2, ok))
        if CAPTURE:
            # The state after row ``row`` of this chunk: S_end's formula cut there (rows j <= row),
            # one more product per capture; the carried state is not touched.
            for mi in range(cap_lo, cap_hi):
                row = tl.load(cap_ptr + mi) - (base + ci * BLOCK_C)
                if (row >= 0) & (row < BLOCK_C):
                    upto = r <= row
                    g_m = tl.sum(tl.where(r == row, G, 0.0), 0)
                    Km = K * tl.where(upto, tl.exp(tl.where(upto, g_m - G, 0.0)), 0.0)[:, None]
                    Sm = S * tl.exp(g_m) + tl.dot(tl.trans(Km), Delta, input_precision=PREC)
                    store_state(cb_ptr, cpages_ptr, mi, cpps, cpe, coffs, e, m2, live, Sm)
        g_end = tl.sum(gc, 0)
        Kd = K * tl.exp(g_end - G)[:, None]
        S = S * tl.exp(g_end) + tl.dot(tl.trans(Kd), Delta, input_precision=PREC)
        if STORE_CHUNKS:
            tl.store(cst_ptr + ((crow + ci) * H + h) * DK * DV + i[:, None] * DV + j[None, :],
                     S, mask=m2)
    store_state(st_ptr, pages_ptr, s, pps, pe, off, e, m2, live, S)


def gdn_chunked_paged(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                      beta: torch.Tensor, state: PagedState, cu_seqlens: torch.Tensor,
                      has_initial_state: torch.Tensor | None, out: torch.Tensor, *,
                      scale: float, use_qk_l2norm: bool = True, chunk_size: int = 64,
                      start_pos: torch.Tensor | None = None,
                      intermediate: torch.Tensor | None = None,
                      chunk_states: torch.Tensor | None = None,
                      chunk_offsets: torch.Tensor | None = None,
                      captures: Captures | None = None) -> None:
    """The delta rule over a varlen batch in chunks, states (H, Dk, Dv) updated in place.

    Layouts as :func:`pagefold.ops.gdn.triton.gdn_paged` (q, k (T, Hk, Dk); v (T, H, Dv);
    g, beta (T, H); any token/head strides, contiguous channels). ``chunk_size`` is rounded
    up to a power of two in [16, 64] (:func:`block_chunk`: ``tl.dot``'s smallest tile; the
    inverse's join). ``chunk_states`` needs ``chunk_offsets`` from
    :func:`~pagefold.ops.common.triton.chunk_layout` with that chunk length and the same
    ``start_pos``. ``captures``: the state right after each
    capture token is written to its row of ``captures.target`` (in the target's dtype)."""
    t, hk, dk = q.shape
    h, dv = v.shape[1], v.shape[2]
    n = cu_seqlens.shape[0] - 1
    if n == 0:
        return
    if h % hk:
        raise ValueError(f"value heads {h} must be a multiple of key heads {hk}")
    assert k.stride() == q.stride() and q.stride(2) == 1 and v.stride(2) == 1
    block_c = block_chunk(chunk_size)
    g = g.float().contiguous()
    beta = beta.float().contiguous()
    cu, init = seq_args(cu_seqlens, has_initial_state, q.device)
    pos, coff = chunk_args(cu, start_pos, chunk_offsets, chunk_states, q.device)
    block_v = pow2(dv, 16) if INTERPRET else min(pow2(dv, 16), 32)
    gdn_chunk_kernel[(n, h, triton.cdiv(dv, block_v))](
        q, k, q.stride(0), q.stride(1), v, v.stride(0), v.stride(1), g, beta, g.stride(0), cu,
        pos, init, state.base, state.pages, state.pages.shape[1], state.page_elems,
        state.offset, out, out.stride(0), out.stride(1),
        intermediate if intermediate is not None else g,
        chunk_states if chunk_states is not None else g, coff, *Captures.args(captures, cu),
        float(scale), h, h // hk, dk, dv, HAS_INIT=has_initial_state is not None,
        HAS_POS=start_pos is not None, L2NORM=bool(use_qk_l2norm),
        STORE_INTER=intermediate is not None, STORE_CHUNKS=chunk_states is not None,
        CAPTURE=captures is not None, PREC=chunk_prec(v.dtype), BLOCK_C=block_c,
        BLOCK_K=pow2(dk, 16), BLOCK_V=block_v, num_warps=4 if INTERPRET else 8)


def gdn_chunked_triton(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                       beta: torch.Tensor, initial_state: torch.Tensor,
                       cu_seqlens: torch.Tensor, *, scale: float | None = None,
                       use_qk_l2norm: bool = True, chunk_size: int = 64,
                       start_pos: torch.Tensor | None = None,
                       intermediate: torch.Tensor | None = None,
                       chunk_states: torch.Tensor | None = None,
                       capture: tuple[torch.Tensor, torch.Tensor] | None = None
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """The signature of :func:`pagefold.ops.gdn.reference.gdn_naive`:
    ``(o (T, H, Dv) in v's dtype, final_state (N, H, Dk, Dv) float32)``; ``initial_state``
    is not modified. Captures as the module docstring (``chunk_states`` rows as
    :func:`~pagefold.ops.common.triton.chunk_layout` with :func:`block_chunk` of ``chunk_size``)."""
    coff = dense_chunk_offsets(cu_seqlens, chunk_size, start_pos, chunk_states)
    prepare(q[:0], k[:0], v[:0], g[:0], beta[:0], initial_state, cu_seqlens, scale, False)
    if q.shape[0] != v.shape[0] or g.shape != v.shape[:2] or beta.shape != v.shape[:2]:
        raise ValueError("q, k, v, g, beta must share the token and head dimensions")
    final = initial_state.float().contiguous().clone()
    out = torch.empty(v.shape, dtype=v.dtype, device=v.device)
    gdn_chunked_paged(q.contiguous(), k.contiguous(), v.contiguous(), g, beta,
                      PagedState.dense(final), cu_seqlens, None, out,
                      scale=q.shape[2] ** -0.5 if scale is None else scale,
                      use_qk_l2norm=use_qk_l2norm, chunk_size=chunk_size,
                      start_pos=start_pos, intermediate=intermediate,
                      chunk_states=chunk_states, chunk_offsets=coff,
                      captures=Captures.dense(cu_seqlens, capture, final))
    return out, final
