"""Causal depthwise conv1d in Triton with the conv window (state) read from and written to
its pages.

Math and layouts as :mod:`pagefold.ops.conv1d.reference`: for token ``t`` of sequence ``s``
(starting at ``c0 = cu[s]``), ``y[t] = act(bias + sum_j w[:, j] * x_ext[t - (K-1) + j])``,
where positions before ``c0`` come from the state ``(C, K-1)`` (oldest first, zeros for a
fresh sequence). Every output depends on inputs only, so one program per (token, channel
block) computes them all in parallel; a second launch then writes each sequence's new state
(the last ``K-1`` inputs of ``[state | tokens]``), after every read of the old one.

:func:`causal_conv1d_triton` has the signature of ``causal_conv1d_naive`` (dense state, not
modified); :func:`conv_paged` is the in-place form the state ops' Triton steps use.

The windows of the GDN / Mamba-2 special steps are here too. **Captures** (prefix-cache
checkpoints inside a prefill chunk, ``capture=(after, pages)``): :func:`capture_conv_and_plan`
writes the window after each capture token to the checkpoint pages (:func:`conv_windows`,
launched *before* the conv kernel replaces the old window: a window near a sequence's start
still reads it; exactly the bytes a step ending there leaves) and plans the recurrent
state's captures (:class:`~pagefold.ops.common.triton.Captures`) for the chunked kernels.
**Verify** (a speculative step; nothing stored): :func:`verify_conv` gives the conv outputs
and the window after every token (T, C, K-1), from the pages or from dense initial states
(:func:`verify_initial`: a drafter's chained passes).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagefold.ops.common.triton import (
    INTERPRET,
    Captures,
    PagedState,
    gate,
    has_pages,
    pow2,
    seq_args,
    state_addr,
)
from pagefold.ops.conv1d.reference import check_args


@triton.jit
def conv_kernel(x_ptr, x_st, w_ptr, b_ptr, seg_ptr, cu_ptr, init_ptr, st_ptr, pages_ptr,
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
def conv_state_kernel(x_ptr, x_st, cu_ptr, init_ptr, st_ptr, pages_ptr, pps, pe, off, C, K,
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
    cu, init = seq_args(cu_seqlens, has_initial_state, x.device)
    n = cu.shape[0] - 1
    block_c = pow2(c) if INTERPRET else min(pow2(c), 256)  # interpreter: fewer programs
    pps, pe, off = state.pages.shape[1], state.page_elems, state.offset
    if t:
        seg = torch.searchsorted(cu[1:], torch.arange(t, device=x.device), right=True)
        conv_kernel[(t, triton.cdiv(c, block_c))](
            x, x.stride(0), weight.contiguous(), bias if bias is not None else weight, seg, cu,
            init, state.base, state.pages, pps, pe, off, y, y.stride(0), c, k,
            HAS_BIAS=bias is not None, SILU=activation is not None,
            HAS_INIT=has_initial_state is not None, BLOCK_C=block_c)
    if n and store_state:
        conv_state_kernel[(n, triton.cdiv(c, block_c))](
            x, x.stride(0), cu, init, state.base, state.pages, pps, pe, off, c, k,
            HAS_INIT=has_initial_state is not None, BLOCK_C=block_c, BLOCK_K=pow2(k - 1))
    return y


def causal_conv1d_triton(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                         conv_state: torch.Tensor, cu_seqlens: torch.Tensor,
                         activation: str | None = "silu") -> tuple[torch.Tensor, torch.Tensor]:
    """The signature of :func:`pagefold.ops.conv1d.reference.causal_conv1d_naive`: returns
    ``(y (T, C), new_conv_state (N, C, K-1))`` in x's dtype; ``conv_state`` is not modified."""
    check_args(x, weight, conv_state, activation)
    new = conv_state.to(x.dtype).contiguous().clone()
    y = conv_paged(x, weight, bias, PagedState.dense(new), cu_seqlens, None, activation)
    return y, new


@triton.jit
def conv_window_kernel(x_ptr, x_st, cu_ptr, init_ptr, st_ptr, pages_ptr, pps, pe, off,
                        tok_ptr, seq_ptr, ob_ptr, opages_ptr, opps, ope, ooff, C, K,
                        HAS_INIT: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_K: tl.constexpr):
    m = tl.program_id(0)
    c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    i = tl.arange(0, BLOCK_K)
    tok = tl.load(tok_ptr + m)
    s = tl.load(seq_ptr + m)
    c0 = tl.load(cu_ptr + s)
    use_state = has_pages(pages_ptr, s, pps)
    if HAS_INIT:
        use_state = use_state & (tl.load(init_ptr + s) != 0)
    mm = (c[:, None] < C) & (i[None, :] < K - 1)
    # Column i of the window after token ``tok`` is position b + i of [old window (K-1) |
    # the sequence's tokens], b = tok - c0 + 1 the tokens it includes.
    ep = tok - c0 + 1 + i[None, :]
    from_x = ep >= K - 1
    xv = tl.load(x_ptr + (c0 + ep - (K - 1)) * x_st + c[:, None], mask=mm & from_x, other=0.0)
    om = gate(mm & (~from_x), use_state)
    old = tl.load(st_ptr + state_addr(pages_ptr, s, pps, pe, off, c[:, None] * (K - 1) + ep, om),
                  mask=om, other=0.0)
    win = tl.where(from_x, xv.to(ob_ptr.dtype.element_ty), old.to(ob_ptr.dtype.element_ty))
    e_new = c[:, None] * (K - 1) + i[None, :]
    tl.store(ob_ptr + state_addr(opages_ptr, m, opps, ope, ooff, e_new, mm), win, mask=mm)


def conv_windows(x: torch.Tensor, state: PagedState, cu_seqlens: torch.Tensor,
                 has_initial_state: torch.Tensor | None, tokens: torch.Tensor,
                 seqs: torch.Tensor, out: PagedState, kernel_size: int) -> None:
    """Row ``m`` of ``out`` receives the conv window (C, K-1) right after flat token
    ``tokens[m]`` of sequence ``seqs[m]``: the last ``K-1`` conv *inputs* ``x`` (T, C) up to
    and including it, the sequence's old window (``state``, zeros for a fresh sequence) in
    front. ``state`` is only read: run this before the conv kernel replaces it."""
    m = tokens.shape[0]
    c = x.shape[1]
    if m == 0:
        return
    if x.stride(1) != 1:
        x = x.contiguous()
    cu, init = seq_args(cu_seqlens, has_initial_state, x.device)
    block_c = pow2(c) if INTERPRET else min(pow2(c), 256)
    conv_window_kernel[(m, triton.cdiv(c, block_c))](
        x, x.stride(0), cu, init, state.base, state.pages, state.pages.shape[1],
        state.page_elems, state.offset, tokens.to(x.device, torch.int64).contiguous(),
        seqs.to(x.device, torch.int64).contiguous(), out.base, out.pages, out.pages.shape[1],
        out.page_elems, out.offset, c, kernel_size, HAS_INIT=has_initial_state is not None,
        BLOCK_C=block_c, BLOCK_K=pow2(kernel_size - 1))


def capture_conv_and_plan(view, x: torch.Tensor, conv: PagedState, cu_seqlens: torch.Tensor,
                          has_initial_state: torch.Tensor,
                          capture: tuple[torch.Tensor, torch.Tensor], kernel_size: int
                          ) -> Captures | None:
    """A capture step's first half: the conv windows after the capture tokens written to the
    checkpoint pages (before the conv kernel runs), and the plan of the recurrent state's
    captures (``ssm`` of the checkpoint pages) for the chunked kernel. None (nothing written)
    when the pool cannot be addressed."""
    after, pages = capture
    conv_t = PagedState.from_view(view, "conv", pages)
    ssm_t = PagedState.from_view(view, "ssm", pages)
    if conv_t is None or ssm_t is None:
        return None
    caps = Captures.build(cu_seqlens, after.to(x.device), ssm_t)
    # Rows of conv_t follow ``after``'s order; the plan's rows follow the sorted order.
    conv_sorted = PagedState(conv_t.base, caps.target.pages, conv_t.page_elems, conv_t.offset)
    conv_windows(x, conv, cu_seqlens, has_initial_state, caps.after, caps.seq, conv_sorted,
                 kernel_size)
    return caps


def verify_initial(view, page_ids: torch.Tensor, initial: dict[str, torch.Tensor] | None
             ) -> tuple[PagedState | None, PagedState | None]:
    """The verify pass's initial states: the pages, or dense tensors (a drafter's pass)."""
    if initial is not None:
        return (PagedState.dense(initial["conv"].contiguous()),
                PagedState.dense(initial["ssm"].contiguous()))
    return PagedState.from_view(view, "conv", page_ids), PagedState.from_view(view, "ssm",
                                                                             page_ids)


def verify_conv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                 conv: PagedState, cu_seqlens: torch.Tensor,
                 has_initial_state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The conv outputs (state untouched) and the window after every token (T, C, K-1)."""
    t, c = x.shape
    k = weight.shape[1]
    windows = torch.empty((t, c, k - 1), dtype=x.dtype, device=x.device)
    cu = cu_seqlens.to(x.device, torch.int64)
    tok = torch.arange(t, device=x.device)
    seq = torch.searchsorted(cu[1:], tok, right=True)
    conv_windows(x, conv, cu, has_initial_state, tok, seq, PagedState.dense(windows), k)
    y = conv_paged(x, weight, bias, conv, cu, has_initial_state, "silu", store_state=False)
    return y, windows
