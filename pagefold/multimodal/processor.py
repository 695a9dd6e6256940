"""Engine-side image processing: images -> encoder inputs, expanded prompt, M-RoPE positions.

The prompt marks each image with one placeholder token (the model's
:class:`~pagefold.multimodal.layouts.ImageLayout` says which: Qwen3.5's ``<|image_pad|>``,
Gemma 3's ``<start_of_image>``). Each image goes through transformers' image processor (the
PIL/numpy one: no torchvision needed), and its placeholder is expanded to the tokens the
vision tower produces for it (with the layout's tokens around them), as vLLM and
transformers' processors do. Inputs are validated here, before anything is queued: the
number of images against the placeholders and against ``limit_mm_per_prompt``, the image type.
"""

from __future__ import annotations

import base64
import binascii
import io
import urllib.parse
from pathlib import Path
from typing import Any

import numpy as np

from pagefold.multimodal.inputs import ImageFeature, MultiModalInputs, pixels_hash
from pagefold.multimodal.layouts import ImageLayout, layout_for

__all__ = ["ImageInputProcessor", "decode_image_url", "image_processor_for"]


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


class ImageInputProcessor:
    """Turns a prompt's token ids and images into the expanded ids and a request's
    :class:`MultiModalInputs`, through the model's :class:`ImageLayout`."""

    def __init__(self, layout: ImageLayout, *, limit: int) -> None:
        self.layout = layout
        self.image_token_id = layout.image_token_id
        self.limit = limit
        # ``allowed_local_media_path``: file:// image URLs are read from under it (None: never).
        self.local_root: str | None = None

    def decode_url(self, url: str):
        """A chat ``image_url`` part's image (``decode_image_url`` with this engine's
        ``allowed_local_media_path``)."""
        return decode_image_url(url, self.local_root)

    def placeholder(self, tokenizer) -> str:
        """The text that stands for one image in a chat message (the chat endpoint writes it
        where an ``image_url`` part was): Qwen3.5's ``<|vision_start|><|image_pad|>
        <|vision_end|>``, Gemma 3's ``<start_of_image>``."""
        return "".join(tokenizer.convert_ids_to_tokens(self.layout.chat_ids))

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
        lay = self.layout
        slots = [i for i, t in enumerate(token_ids) if t == lay.placeholder_id]
        if len(slots) != len(imgs):
            raise ValueError(f"the prompt has {len(slots)} image placeholders but "
                             f"{len(imgs)} images were given")
        if not imgs:
            return list(token_ids), MultiModalInputs()
        try:
            processed = lay.process([im.convert("RGB") for im in imgs])
        except Exception as e:  # the processor's own checks (size, channels)
            raise ValueError(f"image processing failed: {e}") from e
        ids: list[int] = []
        features = []
        prev = 0
        for slot, img in zip(slots, processed, strict=True):
            ids.extend(token_ids[prev:slot])
            ids.extend(lay.before)
            chunk = np.ascontiguousarray(img.pixels, dtype=np.float32)
            features.append(ImageFeature(
                offset=len(ids), length=img.length, mm_hash=pixels_hash(chunk, img.grid),
                pixels=chunk.tobytes(), shape=list(chunk.shape), grid_thw=list(img.grid)))
            ids.extend([lay.image_token_id] * img.length)
            ids.extend(lay.after)
            prev = slot + 1
        ids.extend(token_ids[prev:])
        mm = MultiModalInputs(features, bidirectional=lay.bidirectional)
        if lay.positions == "mrope":
            mm.mrope_positions, mm.mrope_delta = lay.rope(len(ids), features)
        return ids, mm


def image_processor_for(model_dir: str | Path, hf_config, arch: str, limit: int | None,
                        local_root: str | None = None) -> ImageInputProcessor | None:
    """The image input processor of a checkpoint that takes images (None otherwise).
    ``limit``: the most images per prompt (``limit_mm_per_prompt``'s ``image``; default 8);
    ``local_root``: ``allowed_local_media_path``."""
    layout = layout_for(model_dir, hf_config, arch)
    if layout is None:
        return None
    out = ImageInputProcessor(layout, limit=8 if limit is None else limit)
    out.local_root = local_root
    return out
