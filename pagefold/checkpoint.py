"""What a local Hugging Face checkpoint folder says about itself, read in one place.

``config.json`` (as a dict, or as a transformers config with its architecture), the tokenizer,
and ``generation_config.json`` (EOS ids here; sampling defaults in ``generation_defaults``).
This module sits low in the import graph: the engine, the offline API, tensor-parallel ranks,
draft models and the server all read checkpoints through it, and it imports no engine code.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from pagefold.architectures import resolve_architecture

__all__ = ["generation_eos_ids", "load_hf_config", "load_tokenizer", "read_config_dict",
           "read_generation_config", "text_config"]


def read_config_dict(model_dir: Path) -> dict:
    """``config.json`` of ``model_dir`` as a dict; raises ``ValueError`` saying what is wrong
    (no such folder, no config.json, not JSON)."""
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


def text_config(hf_config: Any) -> Any:
    """Multimodal checkpoints nest the language model's config under ``text_config``."""
    return getattr(hf_config, "text_config", None) or hf_config


def load_hf_config(model: str) -> tuple[str, Any]:
    """``(architecture, transformers config)`` of the checkpoint folder ``model``; the
    architecture is the first one pagefold serves (``ValueError`` when there is none)."""
    from transformers import AutoConfig  # heavy: only when a checkpoint is opened

    path = Path(model)
    arch = resolve_architecture(read_config_dict(path))
    return arch, AutoConfig.from_pretrained(str(path))


def load_tokenizer(path: str):
    """The checkpoint's tokenizer; ``ValueError`` (with the cause) when it cannot load."""
    from transformers import AutoTokenizer  # heavy: only when a tokenizer is needed

    try:
        return AutoTokenizer.from_pretrained(path)
    except Exception as e:  # noqa: BLE001 - re-raised with what to do
        raise ValueError(f"cannot load a tokenizer from {path!r}: {e}") from e


def read_generation_config(folder: str | Path) -> dict | None:
    """``generation_config.json`` of ``folder`` as a dict, None when the folder has none;
    ``ValueError`` naming the file when it cannot be read or is not JSON."""
    f = Path(folder) / "generation_config.json"
    if not f.is_file():
        return None
    try:
        return json.loads(f.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"cannot read {f}: {e}") from None


def generation_eos_ids(model: str) -> list[int]:
    """EOS ids a checkpoint's generation_config adds (e.g. Qwen's <|im_end|>)."""
    cfg = read_generation_config(model)
    eos = None if cfg is None else cfg.get("eos_token_id")
    if eos is None:
        return []
    return [eos] if isinstance(eos, int) else list(eos)
