"""The batched LoRA ops in Triton (GPU; tested under ``TRITON_INTERPRET=1``). One program
per (row, block of outputs): the row's slot is read first and a base row (slot -1) loads
nothing (masked): its shrink row is zeros and its ``y`` row is never stored. Sums in float32,
one rounding of ``y``, as the compiled CPU form."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagefold.ops.common.triton import pow2


@triton.jit
def _shrink_kernel(x_ptr, xs, a_ptr, idx_ptr, v_ptr, R, K,
                   BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr):
    i = tl.program_id(0)
    rb = tl.program_id(1)
    s = tl.load(idx_ptr + i)
    k_lim = tl.where(s >= 0, K, 0)  # a base row reads nothing
    s = tl.maximum(s, 0)
    r = rb * BLOCK_R + tl.arange(0, BLOCK_R)
    acc = tl.zeros([BLOCK_R], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        xk = tl.load(x_ptr + i * xs + k, mask=k < k_lim, other=0.0).to(tl.float32)
        a = tl.load(a_ptr + (s * R + r[:, None]) * K + k[None, :],
                    mask=(r[:, None] < R) & (k[None, :] < k_lim), other=0.0).to(tl.float32)
        acc += tl.sum(a * xk[None, :], axis=1)
    tl.store(v_ptr + i * R + r, acc, mask=r < R)


@triton.jit
def _expand_kernel(y_ptr, ys, v_ptr, b_ptr, idx_ptr, N_OUT, R,
                   BLOCK_O: tl.constexpr, BLOCK_R: tl.constexpr):
    i = tl.program_id(0)
    ob = tl.program_id(1)
    s = tl.load(idx_ptr + i)
    o_lim = tl.where(s >= 0, N_OUT, 0)  # a base row reads and writes nothing
    s = tl.maximum(s, 0)
    o = ob * BLOCK_O + tl.arange(0, BLOCK_O)
    r = tl.arange(0, BLOCK_R)
    v = tl.load(v_ptr + i * R + r, mask=r < R, other=0.0)
    b = tl.load(b_ptr + (s * R + r[None, :]) * N_OUT + o[:, None],
                mask=(o[:, None] < o_lim) & (r[None, :] < R), other=0.0).to(tl.float32)
    acc = tl.sum(b * v[None, :], axis=1)
    m = o < o_lim
    y = tl.load(y_ptr + i * ys + o, mask=m, other=0.0).to(tl.float32)
    tl.store(y_ptr + i * ys + o, (y + acc).to(y_ptr.dtype.element_ty), mask=m)


def shrink(x: torch.Tensor, a: torch.Tensor, idx: torch.Tensor) -> torch.Tensor | None:
    """``v`` (rows, R) float32, or None when the inputs do not fit (the caller's torch form)."""
    if (x.dim() != 2 or x.stride(1) != 1 or not a.is_contiguous() or a.dim() != 3
            or idx.dtype != torch.int64 or not idx.is_contiguous()):
        return None
    n, k = x.shape
    r = a.shape[1]
    v = torch.empty(n, r, dtype=torch.float32, device=x.device)
    if n == 0:
        return v
    block_r = min(pow2(r), 64)
    _shrink_kernel[(n, triton.cdiv(r, block_r))](x, x.stride(0), a, idx, v, r, k,
                                                 BLOCK_R=block_r, BLOCK_K=64)
    return v


def expand_(y: torch.Tensor, v: torch.Tensor, b: torch.Tensor, idx: torch.Tensor) -> bool:
    """``y += v @ b[idx]`` (``b`` (slots, R, out)) on the adapter rows; False: not done."""
    if (y.dim() != 2 or y.stride(1) != 1 or not b.is_contiguous() or b.dim() != 3
            or v.dtype != torch.float32 or not v.is_contiguous()
            or idx.dtype != torch.int64 or not idx.is_contiguous()):
        return False
    n, o = y.shape
    r = b.shape[1]
    if n:
        _expand_kernel[(n, triton.cdiv(o, 64))](y, y.stride(0), v, b, idx, o, r,
                                                BLOCK_O=64, BLOCK_R=pow2(r))
    return True
