"""Cache-shaping fields read the same way from a transformers config or a ``config.json`` dict.

The spec readers of every family (``spec_from_config`` for the first hybrids,
``spec_families`` for the later ones) share these; they sit below both so neither imports the
other's helpers.
"""

from __future__ import annotations

from typing import Any

import torch

from pagefold.core.layer_kinds import config_get

DTYPE_NAMES = {
    "float32": torch.float32,
    "float": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "half": torch.float16,
}
# head_dim when a config omits it: transformers' class default for these model types,
# hidden_size // num_attention_heads for the rest.
HEAD_DIM_DEFAULTS = {
    "qwen3": 128,
    "qwen3_moe": 128,
    "qwen3_5_text": 256,
    "qwen3_5_moe_text": 256,
    "qwen3_next": 256,
}


def parse_dtype(value: str | torch.dtype, what: str) -> torch.dtype:
    """A dtype from its config spelling (``"bfloat16"``, ``"torch.float32"``, ``"half"``);
    raises ``ValueError`` naming ``what`` and the accepted names."""
    if isinstance(value, torch.dtype):
        return value
    name = str(value).removeprefix("torch.")
    if name not in DTYPE_NAMES:
        raise ValueError(f"{what} must be one of {', '.join(DTYPE_NAMES)}; got {value!r}")
    return DTYPE_NAMES[name]


def split_for_tp(n: int, tp: int, what: str) -> int:
    """``n / tp``; raises ``ValueError`` naming ``what`` when ``tp`` does not divide ``n``."""
    if n % tp:
        raise ValueError(f"{what} ({n}) is not divisible by tensor_parallel_size {tp}")
    return n // tp


def unwrap_text_config(hf_config: Any) -> Any:
    """The language model's config: ``text_config`` when the checkpoint nests one (Qwen3.5)."""
    text = config_get(hf_config, "text_config", default=None)
    return text if text is not None else hf_config


def config_model_dtype(hf_config: Any) -> str | None:
    """The dtype a checkpoint's config names (``dtype`` or ``torch_dtype``), text config first."""
    for cfg in (unwrap_text_config(hf_config), hf_config):
        value = config_get(cfg, "dtype", "torch_dtype", default=None)
        if value is not None:
            return str(value).removeprefix("torch.")
    return None


def config_head_dim(cfg: Any) -> int:
    """Attention head size: the config's ``head_dim`` / ``attention_head_dim``, else the model
    type's transformers default, else ``hidden_size // num_attention_heads``."""
    value = config_get(cfg, "head_dim", "attention_head_dim", default=None)
    if value is not None:
        return int(value)
    mt = config_get(cfg, "model_type", default=None)
    if mt in HEAD_DIM_DEFAULTS:
        return HEAD_DIM_DEFAULTS[mt]
    return int(config_get(cfg, "hidden_size")) // int(config_get(cfg, "num_attention_heads"))
