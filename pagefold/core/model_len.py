"""How long a sequence the model's positions support, and the check of ``max_model_len``.

A model trained on ``max_position_embeddings`` positions produces garbage past them; RoPE
scaling stretches that range. The derived limit follows vLLM's rule:

* no scaling (``rope_type`` default / mrope), or a type whose ``max_position_embeddings``
  already states the extended range (``llama3``, ``longrope``, ``su``): the config's value;
* ``yarn``: ``original_max_position_embeddings * factor`` (falling back to the config's
  value when the original is not given);
* any other scaling with a ``factor`` (``linear``, ``dynamic``, ...): value x factor.

A longer ``max_model_len`` is refused unless explicitly allowed (``allow_long_max_model_len``
or the environment variable ``PAGEFOLD_ALLOW_LONG_MAX_MODEL_LEN=1``), as vLLM does with
``VLLM_ALLOW_LONG_MAX_MODEL_LEN``.
"""

from __future__ import annotations

import logging
import os

logger = logging.getLogger("pagefold")

ENV_ALLOW_LONG = "PAGEFOLD_ALLOW_LONG_MAX_MODEL_LEN"
# Types whose max_position_embeddings already is the extended range.
_ALREADY_EXTENDED = ("llama3", "longrope", "su")
_UNSCALED = (None, "default", "mrope")


def rope_parameters(cfg) -> dict | None:
    rope = getattr(cfg, "rope_parameters", None) or getattr(cfg, "rope_scaling", None)
    return rope if isinstance(rope, dict) else None


def derived_max_positions(cfg) -> int | None:
    """Positions the model supports (None when its config names no limit)."""
    max_pos = getattr(cfg, "max_position_embeddings", None)
    if not max_pos:
        return None
    rope = rope_parameters(cfg) or {}
    rope_type = rope.get("rope_type", rope.get("type"))
    factor = rope.get("factor")
    if rope_type in _UNSCALED or rope_type in _ALREADY_EXTENDED or not factor:
        return int(max_pos)
    if rope_type == "yarn":
        max_pos = rope.get("original_max_position_embeddings") or max_pos
    return int(max_pos * factor)


def long_allowed(flag: bool) -> bool:
    return flag or os.environ.get(ENV_ALLOW_LONG, "").strip().lower() in ("1", "true", "yes")


def resolve_max_model_len(requested: int | None, cfg, *, allow_long: bool = False,
                          default: int = 4096) -> int:
    """``requested`` checked against :func:`derived_max_positions` (the limit itself when
    None). Raises ``ValueError`` naming both numbers and the override."""
    limit = derived_max_positions(cfg)
    if requested is None:
        return limit or default
    if limit is not None and requested > limit:
        if not long_allowed(allow_long):
            raise ValueError(
                f"max_model_len {requested} is longer than the model supports: "
                f"{limit} positions (max_position_embeddings with rope scaling, from "
                "config.json); past them the output is garbage. Lower max_model_len, or pass "
                f"--allow-long-max-model-len (or set {ENV_ALLOW_LONG}=1) if you know better")
        logger.warning("max_model_len %d exceeds the model's %d positions "
                       "(allowed explicitly): outputs past %d may be wrong", requested, limit,
                       limit)
    return requested
