"""Rotary position embedding with a precomputed cos/sin table (neox-style rotate-half)."""

from __future__ import annotations

import torch
from torch import nn


def inv_freq_from_config(config, head_dim: int,
                         rotary_dim: int | None = None) -> tuple[torch.Tensor, float]:
    """Inverse frequencies and attention scaling exactly as transformers computes them.

    Scaled variants (llama3, linear, yarn, dynamic, longrope) come from transformers' own RoPE
    initialisers so every config's ``rope_parameters`` is honoured.
    """
    params = getattr(config, "rope_parameters", None) or {}
    rope_type = params.get("rope_type", params.get("type", "default"))
    dim = rotary_dim or head_dim
    if rope_type == "default":
        theta = params.get("rope_theta", getattr(config, "rope_theta", 10000.0))
        inv = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
        return inv, 1.0
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    if rope_type not in ROPE_INIT_FUNCTIONS:
        raise ValueError(f"unsupported rope_type {rope_type!r}; "
                         f"known: {sorted(ROPE_INIT_FUNCTIONS)}")
    inv, scaling = ROPE_INIT_FUNCTIONS[rope_type](config, None)
    return inv.float(), float(scaling)


class RotaryEmbedding(nn.Module):
    """Applies RoPE to the first ``rotary_dim`` channels of each head (all of them by default).

    ``cos``/``sin`` are float32 (max_positions, rotary_dim) tables; the compiled q/k norm +
    RoPE kernel (:func:`pagefold.ops.elementwise.cpu.qk_norm_rope`) reads them directly and
    rounds as :meth:`forward` does (tables cast to the input dtype, each product and the sum
    rounded).
    """

    def __init__(self, config, head_dim: int, max_positions: int, rotary_dim: int | None = None):
        super().__init__()
        self.head_dim = head_dim
        self.rotary_dim = rotary_dim or head_dim
        inv_freq, scaling = inv_freq_from_config(config, head_dim, self.rotary_dim)
        pos = torch.arange(max_positions, dtype=torch.float32)
        freqs = pos[:, None] * inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        self.register_buffer("cos", emb.cos() * scaling, persistent=False)
        self.register_buffer("sin", emb.sin() * scaling, persistent=False)
        self.mrope_axis = mrope_axis(config, self.rotary_dim)

    def tables(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """float32 (T, rotary_dim) cos and sin rows of ``positions``: (T,) plain positions, or
        (3, T) M-RoPE positions (temporal, height, width), where channel ``c`` takes row
        ``mrope_axis[c]``'s position (equal rows give the plain rows bit for bit)."""
        if positions.dim() == 1:
            return self.cos[positions], self.sin[positions]
        if self.mrope_axis is None:
            raise ValueError("3-row (M-RoPE) positions for a model without mrope_section")
        pos = positions[self.mrope_axis.to(positions.device)].T  # (T, rotary_dim)
        ch = torch.arange(self.rotary_dim, device=positions.device)
        return self.cos[pos, ch], self.sin[pos, ch]

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor):
        """q (T, H, D), k (T, KVH, D); positions (T,) or (3, T) (see :meth:`tables`);
        returns rotated copies in the input dtype."""
        cos, sin = self.tables(positions)
        cos, sin = cos.to(q.dtype).unsqueeze(1), sin.to(q.dtype).unsqueeze(1)
        return _apply(q, cos, sin, self.rotary_dim), _apply(k, cos, sin, self.rotary_dim)


def mrope_axis(config, rotary_dim: int) -> torch.Tensor | None:
    """Per rotary channel, which M-RoPE position row rotates it (0 temporal, 1 height, 2
    width), or None without ``mrope_section``. Interleaved, as transformers' Qwen3.5 lays it
    out whatever ``mrope_interleaved`` says: of the ``rotary_dim / 2`` frequencies,
    ``j % 3 == 1`` below ``3 * section[1]`` is height, ``j % 3 == 2`` below
    ``3 * section[2]`` width, every other temporal. Both rotate-half halves share it."""
    params = getattr(config, "rope_parameters", None) or {}
    section = params.get("mrope_section")
    if not section:
        return None
    half = rotary_dim // 2
    axis = torch.zeros(half, dtype=torch.int64)
    for row in (1, 2):
        axis[row:3 * section[row]:3] = row
    return torch.cat([axis, axis])


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def _apply(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, rotary_dim: int) -> torch.Tensor:
    if rotary_dim == x.shape[-1]:
        return x * cos + _rotate_half(x) * sin
    rot, rest = x[..., :rotary_dim], x[..., rotary_dim:]
    return torch.cat((rot * cos + _rotate_half(rot) * sin, rest), dim=-1)
