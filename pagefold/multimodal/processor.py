"""Engine-side image processing: images -> encoder inputs, expanded prompt, M-RoPE positions.

The prompt marks each image with one image placeholder token (``image_token_id``; Qwen3.5's
chat template writes ``<|vision_start|><|image_pad|><|vision_end|>``). Each image goes through
transformers' image processor (the PIL/numpy one: no torchvision needed), and its placeholder
is expanded to the ``t * h * w / merge**2`` tokens the vision tower produces for it, as vLLM
and transformers' processors do. Inputs are validated here, before anything is queued: the
number of images against the placeholders and against ``limit_mm_per_prompt``, the image type.
"""

from __future__ import annotations

import base64
import binascii
import io
import json
import urllib.parse
from pathlib import Path
from typing import Any

import numpy as np

from pagefold.multimodal.inputs import ImageFeature, MultiModalInputs, pixels_hash

__all__ = ["ImageInputProcessor", "decode_image_url", "image_processor_for", "mrope_positions"]

# Architectures whose images pagefold encodes, with the kind of their rotary positions.
IMAGE_ARCHITECTURES = {"Qwen3_5ForConditionalGeneration": "mrope"}

_PROCESSOR_KEYS = ("patch_size", "temporal_patch_size", "merge_size", "min_pixels",
                   "max_pixels", "image_mean", "image_std", "size", "do_resize",
                   "do_rescale", "rescale_factor", "do_normalize", "do_convert_rgb")


def decode_image_url(url: str, local_root: str | None = None):
    """A PIL image from a ``data:image/...;base64,`` URL, or from a ``file://`` URL of a file
    inside ``local_root`` (vLLM's ``--allowed-local-media-path``; None: file URLs refused, a
    client must not read the server's files). Raises ValueError naming the problem: a remote
    URL (no network here), a file URL outside the allowed directory (symlinks resolved first)
    or of no file, another scheme, bad base64, bytes that are not an image."""
    if not isinstance(url, str) or not url:
        raise ValueError("image_url.url must be a non-empty string")
    if url.startswith(("http://", "https://")):
        raise ValueError(f"remote image URLs are not fetched (no network): {url[:60]!r}; "
                         "send the image as a data:image/...;base64 URL")
    if url.startswith("file://"):
        return _open_image(_local_file(url, local_root))
    head, _, payload = url.partition(",")
    if not head.startswith("data:image/") or not head.endswith(";base64"):
        raise ValueError("an image URL must be data:image/<type>;base64,... (or file:// under "
                         f"--allowed-local-media-path): got {head[:40]!r}")
    try:
        data = base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError) as e:
        raise ValueError(f"image data URL has invalid base64: {e}") from None
    return _open_image(data)


def _local_file(url: str, local_root: str | None) -> bytes:
    """The bytes of a ``file://`` URL's file, which must resolve inside ``local_root``."""
    if local_root is None:
        raise ValueError("file:// image URLs are refused unless the engine is started with "
                         "--allowed-local-media-path DIR (allowed_local_media_path)")
    parsed = urllib.parse.urlparse(url)
    if parsed.netloc not in ("", "localhost"):
        raise ValueError(f"file:// image URL names a host {parsed.netloc!r}; only local files "
                         "are read")
    root = Path(local_root).resolve()
    path = Path(urllib.parse.unquote(parsed.path)).resolve()
    if not path.is_relative_to(root):
        raise ValueError(f"image file {str(path)!r} is outside --allowed-local-media-path "
                         f"{str(root)!r}")
    if not path.is_file():
        raise ValueError(f"no image file at {str(path)!r}")
    return path.read_bytes()


def _open_image(data: bytes):
    from PIL import Image, UnidentifiedImageError

    try:
        img = Image.open(io.BytesIO(data))
        img.load()
    except (UnidentifiedImageError, OSError) as e:
        raise ValueError(f"malformed image: {e}") from None
    return img


def mrope_positions(num_tokens: int, features: list[ImageFeature], merge: int
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


class ImageInputProcessor:
    """Turns a prompt's token ids and images into the expanded ids and a request's
    :class:`MultiModalInputs`."""

    def __init__(self, hf_config, image_processor, *, limit: int, positions: str) -> None:
        vc = hf_config.vision_config
        self.image_token_id = int(hf_config.image_token_id)
        # The tokens around an image's placeholder in a rendered chat (Qwen: vision start/end).
        self.wrap = [getattr(hf_config, k, None)
                     for k in ("vision_start_token_id", "vision_end_token_id")]
        self.merge = int(vc.spatial_merge_size)
        self.limit = limit
        self.positions = positions
        self.image_processor = image_processor
        # ``allowed_local_media_path``: file:// image URLs are read from under it (None: never).
        self.local_root: str | None = None

    def decode_url(self, url: str):
        """A chat ``image_url`` part's image (``decode_image_url`` with this engine's
        ``allowed_local_media_path``)."""
        return decode_image_url(url, self.local_root)

    def placeholder(self, tokenizer) -> str:
        """The text that stands for one image in a chat message (the chat endpoint writes it
        where an ``image_url`` part was): ``<|vision_start|><|image_pad|><|vision_end|>``."""
        start, end = self.wrap
        ids = ([start] if start is not None else []) + [self.image_token_id] + (
            [end] if end is not None else [])
        return "".join(tokenizer.convert_ids_to_tokens(ids))

    def process(self, token_ids: list[int], images: Any
                ) -> tuple[list[int], MultiModalInputs]:
        from PIL import Image

        imgs = list(images) if isinstance(images, list | tuple) else [images]
        if len(imgs) > self.limit:
            raise ValueError(f"{len(imgs)} images in one prompt, above limit_mm_per_prompt "
                             f"image={self.limit}")
        for i, img in enumerate(imgs):
            if not isinstance(img, Image.Image):
                raise ValueError(f"image {i} is a {type(img).__name__}, not a PIL.Image")
        slots = [i for i, t in enumerate(token_ids) if t == self.image_token_id]
        if len(slots) != len(imgs):
            raise ValueError(f"the prompt has {len(slots)} image placeholders but "
                             f"{len(imgs)} images were given")
        if not imgs:
            return list(token_ids), MultiModalInputs()
        try:
            out = self.image_processor(images=[im.convert("RGB") for im in imgs],
                                       return_tensors="np")
        except Exception as e:  # the processor's own checks (size, channels)
            raise ValueError(f"image processing failed: {e}") from e
        pixels = np.asarray(out["pixel_values"], dtype=np.float32)
        grids = np.asarray(out["image_grid_thw"]).tolist()
        ids: list[int] = []
        features = []
        first, prev = 0, 0
        for slot, grid in zip(slots, grids, strict=True):
            ids.extend(token_ids[prev:slot])
            patches = int(np.prod(grid))
            length = patches // self.merge**2
            chunk = pixels[first:first + patches]
            first += patches
            features.append(ImageFeature(
                offset=len(ids), length=length, mm_hash=pixels_hash(chunk, grid),
                pixels=chunk.tobytes(), shape=list(chunk.shape), grid_thw=list(grid)))
            ids.extend([self.image_token_id] * length)
            prev = slot + 1
        ids.extend(token_ids[prev:])
        mm = MultiModalInputs(features)
        if self.positions == "mrope":
            mm.mrope_positions, mm.mrope_delta = mrope_positions(len(ids), features, self.merge)
        return ids, mm


def _qwen_image_processor(model_dir: Path, vision_config):
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import (
        Qwen2VLImageProcessorPil,
    )

    path = model_dir / "preprocessor_config.json"
    saved = json.loads(path.read_text()) if path.is_file() else {}
    kw = {k: v for k, v in saved.items() if k in _PROCESSOR_KEYS}
    kw.setdefault("patch_size", vision_config.patch_size)
    kw.setdefault("temporal_patch_size", vision_config.temporal_patch_size)
    kw.setdefault("merge_size", vision_config.spatial_merge_size)
    return Qwen2VLImageProcessorPil(**kw)


def image_processor_for(model_dir: str | Path, hf_config, arch: str, limit: int | None,
                        local_root: str | None = None) -> ImageInputProcessor | None:
    """The image input processor of a checkpoint that takes images (None otherwise).
    ``limit``: the most images per prompt (``limit_mm_per_prompt``'s ``image``; default 8);
    ``local_root``: ``allowed_local_media_path``."""
    kind = IMAGE_ARCHITECTURES.get(arch)
    vc = getattr(hf_config, "vision_config", None)
    if kind is None or vc is None or getattr(hf_config, "image_token_id", None) is None:
        return None
    proc = _qwen_image_processor(Path(model_dir), vc)
    out = ImageInputProcessor(hf_config, proc, limit=8 if limit is None else limit,
                              positions=kind)
    out.local_root = local_root
    return out
