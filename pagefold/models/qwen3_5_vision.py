"""Qwen3.5's vision tower: patch embedding -> ViT blocks with 2-D rotary -> 2x2 patch merger.

Input: the image processor's ``pixel_values`` (patches, C * Tp * P * P), each image's patches in
merge-block order (every ``merge x merge`` group of neighbouring patches consecutive), and its
``(t, h, w)`` patch grid. Output: ``t * h * w / merge**2`` embeddings of the text model's width
per image, in the order of the image's placeholder tokens.

The math follows transformers' ``Qwen3_5VisionModel``: a learned square position table
resampled bilinearly (corners aligned) to each grid, axial RoPE (height then width
frequencies over half the head each, the whole head rotated, in float32), full bidirectional
attention within each frame, pre-LayerNorm blocks, and the merger (LayerNorm, then the
``merge**2`` neighbours concatenated, fc1, GELU, fc2). Weight names match the checkpoint's
``model.visual.*``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["Qwen3_5VisionModel"]


def _activation(name: str):
    if name in ("gelu_pytorch_tanh", "gelu_new", "gelu_fast"):
        return lambda x: F.gelu(x, approximate="tanh")
    if name == "gelu":
        return F.gelu
    if name in ("silu", "swish"):
        return F.silu
    raise ValueError(f"unsupported vision activation {name!r}")


class VisionPatchEmbed(nn.Module):
    """A Conv3d whose kernel equals its stride: one linear map per (Tp, P, P) patch."""

    def __init__(self, cfg) -> None:
        super().__init__()
        self.shape = (cfg.in_channels, cfg.temporal_patch_size, cfg.patch_size, cfg.patch_size)
        k = self.shape[1:]
        self.proj = nn.Conv3d(cfg.in_channels, cfg.hidden_size, kernel_size=k, stride=k)

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        x = pixels.view(-1, *self.shape).to(self.proj.weight.dtype)
        return self.proj(x).view(x.shape[0], -1)


class VisionAttention(nn.Module):
    def __init__(self, cfg) -> None:
        super().__init__()
        self.num_heads = cfg.num_heads
        self.head_dim = cfg.hidden_size // cfg.num_heads
        self.qkv = nn.Linear(cfg.hidden_size, 3 * cfg.hidden_size)
        self.proj = nn.Linear(cfg.hidden_size, cfg.hidden_size)

    def forward(self, x: torch.Tensor, bounds: list[int], cos: torch.Tensor,
                sin: torch.Tensor) -> torch.Tensor:
        """x (N, dim); ``bounds``: frame boundaries (attention stays within a frame)."""
        n = x.shape[0]
        q, k, v = self.qkv(x).view(n, 3, self.num_heads, self.head_dim).unbind(1)
        q, k = _rotate(q, cos, sin), _rotate(k, cos, sin)
        outs = []
        for a, b in zip(bounds[:-1], bounds[1:]):
            o = F.scaled_dot_product_attention(
                q[a:b].transpose(0, 1), k[a:b].transpose(0, 1), v[a:b].transpose(0, 1),
                scale=self.head_dim**-0.5)
            outs.append(o.transpose(0, 1))
        return self.proj(torch.cat(outs).reshape(n, -1))


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Neox rotate-half RoPE over the whole head, in float32, cast back."""
    xf = x.float()
    half = xf.shape[-1] // 2
    rot = torch.cat((-xf[..., half:], xf[..., :half]), dim=-1)
    return (xf * cos[:, None] + rot * sin[:, None]).to(x.dtype)


class VisionMLP(nn.Module):
    def __init__(self, cfg) -> None:
        super().__init__()
        self.linear_fc1 = nn.Linear(cfg.hidden_size, cfg.intermediate_size)
        self.linear_fc2 = nn.Linear(cfg.intermediate_size, cfg.hidden_size)
        self.act = _activation(cfg.hidden_act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_fc2(self.act(self.linear_fc1(x)))


class VisionBlock(nn.Module):
    def __init__(self, cfg) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(cfg.hidden_size, eps=1e-6)
        self.norm2 = nn.LayerNorm(cfg.hidden_size, eps=1e-6)
        self.attn = VisionAttention(cfg)
        self.mlp = VisionMLP(cfg)

    def forward(self, x, bounds, cos, sin):
        x = x + self.attn(self.norm1(x), bounds, cos, sin)
        return x + self.mlp(self.norm2(x))


class VisionMerger(nn.Module):
    """LayerNorm per patch, then each merge group's patches concatenated -> fc1 -> GELU -> fc2."""

    def __init__(self, cfg) -> None:
        super().__init__()
        self.width = cfg.hidden_size * cfg.spatial_merge_size**2
        self.norm = nn.LayerNorm(cfg.hidden_size, eps=1e-6)
        self.linear_fc1 = nn.Linear(self.width, self.width)
        self.linear_fc2 = nn.Linear(self.width, cfg.out_hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.norm(x).view(-1, self.width)
        return self.linear_fc2(F.gelu(self.linear_fc1(x)))


def _grid_rows_cols(h: int, w: int, merge: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Row and column of each patch of an (h, w) grid, in merge-block order."""
    rows = torch.arange(h)[:, None].expand(h, w)
    cols = torch.arange(w)[None, :].expand(h, w)
    shape = (h // merge, merge, w // merge, merge)
    return (rows.reshape(shape).transpose(1, 2).flatten(),
            cols.reshape(shape).transpose(1, 2).flatten())


def _taps(index: torch.Tensor, size: int, side: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Bilinear taps (floor, floor + 1, clamped) into a ``side`` table and their weights,
    corners aligned: target ``i`` of ``size`` sits at ``i * (side - 1) / (size - 1)``."""
    src = index.float() * (side - 1) / max(size - 1, 1)
    floor = torch.floor(src)
    offsets = torch.arange(2)
    taps = (floor.long()[:, None] + offsets).clamp(0, side - 1)
    weights = (1 - (src[:, None] - floor[:, None] - offsets).abs()).clamp(min=0)
    return taps, weights


class Qwen3_5VisionModel(nn.Module):
    """The vision tower (``model.visual``); :meth:`forward` encodes one or more images."""

    def __init__(self, cfg) -> None:
        super().__init__()
        self.merge = cfg.spatial_merge_size
        self.patch_embed = VisionPatchEmbed(cfg)
        self.pos_embed = nn.Embedding(cfg.num_position_embeddings, cfg.hidden_size)
        self.side = int(cfg.num_position_embeddings**0.5)
        self.blocks = nn.ModuleList(VisionBlock(cfg) for _ in range(cfg.depth))
        self.merger = VisionMerger(cfg)
        head_dim = cfg.hidden_size // cfg.num_heads
        params = getattr(cfg, "rope_parameters", None) or {}
        theta = params.get("rope_theta", 10000.0)
        spatial = head_dim // 2
        inv = 1.0 / (theta ** (torch.arange(0, spatial, 2, dtype=torch.float) / spatial))
        self.register_buffer("inv_freq", inv, persistent=False)

    def tokens_per_image(self, grid_thw: tuple[int, int, int]) -> int:
        t, h, w = grid_thw
        return t * h * w // self.merge**2

    def _positions(self, grids: list[tuple[int, int, int]]):
        """Per patch: the resampled learned position embedding, and the rotary cos/sin."""
        idx, wts, hw = [], [], []
        for t, h, w in grids:
            rows, cols = _grid_rows_cols(h, w, self.merge)
            ht, hw_ = _taps(rows, h, self.side)
            wt, ww = _taps(cols, w, self.side)
            idx.append((ht[:, :, None] * self.side + wt[:, None, :]).reshape(-1, 4).repeat(t, 1))
            wts.append((hw_[:, :, None] * ww[:, None, :]).reshape(-1, 4).repeat(t, 1))
            hw.append(torch.stack([rows, cols], dim=-1).repeat(t, 1))
        dev = self.inv_freq.device
        idx, wts, hw = torch.cat(idx).to(dev), torch.cat(wts).to(dev), torch.cat(hw).to(dev)
        pos = (self.pos_embed(idx) * wts[:, :, None]).sum(1)
        freqs = hw[..., None].float() * self.inv_freq  # (N, 2, spatial / 2)
        freqs = torch.cat([freqs[:, 0], freqs[:, 1]], dim=-1)
        freqs = torch.cat([freqs, freqs], dim=-1)
        return pos, freqs.cos(), freqs.sin()

    def forward(self, pixels: torch.Tensor, grids: list[tuple[int, int, int]]) -> torch.Tensor:
        """pixels (patches, C * Tp * P * P) of the images with patch grids ``grids`` ->
        (sum of tokens_per_image, out_hidden_size)."""
        x = self.patch_embed(pixels)
        pos, cos, sin = self._positions(grids)
        x = x + pos.to(x.dtype)
        bounds = [0]
        for t, h, w in grids:
            for _ in range(t):
                bounds.append(bounds[-1] + h * w)
        for blk in self.blocks:
            x = blk(x, bounds, cos, sin)
        return self.merger(x)
