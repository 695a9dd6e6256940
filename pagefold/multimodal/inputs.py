"""What a request carries of its images: plain data (msgspec-encodable, picklable).

Invariants: features are in prompt order and do not overlap; feature ``i`` covers prompt tokens
``offset .. offset + length - 1`` (all image placeholder tokens) and its encoder output has
``length`` rows; ``mm_hash`` is the sha256 of the processed pixels and grid, so two images
hash equal exactly when the encoder sees the same input.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field

import numpy as np
import torch

__all__ = ["ImageFeature", "MultiModalInputs", "pixels_hash"]


def pixels_hash(pixels: np.ndarray, grid_thw: list[int]) -> str:
    h = hashlib.sha256(np.ascontiguousarray(pixels, dtype=np.float32).tobytes())
    h.update(repr(list(grid_thw)).encode())
    return h.hexdigest()


@dataclass(slots=True)
class ImageFeature:
    """One image of a prompt: its placeholder span, content hash and the encoder's input
    (float32 patches as raw bytes, shape ``shape``; patch grid ``grid_thw``)."""

    offset: int
    length: int
    mm_hash: str
    pixels: bytes
    shape: list[int]
    grid_thw: list[int]

    def pixel_tensor(self) -> torch.Tensor:
        return torch.frombuffer(bytearray(self.pixels), dtype=torch.float32).view(*self.shape)


@dataclass(slots=True)
class MultiModalInputs:
    """A request's images and, for M-RoPE models, the (3, prompt length) rotary positions of
    its prompt (temporal, height, width rows) and the offset of every later position:
    position ``p`` past the prompt rotates at ``p + mrope_delta`` on all three rows.

    ``bidirectional`` (Gemma 3): the tokens of one image attend to each other both ways, so a
    prefill chunk never ends strictly inside an image (the scheduler's rule,
    ``core/encoder_budget.py``): an image token's keys and values depend on the image's later
    tokens, which must be in the same forward."""

    features: list[ImageFeature] = field(default_factory=list)
    mrope_positions: list[list[int]] | None = None
    mrope_delta: int = 0
    bidirectional: bool = False

    def hashes_in(self, start: int, end: int) -> list[str]:
        """Content hashes of the images with a placeholder token in ``[start, end)``."""
        return [f.mm_hash for f in self.features
                if f.offset < end and start < f.offset + f.length]

    def cut_inside(self, start: int, end: int) -> ImageFeature | None:
        """With ``bidirectional``: the image a chunk ``[start, end)`` would end strictly inside
        (None when it ends outside every image, or when attention is causal)."""
        if self.bidirectional:
            for f in self.features:
                if f.offset < end < f.offset + f.length:
                    return f
        return None
