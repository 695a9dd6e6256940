"""MXFP4 weights (OCP Microscaling FP4, as gpt-oss stores its experts), kept as stored.

A matrix of ``R`` output rows and ``K`` inputs is ``blocks`` (R, K / 32, 16) uint8 and
``scales`` (R, K / 32) uint8: each block of 32 consecutive inputs holds 32 FP4 (E2M1) codes two
to a byte (the even input in the low nibble) and shares one E8M0 scale ``2 ** (s - 127)``
(255 is NaN and refused). E2M1 codes: sign bit 3, two exponent bits, one mantissa bit; the
values 0, 0.5, 1, 1.5, 2, 3, 4, 6 and their negatives. Stacked experts carry a leading
expert dimension.

The product decodes a tile of rows into float32 (every value and scale exact in float32) and
multiplies (:func:`mxfp4_reference`); that is the reference the compiled CPU kernel
(``pf_qgemv_mxfp4``, ``csrc/mxfp4.cpp``: 1..``KERNEL_MAX_ROWS`` rows, float32 sums of the
exactly decoded weights, so it agrees with the reference to float32 rounding of the sums) and
the Triton kernel (``ops/quant/triton.py``, where the Triton kernels run) are tested against.
bf16 rows take the compiled kernel through float32 (their product rounded to bf16 once).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from pagefold.csrc import cpu_ops
from pagefold.kernels import dispatch
from pagefold.quantization.formats import QuantizationError

__all__ = ["E2M1", "KERNEL_MAX_ROWS", "MXFP4_BLOCK", "check_mxfp4", "dequantize_mxfp4",
           "mxfp4_linear", "mxfp4_reference"]

MXFP4_BLOCK = 32
E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
TILE_ROWS = 2048  # rows decoded at a time: bounds the transient float32 tile
KERNEL_MAX_ROWS = 32  # activation rows the compiled kernel takes (more: the reference)


def check_mxfp4(blocks: torch.Tensor, scales: torch.Tensor, name: str) -> None:
    """A :class:`QuantizationError` naming ``name`` unless ``blocks`` / ``scales`` are a
    consistent MXFP4 pair with finite scales."""
    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8:
        raise QuantizationError(f"{name}: mxfp4 blocks and scales must be uint8, got "
                                f"{blocks.dtype} and {scales.dtype}")
    if blocks.shape[-1] != MXFP4_BLOCK // 2 or blocks.shape[:-1] != scales.shape:
        raise QuantizationError(f"{name}: mxfp4 blocks {tuple(blocks.shape)} do not match "
                                f"scales {tuple(scales.shape)} (want blocks = scales + (16,); "
                                "truncated or corrupt checkpoint)")
    if bool((scales == 255).any()):
        raise QuantizationError(f"{name}: mxfp4 scale 255 (NaN) in the checkpoint")


def _pair_lut(dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """(256, 2): the two E2M1 values of each byte (low nibble first)."""
    lut = torch.tensor(E2M1, dtype=torch.float32)
    b = torch.arange(256)
    return torch.stack((lut[b & 15], lut[b >> 4]), dim=-1).to(device=device, dtype=dtype)


def dequantize_mxfp4(blocks: torch.Tensor, scales: torch.Tensor,
                     dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """(..., R, G, 16) codes and (..., R, G) scales -> (..., R, G * 32) in ``dtype`` (exact in
    float32 and bfloat16: E2M1 values times powers of two; one table lookup per byte)."""
    # 2 ** (s - 127) exactly: s as a float32 exponent field (s = 0: the subnormal 2 ** -127).
    e = scales.to(torch.int32)
    scale = torch.where(e == 0, torch.full_like(e, 1 << 22), e << 23).view(torch.float32)
    pairs = F.embedding(blocks.reshape(-1, MXFP4_BLOCK // 2).to(torch.int32),
                        _pair_lut(dtype, blocks.device))  # (rows * G, 16, 2)
    w = pairs.view(*scales.shape, MXFP4_BLOCK) * scale.to(dtype)[..., None]
    return w.reshape(*scales.shape[:-1], scales.shape[-1] * MXFP4_BLOCK)


def _decode_dtype(dtype: torch.dtype) -> torch.dtype:
    # float16's exponent range is too narrow for every scale: decode it through float32.
    return dtype if dtype in (torch.float32, torch.bfloat16) else torch.float32


def _kernel(x: torch.Tensor, blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor | None:
    """``pf_qgemv_mxfp4`` on 1..``KERNEL_MAX_ROWS`` CPU rows (float32 sums), else None."""
    if (x.device.type != "cpu" or x.dim() != 2 or not 1 <= x.shape[0] <= KERNEL_MAX_ROWS
            or not (blocks.is_contiguous() and scales.is_contiguous())
            or x.dtype not in (torch.float32, torch.bfloat16)):
        return None
    lib = cpu_ops.kernels()
    if lib is None:
        return None
    xf = x.float().contiguous()
    n, k = scales.shape[0], scales.shape[1] * MXFP4_BLOCK
    y = torch.empty((x.shape[0], n), dtype=torch.float32)
    rc = lib.pf_qgemv_mxfp4(xf.data_ptr(), xf.shape[0], k, n, blocks.data_ptr(),
                            scales.data_ptr(), y.data_ptr(), n, torch.get_num_threads())
    return y.to(x.dtype) if rc == 0 else None


def mxfp4_linear(x: torch.Tensor, blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """``x @ w.T`` for the MXFP4 matrix ``w`` (R, K): the compiled kernel for few CPU rows,
    the Triton kernel where the Triton kernels run, else :func:`mxfp4_reference`."""
    if dispatch.use_triton(x.device) and x.dim() == 2:
        from pagefold.ops.quant.triton import mxfp4_gemm  # imports triton: only where it runs

        return mxfp4_gemm(x.float(), blocks, scales).to(x.dtype)
    y = _kernel(x, blocks, scales)
    return y if y is not None else mxfp4_reference(x, blocks, scales)


def mxfp4_reference(x: torch.Tensor, blocks: torch.Tensor, scales: torch.Tensor
                    ) -> torch.Tensor:
    """``x @ w.T`` decoding a tile of rows at a time into ``x``'s dtype (exact in float32 and
    bfloat16) and multiplying with ``F.linear``."""
    rows = scales.shape[0]
    if rows <= TILE_ROWS:
        return F.linear(x, dequantize_mxfp4(blocks, scales, _decode_dtype(x.dtype)).to(x.dtype))
    y = x.new_empty((*x.shape[:-1], rows))
    for r0 in range(0, rows, TILE_ROWS):
        r1 = min(rows, r0 + TILE_ROWS)
        w = dequantize_mxfp4(blocks[r0:r1], scales[r0:r1], _decode_dtype(x.dtype))
        y[..., r0:r1] = F.linear(x, w.to(x.dtype))
    return y
