"""The compiled CPU batched LoRA kernels (``csrc/lora.cpp``) through ctypes. Each returns
None / False (nothing written) when the kernel does not take the inputs; the caller then runs
:mod:`pagefold.ops.lora.reference`."""

from __future__ import annotations

import torch

from pagefold.csrc.cpu_ops import kernels, ptr, rows_ok, usable


def _idx_ok(idx: torch.Tensor, rows: int) -> bool:
    return (idx.dtype == torch.int64 and idx.is_contiguous() and idx.device.type == "cpu"
            and idx.numel() == rows)


def shrink(x: torch.Tensor, a: torch.Tensor, idx: torch.Tensor) -> torch.Tensor | None:
    """``v`` (rows, R) float32 via ``pf_lora_shrink``, or None."""
    lib = kernels()
    code = usable(x, a)
    if (lib is None or code is None or not rows_ok(x) or a.dim() != 3 or not a.is_contiguous()
            or a.shape[2] != x.shape[1] or not _idx_ok(idx, x.shape[0])):
        return None
    v = torch.empty(x.shape[0], a.shape[1], dtype=torch.float32)
    rc = lib.pf_lora_shrink(code, ptr(x), x.stride(0), ptr(a), ptr(idx), ptr(v), x.shape[0],
                            a.shape[1], a.shape[2], torch.get_num_threads())
    return v if rc == 0 else None


def expand_(y: torch.Tensor, v: torch.Tensor, b: torch.Tensor, idx: torch.Tensor) -> bool:
    """``y += v @ b[idx]`` (``b`` (slots, R, out)) on the adapter rows via
    ``pf_lora_expand``; False: not done."""
    lib = kernels()
    code = usable(y, b)
    if (lib is None or code is None or not rows_ok(y) or b.dim() != 3 or not b.is_contiguous()
            or b.shape[2] != y.shape[1] or v.dtype != torch.float32 or not v.is_contiguous()
            or v.device.type != "cpu" or v.shape != (y.shape[0], b.shape[1])
            or not _idx_ok(idx, y.shape[0])):
        return False
    rc = lib.pf_lora_expand(code, ptr(y), y.stride(0), ptr(v), ptr(b), ptr(idx), y.shape[0],
                            b.shape[2], b.shape[1], torch.get_num_threads())
    return rc == 0
