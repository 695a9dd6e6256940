"""The compiled varlen causal conv (``csrc/conv.cpp``) through ctypes."""

from __future__ import annotations

import torch

from pagefold.csrc.cpu_ops import DTYPE_CODE, kernels
from pagefold.ops.common.capture import PagedOut

__all__ = ["conv_varlen_cpu"]


def conv_varlen_cpu(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                     conv_state: torch.Tensor, cu_seqlens: torch.Tensor,
                     activation: str | None, capture: tuple[list[int], PagedOut] | None = None
                     ) -> tuple[torch.Tensor, torch.Tensor] | None:
    """``causal_conv1d_varlen`` through ``pf_conv_varlen``, or None (nothing done) when the
    kernel does not take the inputs: kernels off, not on the CPU, float32 / bf16 not shared by
    every tensor, rows of ``x`` not contiguous, a capture destination in other pages or of
    another dtype. ``capture``: (flat token indices, a ``PagedOut``) written into the pages."""
    lib = kernels()
    tensors = (x, weight, conv_state, *(() if bias is None else (bias,)))
    code = DTYPE_CODE.get(x.dtype)
    if (lib is None or code is None or any(t.dtype != x.dtype or t.device.type != "cpu"
                                           for t in tensors) or x.stride(1) != 1):
        return None
    cap_args: tuple = (None, 0, None, 0, None, 0, 0)
    if capture:
        found = capture[1].kernel_args() if capture[1].dtype == x.dtype else None
        if found is None:
            return None
        pages, paged = found  # pages: kept alive over the call
        tok = torch.tensor(capture[0], dtype=torch.int64)
        cap_args = (tok.data_ptr(), len(capture[0]), *paged)
    t, c = x.shape
    k = weight.shape[1]
    w = weight.contiguous()
    b = bias.contiguous() if bias is not None else None
    state = conv_state.contiguous()
    cu = cu_seqlens.to(torch.int64).contiguous()
    y = torch.empty((t, c), dtype=x.dtype)
    new_state = torch.empty_like(state)
    rc = lib.pf_conv_varlen(code, x.data_ptr(), x.stride(0), w.data_ptr(),
                            b.data_ptr() if b is not None else None, state.data_ptr(),
                            new_state.data_ptr(), cu.data_ptr(), cu.numel() - 1, y.data_ptr(),
                            c, k, int(activation is not None), *cap_args,
                            torch.get_num_threads())
    return (y, new_state) if rc == 0 else None
