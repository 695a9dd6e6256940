"""Mamba-2 SSD scan in Triton with the SSM state in its pages.

One program per (sequence, head, tile of ``BLOCK_P`` head channels) keeps ``h[tile, :]``
(BLOCK_P x N, float32) in registers and walks the sequence's tokens, the definition of
:mod:`pagefold.ops.ssd.reference`::

    h <- exp(dt A) h + dt x B^T;   y = h C + D x

(``dt`` already discretised). B and C of group ``head // (H/G)`` are loaded per token; the
state is read from its pages once (zeros for a fresh sequence) and written back once. Decode
batches take this kernel; :func:`mamba_scan_layer` sends batches with a prefill chunk to the
chunked kernel of :mod:`pagefold.ops.ssd.triton_chunked`.
``intermediate`` (optional, (T, H, P, N) float32) receives the state after every token.

:func:`ssd_triton` has the signature of ``ssd_naive``; :func:`mamba_scan_layer` runs a Mamba-2
mixer's conv and scan over its pages.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from pagefold.ops.common.triton import (
    INTERPRET,
    PagedState,
    load_state,
    pow2,
    prefill_chunk_size,
    seq_args,
    store_state,
)
from pagefold.ops.conv1d.triton import (
    capture_conv_and_plan,
    conv_paged,
    verify_conv,
    verify_initial,
)
from pagefold.ops.ssd import triton_chunked
from pagefold.ops.ssd.reference import check_inputs, discretize_dt, seq_bounds


@triton.jit
def ssd_kernel(x_ptr, x_st, x_sh, dt_ptr, dt_st, a_ptr, b_ptr, c_ptr, bc_st, bc_sg, d_ptr,
                cu_ptr, init_ptr, st_ptr, pages_ptr, pps, pe, off, y_ptr, y_st, y_sh,
                inter_ptr, H, HG, P, N,
                HAS_D: tl.constexpr, HAS_INIT: tl.constexpr, STORE_INTER: tl.constexpr,
                STORE_FINAL: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr):
    s = tl.program_id(0)
    h = tl.program_id(1)
    pt = tl.program_id(2)
    grp = h // HG
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
    for t in range(c0, c1):  # int64 bounds (cu is int64): 64-bit token offsets
        x = tl.load(x_ptr + t * x_st + h * x_sh + p, mask=pm, other=0.0).to(tl.float32)
        dt = tl.load(dt_ptr + t * dt_st + h).to(tl.float32)
        B = tl.load(b_ptr + t * bc_st + grp * bc_sg + n, mask=nm, other=0.0).to(tl.float32)
        C = tl.load(c_ptr + t * bc_st + grp * bc_sg + n, mask=nm, other=0.0).to(tl.float32)
        S = S * tl.exp(dt * A) + (dt * x)[:, None] * B[None, :]
        y = tl.sum(S * C[None, :], 1)
        if HAS_D:
            y = y + Dh * x
        tl.store(y_ptr + t * y_st + h * y_sh + p, y.to(y_ptr.dtype.element_ty), mask=pm)
        if STORE_INTER:
            tl.store(inter_ptr + (t * H + h) * P * N + p[:, None] * N + n[None, :], S, mask=m2)
    if STORE_FINAL:
        store_state(st_ptr, pages_ptr, s, pps, pe, off, e, m2, live, S)


def ssd_paged(x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor,
              C: torch.Tensor, D: torch.Tensor | None, state: PagedState,
              cu_seqlens: torch.Tensor, has_initial_state: torch.Tensor | None,
              out: torch.Tensor, intermediate: torch.Tensor | None = None,
              store_final: bool = True) -> None:
    """The scan over a varlen batch, states (H, P, N) in ``state`` updated in place (read
    only with ``store_final=False``: a verify pass keeps ``intermediate`` instead).

    x (T, H, P), B/C (T, G, N) with one shared stride layout, contiguous last dims (any token
    and head strides); dt (T, H) discretised; A, D (H,); ``out`` (T, H, P) receives y."""
    t, h, p = x.shape
    g, nst = B.shape[1], B.shape[2]
    ns = cu_seqlens.shape[0] - 1
    if ns == 0:
        return
    assert B.stride() == C.stride() and B.stride(2) == 1 and x.stride(2) == 1
    dt = dt.float().contiguous()
    cu, init = seq_args(cu_seqlens, has_initial_state, x.device)
    block_p = pow2(p) if INTERPRET else min(pow2(p), 32)  # interpreter: fewer programs
    ssd_kernel[(ns, h, triton.cdiv(p, block_p))](
        x, x.stride(0), x.stride(1), dt, dt.stride(0), A.float().contiguous(), B, C,
        B.stride(0), B.stride(1), D.contiguous() if D is not None else dt, cu, init,
        state.base, state.pages, state.pages.shape[1], state.page_elems, state.offset, out,
        out.stride(0), out.stride(1), intermediate if intermediate is not None else dt, h,
        h // g, p, nst, HAS_D=D is not None, HAS_INIT=has_initial_state is not None,
        STORE_INTER=intermediate is not None, STORE_FINAL=bool(store_final), BLOCK_P=block_p,
        BLOCK_N=pow2(nst))


def ssd_triton(x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor,
               C: torch.Tensor, D: torch.Tensor | None, initial_state: torch.Tensor,
               cu_seqlens: torch.Tensor, *, dt_bias: torch.Tensor | None,
               dt_softplus: bool = True, dt_min: float = 0.0, dt_max: float = math.inf,
               chunk_size: int = 64, intermediate: torch.Tensor | None = None
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """The signature of :func:`pagefold.ops.ssd.reference.ssd_naive` (``chunk_size``
    ignored): ``(y (T, H, P) in x's dtype, final_state (S, H, P, N) float32)``;
    ``initial_state`` is not modified."""
    del chunk_size
    seq_bounds(cu_seqlens, check_inputs(x, dt, A, B, C, D, initial_state, cu_seqlens)[0])
    dtf = discretize_dt(dt, dt_bias, dt_softplus, dt_min, dt_max)
    final = initial_state.float().contiguous().clone()
    y = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    ssd_paged(x.contiguous(), dtf, A, B.contiguous(), C.contiguous(), D,
              PagedState.dense(final), cu_seqlens, None, y, intermediate)
    return y, final


def _split(y: torch.Tensor, num_heads: int, head_dim: int, n_groups: int, state_size: int
           ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x (T, H, P), B, C (T, G, N): views of the conv output ``[x | B | C]``."""
    t, inter, gn = y.shape[0], num_heads * head_dim, n_groups * state_size
    return (y[:, :inter].view(t, num_heads, head_dim),
            y[:, inter : inter + gn].view(t, n_groups, state_size),
            y[:, inter + gn : inter + 2 * gn].view(t, n_groups, state_size))


def mamba_scan_layer(view, page_ids: torch.Tensor, has_initial_state: torch.Tensor,
                     cu_seqlens: torch.Tensor, xbc: torch.Tensor, conv_weight: torch.Tensor,
                     conv_bias: torch.Tensor | None, dt: torch.Tensor, A: torch.Tensor,
                     D: torch.Tensor | None, *, num_heads: int, head_dim: int, n_groups: int,
                     state_size: int, y_dtype: torch.dtype,
                     capture: tuple[torch.Tensor, torch.Tensor] | None = None
                     ) -> torch.Tensor | None:
    """A Mamba-2 mixer's conv (SiLU) and SSD scan over its pages: ``xbc`` (T, conv_dim) is
    ``[x | B | C]`` before the conv, ``dt`` (T, H) discretised. Returns y (T, H, P) in
    ``y_dtype`` (states stored in place), or None when the pool cannot be addressed.
    ``capture=(after, pages)``: checkpoints inside the step, as ``gdn_layer``'s."""
    conv = PagedState.from_view(view, "conv", page_ids)
    ssm = PagedState.from_view(view, "ssm", page_ids)
    if conv is None or ssm is None or view.spec.component("conv").dtype != xbc.dtype:
        return None
    t = xbc.shape[0]
    caps = None
    if capture is not None:
        caps = capture_conv_and_plan(view, xbc, conv, cu_seqlens, has_initial_state, capture,
                                     conv_weight.shape[1])
        if caps is None:
            return None
    y = conv_paged(xbc, conv_weight, conv_bias, conv, cu_seqlens, has_initial_state, "silu")
    xs, B, C = _split(y, num_heads, head_dim, n_groups, state_size)
    out = torch.empty((t, num_heads, head_dim), dtype=y_dtype, device=xbc.device)
    n = cu_seqlens.shape[0] - 1
    if t > n or caps is not None:  # a prefill chunk in the batch: the chunked form
        triton_chunked.ssd_chunked_paged(xs, dt, A, B, C, D, ssm, cu_seqlens,
                                         has_initial_state, out,
                                         chunk_size=prefill_chunk_size(t, n), captures=caps)
    else:  # decode: one token per sequence, the token loop
        ssd_paged(xs, dt, A, B, C, D, ssm, cu_seqlens, has_initial_state, out)
    return out


def mamba_verify_layer(view, page_ids: torch.Tensor, has_initial_state: torch.Tensor,
                       cu_seqlens: torch.Tensor, xbc: torch.Tensor, conv_weight: torch.Tensor,
                       conv_bias: torch.Tensor | None, dt: torch.Tensor, A: torch.Tensor,
                       D: torch.Tensor | None, *, num_heads: int, head_dim: int, n_groups: int,
                       state_size: int, initial: dict[str, torch.Tensor] | None = None
                       ) -> tuple[torch.Tensor, dict[str, torch.Tensor]] | None:
    """A Mamba-2 mixer's verify pass: ``(y (T, H, P) in xbc's dtype, {"conv": (T, C, K-1),
    "ssm": (T, H, P, N) float32})``; ``dt`` (T, H) discretised. Pages only read; None when
    the pool cannot be addressed."""
    conv, ssm = verify_initial(view, page_ids, initial)
    if conv is None or ssm is None or (initial is None and
                                       view.spec.component("conv").dtype != xbc.dtype):
        return None
    t = xbc.shape[0]
    y, windows = verify_conv(xbc, conv_weight, conv_bias, conv, cu_seqlens, has_initial_state)
    xs, B, C = _split(y, num_heads, head_dim, n_groups, state_size)
    out = torch.empty((t, num_heads, head_dim), dtype=xbc.dtype, device=xbc.device)
    states = torch.empty((t, num_heads, head_dim, state_size), dtype=torch.float32,
                         device=xbc.device)
    ssd_paged(xs, dt, A, B, C, D, ssm, cu_seqlens, has_initial_state, out, states,
              store_final=False)
    return out, {"conv": windows, "ssm": states}
