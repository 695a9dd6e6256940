"""``speculative_config``: vLLM's dictionary interface, parsed and validated up front.

Accepted forms (the same keys as vLLM)::

    {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4,
     "prompt_lookup_min": 2}
    {"model": "/path/to/draft", "num_speculative_tokens": 3}      # method "draft_model"
    {"method": "mtp", "num_speculative_tokens": 1}
    {"method": "eagle", "model": "/path/to/eagle-head", "num_speculative_tokens": 3}
    {"method": "eagle3", "model": "/path/to/eagle3-head", "num_speculative_tokens": 3}

plus ``disable_by_batch_size`` (speculation is skipped on steps with at least that many running
requests; vLLM's ``speculative_disable_by_batch_size``) and pagefold's ``adaptive_k`` (each
request's k follows its acceptance history, at most ``num_speculative_tokens``). A JSON string
is accepted wherever a dict is (``pagefold serve --speculative-config JSON``).

Invariants of a built :class:`SpeculativeConfig`: ``num_speculative_tokens >= 1``;
for n-gram, ``1 <= prompt_lookup_min <= prompt_lookup_max``; ``model`` is set exactly when the
method is ``draft_model``, ``eagle`` or ``eagle3`` (:data:`MODEL_METHODS`).
:func:`check_model_supports` raises a ``ValueError`` naming what to change when the target
model cannot use the method.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pagefold.core.config_fields import unwrap_text_config
from pagefold.core.spec_from_config import detect_family
from pagefold.json_option import json_object

__all__ = ["METHODS", "MODEL_METHODS", "SpeculativeConfig", "check_model_supports"]

METHODS = ("ngram", "draft_model", "mtp", "eagle", "eagle3")
# The methods that draft with a checkpoint of their own ('model': a local folder).
MODEL_METHODS = ("draft_model", "eagle", "eagle3")
# Aliases vLLM accepts for the same methods.
_ALIASES = {"draft": "draft_model", "[ngram]": "ngram", "qwen3_next_mtp": "mtp"}
_KEYS = {
    "method", "model", "num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min",
    "disable_by_batch_size", "draft_tensor_parallel_size", "adaptive_k",
}
# Families whose checkpoints may ship multi-token-prediction weights (``mtp.*`` tensors).
MTP_FAMILIES = ("gdn",)


@dataclass(frozen=True, slots=True)
class SpeculativeConfig:
    """A validated speculative decoding setup (see the module docstring)."""

    method: str
    num_speculative_tokens: int
    prompt_lookup_max: int = 0
    prompt_lookup_min: int = 0
    model: str | None = None
    disable_by_batch_size: int | None = None
    # pagefold's extension: each request's k follows its acceptance history (engine.py).
    adaptive_k: bool = False

    @classmethod
    def from_user(cls, value: SpeculativeConfig | dict[str, Any] | str | None
                  ) -> SpeculativeConfig | None:
        """Parse a dict, a JSON string or an existing config; ``None``/``{}`` mean off."""
        if value is None or isinstance(value, SpeculativeConfig):
            return value
        value = {k: v for k, v in json_object(value, "speculative_config").items()
                 if v is not None}  # None: not given
        if not value:
            return None
        unknown = sorted(set(value) - _KEYS)
        if unknown:
            raise ValueError(
                f"speculative_config has unknown key(s) {unknown}; known: {sorted(_KEYS)}"
            )
        model = value.get("model")
        method = value.get("method")
        if method is None:
            if model is None:
                raise ValueError(
                    "speculative_config needs a 'method' (ngram, mtp, eagle, eagle3) or a "
                    "draft 'model' path"
                )
            method = "ngram" if model in ("ngram", "[ngram]") else "draft_model"
        method = _ALIASES.get(str(method), str(method))
        if method not in METHODS:
            raise ValueError(
                f"speculative method {method!r} is not supported; use one of {', '.join(METHODS)}"
            )
        if method in MODEL_METHODS and not model:
            raise ValueError(f"speculative method {method!r} needs 'model': a local path")
        if method not in MODEL_METHODS:
            model = None
        k = value.get("num_speculative_tokens")
        if k is None:
            if method != "mtp":
                raise ValueError(f"speculative method {method!r} needs num_speculative_tokens")
            k = 1
        k = _int(k, "num_speculative_tokens")
        if not 1 <= k <= 16:
            raise ValueError(f"num_speculative_tokens must be in 1..16, got {k}")
        lo = hi = 0
        if method == "ngram":
            hi = _int(value.get("prompt_lookup_max", 5), "prompt_lookup_max")
            lo = _int(value.get("prompt_lookup_min", min(hi, 2) if hi else 1),
                      "prompt_lookup_min")
            if not 1 <= lo <= hi:
                raise ValueError(
                    "need 1 <= prompt_lookup_min <= prompt_lookup_max, got "
                    f"prompt_lookup_min={lo}, prompt_lookup_max={hi}"
                )
        elif value.get("prompt_lookup_max") or value.get("prompt_lookup_min"):
            raise ValueError("prompt_lookup_max/min only apply to method 'ngram'")
        dbs = value.get("disable_by_batch_size")
        if dbs is not None:
            dbs = _int(dbs, "disable_by_batch_size")
            if dbs < 1:
                raise ValueError(f"disable_by_batch_size must be >= 1, got {dbs}")
        tp = value.get("draft_tensor_parallel_size")
        if tp not in (None, 1):
            raise ValueError("draft_tensor_parallel_size must be 1")
        adaptive = value.get("adaptive_k", False)
        if not isinstance(adaptive, bool):
            raise ValueError(f"adaptive_k must be true or false, got {adaptive!r}")
        return cls(method, k, hi, lo, model, dbs, adaptive)

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"method": self.method,
                               "num_speculative_tokens": self.num_speculative_tokens}
        if self.method == "ngram":
            out |= {"prompt_lookup_max": self.prompt_lookup_max,
                    "prompt_lookup_min": self.prompt_lookup_min}
        if self.model is not None:
            out["model"] = self.model
        if self.disable_by_batch_size is not None:
            out["disable_by_batch_size"] = self.disable_by_batch_size
        if self.adaptive_k:
            out["adaptive_k"] = True
        return out


def _int(value: Any, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{name} must be an integer, got {value!r}")
    return value


def _get(cfg: Any, name: str, default: Any = None) -> Any:
    if isinstance(cfg, dict):
        return cfg.get(name, default)
    return getattr(cfg, name, default)


def check_model_supports(spec: SpeculativeConfig, hf_config: Any,
                         draft_config: Any | None = None) -> None:
    """Raise ``ValueError`` when the target model cannot use ``spec``'s method.

    * ``ngram`` works with every model.
    * ``mtp`` needs a family that ships MTP heads (Qwen3-Next / Qwen3.5) and a config that
      declares them (``mtp_num_hidden_layers >= 1``).
    * ``draft_model`` needs the draft's vocabulary to match the target's (same tokenizer).
    """
    text = unwrap_text_config(hf_config)
    if spec.method == "mtp":
        family = detect_family(hf_config)
        n = _get(text, "mtp_num_hidden_layers", 0) or _get(text, "num_nextn_predict_layers", 0)
        mt = _get(text, "model_type", None) or _get(hf_config, "model_type", None)
        if family not in MTP_FAMILIES or not n:
            raise ValueError(
                f"speculative method 'mtp' needs a checkpoint with multi-token-prediction "
                f"weights (Qwen3-Next / Qwen3.5 with mtp_num_hidden_layers >= 1); this "
                f"{mt} model declares none. Use {{\"method\": \"ngram\", ...}} or a draft "
                f"'model' instead."
            )
    elif spec.method == "draft_model" and draft_config is not None:
        dtext = unwrap_text_config(draft_config)
        tv, dv = _get(text, "vocab_size"), _get(dtext, "vocab_size")
        if tv != dv:
            raise ValueError(
                f"the draft model's vocab_size {dv} differs from the target's {tv}; a draft "
                f"model must share the target's tokenizer"
            )
