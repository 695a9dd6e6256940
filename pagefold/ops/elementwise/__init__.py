"""Elementwise / row-wise hot paths (RMSNorm with the residual add, q/k norm + RoPE,
SiLU-and-mul, the gated RMSNorms, the sigmoid output gate): the one entry layers call.

Each routes by :mod:`pagefold.kernels.dispatch`'s mode: Triton (:mod:`.triton`) where it is
selected for the tensors' device, else the compiled CPU kernel (:mod:`.cpu`). ``None``: not
handled (another device or dtype, unusual strides): the caller runs its own torch form, the
reference these are tested against.
"""

from __future__ import annotations

import torch

from pagefold.kernels import dispatch
from pagefold.ops.elementwise import cpu
from pagefold.ops.elementwise.cpu import NORM_FLOAT_WEIGHT, gated_norm_gate_first

__all__ = ["NORM_FLOAT_WEIGHT", "gated_norm_gate_first", "qk_norm_rope", "rms_norm",
           "rms_norm_gated", "sigmoid_gate", "silu_and_mul"]


def _triton(device: torch.device):
    """The Triton module when it is selected for ``device`` (imported only then), else None."""
    if not dispatch.use_triton(device):
        return None
    from pagefold.ops.elementwise import triton as elementwise_triton

    return elementwise_triton


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, zero_centered: bool | int,
             residual: torch.Tensor | None = None) -> torch.Tensor | None:
    """See :func:`.cpu.rms_norm` (``zero_centered`` may be :data:`NORM_FLOAT_WEIGHT`, a
    compiled-only mode)."""
    t = _triton(x.device) if zero_centered != NORM_FLOAT_WEIGHT else None
    mod = t if t is not None else cpu
    return mod.rms_norm(x, weight, eps, zero_centered, residual=residual)


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor | None:
    """See :func:`.cpu.silu_and_mul`."""
    t = _triton(gate_up.device)
    return (t or cpu).silu_and_mul(gate_up)


def qk_norm_rope(qkv: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor,
                 sin: torch.Tensor, **kw) -> tuple[torch.Tensor, torch.Tensor] | None:
    """See :func:`.cpu.qk_norm_rope`."""
    t = _triton(qkv.device)
    return (t or cpu).qk_norm_rope(qkv, positions, cos, sin, **kw)


def rms_norm_gated(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor,
                   eps: float) -> torch.Tensor | None:
    """See :func:`.cpu.rms_norm_gated`."""
    t = _triton(x.device)
    return (t or cpu).rms_norm_gated(x, gate, weight, eps)


def sigmoid_gate(o: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    """``o * sigmoid(gate)`` for ``o`` (T, H * D) and ``gate`` (T, H, D) (any row and head
    strides, contiguous heads); a new (T, H * D) tensor in ``o``'s dtype: the compiled kernel
    in bf16 on the CPU (the same bits as the native decode step, which calls it too), else
    torch."""
    out = cpu.sigmoid_gate(o, gate)
    return out if out is not None else o * torch.sigmoid(gate.reshape(gate.shape[0], -1))
