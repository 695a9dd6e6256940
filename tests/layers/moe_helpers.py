"""Shared pieces of the MoE experts' tests: random bf16 experts and the general path."""

from __future__ import annotations

import torch

from pagefold.layers.moe import MoEExperts


def random_experts(n_exp: int, hidden: int, inter: int, seed: int = 0) -> MoEExperts:
    """bf16 ``MoEExperts`` with N(0, 0.2) weights (large enough that wrong rows show)."""
    torch.manual_seed(seed)
    m = MoEExperts(n_exp, hidden, inter)
    with torch.no_grad():
        m.gate_up_proj.normal_(0, 0.2)
        m.down_proj.normal_(0, 0.2)
    return m.bfloat16()


def general_path(m: MoEExperts, x, idx, w) -> torch.Tensor:
    """``m``'s output through the general path (the Python loop over experts): the few-token
    and grouped paths turned off on this instance only."""
    m._few_rows = lambda *a: None
    m._grouped_ok = lambda *a: False
    try:
        return m(x, idx, w)
    finally:
        del m._few_rows, m._grouped_ok
