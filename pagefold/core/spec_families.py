"""Cache specs for the families added after the first hybrids (issue 17), one reader each.

:data:`FAMILY_READERS` maps a family (``pagefold.architectures``) to its reader;
:func:`pagefold.core.spec_from_config.layer_specs_from_config` consults it before its own
families. Every reader takes a transformers config or a ``config.json`` dict (``config_get``
reads both) and returns ``{layer name: spec}`` per tensor-parallel rank. Layer names are
``layers.{i}``, except where one model layer keeps two caches (Falcon-H1: ``layers.{i}``
attention and ``layers.{i}.mamba`` state).

New state kinds (all :class:`~pagefold.core.kv_cache_spec.StateSpec`, so the one generic state
manager serves them: checkpoints and forks copy whole pages):

* ``mamba2`` (Mamba2ForCausalLM, Falcon-H1): as in ``spec_from_config``.
* ``shortconv`` (LFM2): ``conv (hidden / tp, L_cache - 1)`` in the model dtype.
* ``mamba1`` (Jamba, Mamba, Falcon-Mamba): ``conv (I / tp, K - 1)`` in the model dtype,
  ``ssm (I / tp, N)`` in the SSM dtype, ``I = mamba_expand * hidden`` (Jamba) or
  ``expand * hidden`` (Mamba, Falcon-Mamba).
* Llama-4 text: RoPE layers are chunked local attention
  (:class:`~pagefold.core.kv_cache_spec.ChunkedLocalAttentionSpec`, ``attention_chunk_size``),
  NoPE layers full attention.
* ``lightning`` (MiniMax): ``kv (H / tp, D, D)`` in the SSM dtype.
* ``kda`` (Kimi Linear): ``conv (3 H D / tp, K - 1)`` in the model dtype, ``ssm (H / tp, D, D)``
  float32 unless ``mamba_ssm_cache_dtype`` says otherwise.

Kimi Linear's MLA layers get an :class:`~pagefold.core.kv_cache_spec.MLASpec`: one latent row of
``kv_lora_rank + qk_rope_head_dim`` values per token.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch

from pagefold.core.config_fields import config_head_dim, parse_dtype, split_for_tp
from pagefold.core.kv_cache_spec import (
    ChunkedLocalAttentionSpec,
    FullAttentionSpec,
    LayerSpec,
    MLASpec,
    SlidingWindowSpec,
    StateComponent,
    StateSpec,
    TPSplit,
)
from pagefold.core.layer_kinds import config_get, num_layers, unknown_layer_type

__all__ = ["FAMILY_READERS"]

_get = config_get
FALCON_H1_D_SSM = 1024  # transformers' FalconH1Config default for mamba_d_ssm
_split = split_for_tp


def _ssm_dtype(cfg: Any, model_dtype: torch.dtype, override: str | None) -> torch.dtype:
    if override is not None and override != "auto":
        return parse_dtype(override, "mamba_ssm_cache_dtype")
    named = _get(cfg, "mamba_ssm_dtype", "mamba_ssm_cache_dtype", default=None)
    if named is not None and named != "auto":
        return parse_dtype(named, "the config's mamba_ssm_dtype")
    return model_dtype


def mamba2_state(
    *, heads: int, head_dim: int, groups: int, state: int, kernel: int, tp: int, num_spec: int,
    conv_dtype: torch.dtype, ssm_dtype: torch.dtype,
) -> StateSpec:
    """Mamba-2 state: ``(conv (conv_dim / tp, K - 1 + spec), ssm (H / tp, P, N))``."""
    bc = (groups * state, state)  # B and C cut by groups (one group: replicated)
    if groups % tp:
        if groups != 1:
            raise ValueError(
                f"Mamba-2 n_groups ({groups}) must be 1 or divisible by tensor_parallel_size {tp}")
        groups = tp
    conv_dim = heads * head_dim + 2 * groups * state
    return StateSpec(kind="mamba2", components=(
        StateComponent("conv", (_split(conv_dim, tp, "Mamba-2 conv_dim"), kernel - 1 + num_spec),
                       conv_dtype, TPSplit(0, ((heads * head_dim, 1), bc, bc))),
        StateComponent("ssm", (_split(heads, tp, "Mamba-2 heads"), head_dim, state), ssm_dtype,
                       TPSplit(0, ((heads, 1),))),
    ))


def _attention(cfg: Any, tp: int, kv_dtype: torch.dtype) -> FullAttentionSpec:
    kv_heads = int(_get(cfg, "num_key_value_heads", "num_attention_heads"))
    # KV heads cut over the ranks, replicated when fewer (``layers.attention_block.split_heads``)
    return FullAttentionSpec(max(1, kv_heads // tp), config_head_dim(cfg), kv_dtype,
                             TPSplit(2, ((kv_heads, 1),)))


def _sliding_or_full(cfg: Any, types: list[str], tp: int, kv_dtype: torch.dtype,
                     family: str) -> dict[str, LayerSpec]:
    full = _attention(cfg, tp, kv_dtype)
    out: dict[str, LayerSpec] = {}
    for i, t in enumerate(types):
        if t == "full_attention":
            out[f"layers.{i}"] = full
        elif t == "sliding_attention":
            window = int(_get(cfg, "sliding_window"))
            out[f"layers.{i}"] = SlidingWindowSpec(full.num_kv_heads, full.head_dim, kv_dtype,
                                                   window, full.split)
        else:
            raise unknown_layer_type(family, i, t, ["full_attention", "sliding_attention"])
    return out


# ---- readers ------------------------------------------------------------------------------


def _mamba2(cfg, *, model_dtype, kv_dtype, tp, ssm_override, num_spec):
    heads = int(_get(cfg, "num_heads"))
    spec = mamba2_state(
        heads=heads, head_dim=int(_get(cfg, "head_dim")), groups=int(_get(cfg, "n_groups")),
        state=int(_get(cfg, "state_size")), kernel=int(_get(cfg, "conv_kernel")), tp=tp,
        num_spec=num_spec, conv_dtype=model_dtype,
        ssm_dtype=_ssm_dtype(cfg, model_dtype, ssm_override))
    return {f"layers.{i}": spec for i in range(num_layers(cfg))}


def gemma3_layer_types(cfg: Any) -> list[str]:
    """``layer_types``, else transformers' rule: every ``sliding_window_pattern``-th layer is
    full attention, the others sliding."""
    types = _get(cfg, "layer_types", default=None)
    if types is not None:
        return list(types)
    pattern = int(_get(cfg, "sliding_window_pattern", default=6))
    return ["sliding_attention" if (i + 1) % pattern else "full_attention"
            for i in range(num_layers(cfg))]


def _gemma3(cfg, *, model_dtype, kv_dtype, tp, ssm_override, num_spec):
    return _sliding_or_full(cfg, gemma3_layer_types(cfg), tp, kv_dtype, "Gemma-3")


def gpt_oss_layer_types(cfg: Any) -> list[str]:
    """``layer_types``, else transformers' default: even layers sliding, odd layers full."""
    types = _get(cfg, "layer_types", default=None)
    if types is not None:
        return list(types)
    return ["sliding_attention" if i % 2 == 0 else "full_attention"
            for i in range(num_layers(cfg))]


def _gpt_oss(cfg, *, model_dtype, kv_dtype, tp, ssm_override, num_spec):
    return _sliding_or_full(cfg, gpt_oss_layer_types(cfg), tp, kv_dtype, "gpt-oss")


def lfm2_layer_types(cfg: Any) -> list[str]:
    """``layer_types`` (``conv`` / ``full_attention``), else from ``full_attn_idxs`` (all
    attention when neither is given, as transformers defaults)."""
    types = _get(cfg, "layer_types", default=None)
    if types is None:
        n = num_layers(cfg)
        idxs = _get(cfg, "full_attn_idxs", default=None)
        full = set(range(n) if idxs is None else idxs)
        types = ["full_attention" if i in full else "conv" for i in range(n)]
    for i, t in enumerate(types):
        if t not in ("conv", "full_attention"):
            raise unknown_layer_type("LFM2", i, t, ["conv", "full_attention"])
    return list(types)


def _lfm2(cfg, *, model_dtype, kv_dtype, tp, ssm_override, num_spec):
    hidden = int(_get(cfg, "hidden_size"))
    kernel = int(_get(cfg, "conv_L_cache"))
    heads = int(_get(cfg, "num_attention_heads"))
    kv_heads = int(_get(cfg, "num_key_value_heads", "num_attention_heads"))
    attn = FullAttentionSpec(max(1, kv_heads // tp), hidden // heads, kv_dtype,
                             TPSplit(2, ((kv_heads, 1),)))
    conv = StateSpec(kind="shortconv", components=(  # channels cut like in_proj's B, C, x rows
        StateComponent("conv", (_split(hidden, tp, "LFM2 hidden_size"), kernel - 1 + num_spec),
                       model_dtype, TPSplit(0, ((hidden, 1),))),))
    return {f"layers.{i}": attn if t == "full_attention" else conv
            for i, t in enumerate(lfm2_layer_types(cfg))}


def _falcon_h1(cfg, *, model_dtype, kv_dtype, tp, ssm_override, num_spec):
    heads = int(_get(cfg, "mamba_n_heads"))
    # FalconH1Config's default for a config without the field is 1024; an explicit null means
    # mamba_expand * hidden_size (as transformers reads both).
    if isinstance(cfg, Mapping) and "mamba_d_ssm" not in cfg:
        inter = FALCON_H1_D_SSM
    else:
        inter = _get(cfg, "mamba_d_ssm", default=None)
    if inter is None:
        inter = int(_get(cfg, "mamba_expand")) * int(_get(cfg, "hidden_size"))
    head_dim = _get(cfg, "mamba_d_head", default="auto")
    head_dim = int(inter) // heads if head_dim == "auto" else int(head_dim)
    state = mamba2_state(
        heads=heads, head_dim=head_dim, groups=int(_get(cfg, "mamba_n_groups")),
        state=int(_get(cfg, "mamba_d_state")), kernel=int(_get(cfg, "mamba_d_conv")), tp=tp,
        num_spec=num_spec, conv_dtype=model_dtype,
        ssm_dtype=_ssm_dtype(cfg, model_dtype, ssm_override))
    attn = _attention(cfg, tp, kv_dtype)
    out: dict[str, LayerSpec] = {}
    for i in range(num_layers(cfg)):
        out[f"layers.{i}"] = attn
        out[f"layers.{i}.mamba"] = state
    return out


def zamba2_hybrid_layers(cfg: Any) -> list[int]:
    """Indices of Zamba2's hybrid layers (Mamba-2 plus a use of a shared attention block)."""
    types = _get(cfg, "layers_block_type", "layer_types")
    table = {"mamba": "mamba", "mamba2": "mamba", "linear_attention": "mamba", "m": "mamba",
             "hybrid": "hybrid", "g": "hybrid"}
    out = []
    for i, t in enumerate(types):
        if t not in table:
            raise unknown_layer_type("Zamba2", i, t, list(table))
        if table[t] == "hybrid":
            out.append(i)
    return out


def _zamba2(cfg, *, model_dtype, kv_dtype, tp, ssm_override, num_spec):
    hidden = int(_get(cfg, "hidden_size"))
    heads = int(_get(cfg, "n_mamba_heads"))
    inter = int(_get(cfg, "mamba_expand")) * hidden
    state = mamba2_state(
        heads=heads, head_dim=inter // heads, groups=int(_get(cfg, "mamba_ngroups")),
        state=int(_get(cfg, "mamba_d_state")), kernel=int(_get(cfg, "mamba_d_conv")), tp=tp,
        num_spec=num_spec, conv_dtype=model_dtype,
        ssm_dtype=_ssm_dtype(cfg, model_dtype, ssm_override))
    attn_heads = int(_get(cfg, "num_attention_heads"))
    kv_heads = int(_get(cfg, "num_key_value_heads", "num_attention_heads"))
    attn = FullAttentionSpec(max(1, kv_heads // tp), 2 * hidden // attn_heads, kv_dtype,
                             TPSplit(2, ((kv_heads, 1),)))
    out: dict[str, LayerSpec] = {f"layers.{i}": state for i in range(num_layers(cfg))}
    for i in zamba2_hybrid_layers(cfg):
        out[f"layers.{i}.attn"] = attn  # one KV cache per use of a shared block
    return out


def jamba_layer_kinds(cfg: Any) -> list[tuple[str, bool]]:
    """Per layer ``(mixer, moe)``: mixer ``attention`` when ``i % attn_layer_period ==
    attn_layer_offset`` else ``mamba``; MoE when ``i % expert_layer_period ==
    expert_layer_offset`` and there is more than one expert (transformers' rules)."""
    ap, ao = int(_get(cfg, "attn_layer_period")), int(_get(cfg, "attn_layer_offset"))
    ep, eo = int(_get(cfg, "expert_layer_period")), int(_get(cfg, "expert_layer_offset"))
    experts = int(_get(cfg, "num_experts", "num_local_experts", default=1))
    return [("attention" if i % ap == ao else "mamba", experts > 1 and i % ep == eo)
            for i in range(num_layers(cfg))]


def mamba1_state(*, inter: int, state: int, kernel: int, tp: int, num_spec: int,
                 conv_dtype: torch.dtype, ssm_dtype: torch.dtype) -> StateSpec:
    """Mamba-1 state: ``(conv (I / tp, K - 1 + spec), ssm (I / tp, N))``."""
    i = _split(inter, tp, "Mamba-1 intermediate size")
    cut = TPSplit(0, ((inter, 1),))  # channels cut like in_proj's xs rows
    return StateSpec(kind="mamba1", components=(
        StateComponent("conv", (i, kernel - 1 + num_spec), conv_dtype, cut),
        StateComponent("ssm", (i, state), ssm_dtype, cut),
    ))


def _jamba(cfg, *, model_dtype, kv_dtype, tp, ssm_override, num_spec):
    state = mamba1_state(
        inter=int(_get(cfg, "mamba_expand")) * int(_get(cfg, "hidden_size")),
        state=int(_get(cfg, "mamba_d_state")), kernel=int(_get(cfg, "mamba_d_conv")), tp=tp,
        num_spec=num_spec, conv_dtype=model_dtype,
        ssm_dtype=_ssm_dtype(cfg, model_dtype, ssm_override))
    attn = _attention(cfg, tp, kv_dtype)
    return {f"layers.{i}": attn if mixer == "attention" else state
            for i, (mixer, _) in enumerate(jamba_layer_kinds(cfg))}


def _mamba1(cfg, *, model_dtype, kv_dtype, tp, ssm_override, num_spec):
    """Mamba / Falcon-Mamba: a Mamba-1 state in every layer, ``I = expand * hidden_size``."""
    state = mamba1_state(
        inter=int(float(_get(cfg, "expand")) * int(_get(cfg, "hidden_size"))),
        state=int(_get(cfg, "state_size")), kernel=int(_get(cfg, "conv_kernel")), tp=tp,
        num_spec=num_spec, conv_dtype=model_dtype,
        ssm_dtype=_ssm_dtype(cfg, model_dtype, ssm_override))
    return {f"layers.{i}": state for i in range(num_layers(cfg))}


def llama4_layer_types(cfg: Any) -> list[str]:
    """``layer_types`` (``chunked_attention`` / ``full_attention``), else transformers' rule:
    RoPE layers (``no_rope_layers[i] == 1``, by default all but every
    ``no_rope_layer_interval``-th) are chunked when ``attention_chunk_size`` is set."""
    types = _get(cfg, "layer_types", default=None)
    if types is None:
        n = num_layers(cfg)
        rope = _get(cfg, "no_rope_layers", default=None)
        if not rope:
            every = int(_get(cfg, "no_rope_layer_interval", default=4))
            rope = [int((i + 1) % every != 0) for i in range(n)]
        chunked = _get(cfg, "attention_chunk_size", default=None) is not None
        types = ["chunked_attention" if r and chunked else "full_attention" for r in rope[:n]]
    for i, t in enumerate(types):
        if t not in ("chunked_attention", "full_attention"):
            raise unknown_layer_type("Llama-4", i, t, ["chunked_attention", "full_attention"])
    return list(types)


def _llama4(cfg, *, model_dtype, kv_dtype, tp, ssm_override, num_spec):
    full = _attention(cfg, tp, kv_dtype)
    out: dict[str, LayerSpec] = {}
    for i, t in enumerate(llama4_layer_types(cfg)):
        out[f"layers.{i}"] = full if t == "full_attention" else ChunkedLocalAttentionSpec(
            full.num_kv_heads, full.head_dim, kv_dtype, int(_get(cfg, "attention_chunk_size")),
            full.split)
    return out


def minimax_layer_types(cfg: Any) -> list[str]:
    """``layer_types`` (``linear_attention`` / ``full_attention``), else the original
    checkpoints' ``attn_type_list`` (0 lightning, 1 full), else transformers' default (full
    attention at even layers)."""
    types = _get(cfg, "layer_types", default=None)
    if types is None:
        flags = _get(cfg, "attn_type_list", default=None)
        if flags is not None:
            types = ["full_attention" if int(f) else "linear_attention" for f in flags]
        else:
            types = ["full_attention" if (i + 1) % 2 else "linear_attention"
                     for i in range(num_layers(cfg))]
    for i, t in enumerate(types):
        if t not in ("linear_attention", "full_attention"):
            raise unknown_layer_type("MiniMax", i, t, ["linear_attention", "full_attention"])
    return list(types)


def _minimax(cfg, *, model_dtype, kv_dtype, tp, ssm_override, num_spec):
    heads = int(_get(cfg, "num_attention_heads"))
    d = config_head_dim(cfg)
    lightning = StateSpec(kind="lightning", components=(
        StateComponent("kv", (_split(heads, tp, "MiniMax heads"), d, d),
                       _ssm_dtype(cfg, model_dtype, ssm_override), TPSplit(0, ((heads, 1),))),))
    attn = _attention(cfg, tp, kv_dtype)
    return {f"layers.{i}": attn if t == "full_attention" else lightning
            for i, t in enumerate(minimax_layer_types(cfg))}


def _kimi_linear_cfg(cfg: Any) -> dict[str, Any]:
    sub = _get(cfg, "linear_attn_config", default=None) or {}
    return {
        "heads": sub.get("num_heads") or _get(cfg, "linear_num_heads", default=32),
        "head_dim": sub.get("head_dim") or _get(cfg, "linear_head_dim", default=128),
        "kernel": sub.get("short_conv_kernel_size") or _get(cfg, "linear_conv_kernel_dim",
                                                              default=4),
        "sub": sub,
    }


def kimi_layer_types(cfg: Any) -> list[str]:
    """``layer_types``; else the checkpoint's ``linear_attn_config`` (1-indexed
    ``full_attn_layers`` / ``kda_layers``); else transformers' default (MLA every 4th layer
    from layer 4 on)."""
    types = _get(cfg, "layer_types", default=None)
    n = num_layers(cfg)
    if types is None:
        sub = _kimi_linear_cfg(cfg)["sub"]
        if "full_attn_layers" in sub and "kda_layers" in sub:
            types = [None] * n
            for i in sub["full_attn_layers"]:
                types[int(i) - 1] = "full_attention"
            for i in sub["kda_layers"]:
                types[int(i) - 1] = "linear_attention"
        else:
            types = ["full_attention" if i and i % 4 == 0 else "linear_attention"
                     for i in range(n)]
    for i, t in enumerate(types):
        if t not in ("linear_attention", "full_attention"):
            raise unknown_layer_type("Kimi Linear", i, t, ["linear_attention", "full_attention"])
    return list(types)


def _kimi_linear(cfg, *, model_dtype, kv_dtype, tp, ssm_override, num_spec):
    lin = _kimi_linear_cfg(cfg)
    full, d = int(lin["heads"]), int(lin["head_dim"])
    heads = _split(full, tp, "KDA heads")
    ssm = (torch.float32 if ssm_override in (None, "auto")
           else _ssm_dtype(cfg, model_dtype, ssm_override))  # transformers keeps it in float32
    qkv = (full * d, d)  # the q, k and v conv channels, each cut by heads
    kda = StateSpec(kind="kda", components=(
        StateComponent("conv", (3 * heads * d, int(lin["kernel"]) - 1 + num_spec), model_dtype,
                       TPSplit(0, (qkv, qkv, qkv))),
        StateComponent("ssm", (heads, d, d), ssm, TPSplit(0, ((full, 1),))),
    ))
    latent = int(_get(cfg, "kv_lora_rank")) + int(_get(cfg, "qk_rope_head_dim"))
    # The latent is shared by all heads: every rank keeps it whole (a replicated split).
    mla = MLASpec(latent, kv_dtype, TPSplit(1, ((latent, latent),)))
    return {f"layers.{i}": mla if t == "full_attention" else kda
            for i, t in enumerate(kimi_layer_types(cfg))}


# family -> its reader (keyword arguments: model_dtype, kv_dtype, tp, ssm_override,
# num_spec); ``core/spec_from_config`` picks the family from the architecture registry.
FAMILY_READERS: dict[str, Callable[..., dict[str, LayerSpec]]] = {
    "kimi_linear": _kimi_linear,
    "minimax": _minimax,
    "jamba": _jamba,
    "mamba1": _mamba1,
    "llama4": _llama4,
    "zamba2": _zamba2,
    "falcon_h1": _falcon_h1,
    "lfm2": _lfm2,
    "mamba2": _mamba2,
    "gemma3": _gemma3,
    "gpt_oss": _gpt_oss,
}
