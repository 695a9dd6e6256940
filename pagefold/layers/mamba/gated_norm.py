"""Gated, grouped RMSNorm applied to the Mamba-2 scan output before ``out_proj``.

transformers' Nemotron-H, Bamba and GraniteMoeHybrid mixers all use the same module
(``*RMSNormGated``): the gate is applied *before* the norm (mamba_ssm's
``norm_before_gate=False``), and the RMS statistics are taken per group of
``group_size = intermediate_size // n_groups`` channels, i.e. per SSM group, not over the whole
hidden vector:

    z = x * silu(gate)                              (float32)
    z_g = z_g * rsqrt(mean(z_g ** 2) + eps)         (for each group g of group_size channels)
    y = weight * z.to(x.dtype)

On the CPU the gate-first form runs compiled (``csrc/gated_norm.cpp``, the same steps and
roundings, equal up to float32 rounding); the torch form stays the fallback.

``norm_before_gate=True`` (the other mamba_ssm variant, unused by those three models) is
``y = weight * rmsnorm_grouped(x) * silu(gate)``.

Tensor parallelism: with a group per rank or more, each rank normalises its own groups. A
single group (``n_groups == 1``, Granite-4.0-H, Falcon-H1, Mamba-2) spans every rank's
channels: ``spans_ranks`` sums the squares over ranks (one all-reduce) before the mean.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pagefold.distributed.parallel_state import all_reduce, tp_size
from pagefold.ops.elementwise import gated_norm_gate_first

__all__ = ["GatedRMSNorm"]


class GatedRMSNorm(nn.Module):
    """Grouped RMSNorm with an optional SiLU gate.

    Parameters: ``weight`` (hidden_size,), named as in transformers so checkpoints load by
    name. ``forward(x, gate)`` takes ``x`` and ``gate`` of the same shape (..., hidden_size)
    and returns (..., hidden_size) in ``x.dtype``. Statistics are always computed in float32.
    ``gate=None`` gives a plain grouped RMSNorm.
    """

    def __init__(
        self,
        hidden_size: int,
        eps: float = 1e-6,
        group_size: int | None = None,
        norm_before_gate: bool = False,
        spans_ranks: bool = False,
    ) -> None:
        """``spans_ranks``: ``hidden_size`` is this rank's share of one group that all ranks
        share (the statistics are taken over the whole group)."""
        super().__init__()
        self.spans_ranks = spans_ranks and tp_size() > 1
        group_size = hidden_size if group_size is None else group_size
        if group_size <= 0 or hidden_size % group_size != 0:
            raise ValueError(f"hidden_size {hidden_size} not divisible by group_size {group_size}")
        self.hidden_size = hidden_size
        self.eps = eps
        self.group_size = group_size
        self.norm_before_gate = norm_before_gate
        self.weight = nn.Parameter(torch.ones(hidden_size))

    def _rms_grouped(self, z: torch.Tensor) -> torch.Tensor:
        if self.spans_ranks:
            sq = all_reduce(z.pow(2).sum(-1, keepdim=True))
            return z * torch.rsqrt(sq / (self.hidden_size * tp_size()) + self.eps)
        *lead, d = z.shape
        zg = z.view(*lead, d // self.group_size, self.group_size)
        zg = zg * torch.rsqrt(zg.pow(2).mean(-1, keepdim=True) + self.eps)
        return zg.view(*lead, d)

    def forward(self, x: torch.Tensor, gate: torch.Tensor | None = None) -> torch.Tensor:
        if x.shape[-1] != self.hidden_size:
            raise ValueError(f"expected last dim {self.hidden_size}, got {x.shape[-1]}")
        if gate is not None and gate.shape != x.shape:
            raise ValueError(f"gate shape {tuple(gate.shape)} != x shape {tuple(x.shape)}")
        if (gate is not None and not self.norm_before_gate and not self.spans_ranks
                and x.device.type == "cpu" and x.dim() == 2):
            out = gated_norm_gate_first(x, gate, self.weight, self.group_size, self.eps)
            if out is not None:
                return out
        in_dtype = x.dtype
        z = x.float()
        if gate is not None and not self.norm_before_gate:
            z = z * F.silu(gate.float())
        z = self._rms_grouped(z)
        if gate is not None and self.norm_before_gate:
            z = z * F.silu(gate.float())
        # HF rounds the normalised value to the input dtype before the weight multiply; do the
        # same so low-precision results round identically, then pin the output to x's dtype.
        return (self.weight * z.to(in_dtype)).to(in_dtype)

    def extra_repr(self) -> str:
        return (
            f"{self.hidden_size}, eps={self.eps}, group_size={self.group_size}, "
            f"norm_before_gate={self.norm_before_gate}"
        )
