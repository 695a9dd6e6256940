"""RMSNorm in the two flavours checkpoints use: ``x * w`` and zero-centred ``x * (1 + w)``; and the
weightless one (no ``w``: Falcon-Mamba's dt/B/C norms, Llama-4's query/key L2 norm)."""

from __future__ import annotations

import torch
from torch import nn

from pagefold.layers.native_record import bf16_vector
from pagefold.ops import elementwise


class RMSNorm(nn.Module):
    """Normalises in float32 and casts back, as transformers does.

    ``zero_centered``: the weight is stored as an offset from 1 (Qwen3.5 / Qwen3-Next).

    ``forward(x)`` returns the normalised tensor. ``forward(x, residual)`` first adds: it
    returns ``(norm(x + residual), x + residual)``, the sum rounded to x's dtype as a separate
    add would (decoder layers carry the residual this way so the add and the norm are one
    pass); the sum may be written into ``residual``'s storage.

    A fused kernel (C++ on the CPU, Triton on CUDA; :mod:`pagefold.ops.elementwise`) does the
    whole row in one pass with the same roundings; :meth:`reference` is the torch formulation,
    used elsewhere.
    """

    def __init__(self, dim: int, eps: float = 1e-6, zero_centered: bool = False) -> None:
        super().__init__()
        self.eps = eps
        self.zero_centered = zero_centered
        self.weight = nn.Parameter(torch.zeros(dim) if zero_centered else torch.ones(dim))

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        if residual is None:
            out = elementwise.rms_norm(x, self.weight, self.eps, self.zero_centered)
            return out if out is not None else self.reference(x)
        out = elementwise.rms_norm(x, self.weight, self.eps, self.zero_centered, residual=residual)
        if out is not None:
            return out, residual
        residual = x + residual
        return self.reference(residual), residual

    def native_norm(self) -> tuple[int, float, int] | None:
        """(weight pointer, eps, kernel mode) for the native decode step (``decode_native``),
        whose ``pf_rms_norm`` call is this forward's on the CPU; None for a weight the
        kernel does not read as it is."""
        if not bf16_vector(self.weight):
            return None
        return self.weight.data_ptr(), float(self.eps), int(bool(self.zero_centered))

    def reference(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        if self.zero_centered:
            return (h * (1.0 + self.weight.float())).to(dtype)
        return self.weight * h.to(dtype)


class WeightlessRMSNorm(nn.Module):
    """``x * rsqrt(mean(x^2) + eps)`` computed in float32 and cast back to x's dtype, with no
    weight (transformers' ``Llama4TextL2Norm`` / Falcon-Mamba's mixer norms)."""

    def __init__(self, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        return (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype)
