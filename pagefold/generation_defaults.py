"""Sampling defaults from a checkpoint's ``generation_config.json`` (as vLLM applies them).

``--generation-config auto`` (the default) takes ``temperature``, ``top_p``, ``top_k``,
``min_p``, ``repetition_penalty`` and ``max_new_tokens`` (as ``max_tokens``) from the file
next to the weights; ``vllm`` takes none (the engine's neutral defaults); any other value is
a folder holding a ``generation_config.json``. A request's own fields always win.
"""

from __future__ import annotations

import logging
from pathlib import Path

from pagefold.checkpoint import read_generation_config

logger = logging.getLogger("pagefold")

# generation_config.json key -> SamplingParams field.
KEYS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p",
        "repetition_penalty": "repetition_penalty", "max_new_tokens": "max_tokens"}


def generation_defaults(model: str, mode: str = "auto") -> dict:
    """SamplingParams keyword defaults for ``model`` under ``--generation-config mode``."""
    if mode == "vllm":
        return {}
    folder = Path(model) if mode == "auto" else Path(mode)
    cfg = read_generation_config(folder)
    if cfg is None:
        if mode != "auto":
            raise ValueError(f"--generation-config {mode}: no generation_config.json in {folder}")
        return {}
    out = {}
    for key, field in KEYS.items():
        value = cfg.get(key)
        if value is not None and isinstance(value, int | float) and not isinstance(value, bool):
            out[field] = value
    return out


def log_generation_defaults(defaults: dict, mode: str) -> None:
    if mode == "vllm":
        logger.info("generation config 'vllm': the engine's neutral sampling defaults")
    elif defaults:
        logger.info("Default sampling parameters have been overridden by the model's "
                    "generation config (--generation-config %s): %s; use --generation-config "
                    "vllm to disable", mode, defaults)
    else:
        logger.info("generation config %s: no sampling defaults found", mode)


def truncate_prompt(ids: list[int], k: int, max_model_len: int) -> list[int]:
    """The last ``k`` prompt tokens (``k = -1``: the last ``max_model_len - 1``)."""
    keep = max_model_len - 1 if k == -1 else k
    return list(ids[-keep:]) if len(ids) > keep else list(ids)
