"""RMSNorm in the two flavours checkpoints use: ``x * w`` and zero-centred ``x * (1 + w)``."""

from __future__ import annotations

import torch
from torch import nn


class RMSNorm(nn.Module):
    """Normalises in float32 and casts back, as transformers does.

    ``zero_centered``: the weight is stored as an offset from 1 (Qwen3.5 / Qwen3-Next).
    """

    def __init__(self, dim: int, eps: float = 1e-6, zero_centered: bool = False) -> None:
        super().__init__()
        self.eps = eps
        self.zero_centered = zero_centered
        self.weight = nn.Parameter(torch.zeros(dim) if zero_centered else torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        if self.zero_centered:
            return (h * (1.0 + self.weight.float())).to(dtype)
        return self.weight * h.to(dtype)
