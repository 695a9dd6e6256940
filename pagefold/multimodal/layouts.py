"""Per-model hooks of the image pipeline: how a model's prompt marks an image, which image
processor prepares it, how many tokens it becomes, and how those tokens attend and rotate.

An :class:`ImageLayout` is all :class:`~pagefold.multimodal.processor.ImageInputProcessor`
knows of a model. Two layouts exist:

* :class:`QwenLayout` (Qwen3.5): the prompt holds ``<|vision_start|><|image_pad|>
  <|vision_end|>``; the pad is repeated ``t * h * w / merge**2`` times (transformers'
  Qwen2-VL PIL processor gives the patch grid); M-RoPE positions; causal attention.
* :class:`Gemma3Layout` (Gemma 3): the prompt holds ``<start_of_image>``, which becomes
  ``"\\n\\n" <start_of_image> <image_soft_token> x mm_tokens_per_image <end_of_image> "\\n\\n"``
  (transformers' ``Gemma3Processor``'s full image sequence, with the two ``"\\n\\n"`` tokenized
  alone, as vLLM does); Gemma 3's PIL image processor (no pan-and-scan); plain positions; the
  soft tokens of one image attend to each other both ways (``bidirectional``).
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import numpy as np

logger = logging.getLogger(__name__)

__all__ = ["Gemma3Layout", "ImageLayout", "ProcessedImage", "QwenLayout", "layout_for",
           "mrope_positions"]

_QWEN_KEYS = ("patch_size", "temporal_patch_size", "merge_size", "min_pixels",
              "max_pixels", "image_mean", "image_std", "size", "do_resize",
              "do_rescale", "rescale_factor", "do_normalize", "do_convert_rgb")
_GEMMA3_KEYS = ("size", "image_mean", "image_std", "resample", "do_resize", "do_rescale",
                "rescale_factor", "do_normalize", "do_convert_rgb")


@dataclass(slots=True)
class ProcessedImage:
    """One image as the encoder takes it: float32 pixels, its grid (hashed with the pixels)
    and the number of embeddings (placeholder tokens) the encoder gives for it."""

    pixels: np.ndarray
    grid: list[int]
    length: int


class ImageLayout(Protocol):
    """The hooks: ``placeholder_id``: the prompt token that stands for one image;
    ``image_token_id``: the token each embedding row takes; ``before`` / ``after``: token ids
    the placeholder becomes around the image tokens; ``chat_ids``: what a chat ``image_url``
    part renders to; ``positions``: ``"mrope"`` (then :meth:`rope` gives them) or None (plain
    positions); ``bidirectional``: the tokens of one image attend to each other both ways (a
    prefill chunk then never ends inside one)."""

    placeholder_id: int
    image_token_id: int
    before: list[int]
    after: list[int]
    chat_ids: list[int]
    positions: str | None
    bidirectional: bool

    def process(self, images: list) -> list[ProcessedImage]:
        """The encoder inputs of RGB PIL images, in order."""
        ...


def _saved(model_dir: Path, keys: tuple[str, ...]) -> dict[str, Any]:
    path = model_dir / "preprocessor_config.json"
    saved = json.loads(path.read_text()) if path.is_file() else {}
    return {k: v for k, v in saved.items() if k in keys and v is not None}


def mrope_positions(num_tokens: int, features: list, merge: int
                    ) -> tuple[list[list[int]], int]:
    """Qwen3.5's (3, num_tokens) rotary positions and the delta of later positions.

    Text tokens advance all three rows by one; an image with patch grid (t, h, w) spans
    ``t * (h/m) * (w/m)`` tokens whose (temporal, height, width) rows are ``start + frame``,
    ``start + row``, ``start + col``, after which positions resume at
    ``start + max(h, w) / m``."""
    rows = np.zeros((3, num_tokens), dtype=np.int64)
    pos, tok = 0, 0
    for f in sorted(features, key=lambda f: f.offset):
        n = f.offset - tok
        rows[:, tok:f.offset] = np.arange(pos, pos + n)
        pos += n
        t, h, w = f.grid_thw[0], f.grid_thw[1] // merge, f.grid_thw[2] // merge
        tt, hh, ww = np.meshgrid(np.arange(t), np.arange(h), np.arange(w), indexing="ij")
        rows[:, f.offset:f.offset + f.length] = np.stack([tt, hh, ww]).reshape(3, -1) + pos
        pos += max(h, w)
        tok = f.offset + f.length
    rows[:, tok:] = np.arange(pos, pos + num_tokens - tok)
    delta = int(rows.max()) + 1 - num_tokens if num_tokens else 0
    return rows.tolist(), delta


class QwenLayout:
    positions = "mrope"
    bidirectional = False

    def __init__(self, model_dir: Path, hf_config) -> None:
        from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import (
            Qwen2VLImageProcessorPil,
        )

        vc = hf_config.vision_config
        self.image_token_id = self.placeholder_id = int(hf_config.image_token_id)
        self.before, self.after = [], []
        wrap = [getattr(hf_config, k, None) for k in ("vision_start_token_id",
                                                      "vision_end_token_id")]
        self.chat_ids = ([wrap[0]] if wrap[0] is not None else []) + [self.image_token_id] + (
            [wrap[1]] if wrap[1] is not None else [])
        self.merge = int(vc.spatial_merge_size)
        kw = _saved(model_dir, _QWEN_KEYS)
        kw.setdefault("patch_size", vc.patch_size)
        kw.setdefault("temporal_patch_size", vc.temporal_patch_size)
        kw.setdefault("merge_size", vc.spatial_merge_size)
        self.image_processor = Qwen2VLImageProcessorPil(**kw)

    def process(self, images: list) -> list[ProcessedImage]:
        out = self.image_processor(images=images, return_tensors="np")
        pixels = np.asarray(out["pixel_values"], dtype=np.float32)
        result, first = [], 0
        for grid in np.asarray(out["image_grid_thw"]).tolist():
            patches = int(np.prod(grid))
            result.append(ProcessedImage(pixels[first:first + patches], list(grid),
                                         patches // self.merge**2))
            first += patches
        return result

    def rope(self, num_tokens: int, features: list) -> tuple[list[list[int]], int]:
        """The prompt's (3, num_tokens) M-RoPE positions and the later-position delta."""
        return mrope_positions(num_tokens, features, self.merge)


class Gemma3Layout:
    positions = None
    bidirectional = True

    def __init__(self, model_dir: Path, hf_config) -> None:
        from transformers.models.gemma3.image_processing_pil_gemma3 import (
            Gemma3ImageProcessorPil,
        )

        from pagefold.checkpoint import load_tokenizer

        vc = hf_config.vision_config
        self.placeholder_id = int(hf_config.boi_token_index)
        self.image_token_id = int(hf_config.image_token_index)
        self.length = int(hf_config.mm_tokens_per_image)
        newlines = load_tokenizer(str(model_dir)).encode("\n\n", add_special_tokens=False)
        self.before = list(newlines) + [self.placeholder_id]
        self.after = [int(hf_config.eoi_token_index)] + list(newlines)
        self.chat_ids = [self.placeholder_id]
        kw = _saved(model_dir, _GEMMA3_KEYS)
        side = int(vc.image_size)
        kw.setdefault("size", {"height": side, "width": side})
        if (kw["size"].get("height"), kw["size"].get("width")) != (side, side):
            raise ValueError(f"preprocessor size {kw['size']} differs from the vision tower's "
                             f"image_size {side}")
        saved_pan = _saved(model_dir, ("do_pan_and_scan",)).get("do_pan_and_scan")
        if saved_pan:
            logger.warning("Gemma 3 pan-and-scan crops are not taken: each image is one "
                           "%dx%d view", side, side)
        self.patch = int(vc.patch_size)
        self.image_processor = Gemma3ImageProcessorPil(do_pan_and_scan=False, **kw)

    def process(self, images: list) -> list[ProcessedImage]:
        out = self.image_processor(images=images, return_tensors="np")
        pixels = np.asarray(out["pixel_values"], dtype=np.float32)  # (n, C, H, W)
        grid = [1, pixels.shape[2] // self.patch, pixels.shape[3] // self.patch]
        return [ProcessedImage(p, list(grid), self.length) for p in pixels]


_LAYOUTS = {"Qwen3_5ForConditionalGeneration": QwenLayout,
            "Gemma3ForConditionalGeneration": Gemma3Layout}


def layout_for(model_dir: str | Path, hf_config, arch: str) -> ImageLayout | None:
    """The image layout of a checkpoint that takes images (None: text only)."""
    cls = _LAYOUTS.get(arch)
    if (cls is None or getattr(hf_config, "vision_config", None) is None
            or getattr(hf_config, "image_token_id", None) is None):
        return None
    return cls(Path(model_dir), hf_config)
