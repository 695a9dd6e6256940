"""Architecture name -> pagefold model class; loading a local Hugging Face directory."""

from __future__ import annotations

import importlib
import json
import logging
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

# architecture -> (module, class). Hybrid models register here as they land.
_MODELS: dict[str, tuple[str, str]] = {
    "LlamaForCausalLM": ("pagefold.models.llama", "LlamaForCausalLM"),
    "Qwen2ForCausalLM": ("pagefold.models.llama", "Qwen2ForCausalLM"),
    "Qwen3ForCausalLM": ("pagefold.models.llama", "Qwen3ForCausalLM"),
    "NemotronHForCausalLM": ("pagefold.models.nemotron_h", "NemotronHForCausalLM"),
    "GraniteMoeHybridForCausalLM": ("pagefold.models.granite_hybrid",
                                    "GraniteMoeHybridForCausalLM"),
    "BambaForCausalLM": ("pagefold.models.granite_hybrid", "BambaForCausalLM"),
    "Qwen3_5ForCausalLM": ("pagefold.models.qwen3_5", "Qwen3_5ForCausalLM"),
    "Qwen3_5ForConditionalGeneration": ("pagefold.models.qwen3_5",
                                        "Qwen3_5ForConditionalGeneration"),
    "Qwen3NextForCausalLM": ("pagefold.models.qwen3_next", "Qwen3NextForCausalLM"),
    "Mamba2ForCausalLM": ("pagefold.models.mamba2", "Mamba2ForCausalLM"),
    "Gemma3ForCausalLM": ("pagefold.models.gemma3", "Gemma3ForCausalLM"),
    "GptOssForCausalLM": ("pagefold.models.gpt_oss", "GptOssForCausalLM"),
    "Lfm2ForCausalLM": ("pagefold.models.lfm2", "Lfm2ForCausalLM"),
    "FalconH1ForCausalLM": ("pagefold.models.falcon_h1", "FalconH1ForCausalLM"),
    "Zamba2ForCausalLM": ("pagefold.models.zamba2", "Zamba2ForCausalLM"),
    "JambaForCausalLM": ("pagefold.models.jamba", "JambaForCausalLM"),
    "MiniMaxForCausalLM": ("pagefold.models.minimax", "MiniMaxForCausalLM"),
    "KimiLinearForCausalLM": ("pagefold.models.kimi_linear", "KimiLinearForCausalLM"),
}


def supported_architectures() -> list[str]:
    return sorted(_MODELS)


def register(arch: str, module: str, cls: str) -> None:
    _MODELS[arch] = (module, cls)


def read_config_dict(model_dir: Path) -> dict:
    cfg = model_dir / "config.json"
    if not model_dir.exists():
        raise ValueError(f"model path {str(model_dir)!r} does not exist; give a local Hugging Face "
                         "model directory (config.json, *.safetensors, tokenizer files)")
    if not cfg.exists():
        raise ValueError(f"{model_dir} has no config.json; is it a Hugging Face model directory?")
    try:
        return json.loads(cfg.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{cfg} is not valid JSON ({e}); the model's config file is corrupt or "
                         "truncated") from None


def resolve_architecture(config: dict) -> str:
    archs = config.get("architectures") or []
    for a in archs:
        if a in _MODELS:
            return a
    raise ValueError(
        f"unsupported architecture {archs or config.get('model_type')!r}; pagefold supports: "
        f"{', '.join(supported_architectures())}"
    )


def model_class(arch: str):
    mod, cls = _MODELS[arch]
    return getattr(importlib.import_module(mod), cls)


def text_config(hf_config):
    """Multimodal checkpoints nest the language model's config under ``text_config``."""
    return getattr(hf_config, "text_config", None) or hf_config


def load_model(model_dir: Path, hf_config, arch: str, dtype: torch.dtype, max_positions: int,
               device: torch.device, quantization: str | None = None):
    """The model in ``model_dir`` with its weights; ``quantization``: the option (vLLM's
    ``--quantization``), checked against the checkpoint's own ``quantization_config``."""
    from pagefold.models.weights import iter_weights
    from pagefold.quantization import (
        Quantizer,
        finalize_all,
        quantize_loaded,
        resolve,
        weights_summary,
    )

    plan = resolve(hf_config, quantization)
    cls = model_class(arch)
    prev = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = cls(text_config(hf_config), max_positions=max_positions)
    finally:
        torch.set_default_dtype(prev)
    if plan is not None and plan.checkpoint is not None:
        model.pf_quant = Quantizer(plan)
    model.load_weights(iter_weights(model_dir))
    if plan is not None and plan.checkpoint is not None:
        finalize_all(model)
    if plan is not None and plan.on_load is not None:
        quantize_loaded(model, plan.on_load)
    model.eval().requires_grad_(False)
    nparams = sum(p.numel() for p in model.parameters())
    logger.info("loaded %s from %s: %.1fM parameters, %s%s", arch, model_dir, nparams / 1e6,
                dtype, f", {plan.label}" if plan is not None else "")
    logger.info("weights: %s", weights_summary(model))
    return model
