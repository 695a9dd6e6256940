"""Gemma 3's image encoder: the SigLIP vision tower and Gemma 3's multi-modal projector.

Input: the image processor's ``pixel_values`` of one or more images, (N, C, S, S) with ``S`` the
tower's ``image_size``. Output: ``mm_tokens_per_image`` embeddings of the text model's width
per image, in the order of the image's soft tokens (row-major over the pooled grid).

The math follows transformers' ``SiglipVisionModel`` (the ``last_hidden_state``; no pooling
head) and ``Gemma3MultiModalProjector``:

* patch embedding: a Conv2d whose kernel equals its stride, plus a learned position per patch
  (the grid is always ``image_size / patch_size`` square: no interpolation);
* pre-LayerNorm encoder layers: full bidirectional attention over the image's patches (scale
  ``head_dim ** -0.5``, biased q/k/v/out projections), a ``fc1 -> act -> fc2`` MLP; then
  ``post_layernorm``;
* projector: the (P, P) patch grid average-pooled by ``P / sqrt(mm_tokens_per_image)``, a
  zero-centred RMSNorm (``x * (1 + w)``, in float32), a matmul by
  ``mm_input_projection_weight`` (vision width x text width).

Weight names: ``vision_tower.{embeddings,encoder,post_layernorm}.*`` (the published layout's
``vision_tower.vision_model.*`` is renamed by the caller) and ``multi_modal_projector.*``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pagefold.layers.activations import get_activation

__all__ = ["Gemma3VisionEncoder"]


class SiglipEmbeddings(nn.Module):
    def __init__(self, cfg) -> None:
        super().__init__()
        self.patch_embedding = nn.Conv2d(cfg.num_channels, cfg.hidden_size,
                                         kernel_size=cfg.patch_size, stride=cfg.patch_size)
        self.num_patches = (cfg.image_size // cfg.patch_size) ** 2
        self.position_embedding = nn.Embedding(self.num_patches, cfg.hidden_size)

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        x = self.patch_embedding(pixels.to(self.patch_embedding.weight.dtype))
        x = x.flatten(2).transpose(1, 2)  # (N, patches, dim), row-major over the grid
        return x + self.position_embedding.weight[None]


class SiglipAttention(nn.Module):
    def __init__(self, cfg) -> None:
        super().__init__()
        dim = cfg.hidden_size
        self.num_heads = cfg.num_attention_heads
        self.head_dim = dim // self.num_heads
        self.q_proj = nn.Linear(dim, dim)
        self.k_proj = nn.Linear(dim, dim)
        self.v_proj = nn.Linear(dim, dim)
        self.out_proj = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n, t, _ = x.shape

        def heads(y: torch.Tensor) -> torch.Tensor:
            return y.view(n, t, self.num_heads, self.head_dim).transpose(1, 2)

        o = F.scaled_dot_product_attention(heads(self.q_proj(x)), heads(self.k_proj(x)),
                                           heads(self.v_proj(x)), scale=self.head_dim**-0.5)
        return self.out_proj(o.transpose(1, 2).reshape(n, t, -1))


class SiglipMLP(nn.Module):
    def __init__(self, cfg) -> None:
        super().__init__()
        self.fc1 = nn.Linear(cfg.hidden_size, cfg.intermediate_size)
        self.fc2 = nn.Linear(cfg.intermediate_size, cfg.hidden_size)
        self.act = get_activation(cfg.hidden_act, what="vision activation")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


class SiglipEncoderLayer(nn.Module):
    def __init__(self, cfg) -> None:
        super().__init__()
        self.layer_norm1 = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)
        self.self_attn = SiglipAttention(cfg)
        self.layer_norm2 = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)
        self.mlp = SiglipMLP(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.layer_norm1(x))
        return x + self.mlp(self.layer_norm2(x))


class SiglipEncoder(nn.Module):
    def __init__(self, cfg) -> None:
        super().__init__()
        self.layers = nn.ModuleList(SiglipEncoderLayer(cfg) for _ in range(cfg.num_hidden_layers))


class SiglipVisionTower(nn.Module):
    def __init__(self, cfg) -> None:
        super().__init__()
        self.embeddings = SiglipEmbeddings(cfg)
        self.encoder = SiglipEncoder(cfg)
        self.post_layernorm = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        x = self.embeddings(pixels)
        for layer in self.encoder.layers:
            x = layer(x)
        return self.post_layernorm(x)


class Gemma3Projector(nn.Module):
    def __init__(self, vision_cfg, text_hidden: int, tokens_per_image: int) -> None:
        super().__init__()
        self.mm_input_projection_weight = nn.Parameter(
            torch.zeros(vision_cfg.hidden_size, text_hidden))
        self.mm_soft_emb_norm = _ZeroCentredRMSNorm(vision_cfg.hidden_size,
                                                    vision_cfg.layer_norm_eps)
        self.side = vision_cfg.image_size // vision_cfg.patch_size
        per_side = int(round(tokens_per_image**0.5))
        if per_side * per_side != tokens_per_image or self.side % per_side:
            raise ValueError(f"mm_tokens_per_image {tokens_per_image} does not pool a "
                             f"{self.side}x{self.side} patch grid")
        self.kernel = self.side // per_side

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n, _, dim = x.shape
        grid = x.transpose(1, 2).reshape(n, dim, self.side, self.side)
        pooled = F.avg_pool2d(grid, self.kernel, self.kernel).flatten(2).transpose(1, 2)
        return torch.matmul(self.mm_soft_emb_norm(pooled),
                            self.mm_input_projection_weight).to(x.dtype)


class _ZeroCentredRMSNorm(nn.Module):
    """``x / rms(x) * (1 + w)`` in float32, cast back (transformers' ``Gemma3RMSNorm``)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (y * (1.0 + self.weight.float())).to(x.dtype)


class Gemma3VisionEncoder(nn.Module):
    """``vision_tower`` + ``multi_modal_projector``: images -> soft-token embeddings."""

    def __init__(self, vision_cfg, text_hidden: int, tokens_per_image: int) -> None:
        super().__init__()
        self.tokens_per_image = tokens_per_image
        self.vision_tower = SiglipVisionTower(vision_cfg)
        self.multi_modal_projector = Gemma3Projector(vision_cfg, text_hidden, tokens_per_image)

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        """pixels (N, C, S, S) or (C, S, S) -> (N * tokens_per_image, text width)."""
        if pixels.dim() == 3:
            pixels = pixels[None]
        out = self.multi_modal_projector(self.vision_tower(pixels))
        return out.reshape(-1, out.shape[-1])
