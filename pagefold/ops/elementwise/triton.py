"""Fused row-wise kernels in Triton: RMSNorm (with the residual add), q/k norm + RoPE,
SiLU-and-mul and the gated RMSNorm of GDN outputs.

Each has the signature and contract of its :mod:`pagefold.csrc.cpu_ops` counterpart and
rounds as the torch reference does (the result of each torch op rounded to the model dtype),
so float32 and bf16 outputs match the torch path up to the order of float32 sums. One
program per row; the row is loaded once (``BLOCK`` = the row length rounded up to a power of
two).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagefold.ops.common.triton import INTERPRET, pow2


@triton.jit
def rms_norm_kernel(x_ptr, x_st, r_ptr, r_st, w_ptr, out_ptr, R, D, eps,
                     HAS_RES: tl.constexpr, ZERO_CENTERED: tl.constexpr, ROWS: tl.constexpr,
                     BLOCK: tl.constexpr):
    row = (tl.program_id(0) * ROWS + tl.arange(0, ROWS)).to(tl.int64)[:, None]
    d = tl.arange(0, BLOCK)[None, :]
    m = (row < R) & (d < D)
    x = tl.load(x_ptr + row * x_st + d, mask=m, other=0.0)
    if HAS_RES:
        res = tl.load(r_ptr + row * r_st + d, mask=m, other=0.0)
        x = (x.to(tl.float32) + res.to(tl.float32)).to(x.dtype)  # x + residual, rounded
        tl.store(r_ptr + row * r_st + d, x, mask=m)
    h = x.to(tl.float32)
    h = h * tl.rsqrt(tl.sum(h * h, 1) / D + eps)[:, None]
    w = tl.load(w_ptr + d, mask=d < D, other=0.0).to(tl.float32)
    if ZERO_CENTERED:
        y = h * (1.0 + w)
    else:
        y = w * h.to(x.dtype).to(tl.float32)  # weight * h.to(dtype), one rounding
    tl.store(out_ptr + row * D + d, y.to(out_ptr.dtype.element_ty), mask=m)


def _rows(n: int, width: int) -> int:
    """Rows per program: many under the interpreter (its cost is per program, not per
    element), on a GPU enough to give each program ~1-4K elements."""
    if INTERPRET:
        return min(pow2(n), 64)
    return max(1, min(pow2(n), 4096 // pow2(width)))


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, zero_centered: bool,
             residual: torch.Tensor | None = None) -> torch.Tensor | None:
    """See :func:`pagefold.ops.elementwise.cpu.rms_norm`: with ``residual``, ``residual += x`` in
    place and the sum is normalised. None when not handled."""
    d = x.shape[-1]
    if x.numel() == 0 or weight.numel() != d or x.dtype != weight.dtype:
        return None
    x2 = x.reshape(-1, d)
    if x2.stride(1) != 1:
        x2 = x2.contiguous()
    r2 = None
    if residual is not None:
        if residual.shape != x.shape or residual.dtype != x.dtype:
            return None
        r2 = residual.view(-1, d) if residual.is_contiguous() else None
        if r2 is None:
            return None
    out = torch.empty(x2.shape, dtype=x.dtype, device=x.device)
    n = x2.shape[0]
    rows = _rows(n, d)
    rms_norm_kernel[(triton.cdiv(n, rows),)](
        x2, x2.stride(0), r2 if r2 is not None else x2, r2.stride(0) if r2 is not None else 0,
        weight.contiguous(), out, n, d, float(eps), HAS_RES=r2 is not None,
        ZERO_CENTERED=bool(zero_centered), ROWS=rows, BLOCK=pow2(d))
    return out.view(x.shape)


@triton.jit
def silu_mul_kernel(x_ptr, x_st, out_ptr, R, INTER, ROWS: tl.constexpr, BLOCK: tl.constexpr):
    row = (tl.program_id(0) * ROWS + tl.arange(0, ROWS)).to(tl.int64)[:, None]
    i = (tl.program_id(1) * BLOCK + tl.arange(0, BLOCK))[None, :]
    m = (row < R) & (i < INTER)
    gate = tl.load(x_ptr + row * x_st + i, mask=m, other=0.0)
    up = tl.load(x_ptr + row * x_st + INTER + i, mask=m, other=0.0)
    gf = gate.to(tl.float32)
    s = (gf / (1.0 + tl.exp(-gf))).to(gate.dtype).to(tl.float32)  # silu(gate), rounded
    tl.store(out_ptr + row * INTER + i, (s * up.to(tl.float32)).to(out_ptr.dtype.element_ty),
             mask=m)


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor | None:
    """``silu(gate) * up`` for ``gate_up`` (T, 2I) = [gate | up] -> (T, I)."""
    if gate_up.dim() != 2 or gate_up.shape[1] % 2 or gate_up.stride(1) != 1:
        return None
    n, i = gate_up.shape[0], gate_up.shape[1] // 2
    out = torch.empty((n, i), dtype=gate_up.dtype, device=gate_up.device)
    if n:
        block = pow2(i) if INTERPRET else min(pow2(i), 1024)
        rows = _rows(n, block)
        silu_mul_kernel[(triton.cdiv(n, rows), triton.cdiv(i, block))](
            gate_up, gate_up.stride(0), out, n, i, ROWS=rows, BLOCK=block)
    return out


@triton.jit
def qk_norm_rope_kernel(qkv_ptr, row_st, q_off, q_hs, k_off, pos_ptr, cos_ptr, sin_ptr, ROT,
                         qw_ptr, kw_ptr, eps, q_out, k_out, H, KVH, D,
                         HAS_NORM: tl.constexpr, ZERO_CENTERED: tl.constexpr,
                         BLOCK_J: tl.constexpr, BLOCK: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    j = tl.arange(0, BLOCK_J)[:, None]  # query heads first, then kv heads
    is_q = j < H
    col = tl.where(is_q, q_off + j * q_hs, k_off + (j - H) * D)
    d = tl.arange(0, BLOCK)[None, :]
    m = (j < H + KVH) & (d < D)
    half = ROT // 2
    partner = tl.where(d < half, d + half, d - half)
    pm = m & (d < ROT)
    x = tl.load(qkv_ptr + t * row_st + col + d, mask=m, other=0.0)
    xp = tl.load(qkv_ptr + t * row_st + col + partner, mask=pm, other=0.0)
    dt = x.dtype
    xf = x.to(tl.float32)
    xpf = xp.to(tl.float32)
    if HAS_NORM:
        inv = tl.rsqrt(tl.sum(xf * xf, 1) / D + eps)[:, None]
        w = tl.where(is_q, tl.load(qw_ptr + d, mask=d < D, other=0.0),
                     tl.load(kw_ptr + d, mask=d < D, other=0.0)).to(tl.float32)
        wp = tl.where(is_q, tl.load(qw_ptr + partner, mask=d < ROT, other=0.0),
                      tl.load(kw_ptr + partner, mask=d < ROT, other=0.0)).to(tl.float32)
        if ZERO_CENTERED:
            xf = (xf * inv * (1.0 + w)).to(dt).to(tl.float32)
            xpf = (xpf * inv * (1.0 + wp)).to(dt).to(tl.float32)
        else:
            xf = (w * (xf * inv).to(dt).to(tl.float32)).to(dt).to(tl.float32)
            xpf = (wp * (xpf * inv).to(dt).to(tl.float32)).to(dt).to(tl.float32)
    pos = tl.load(pos_ptr + t)
    c = tl.load(cos_ptr + pos * ROT + d, mask=d < ROT, other=1.0).to(dt).to(tl.float32)
    s = tl.load(sin_ptr + pos * ROT + d, mask=d < ROT, other=0.0).to(dt).to(tl.float32)
    rot = tl.where(d < half, -xpf, xpf)
    a = (xf * c).to(dt).to(tl.float32)
    b = (rot * s).to(dt).to(tl.float32)
    y = tl.where(d < ROT, a + b, xf).to(dt)
    tl.store(q_out + (t * H + j) * D + d, y, mask=m & is_q)
    tl.store(k_out + (t * KVH + j - H) * D + d, y, mask=m & (j >= H))


def qk_norm_rope(qkv: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor,
                 sin: torch.Tensor, *, num_heads: int, num_kv_heads: int, head_dim: int,
                 q_off: int, q_head_stride: int, k_off: int, q_weight: torch.Tensor | None,
                 k_weight: torch.Tensor | None, eps: float, zero_centered: bool
                 ) -> tuple[torch.Tensor, torch.Tensor] | None:
    """See :func:`pagefold.ops.elementwise.cpu.qk_norm_rope`; fresh contiguous q (T, H, D) and
    k (T, KVH, D), or None when not handled."""
    if (qkv.dim() != 2 or qkv.stride(1) != 1 or (q_weight is None) != (k_weight is None)
            or cos.dtype != torch.float32 or cos.shape[1] % 2):
        return None
    t = qkv.shape[0]
    q = torch.empty((t, num_heads, head_dim), dtype=qkv.dtype, device=qkv.device)
    k = torch.empty((t, num_kv_heads, head_dim), dtype=qkv.dtype, device=qkv.device)
    if t:
        w = q_weight if q_weight is not None else cos
        qk_norm_rope_kernel[(t,)](
            qkv, qkv.stride(0), q_off, q_head_stride, k_off, positions.contiguous(),
            cos.contiguous(), sin.contiguous(), cos.shape[1], w.contiguous(),
            (k_weight if k_weight is not None else w).contiguous(), float(eps), q, k,
            num_heads, num_kv_heads, head_dim, HAS_NORM=q_weight is not None,
            ZERO_CENTERED=bool(zero_centered), BLOCK_J=pow2(num_heads + num_kv_heads),
            BLOCK=pow2(head_dim))
    return q, k


@triton.jit
def rms_norm_gated_kernel(x_ptr, x_st, x_sh, g_ptr, g_st, g_sh, w_ptr, out_ptr, R, H, D, eps,
                           ROWS: tl.constexpr, BLOCK: tl.constexpr):
    r = (tl.program_id(0) * ROWS + tl.arange(0, ROWS)).to(tl.int64)[:, None]  # token * H + head
    t = r // H
    h = r % H
    d = tl.arange(0, BLOCK)[None, :]
    m = (r < R) & (d < D)
    x = tl.load(x_ptr + t * x_st + h * x_sh + d, mask=m, other=0.0)
    gate = tl.load(g_ptr + t * g_st + h * g_sh + d, mask=m, other=0.0).to(tl.float32)
    xf = x.to(tl.float32)
    hn = (xf * tl.rsqrt(tl.sum(xf * xf, 1) / D + eps)[:, None]).to(x.dtype).to(tl.float32)
    w = tl.load(w_ptr + d, mask=d < D, other=0.0).to(tl.float32)
    hw = (w * hn).to(x.dtype).to(tl.float32)
    y = hw * (gate / (1.0 + tl.exp(-gate)))
    tl.store(out_ptr + r * D + d, y.to(out_ptr.dtype.element_ty), mask=m)


def rms_norm_gated(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor,
                   eps: float) -> torch.Tensor | None:
    """``weight * rmsnorm(x) * silu(gate)`` per (token, head) row of x/gate (N, H, D)."""
    if x.dim() != 3 or gate.shape != x.shape or x.stride(2) != 1 or gate.stride(2) != 1:
        return None
    n, h, d = x.shape
    out = torch.empty((n, h, d), dtype=x.dtype, device=x.device)
    if n:
        rows = _rows(n * h, d)
        rms_norm_gated_kernel[(triton.cdiv(n * h, rows),)](
            x, x.stride(0), x.stride(1), gate, gate.stride(0), gate.stride(1),
            weight.contiguous(), out, n * h, h, d, float(eps), ROWS=rows, BLOCK=pow2(d))
    return out
