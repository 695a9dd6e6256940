"""Gated DeltaNet in Triton with the recurrent state in its pages.

One program per (sequence, value head, tile of ``BLOCK_V`` value channels) holds its slice
``S[:, tile]`` (Dk x BLOCK_V, float32) of the state in registers and walks the sequence's tokens
in order, the definition of :mod:`pagefold.ops.gdn.reference`::

    S <- exp(g) S;  d = beta (v - S^T k);  S <- S + k d^T;  o = S^T q

with q/k L2-normalised and q scaled. The state is read from its pages once (zeros for a fresh
sequence) and written back once, in place; the value tiles of a head are independent, so
the kernel is right for any lengths. :func:`gdn_layer` runs it for decode batches and sends
batches with a prefill chunk to the chunked WY-form kernel of
:mod:`pagefold.ops.gdn.triton_chunked` (tensor cores).

``intermediate`` (optional, (T, H, Dk, Dv) float32) receives the state after every token: the
per-position states that checkpoints and speculative verification roll back to.

:func:`gdn_triton` has the signature of ``gdn_naive``; :func:`gdn_layer` that of
:func:`pagefold.ops.gdn.cpu.gdn_layer` (conv + delta rule over a layer's pages).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
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
from pagefold.ops.gdn import triton_chunked
from pagefold.ops.gdn.reference import prepare


@triton.jit
def gdn_kernel(q_ptr, k_ptr, qk_st, qk_sh, v_ptr, v_st, v_sh, g_ptr, beta_ptr, gb_st, cu_ptr,
                init_ptr, st_ptr, pages_ptr, pps, pe, off, o_ptr, o_st, o_sh, inter_ptr,
                scale, H, REP, DK, DV,
                HAS_INIT: tl.constexpr, L2NORM: tl.constexpr, STORE_INTER: tl.constexpr,
                STORE_FINAL: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr):
    s = tl.program_id(0)
    h = tl.program_id(1)
    vt = tl.program_id(2)
    hk = h // REP
    i = tl.arange(0, BLOCK_K)
    j = vt * BLOCK_V + tl.arange(0, BLOCK_V)
    im = i < DK
    jm = j < DV
    m2 = im[:, None] & jm[None, :]
    e = (h * DK + i[:, None]) * DV + j[None, :]
    S, live = load_state(st_ptr, pages_ptr, init_ptr, s, pps, pe, off, e, m2, HAS_INIT)
    c0 = tl.load(cu_ptr + s)
    c1 = tl.load(cu_ptr + s + 1)
    for t in range(c0, c1):  # int64 bounds (cu is int64): 64-bit token offsets
        q = tl.load(q_ptr + t * qk_st + hk * qk_sh + i, mask=im, other=0.0).to(tl.float32)
        k = tl.load(k_ptr + t * qk_st + hk * qk_sh + i, mask=im, other=0.0).to(tl.float32)
        v = tl.load(v_ptr + t * v_st + h * v_sh + j, mask=jm, other=0.0).to(tl.float32)
        if L2NORM:
            q = q * tl.rsqrt(tl.sum(q * q, 0) + 1e-6)
            k = k * tl.rsqrt(tl.sum(k * k, 0) + 1e-6)
        q = q * scale
        gt = tl.load(g_ptr + t * gb_st + h).to(tl.float32)
        bt = tl.load(beta_ptr + t * gb_st + h).to(tl.float32)
        S = S * tl.exp(gt)
        delta = (v - tl.sum(S * k[:, None], 0)) * bt
        S = S + k[:, None] * delta[None, :]
        o = tl.sum(S * q[:, None], 0)
        tl.store(o_ptr + t * o_st + h * o_sh + j, o.to(o_ptr.dtype.element_ty), mask=jm)
        if STORE_INTER:
            tl.store(inter_ptr + (t * H + h) * DK * DV + i[:, None] * DV + j[None, :], S,
                     mask=m2)
    if STORE_FINAL:
        store_state(st_ptr, pages_ptr, s, pps, pe, off, e, m2, live, S)


def gdn_paged(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
              beta: torch.Tensor, state: PagedState, cu_seqlens: torch.Tensor,
              has_initial_state: torch.Tensor | None, out: torch.Tensor, *, scale: float,
              use_qk_l2norm: bool = True, intermediate: torch.Tensor | None = None,
              store_final: bool = True) -> None:
    """The delta rule over a varlen batch, states (H, Dk, Dv) in ``state`` updated in place
    (read only with ``store_final=False``: a verify pass keeps ``intermediate`` instead).

    q, k: (T, Hk, Dk) with Hk dividing H (value head ``h`` reads key head ``h // (H/Hk)``),
    any token/head strides with contiguous channels; v (T, H, Dv) likewise; g, beta (T, H)
    float32; ``out`` (T, H, Dv) receives o."""
    t, hk, dk = q.shape
    h, dv = v.shape[1], v.shape[2]
    n = cu_seqlens.shape[0] - 1
    if n == 0:
        return
    assert k.stride() == q.stride() and q.stride(2) == 1 and v.stride(2) == 1
    g = g.float().contiguous()
    beta = beta.float().contiguous()
    cu, init = seq_args(cu_seqlens, has_initial_state, q.device, torch.int)
    # Under the interpreter one tile per head: its cost is per program and per op.
    block_v = pow2(dv) if INTERPRET else min(pow2(dv), 32)
    gdn_kernel[(n, h, triton.cdiv(dv, block_v))](
        q, k, q.stride(0), q.stride(1), v, v.stride(0), v.stride(1), g, beta, g.stride(0), cu,
        init, state.base, state.pages, state.pages.shape[1], state.page_elems, state.offset,
        out, out.stride(0), out.stride(1), intermediate if intermediate is not None else g,
        float(scale), h, h // hk, dk, dv, HAS_INIT=has_initial_state is not None,
        L2NORM=bool(use_qk_l2norm), STORE_INTER=intermediate is not None,
        STORE_FINAL=bool(store_final), BLOCK_K=pow2(dk), BLOCK_V=block_v)


def gdn_triton(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
               beta: torch.Tensor, initial_state: torch.Tensor, cu_seqlens: torch.Tensor, *,
               scale: float | None = None, use_qk_l2norm: bool = True, chunk_size: int = 64,
               intermediate: torch.Tensor | None = None
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """The signature of :func:`pagefold.ops.gdn.reference.gdn_naive` (``chunk_size``
    ignored): ``(o (T, H, Dv) in v's dtype, final_state (N, H, Dk, Dv) float32)``;
    ``initial_state`` is not modified. ``intermediate``: see the module docstring."""
    del chunk_size
    prepare(q[:0], k[:0], v[:0], g[:0], beta[:0], initial_state, cu_seqlens, scale, False)
    if q.shape[0] != v.shape[0] or g.shape != v.shape[:2] or beta.shape != v.shape[:2]:
        raise ValueError("q, k, v, g, beta must share the token and head dimensions")
    final = initial_state.float().contiguous().clone()
    out = torch.empty(v.shape, dtype=v.dtype, device=v.device)
    q, k = q.contiguous(), k.contiguous()
    gdn_paged(q, k, v.contiguous(), g, beta, PagedState.dense(final), cu_seqlens, None, out,
              scale=q.shape[2] ** -0.5 if scale is None else scale,
              use_qk_l2norm=use_qk_l2norm, intermediate=intermediate)
    return out, final


def _split(y: torch.Tensor, a: torch.Tensor, b: torch.Tensor, A_log: torch.Tensor,
           dt_bias: torch.Tensor, num_k_heads: int, num_v_heads: int, head_k_dim: int,
           head_v_dim: int) -> tuple[torch.Tensor, ...]:
    """q, k, v views of the conv output and the gates g (float32), beta (the model dtype),
    computed as the torch path computes them."""
    t, kd = y.shape[0], num_k_heads * head_k_dim
    q = y[:, :kd].view(t, num_k_heads, head_k_dim)
    k = y[:, kd : 2 * kd].view(t, num_k_heads, head_k_dim)
    v = y[:, 2 * kd :].view(t, num_v_heads, head_v_dim)
    g = -A_log.float().exp() * F.softplus(a.float() + dt_bias)
    return q, k, v, g, b.sigmoid()


def gdn_layer(view, page_ids: torch.Tensor, has_initial_state: torch.Tensor,
              cu_seqlens: torch.Tensor, mixed: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
              conv_weight: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor, *,
              num_k_heads: int, num_v_heads: int, head_k_dim: int, head_v_dim: int,
              scale: float | None = None,
              capture: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor | None:
    """A GDN layer's conv and delta rule over its pages; the contract of
    :func:`pagefold.ops.gdn.cpu.gdn_layer_cpu` (o (T, Hv, Dv) in mixed's dtype, both states
    stored in place, None when the pool cannot be addressed in the states' dtypes),
    ``capture=(after, pages)`` included (:func:`~pagefold.ops.conv1d.triton.
    capture_conv_and_plan`; such a step takes the chunked kernel, whatever its lengths)."""
    conv = PagedState.from_view(view, "conv", page_ids)
    ssm = PagedState.from_view(view, "ssm", page_ids)
    if conv is None or ssm is None or view.spec.component("conv").dtype != mixed.dtype:
        return None
    t = mixed.shape[0]
    caps = None
    if capture is not None:
        caps = capture_conv_and_plan(view, mixed, conv, cu_seqlens, has_initial_state, capture,
                                     conv_weight.shape[1])
        if caps is None:
            return None
    y = conv_paged(mixed, conv_weight, None, conv, cu_seqlens, has_initial_state, "silu")
    q, k, v, g, beta = _split(y, a, b, A_log, dt_bias, num_k_heads, num_v_heads, head_k_dim,
                              head_v_dim)
    out = torch.empty((t, num_v_heads, head_v_dim), dtype=mixed.dtype, device=mixed.device)
    scale = head_k_dim**-0.5 if scale is None else scale
    n = cu_seqlens.shape[0] - 1
    if t > n or caps is not None:  # a prefill chunk in the batch: the chunked form
        # Looked up on the module at call time: tests count the calls.
        triton_chunked.gdn_chunked_paged(q, k, v, g, beta, ssm, cu_seqlens, has_initial_state,
                                         out, scale=scale, chunk_size=prefill_chunk_size(t, n),
                                         captures=caps)
    else:  # decode: one token per sequence, the token loop
        gdn_paged(q, k, v, g, beta, ssm, cu_seqlens, has_initial_state, out, scale=scale)
    return out


def gdn_verify_layer(view, page_ids: torch.Tensor, has_initial_state: torch.Tensor,
                     cu_seqlens: torch.Tensor, mixed: torch.Tensor, a: torch.Tensor,
                     b: torch.Tensor, conv_weight: torch.Tensor, A_log: torch.Tensor,
                     dt_bias: torch.Tensor, *, num_k_heads: int, num_v_heads: int,
                     head_k_dim: int, head_v_dim: int, scale: float | None = None,
                     initial: dict[str, torch.Tensor] | None = None
                     ) -> tuple[torch.Tensor, dict[str, torch.Tensor]] | None:
    """A GDN layer's verify pass: ``(o (T, Hv, Dv), {"conv": (T, C, K-1) in mixed's dtype,
    "ssm": (T, Hv, Dk, Dv) float32})``, the states after every token; the pages (or the dense
    ``initial`` states of a drafter's pass) are only read. None when the pool cannot be
    addressed (nothing done)."""
    conv, ssm = verify_initial(view, page_ids, initial)
    if conv is None or ssm is None or (initial is None and
                                       view.spec.component("conv").dtype != mixed.dtype):
        return None
    t = mixed.shape[0]
    y, windows = verify_conv(mixed, conv_weight, None, conv, cu_seqlens, has_initial_state)
    q, k, v, g, beta = _split(y, a, b, A_log, dt_bias, num_k_heads, num_v_heads, head_k_dim,
                              head_v_dim)
    out = torch.empty((t, num_v_heads, head_v_dim), dtype=mixed.dtype, device=mixed.device)
    states = torch.empty((t, num_v_heads, head_k_dim, head_v_dim), dtype=torch.float32,
                         device=mixed.device)
    gdn_paged(q, k, v, g, beta, ssm, cu_seqlens, has_initial_state, out,
              scale=head_k_dim**-0.5 if scale is None else scale, intermediate=states,
              store_final=False)
    return out, {"conv": windows, "ssm": states}
