"""The sigmoid output gate of gated attention (Qwen3.5, Qwen3-Next): ``o * sigmoid(gate)``.

On the CPU in bf16 with the kernels built this is ``pf_sigmoid_gate`` (``csrc/layers.cpp``),
rounded as torch rounds ``o * torch.sigmoid(gate)`` (the sigmoid to bf16, then the product)
but with the kernels' own ``exp``: the module path and the native decode step
(``decode_native``) call the same kernel, so both give the same bits. Other
dtypes and devices use torch.
"""

from __future__ import annotations

import torch

from pagefold.csrc import cpu_ops


def sigmoid_gate(o: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    """``o * sigmoid(gate)`` for ``o`` (T, H * D) and ``gate`` (T, H, D) (any row and head
    strides, contiguous heads); a new (T, H * D) tensor in ``o``'s dtype."""
    t, h, d = gate.shape
    lib = cpu_ops.kernels() if o.device.type == "cpu" else None
    if (lib is not None and o.dtype == torch.bfloat16 and gate.dtype == o.dtype
            and o.is_contiguous() and o.shape == (t, h * d) and gate.stride(2) == 1 and t > 0):
        out = torch.empty_like(o)
        rc = lib.pf_sigmoid_gate(1, o.data_ptr(), o.stride(0), gate.data_ptr(), gate.stride(0),
                                 gate.stride(1), out.data_ptr(), out.stride(0), t, h, d,
                                 torch.get_num_threads())
        if rc == 0:
            return out
    return o * torch.sigmoid(gate.reshape(t, -1))
