"""The state layers' two special steps on the Triton path: in-kernel checkpoint captures and
the speculative verify pass (GDN and Mamba-2), with the conv windows they need.

**Captures** (prefix-cache checkpoints inside a prefill chunk, ``capture=(after, pages)`` as
:func:`pagefold.csrc.cpu_ops.gdn`): for every capture ``m`` the states right after flat token
``after[m]`` go to the checkpoint pages ``pages[m]``, the bytes a step ending after that token
would leave in the request's own pages, up to float32 rounding (the conv window is a copy:
exactly those bytes). The recurrent state comes from the chunked kernels
(``gdn_chunked_paged`` / ``ssd_chunked_paged`` with :class:`~.common.Captures`: the chunk's
exit-state formula cut at the capture row, one more ``tl.dot`` per capture, no re-run); the
conv window from :func:`conv_windows`, launched *before* the conv kernel replaces the old
window in the pages (a window near a sequence's start still reads the old one).

**Verify** (a speculative step of ``1 + k`` tokens per request): nothing is stored in the
request's pages; the state after *every* token comes back, as the torch path's
``*_verify`` kernels return it (:mod:`pagefold.spec_decode.state_verify`), for the runner to
commit the accepted one: the recurrent states from the token-loop kernels' ``intermediate``
(float32, (T, H, ...)) and the conv windows (T, C, K-1) from :func:`conv_windows` with one
"capture" per token into a dense tensor. The initial states are read from the pages, or from
dense tensors (a drafter's chained passes, ``ForwardContext.initial_states``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from pagefold.kernels.triton.common import (
    INTERPRET,
    Captures,
    PagedState,
    gate,
    has_pages,
    pow2,
    state_addr,
)
from pagefold.kernels.triton.conv import conv_paged

__all__ = ["capture_conv_and_plan", "conv_windows", "gdn_verify_layer", "mamba_verify_layer"]


@triton.jit
def _conv_window_kernel(x_ptr, x_st, cu_ptr, init_ptr, st_ptr, pages_ptr, pps, pe, off,
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
    cu = cu_seqlens.to(x.device, torch.int64).contiguous()
    init = has_initial_state.to(x.device, torch.int8).contiguous() \
        if has_initial_state is not None else cu
    block_c = pow2(c) if INTERPRET else min(pow2(c), 256)
    _conv_window_kernel[(m, triton.cdiv(c, block_c))](
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


def _initial(view, page_ids: torch.Tensor, initial: dict[str, torch.Tensor] | None
             ) -> tuple[PagedState | None, PagedState | None]:
    """The verify pass's initial states: the pages, or dense tensors (a drafter's pass)."""
    if initial is not None:
        return (PagedState.dense(initial["conv"].contiguous()),
                PagedState.dense(initial["ssm"].contiguous()))
    return PagedState.from_view(view, "conv", page_ids), PagedState.from_view(view, "ssm",
                                                                             page_ids)


def _verify_conv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
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


def gdn_verify_layer(view, page_ids: torch.Tensor, has_initial_state: torch.Tensor,
                     cu_seqlens: torch.Tensor, mixed: torch.Tensor, a: torch.Tensor,
                     b: torch.Tensor, conv_weight: torch.Tensor, A_log: torch.Tensor,
                     dt_bias: torch.Tensor, *, num_k_heads: int, num_v_heads: int,
                     head_k_dim: int, head_v_dim: int, scale: float | None = None,
                     initial: dict[str, torch.Tensor] | None = None
                     ) -> tuple[torch.Tensor, dict[str, torch.Tensor]] | None:
    """A GDN layer's verify pass: ``(o (T, Hv, Dv), {"conv": (T, C, K-1) in mixed's dtype,
    "ssm": (T, Hv, Dk, Dv) float32})``, the states after every token; the pages are only
    read. None when the pool cannot be addressed (nothing done)."""
    from pagefold.kernels.triton.gdn import gdn_paged

    conv, ssm = _initial(view, page_ids, initial)
    if conv is None or ssm is None or (initial is None and
                                       view.spec.component("conv").dtype != mixed.dtype):
        return None
    t = mixed.shape[0]
    y, windows = _verify_conv(mixed, conv_weight, None, conv, cu_seqlens, has_initial_state)
    kd = num_k_heads * head_k_dim
    q = y[:, :kd].view(t, num_k_heads, head_k_dim)
    k = y[:, kd : 2 * kd].view(t, num_k_heads, head_k_dim)
    v = y[:, 2 * kd :].view(t, num_v_heads, head_v_dim)
    beta = b.sigmoid()  # as the torch path: beta in the model dtype, g in float32
    g = -A_log.float().exp() * F.softplus(a.float() + dt_bias)
    out = torch.empty((t, num_v_heads, head_v_dim), dtype=mixed.dtype, device=mixed.device)
    states = torch.empty((t, num_v_heads, head_k_dim, head_v_dim), dtype=torch.float32,
                         device=mixed.device)
    gdn_paged(q, k, v, g, beta, ssm, cu_seqlens, has_initial_state, out,
              scale=head_k_dim**-0.5 if scale is None else scale, intermediate=states,
              store_final=False)
    return out, {"conv": windows, "ssm": states}


def mamba_verify_layer(view, page_ids: torch.Tensor, has_initial_state: torch.Tensor,
                       cu_seqlens: torch.Tensor, xbc: torch.Tensor, conv_weight: torch.Tensor,
                       conv_bias: torch.Tensor | None, dt: torch.Tensor, A: torch.Tensor,
                       D: torch.Tensor | None, *, num_heads: int, head_dim: int, n_groups: int,
                       state_size: int, initial: dict[str, torch.Tensor] | None = None
                       ) -> tuple[torch.Tensor, dict[str, torch.Tensor]] | None:
    """A Mamba-2 mixer's verify pass: ``(y (T, H, P) in xbc's dtype, {"conv": (T, C, K-1),
    "ssm": (T, H, P, N) float32})``; ``dt`` (T, H) discretised. Pages only read; None when
    the pool cannot be addressed."""
    from pagefold.kernels.triton.ssd import ssd_paged

    conv, ssm = _initial(view, page_ids, initial)
    if conv is None or ssm is None or (initial is None and
                                       view.spec.component("conv").dtype != xbc.dtype):
        return None
    t = xbc.shape[0]
    y, windows = _verify_conv(xbc, conv_weight, conv_bias, conv, cu_seqlens, has_initial_state)
    inter, gn = num_heads * head_dim, n_groups * state_size
    xs = y[:, :inter].view(t, num_heads, head_dim)
    B = y[:, inter : inter + gn].view(t, n_groups, state_size)
    C = y[:, inter + gn : inter + 2 * gn].view(t, n_groups, state_size)
    out = torch.empty((t, num_heads, head_dim), dtype=xbc.dtype, device=xbc.device)
    states = torch.empty((t, num_heads, head_dim, state_size), dtype=torch.float32,
                         device=xbc.device)
    ssd_paged(xs, dt, A, B, C, D, ssm, cu_seqlens, has_initial_state, out, states,
              store_final=False)
    return out, {"conv": windows, "ssm": states}
