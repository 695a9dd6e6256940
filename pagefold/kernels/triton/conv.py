"""Causal depthwise conv1d in Triton with the conv window (state) read from and written to
its pages.

Math and layouts as :mod:`pagefold.layers.causal_conv1d`: for token ``t`` of sequence ``s``
(starting at ``c0 = cu[s]``), ``y[t] = act(bias + sum_j w[:, j] * x_ext[t - (K-1) + j])``,
where positions before ``c0`` come from the state ``(C, K-1)`` (oldest first, zeros for a
fresh sequence). Every output depends on inputs only, so one program per (token, channel
block) computes them all in parallel; a second launch then writes each sequence's new state
(the last ``K-1`` inputs of ``[state | tokens]``), after every read of the old one.

:func:`causal_conv1d_triton` has the signature of ``causal_conv1d_naive`` (dense state, not
modified); :func:`conv_paged` is the in-place form the layers use.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagefold.kernels.triton.common import (
    INTERPRET,
    PagedState,
    gate,
    has_pages,
    pow2,
    state_addr,
)


@triton.jit
def _conv_kernel(x_ptr, x_st, w_ptr, b_ptr, seg_ptr, cu_ptr, init_ptr, st_ptr, pages_ptr,
                 pps, pe, off, y_ptr, y_st, C, K,
                 HAS_BIAS: tl.constexpr, SILU: tl.constexpr, HAS_INIT: tl.constexpr,
                 BLOCK_C: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    cm = c < C
    s = tl.load(seg_ptr + t)
    c0 = tl.load(cu_ptr + s)
    use_state = has_pages(pages_ptr, s, pps)
    if HAS_INIT:
        use_state = use_state & (tl.load(init_ptr + s) != 0)
    acc = tl.zeros((BLOCK_C,), tl.float32)
    for j in range(0, K):
        p = t - (K - 1) + j  # flat input position; before c0 it is state column p - c0 + K - 1
        w = tl.load(w_ptr + c * K + j, mask=cm, other=0.0).to(tl.float32)
        if p >= c0:
            xv = tl.load(x_ptr + p * x_st + c, mask=cm, other=0.0).to(tl.float32)
        else:
            col = p - c0 + (K - 1)
            e = c * (K - 1) + col
            sm = gate(cm, use_state)
            addr = state_addr(pages_ptr, s, pps, pe, off, e, sm)
            xv = tl.load(st_ptr + addr, mask=sm, other=0.0).to(tl.float32)
        acc += w * xv
    if HAS_BIAS:
        acc += tl.load(b_ptr + c, mask=cm, other=0.0).to(tl.float32)
    if SILU:
        acc = acc / (1.0 + tl.exp(-acc))
    tl.store(y_ptr + t * y_st + c, acc.to(y_ptr.dtype.element_ty), mask=cm)


@triton.jit
def _conv_state_kernel(x_ptr, x_st, cu_ptr, init_ptr, st_ptr, pages_ptr, pps, pe, off, C, K,
                       HAS_INIT: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_K: tl.constexpr):
    s = tl.program_id(0)
    c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    i = tl.arange(0, BLOCK_K)
    c0 = tl.load(cu_ptr + s)
    n = tl.load(cu_ptr + s + 1) - c0
    live = has_pages(pages_ptr, s, pps)
    use_state = live
    if HAS_INIT:
        use_state = use_state & (tl.load(init_ptr + s) != 0)
    m = gate((c[:, None] < C) & (i[None, :] < K - 1), live)
    # New column i is extended position n + i of [old state (K-1) | n tokens].
    ep = n + i[None, :]
    from_x = ep >= K - 1
    xv = tl.load(x_ptr + (c0 + ep - (K - 1)) * x_st + c[:, None], mask=m & from_x, other=0.0)
    e_old = c[:, None] * (K - 1) + ep
    om = gate(m & (~from_x), use_state)
    old = tl.load(st_ptr + state_addr(pages_ptr, s, pps, pe, off, e_old, om), mask=om,
                  other=0.0)
    new = tl.where(from_x, xv.to(st_ptr.dtype.element_ty), old)
    e_new = c[:, None] * (K - 1) + i[None, :]
    tl.store(st_ptr + state_addr(pages_ptr, s, pps, pe, off, e_new, m), new, mask=m)


def conv_paged(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
               state: PagedState, cu_seqlens: torch.Tensor,
               has_initial_state: torch.Tensor | None, activation: str | None = "silu",
               store_state: bool = True) -> torch.Tensor:
    """``y`` (T, C) in x's dtype; each sequence's conv state (C, K-1) in ``state`` is read
    (zeros where ``has_initial_state`` is False) and replaced by the new one, in place
    (unless ``store_state`` is False: a verify pass only reads it)."""
    t, c = x.shape
    k = weight.shape[1]
    if x.stride(1) != 1:
        x = x.contiguous()
    y = torch.empty((t, c), dtype=x.dtype, device=x.device)
    cu = cu_seqlens.to(x.device, torch.int64).contiguous()
    n = cu.shape[0] - 1
    init = has_initial_state.to(x.device, torch.int8).contiguous() \
        if has_initial_state is not None else cu
    block_c = pow2(c) if INTERPRET else min(pow2(c), 256)  # interpreter: fewer programs
    pps, pe, off = state.pages.shape[1], state.page_elems, state.offset
    if t:
        seg = torch.searchsorted(cu[1:], torch.arange(t, device=x.device), right=True)
        _conv_kernel[(t, triton.cdiv(c, block_c))](
            x, x.stride(0), weight.contiguous(), bias if bias is not None else weight, seg, cu,
            init, state.base, state.pages, pps, pe, off, y, y.stride(0), c, k,
            HAS_BIAS=bias is not None, SILU=activation is not None,
            HAS_INIT=has_initial_state is not None, BLOCK_C=block_c)
    if n and store_state:
        _conv_state_kernel[(n, triton.cdiv(c, block_c))](
            x, x.stride(0), cu, init, state.base, state.pages, pps, pe, off, c, k,
            HAS_INIT=has_initial_state is not None, BLOCK_C=block_c, BLOCK_K=pow2(k - 1))
    return y


def causal_conv1d_triton(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                         conv_state: torch.Tensor, cu_seqlens: torch.Tensor,
                         activation: str | None = "silu") -> tuple[torch.Tensor, torch.Tensor]:
    """The signature of :func:`pagefold.layers.causal_conv1d.causal_conv1d_naive`: returns
    ``(y (T, C), new_conv_state (N, C, K-1))`` in x's dtype; ``conv_state`` is not modified."""
    from pagefold.layers.causal_conv1d import _check_args

    _check_args(x, weight, conv_state, activation)
    new = conv_state.to(x.dtype).contiguous().clone()
    y = conv_paged(x, weight, bias, PagedState.dense(new), cu_seqlens, None, activation)
    return y, new
