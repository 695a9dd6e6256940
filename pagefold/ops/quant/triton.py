"""Triton kernel of the integer / FP8 weight-only product ``y = x @ w.T`` on kernel-layout
weights (``quantization.int_kernel.IntWeight``): per output row its codes in input order
(4-bit: two to a byte, the even input in the low nibble; 8-bit and FP8: one byte each, FP8 as
float8_e4m3fn bits) and a float32 scale and zero per group of ``group`` inputs, so
``w = scale * (code - zero)``.

One program computes a (BM, BN) tile of ``y``, looping over the inputs in BK blocks: it
decodes the (BN, BK) weight tile in float32 exactly as the torch reference does (FP8 bytes by
moving their exponent and mantissa bits into float32's: normal values scaled by 2^120,
subnormals as ``mantissa * 2^-9``), then ``tl.dot`` in float32 (IEEE products, no TF32), so
the result equals the reference up to the order of float32 sums. Inputs not a multiple of BK,
rows and outputs not a multiple of the tile are masked.

``mxfp4_gemm`` is the same product for MXFP4 weights as stored (``quantization/mxfp4.py``):
E2M1 codes two to a byte and an E8M0 scale per 32 inputs, decoded in float32 exactly (the
code's exponent and mantissa bits give ``(2 + m) * 2 ** (e - 2)``, ``m / 2`` when ``e`` is 0;
the scale ``2 ** (s - 127)`` is ``s`` placed in a float32 exponent field).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagefold.ops.common.triton import INTERPRET, pow2

__all__ = ["mxfp4_gemm", "qgemm"]


@triton.jit
def _int_tile(c_ptr, c_st, s_ptr, z_ptr, g_st, rn, kk, mw, GROUP, BITS: tl.constexpr,
              FP8: tl.constexpr):
    """The (BN, BK) float32 weight tile of an integer / FP8 matrix: ``scale * (code - zero)``."""
    if BITS == 4:
        b = tl.load(c_ptr + rn[:, None] * c_st + (kk // 2)[None, :], mask=mw, other=0)
        q = ((b.to(tl.int32) >> ((kk % 2) * 4)[None, :]) & 15).to(tl.float32)
    else:
        b = tl.load(c_ptr + rn[:, None] * c_st + kk[None, :], mask=mw, other=0)
        code = b.to(tl.int32)
        if FP8:
            mag = code & 0x7F
            normal = (mag << 20).to(tl.float32, bitcast=True) * 1.329227995784916e36  # 2^120
            sub = (mag & 7).to(tl.float32) * 0.001953125  # 2^-9
            v = tl.where((mag >> 3) == 0, sub, normal)
            q = tl.where((code & 0x80) != 0, -v, v)
        else:
            q = code.to(tl.float32)
    g = (kk // GROUP)[None, :]
    s = tl.load(s_ptr + rn[:, None] * g_st + g, mask=mw, other=0.0)
    z = tl.load(z_ptr + rn[:, None] * g_st + g, mask=mw, other=0.0)
    return (q - z) * s


@triton.jit
def _mxfp4_tile(b_ptr, b_st, s_ptr, s_st, rn, kk, mw):
    """The (BN, BK) float32 weight tile of an MXFP4 matrix: E2M1 code times ``2^(s - 127)``."""
    b = tl.load(b_ptr + rn[:, None] * b_st + (kk // 2)[None, :], mask=mw, other=0)
    code = (b.to(tl.int32) >> ((kk % 2) * 4)[None, :]) & 15
    e = (code >> 1) & 3
    m = (code & 1).to(tl.float32)
    # (2 + m) * 2^(e - 2) for e > 0 (1, 1.5, 2, 3, 4, 6), m / 2 for e = 0 (0, 0.5).
    normal = (2.0 + m) * tl.where(e == 3, 2.0, tl.where(e == 2, 1.0, 0.5))
    v = tl.where(e == 0, m * 0.5, normal)
    v = tl.where((code & 8) != 0, -v, v)
    sc = tl.load(s_ptr + rn[:, None] * s_st + (kk // 32)[None, :], mask=mw, other=127)
    si = sc.to(tl.int32)
    return v * tl.where(si == 0, 1 << 22, si << 23).to(tl.float32, bitcast=True)


@triton.jit
def _wonly_kernel(x_ptr, x_st, c_ptr, c_st, s_ptr, z_ptr, g_st, y_ptr, y_st, M, N, K, GROUP,
                  MX: tl.constexpr, BITS: tl.constexpr, FP8: tl.constexpr, BM: tl.constexpr,
                  BN: tl.constexpr, BK: tl.constexpr):
    """One (BM, BN) tile of ``y = x @ w.T``: the weight tile decoded in float32 by the
    format's decoder (``MX``: MXFP4, ``s_ptr`` the E8M0 bytes, ``z_ptr`` unused), then an IEEE
    float32 ``tl.dot``."""
    rm = (tl.program_id(0) * BM + tl.arange(0, BM)).to(tl.int64)
    rn = (tl.program_id(1) * BN + tl.arange(0, BN)).to(tl.int64)
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for k0 in range(0, K, BK):
        kk = k0 + tl.arange(0, BK)
        mx = (rm < M)[:, None] & (kk < K)[None, :]
        x = tl.load(x_ptr + rm[:, None] * x_st + kk[None, :], mask=mx, other=0.0)
        mw = (rn < N)[:, None] & (kk < K)[None, :]
        if MX:
            w = _mxfp4_tile(c_ptr, c_st, s_ptr, g_st, rn, kk, mw)
        else:
            w = _int_tile(c_ptr, c_st, s_ptr, z_ptr, g_st, rn, kk, mw, GROUP, BITS, FP8)
        acc += tl.dot(x.to(tl.float32), tl.trans(w), input_precision="ieee")
    my = (rm < M)[:, None] & (rn < N)[None, :]
    tl.store(y_ptr + rm[:, None] * y_st + rn[None, :], acc, mask=my)


def qgemm(x: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor,
          bits: int, fp8: bool, group: int, out: torch.Tensor) -> None:
    """``out (M, N) float32 = x (M, K) @ w.T`` for ``w`` the (N, K) weight of ``codes`` (N, K
    or ceil(K / 2) bytes), ``scale`` / ``zero`` (N, K / group) float32. ``out`` may be a
    column slice of a wider matrix (its row stride is used)."""
    m, k = x.shape
    n = codes.shape[0]
    if m == 0 or n == 0:
        return
    x = x.contiguous()
    codes, scale, zero = codes.contiguous(), scale.contiguous(), zero.contiguous()
    assert out.stride(1) == 1 and out.dtype == torch.float32 and scale.shape == zero.shape
    bm = min(pow2(m, 16), 64)
    bn = 32 if INTERPRET else 64
    bk = 32 if INTERPRET else 64
    grid = (triton.cdiv(m, bm), triton.cdiv(n, bn))
    _wonly_kernel[grid](x, x.stride(0), codes, codes.stride(0), scale, zero, scale.stride(0),
                        out, out.stride(0), m, n, k, group, MX=False, BITS=bits, FP8=bool(fp8),
                        BM=bm, BN=bn, BK=bk)


def mxfp4_gemm(x: torch.Tensor, blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """``x (M, K) @ w.T`` float32 for the MXFP4 matrix ``w``: ``blocks`` (N, K / 32, 16) and
    ``scales`` (N, K / 32) uint8."""
    m, k = x.shape
    n = scales.shape[0]
    out = torch.empty((m, n), dtype=torch.float32, device=x.device)
    if m == 0 or n == 0:
        return out
    x = x.contiguous()
    b = blocks.reshape(n, -1).contiguous()
    s = scales.contiguous()
    bm = min(pow2(m, 16), 64)
    bn = 32 if INTERPRET else 64
    grid = (triton.cdiv(m, bm), triton.cdiv(n, bn))
    _wonly_kernel[grid](x, x.stride(0), b, b.stride(0), s, s, s.stride(0), out, out.stride(0),
                        m, n, k, 32, MX=True, BITS=4, FP8=False, BM=bm, BN=bn,
                        BK=32 if INTERPRET else 64)
    return out
