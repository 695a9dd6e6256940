"""Tiny random vision-language checkpoints (Qwen3.5 with its vision tower; Llama 4, whose
vision tower pagefold skips) for tests.

Built offline like :mod:`pagefold.testing.tiny_models`: the same trained byte-level BPE, shrunk
by four ids so that four vision special tokens end the vocabulary, a random
``Qwen3_5ForConditionalGeneration`` from transformers saved in the published layout
(``model.language_model.*``, ``model.visual.*``), and a ``preprocessor_config.json`` for the
tiny image processor (4-pixel patches, 2x2 merge, so a 20x28 image is 4x8 patches = 8 tokens).

:func:`build_tiny_llama4_vl`: a random ``Llama4ForConditionalGeneration`` (text: the tiny
``llama4`` arch, a 1-layer vision tower and projector) as transformers saves it
(``language_model.model.*``, ``language_model.lm_head.*``, ``vision_model.*``,
``multi_modal_projector.*``), with the plain tiny tokenizer (no image processor: text only).

:func:`build_tiny_gemma3_vl`: a random ``Gemma3ForConditionalGeneration`` (text: the tiny
``gemma3`` arch, sliding window 11 so an image's 16 tokens outgrow it; a 2-layer SigLIP tower on
32x32 images of 4-pixel patches, its 8x8 outputs average-pooled 2x2 to 16 tokens) with
``<start_of_image>``, ``<end_of_image>``, ``<image_soft_token>`` ending the vocabulary
(:data:`GEMMA3_VISION_TOKENS`) and a ``preprocessor_config.json`` for Gemma 3's image processor.

Invariants: ``len(tokenizer) == text vocab_size``; the vision tokens are
``<|vision_start|>``, ``<|vision_end|>``, ``<|image_pad|>``, ``<|video_pad|>`` at the last
four ids (:data:`VISION_TOKENS`); same seed -> same weights.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from pagefold.testing.tiny_models import (
    BOS_ID,
    EOS_ID,
    IM_END_ID,
    PAD_ID,
    arch_config_kwargs,
    build_tokenizer,
)

__all__ = ["GEMMA3_IMAGE_PROCESSOR", "GEMMA3_VISION_TOKENS", "IMAGE_PROCESSOR", "VISION_TOKENS",
           "build_tiny_gemma3_vl", "build_tiny_llama4_vl", "build_tiny_qwen3_5_vl",
           "image_prompt"]

VISION_TOKENS = ("<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>")

# The image processor's settings (Qwen2-VL's processor, which Qwen3.5 uses): patch 4, temporal
# patch 2, merge 2, images resized to between 8x8 and 32x32 pixels (multiples of 8).
IMAGE_PROCESSOR = dict(
    image_processor_type="Qwen2VLImageProcessor", patch_size=4, temporal_patch_size=2,
    merge_size=2, min_pixels=8 * 8, max_pixels=32 * 32,
    image_mean=[0.5, 0.5, 0.5], image_std=[0.5, 0.5, 0.5],
)

_VISION = dict(
    depth=2, hidden_size=32, intermediate_size=64, num_heads=2, patch_size=4,
    temporal_patch_size=2, spatial_merge_size=2, num_position_embeddings=16, in_channels=3,
    initializer_range=0.1,
)


def image_prompt(text_before: str, text_after: str, images: int = 1) -> str:
    """A prompt with ``images`` image placeholders (``<|vision_start|><|image_pad|>
    <|vision_end|>`` each, as Qwen3.5's chat template writes them) between two texts."""
    one = "<|vision_start|><|image_pad|><|vision_end|>"
    return text_before + one * images + text_after


def build_tiny_qwen3_5_vl(out_dir: str | Path, *, seed: int = 0, vocab_size: int = 512,
                          **text_overrides: Any) -> Path:
    """A random ``Qwen3_5ForConditionalGeneration`` (text: the tiny ``qwen3_5`` arch) in
    ``out_dir``; returns the path."""
    import transformers
    from transformers import GenerationConfig

    out = Path(out_dir)
    tok = build_tokenizer(out, vocab_size=vocab_size - len(VISION_TOKENS))
    tok.add_special_tokens({"additional_special_tokens": list(VISION_TOKENS)},
                           replace_extra_special_tokens=False)
    ids = tok.convert_tokens_to_ids(list(VISION_TOKENS))
    if len(tok) != vocab_size or ids != list(range(vocab_size - 4, vocab_size)):
        raise RuntimeError(f"vision tokens got ids {ids} in a vocabulary of {len(tok)}")
    tok.save_pretrained(out)
    text = arch_config_kwargs("qwen3_5", **text_overrides)
    text.update(vocab_size=vocab_size, bos_token_id=BOS_ID, eos_token_id=EOS_ID,
                pad_token_id=PAD_ID)
    config = transformers.Qwen3_5Config(
        text_config=text, vision_config=dict(_VISION, out_hidden_size=text["hidden_size"]),
        vision_start_token_id=ids[0], vision_end_token_id=ids[1], image_token_id=ids[2],
        video_token_id=ids[3], tie_word_embeddings=text.get("tie_word_embeddings", True))
    torch.manual_seed(seed)
    model = transformers.Qwen3_5ForConditionalGeneration(config).eval()
    model.generation_config = GenerationConfig(
        bos_token_id=BOS_ID, eos_token_id=[EOS_ID, IM_END_ID], pad_token_id=PAD_ID,
        do_sample=False)
    model.save_pretrained(out)
    (out / "preprocessor_config.json").write_text(json.dumps(IMAGE_PROCESSOR, indent=1))
    return out


# Llama 4's vision tower: one layer, hidden 32, 28-pixel images of 14-pixel patches, pixel
# shuffle 0.5 (the adapter's output 24 is projected to the text hidden size).
_LLAMA4_VISION = dict(
    hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=40,
    vision_output_dim=24, projector_input_dim=24, projector_output_dim=24, image_size=28,
    patch_size=14, initializer_range=0.1,
)


def build_tiny_llama4_vl(out_dir: str | Path, *, seed: int = 0, vocab_size: int = 512,
                         **text_overrides: Any) -> Path:
    """A random ``Llama4ForConditionalGeneration`` (text: the tiny ``llama4`` arch) in
    ``out_dir``; returns the path."""
    import transformers
    from transformers import GenerationConfig

    out = Path(out_dir)
    tok = build_tokenizer(out, vocab_size=vocab_size)
    text = arch_config_kwargs("llama4", **text_overrides)
    text.update(vocab_size=len(tok), bos_token_id=BOS_ID, eos_token_id=EOS_ID,
                pad_token_id=PAD_ID)
    config = transformers.Llama4Config(text_config=text, vision_config=_LLAMA4_VISION,
                                       tie_word_embeddings=text["tie_word_embeddings"])
    torch.manual_seed(seed)
    model = transformers.Llama4ForConditionalGeneration(config).eval()
    model.generation_config = GenerationConfig(
        bos_token_id=BOS_ID, eos_token_id=[EOS_ID, IM_END_ID], pad_token_id=PAD_ID,
        do_sample=False)
    model.save_pretrained(out)
    return out


GEMMA3_VISION_TOKENS = ("<start_of_image>", "<end_of_image>", "<image_soft_token>")

# Gemma 3's image processor (PIL): every image resized to 32x32, normalised to [-1, 1].
GEMMA3_IMAGE_PROCESSOR = dict(
    image_processor_type="Gemma3ImageProcessor", size={"height": 32, "width": 32},
    image_mean=[0.5, 0.5, 0.5], image_std=[0.5, 0.5, 0.5], resample=2, do_pan_and_scan=False,
)

_SIGLIP = dict(
    hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
    image_size=32, patch_size=4, vision_use_head=False, layer_norm_eps=1e-6,
)


def build_tiny_gemma3_vl(out_dir: str | Path, *, seed: int = 0, vocab_size: int = 512,
                         **text_overrides: Any) -> Path:
    """A random ``Gemma3ForConditionalGeneration`` (text: the tiny ``gemma3`` arch) in
    ``out_dir``; returns the path. Its prompts mark an image with ``<start_of_image>``."""
    import transformers
    from transformers import GenerationConfig

    out = Path(out_dir)
    tok = build_tokenizer(out, vocab_size=vocab_size - len(GEMMA3_VISION_TOKENS))
    tok.add_special_tokens({"additional_special_tokens": list(GEMMA3_VISION_TOKENS)},
                           replace_extra_special_tokens=False)
    ids = tok.convert_tokens_to_ids(list(GEMMA3_VISION_TOKENS))
    if len(tok) != vocab_size or ids != list(range(vocab_size - 3, vocab_size)):
        raise RuntimeError(f"vision tokens got ids {ids} in a vocabulary of {len(tok)}")
    tok.save_pretrained(out)
    # No final logit soft cap (published Gemma 3 configs have none): transformers'
    # Gemma3ForConditionalGeneration never applies it, its Gemma3ForCausalLM (and vLLM) do.
    text = arch_config_kwargs("gemma3", **{"final_logit_softcapping": None, **text_overrides})
    text.update(vocab_size=vocab_size, bos_token_id=BOS_ID, eos_token_id=EOS_ID,
                pad_token_id=PAD_ID, initializer_range=0.1)
    config = transformers.Gemma3Config(
        text_config=text, vision_config=dict(_SIGLIP, initializer_range=0.1),
        mm_tokens_per_image=16, boi_token_index=ids[0], eoi_token_index=ids[1],
        image_token_index=ids[2], tie_word_embeddings=True, initializer_range=0.1)
    torch.manual_seed(seed)
    model = transformers.Gemma3ForConditionalGeneration(config).eval()
    with torch.no_grad():  # the projector starts at zero: random, so the image is seen
        proj = model.model.multi_modal_projector
        proj.mm_input_projection_weight.normal_(0, 0.3)
        proj.mm_soft_emb_norm.weight.normal_(0, 0.3)
    model.generation_config = GenerationConfig(
        bos_token_id=BOS_ID, eos_token_id=[EOS_ID, IM_END_ID], pad_token_id=PAD_ID,
        do_sample=False)
    model.save_pretrained(out)
    (out / "preprocessor_config.json").write_text(json.dumps(GEMMA3_IMAGE_PROCESSOR, indent=1))
    return out
