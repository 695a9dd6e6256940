"""The torch form of the batched LoRA ops (see :mod:`pagefold.ops.lora`): the rows of each
slot present in the step are gathered, multiplied as one block, and scattered back."""

from __future__ import annotations

import torch


def _slots(idx: torch.Tensor) -> list[tuple[int, torch.Tensor]]:
    """(slot, its rows) for every slot >= 0 present in ``idx``."""
    return [(int(s), (idx == s).nonzero().squeeze(1))
            for s in torch.unique(idx).tolist() if s >= 0]


def shrink(x: torch.Tensor, a: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    v = torch.zeros(x.shape[0], a.shape[1], dtype=torch.float32, device=x.device)
    for s, rows in _slots(idx):
        v[rows] = x[rows].float() @ a[s].float().T
    return v


def expand_(y: torch.Tensor, v: torch.Tensor, b: torch.Tensor, idx: torch.Tensor) -> None:
    for s, rows in _slots(idx):
        y[rows] = (y[rows].float() + v[rows] @ b[s].float()).to(y.dtype)
