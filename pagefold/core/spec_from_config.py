"""Per-layer cache specs straight from a model config (a transformers config or config.json).

``layer_specs_from_config`` is the one place that knows how each supported architecture names
its cache-shaping fields. It needs no weights and no network: the capacity planner calls it on
a ``config.json`` read as a plain dict, the engine on the loaded transformers config.

Shapes are per tensor-parallel rank (what one GPU holds):

* full / sliding attention: ``num_kv_heads = max(1, kv_heads // tp)`` (KV heads are replicated
  when there are fewer than ranks), K and V in the KV-cache dtype.
* Gated DeltaNet (Qwen3.5, Qwen3.5-MoE, Qwen3-Next), ``StateSpec(kind="gdn")``:
  ``conv (conv_dim / tp, kernel - 1 + num_spec)`` in the model dtype, with
  ``conv_dim = 2 * key_heads * key_head_dim + value_heads * value_head_dim``, and
  ``ssm (value_heads / tp, key_head_dim, value_head_dim)`` in the SSM dtype.
* Mamba-2 (Nemotron-H, Granite-4.0-H, Bamba), ``StateSpec(kind="mamba2")``:
  ``conv (conv_dim / tp, kernel - 1 + num_spec)`` in the model dtype, with
  ``conv_dim = intermediate + 2 * groups * state_size``, and
  ``ssm (heads / tp, head_dim, state_size)`` in the SSM dtype. A single B/C group is
  replicated on every rank (``groups`` becomes ``tp``), as the TP-sharded kernels require.

Components are always ordered ``(conv, ssm)``. The SSM dtype is ``mamba_ssm_cache_dtype`` when
given (``"auto"`` counts as not given), else the config's ``mamba_ssm_dtype`` /
``mamba_ssm_cache_dtype`` field (Qwen3.5 names float32; transformers' ``NemotronHConfig``
defaults its field to float32, which is mirrored for a dict that omits it), else the model dtype.
"""

from __future__ import annotations

from typing import Any

import torch

from pagefold.architectures import ARCHITECTURES, MODEL_TYPES
from pagefold.core.config_fields import (
    config_head_dim,
    parse_dtype,
    split_for_tp,
    unwrap_text_config,
)
from pagefold.core.kv_cache_spec import (
    FullAttentionSpec,
    LayerSpec,
    SlidingWindowSpec,
    StateComponent,
    StateSpec,
    TPSplit,
)
from pagefold.core.layer_kinds import CACHED_KINDS, config_get, layer_kinds
from pagefold.core.spec_families import FAMILY_READERS

KV_CACHE_DTYPES = {
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "float32": torch.float32,
    "fp8": torch.float8_e4m3fn,
}
# The families this module reads (layer kinds from ``core/layer_kinds``); the others have a
# reader in ``core/spec_families`` (``FAMILY_READERS``), consulted first.
BASE_FAMILIES = frozenset({"attention", "gdn", "nemotron_h", "granite", "bamba"})
_get = config_get


def _family_among(hf_config: Any, families: frozenset[str] | set[str]) -> str | None:
    """The first of ``families`` the config names: by ``model_type`` (text config, then
    top level), else by an ``architectures`` entry (top level, then text config)."""
    text = unwrap_text_config(hf_config)
    for c in (text, hf_config):
        family = MODEL_TYPES.get(_get(c, "model_type", default=None))
        if family in families:
            return family
    for c in (hf_config, text):
        for arch in _get(c, "architectures", default=None) or []:
            entry = ARCHITECTURES.get(arch)
            if entry is not None and entry.family in families:
                return entry.family
    return None


def detect_family(hf_config: Any) -> str:
    """Map a config to one of the supported families, or raise listing what is supported.
    A family of ``core/spec_families`` named anywhere in the config wins over one of this
    module's (how the two readers were consulted when they were separate)."""
    family = (_family_among(hf_config, set(FAMILY_READERS))
              or _family_among(hf_config, BASE_FAMILIES))
    if family is not None:
        return family
    text = unwrap_text_config(hf_config)
    model_types = [
        _get(text, "model_type", default=None),
        _get(hf_config, "model_type", default=None),
    ]
    archs = list(_get(hf_config, "architectures", default=None) or [])
    archs += list(_get(text, "architectures", default=None) or [])
    raise ValueError(
        f"unsupported architecture (model_type {[m for m in model_types if m] or None}, "
        f"architectures {archs or None}); supported model types: "
        f"{', '.join(MODEL_TYPES)}; supported architectures: {', '.join(ARCHITECTURES)}"
    )


def _ssm_dtype(
    cfg: Any, top: Any, family: str, model_dtype: torch.dtype, override: str | None
) -> torch.dtype:
    if override is not None and override != "auto":
        return parse_dtype(override, "mamba_ssm_cache_dtype")
    for c in (cfg, top):
        named = _get(c, "mamba_ssm_dtype", "mamba_ssm_cache_dtype", default=None)
        if named is not None and named != "auto":
            return parse_dtype(named, "the config's mamba_ssm_dtype")
    if family == "nemotron_h":
        return torch.float32  # NemotronHConfig's default for mamba_ssm_cache_dtype
    return model_dtype


def _gdn_spec(
    cfg: Any, tp: int, num_spec: int, conv_dtype: torch.dtype, ssm_dtype: torch.dtype
) -> StateSpec:
    k_heads = int(_get(cfg, "linear_num_key_heads"))
    v_heads = int(_get(cfg, "linear_num_value_heads"))
    k_dim = int(_get(cfg, "linear_key_head_dim"))
    v_dim = int(_get(cfg, "linear_value_head_dim"))
    kernel = int(_get(cfg, "linear_conv_kernel_dim"))
    split_for_tp(k_heads, tp, "linear_num_key_heads")
    conv_dim = 2 * k_heads * k_dim + v_heads * v_dim
    return StateSpec(
        kind="gdn",
        components=(
            StateComponent("conv", (conv_dim // tp, kernel - 1 + num_spec), conv_dtype,
                           # the q | k | v channel blocks, each cut by heads
                           TPSplit(0, ((k_heads * k_dim, k_dim), (k_heads * k_dim, k_dim),
                                       (v_heads * v_dim, v_dim)))),
            StateComponent(
                "ssm", (split_for_tp(v_heads, tp, "linear_num_value_heads"), k_dim, v_dim),
                ssm_dtype, TPSplit(0, ((v_heads, 1),))),
        ),
    )


def _mamba2_params(cfg: Any, family: str) -> tuple[int, int, int, int, int, int]:
    """(heads, head_dim, groups, state_size, kernel, intermediate) in the family's field names."""
    if family == "nemotron_h":
        heads = int(_get(cfg, "mamba_num_heads"))
        head_dim = int(_get(cfg, "mamba_head_dim"))
        groups = int(_get(cfg, "n_groups", "mamba_n_groups"))
        state = int(_get(cfg, "ssm_state_size"))
        kernel = int(_get(cfg, "conv_kernel", "mamba_d_conv"))
        return heads, head_dim, groups, state, kernel, heads * head_dim
    heads = int(_get(cfg, "mamba_n_heads"))
    intermediate = int(_get(cfg, "mamba_expand")) * int(_get(cfg, "hidden_size"))
    head_dim = _get(cfg, "mamba_d_head", default="auto")
    head_dim = intermediate // heads if head_dim == "auto" else int(head_dim)
    groups = int(_get(cfg, "mamba_n_groups"))
    state = int(_get(cfg, "mamba_d_state"))
    kernel = int(_get(cfg, "mamba_d_conv"))
    return heads, head_dim, groups, state, kernel, intermediate


def _mamba2_spec(
    cfg: Any, family: str, tp: int, num_spec: int, conv_dtype: torch.dtype, ssm_dtype: torch.dtype
) -> StateSpec:
    heads, head_dim, groups, state, kernel, intermediate = _mamba2_params(cfg, family)
    full_groups = groups
    if groups % tp:
        if groups != 1:
            raise ValueError(
                f"Mamba-2 n_groups ({groups}) must be 1 or divisible by tensor_parallel_size {tp}"
            )
        groups = tp  # the single B/C group is replicated on every rank
    conv_dim = intermediate + 2 * groups * state
    # x | B | C channel blocks: x cut by heads, B and C by groups (one group: replicated)
    bc = (full_groups * state, state)
    return StateSpec(
        kind="mamba2",
        components=(
            StateComponent(
                "conv",
                (split_for_tp(conv_dim, tp, "Mamba-2 conv_dim"), kernel - 1 + num_spec),
                conv_dtype, TPSplit(0, ((intermediate, 1), bc, bc)),
            ),
            StateComponent(
                "ssm", (split_for_tp(heads, tp, "Mamba-2 heads"), head_dim, state), ssm_dtype,
                TPSplit(0, ((heads, 1),)),
            ),
        ),
    )


def layer_specs_from_config(
    hf_config: Any,
    *,
    model_dtype: torch.dtype,
    kv_cache_dtype: str = "auto",
    tensor_parallel_size: int = 1,
    mamba_ssm_cache_dtype: str | None = None,
    num_speculative_tokens: int = 0,
) -> dict[str, LayerSpec]:
    """``{"layers.{i}": spec}`` for every layer that caches something, per TP rank.

    ``hf_config`` is a transformers config or a config.json dict (nested ``text_config`` is
    unwrapped). ``kv_cache_dtype``: ``auto`` (the model dtype), ``bfloat16``, ``float16``,
    ``float32`` or ``fp8`` (``torch.float8_e4m3fn``). Layers that cache nothing (Nemotron-H's
    MLP/MoE layers) get no entry, so the keys keep the model's own layer indices.
    Raises ``ValueError`` for an unknown architecture or layer type, naming what is supported.
    """
    tp = int(tensor_parallel_size)
    if tp < 1:
        raise ValueError(f"tensor_parallel_size must be at least 1, got {tp}")
    if num_speculative_tokens < 0:
        raise ValueError(f"num_speculative_tokens must be >= 0, got {num_speculative_tokens}")
    if kv_cache_dtype == "auto":
        kv_dtype = model_dtype
    elif kv_cache_dtype in KV_CACHE_DTYPES:
        kv_dtype = KV_CACHE_DTYPES[kv_cache_dtype]
    else:
        raise ValueError(
            f"kv_cache_dtype must be one of auto, {', '.join(KV_CACHE_DTYPES)}; "
            f"got {kv_cache_dtype!r}"
        )

    family = detect_family(hf_config)
    cfg = unwrap_text_config(hf_config)
    if family in FAMILY_READERS:
        specs = FAMILY_READERS[family](cfg, model_dtype=model_dtype, kv_dtype=kv_dtype, tp=tp,
                                       ssm_override=mamba_ssm_cache_dtype,
                                       num_spec=num_speculative_tokens)
        if not specs:
            raise ValueError(f"this {family} config declares no layer that keeps a cache")
        return specs
    # One parser for the cache and the models; MLP / MoE blocks cache nothing.
    kinds = [k if k in CACHED_KINDS else None for k in layer_kinds(cfg, family)]

    specs: dict[str, LayerSpec] = {}
    attn = sliding = state = None
    for i, kind in enumerate(kinds):
        if kind is None:
            continue
        if kind in ("full", "sliding") and attn is None:
            kv_heads = int(_get(cfg, "num_key_value_heads", "num_attention_heads"))
            # Fewer KV heads than ranks: each rank keeps (a replica of) one head.
            attn = FullAttentionSpec(max(1, kv_heads // tp), config_head_dim(cfg), kv_dtype,
                                     TPSplit(2, ((kv_heads, 1),)))
        if kind == "full":
            specs[f"layers.{i}"] = attn
        elif kind == "sliding":
            if sliding is None:
                window = _get(cfg, "sliding_window", default=None)
                if window is None:
                    raise ValueError(
                        f"layer {i} is sliding_attention but the config has no sliding_window"
                    )
                sliding = SlidingWindowSpec(attn.num_kv_heads, attn.head_dim, kv_dtype, int(window),
                                            attn.split)
            specs[f"layers.{i}"] = sliding
        else:
            if state is None:
                ssm = _ssm_dtype(cfg, hf_config, family, model_dtype, mamba_ssm_cache_dtype)
                if kind == "gdn":
                    state = _gdn_spec(cfg, tp, num_speculative_tokens, model_dtype, ssm)
                else:
                    state = _mamba2_spec(cfg, family, tp, num_speculative_tokens, model_dtype, ssm)
            specs[f"layers.{i}"] = state
    if not specs:
        raise ValueError(f"this {family} config declares no layer that keeps a cache")
    return specs
