"""A quantized matrix as the native decode driver takes it (``csrc/quant_linear.cpp``).

The driver's records name, per matrix, a weight address and the GEMV that multiplies by it,
all GEMVs under one signature (``decode_step.cpp``'s ``GemvFn``). A bf16 matrix's weight
address is its tensor; a quantized one's is a :class:`QuantMatrix` descriptor (its format,
codes, scales, mins or zeros, bits, group, a flag) and its GEMV ``pf_linear_quant``, which
makes the module path's product on bf16 rows (the same kernel, the same roundings), so the
driver's results are the module path's bits.

Invariant: a descriptor points into its weight's tensors; the weight object holds the
descriptor (``native_matrix`` below caches it there), so the two live and die together.
"""

from __future__ import annotations

import ctypes

import torch

from pagefold.csrc import cpu_ops

__all__ = ["FORMATS", "QuantMatrix", "describe", "record_matrix"]

# quant_linear.cpp's enum Format.
FORMATS = {"affine": 1, "affine_q8": 2, "int": 3, "affine_q8mm": 4}


class QuantMatrix(ctypes.Structure):
    """quant_linear.cpp's ``QuantMatrix``, field for field."""

    _fields_ = [("format", ctypes.c_int64), ("codes", ctypes.c_void_p),
                ("scale", ctypes.c_void_p), ("aux", ctypes.c_void_p), ("bits", ctypes.c_int64),
                ("group", ctypes.c_int64), ("flag", ctypes.c_int64)]


def describe(fmt: str, codes: torch.Tensor, scale: torch.Tensor, aux: torch.Tensor, bits: int,
             group: int, flag: int) -> tuple[QuantMatrix, int] | None:
    """The descriptor of a matrix in format ``fmt`` and ``pf_linear_quant``'s address, or None
    without the compiled kernels (or with a library whose descriptor differs: refused, not
    misread)."""
    lib = cpu_ops.kernels()
    if lib is None or getattr(lib, "pf_linear_quant", None) is None:
        return None
    words = len(QuantMatrix._fields_)
    if lib.pf_quant_matrix_words() != words:
        raise RuntimeError("pf_linear_quant's QuantMatrix differs from native_matrix's")
    if not all(t.is_contiguous() and t.device.type == "cpu" for t in (codes, scale, aux)):
        return None
    desc = QuantMatrix(FORMATS[fmt], codes.data_ptr(), scale.data_ptr(), aux.data_ptr(), bits,
                       group, flag)
    return desc, ctypes.cast(lib.pf_linear_quant, ctypes.c_void_p).value


def record_matrix(packed, bias: torch.Tensor | None) -> tuple[int, int, int, int] | None:
    """A quantized layer's matrix for the native decode driver (``layers.native_record``):
    (descriptor address, bias address or 0, its GEMV's address, most rows: the weight's bf16
    choice), or None for a bias that is not contiguous bf16 or a weight whose few-row kernel
    does not take it (``packed.native()``). The layer checks its own conditions first."""
    if bias is not None and not (bias.dtype == torch.bfloat16 and bias.is_contiguous()):
        return None
    got = packed.native()
    if got is None:
        return None
    desc, fn = got
    return (ctypes.addressof(desc), bias.data_ptr() if bias is not None else 0, fn,
            packed.bf16_choice()[1])
