"""Building and loading a pagefold model: the class named by the architecture registry
(``pagefold.architectures``), weights from a local Hugging Face directory."""

from __future__ import annotations

import importlib
import logging
from pathlib import Path

import torch

from pagefold.architectures import ARCHITECTURES
from pagefold.checkpoint import text_config
from pagefold.models.weights import iter_weights
from pagefold.quantization import (
    Quantizer,
    finalize_all,
    quantize_loaded,
    resolve,
    weights_summary,
)
from pagefold.quantization.gguf import GGUFQuantizer, gguf_weights
from pagefold.quantization.qgemv_choice import choose_for as choose_quantized_products

logger = logging.getLogger(__name__)

__all__ = ["build_model", "load_model", "model_class"]


def model_class(arch: str):
    """The pagefold model class of ``arch`` (imported on first use); ``KeyError`` for an
    architecture pagefold does not serve."""
    path = ARCHITECTURES[arch].model
    if path is None:
        raise KeyError(arch)
    module, cls = path.split(":")
    return getattr(importlib.import_module(module), cls)


def build_model(cls, hf_config, max_positions: int):
    """``cls`` built from the checkpoint config's text part (and, for a class that takes one,
    its ``vision_config`` or the whole multimodal config: the vision tower of image inputs),
    without weights."""
    kw = {}
    if getattr(cls, "takes_vision_config", False):
        kw["vision_config"] = getattr(hf_config, "vision_config", None)
    if getattr(cls, "takes_mm_config", False):  # the whole multimodal config (Gemma 3)
        kw["mm_config"] = hf_config
    return cls(text_config(hf_config), max_positions=max_positions, **kw)


def load_model(model_dir: Path, hf_config, arch: str, dtype: torch.dtype, max_positions: int,
               device: torch.device, quantization: str | None = None):
    """``arch``'s model built in ``dtype`` on ``device`` with the weights of ``model_dir``,
    in eval mode without gradients. ``quantization``: the option (vLLM's ``--quantization``),
    checked against the checkpoint's own ``quantization_config``."""
    plan = resolve(hf_config, quantization)
    cls = model_class(arch)
    prev = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = build_model(cls, hf_config, max_positions)
    finally:
        torch.set_default_dtype(prev)
    weights = iter_weights(model_dir)
    if plan is not None and plan.checkpoint is not None:
        model.pf_quant = Quantizer(plan)
    if plan is not None and plan.gguf:
        model.pf_quant = GGUFQuantizer()
        weights = gguf_weights(weights)
    model.load_weights(weights)
    if plan is not None and plan.checkpoint is not None:
        finalize_all(model)
    if plan is not None and plan.gguf:
        model.pf_quant.finalize(model)
    if plan is not None and plan.on_load is not None:
        quantize_loaded(model, plan.on_load)
    if plan is not None and device.type == "cpu" and dtype != torch.float32:
        choose_quantized_products(model)  # bf16 rows' quantized products, by measuring
    model.eval().requires_grad_(False)
    nparams = sum(p.numel() for p in model.parameters())
    logger.info("loaded %s from %s: %.1fM parameters, %s%s", arch, model_dir, nparams / 1e6,
                dtype, f", {plan.label}" if plan is not None else "")
    logger.info("weights: %s", weights_summary(model))
    return model
