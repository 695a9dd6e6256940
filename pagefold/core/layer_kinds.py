"""One parser of a config's per-layer kinds, shared by the cache specs and the models.

``layer_kinds(cfg, family)`` returns one of ``full``, ``sliding``, ``gdn``, ``mamba2``, ``mlp``,
``moe`` per layer (block). ``core/spec_from_config.py`` sizes the cache from it and the models
build their layers from it, so one config can never size one cache and build another model.

Where a config may name its layers several ways, the precedence is transformers' own:

* Nemotron-H: ``layers_block_type`` (alias ``layer_types``) wins; the older
  ``hybrid_override_pattern`` string (``M`` Mamba-2, ``*`` attention, ``-`` MLP, ``E`` MoE)
  is read only when no list is given.
* Granite-4.0-H: ``layer_types`` (alias ``layers_block_type``); all-Mamba when neither is given.
* Bamba: ``attn_layer_indices``; else a ``layers_block_type`` list; else all Mamba.
* Llama / Qwen2 / Qwen3: ``layer_types``, else Qwen's ``max_window_layers`` sliding rule.
* Qwen3.5 / Qwen3-Next: ``layer_types``, else every ``full_attention_interval``-th is attention.

Works on a transformers config object or a plain ``config.json`` dict.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

FULL, SLIDING, GDN, MAMBA2, MLP, MOE = "full", "sliding", "gdn", "mamba2", "mlp", "moe"
CACHED_KINDS = (FULL, SLIDING, GDN, MAMBA2)

# Nemotron-H's hybrid_override_pattern characters (as real checkpoints write them).
NEMOTRON_PATTERN = {"M": MAMBA2, "*": FULL, "-": MLP, "E": MOE}
_MAMBA_HYBRID_TYPES = {"mamba": MAMBA2, "linear_attention": MAMBA2, "attention": FULL,
                       "full_attention": FULL}

_MISSING = object()


def config_get(cfg: Any, *names: str, default: Any = _MISSING) -> Any:
    """First non-None value of ``names`` in a dict or config object; ``default`` or raise."""
    for name in names:
        if isinstance(cfg, Mapping):
            value = cfg.get(name)
        else:
            value = getattr(cfg, name, None)
        if value is not None:
            return value
    if default is _MISSING:
        alt = f" (or {', '.join(repr(n) for n in names[1:])})" if len(names) > 1 else ""
        raise ValueError(f"the model config has no {names[0]!r}{alt}, needed to size its cache")
    return default


def num_layers(cfg: Any) -> int:
    return int(config_get(cfg, "num_hidden_layers", "n_layer", "num_layers"))


def unknown_layer_type(family: str, index: int, value: Any, allowed: list[str]) -> ValueError:
    return ValueError(
        f"layer {index} of this {family} config has unknown layer type {value!r}; "
        f"supported layer types: {', '.join(allowed)}"
    )


def _map_kinds(types: list[Any], table: dict[str, str], family: str) -> list[str]:
    out = []
    for i, t in enumerate(types):
        if t not in table:
            raise unknown_layer_type(family, i, t, list(table))
        out.append(table[t])
    return out


def attention_kinds(cfg: Any) -> list[str]:
    n = num_layers(cfg)
    types = config_get(cfg, "layer_types", default=None)
    if types is None:
        window = config_get(cfg, "sliding_window", default=None)
        use = bool(config_get(cfg, "use_sliding_window", default=False))
        first = int(config_get(cfg, "max_window_layers", default=n))
        # transformers' Qwen2/Qwen3 rule: sliding only when enabled, from max_window_layers on.
        types = ["sliding_attention" if use and window is not None and i >= first
                 else "full_attention" for i in range(n)]
    table = {"full_attention": FULL, "sliding_attention": SLIDING}
    return _map_kinds(list(types), table, "attention")


def gdn_kinds(cfg: Any) -> list[str]:
    types = config_get(cfg, "layer_types", default=None)
    if types is None:
        interval = int(config_get(cfg, "full_attention_interval", default=4))
        types = ["full_attention" if (i + 1) % interval == 0 else "linear_attention"
                 for i in range(num_layers(cfg))]
    table = {"full_attention": FULL, "linear_attention": GDN}
    return _map_kinds(list(types), table, "Gated DeltaNet hybrid")


def nemotron_kinds(cfg: Any) -> list[str]:
    types = config_get(cfg, "layers_block_type", "layer_types", default=None)
    if types is None or isinstance(types, str):
        pattern = config_get(cfg, "hybrid_override_pattern", default=types)
        if pattern is None:
            raise ValueError("Nemotron-H config has neither layers_block_type nor "
                             "hybrid_override_pattern")
        return _map_kinds(list(pattern), NEMOTRON_PATTERN, "Nemotron-H")
    table = dict(_MAMBA_HYBRID_TYPES, mlp=MLP, moe=MOE)
    return _map_kinds(list(types), table, "Nemotron-H")


def granite_kinds(cfg: Any) -> list[str]:
    # transformers defaults a Granite hybrid without layer_types to all-Mamba layers.
    types = config_get(cfg, "layer_types", "layers_block_type", default=None)
    if types is None:
        types = ["mamba"] * num_layers(cfg)
    return _map_kinds(list(types), _MAMBA_HYBRID_TYPES, "Granite-4.0-H")


def bamba_kinds(cfg: Any) -> list[str]:
    indices = config_get(cfg, "attn_layer_indices", default=None)
    if indices is None:
        # A config object exposes the derived list; a dict without indices is all Mamba.
        types = config_get(cfg, "layers_block_type", default=None)
        if types is not None and not isinstance(types, str):
            return _map_kinds(list(types), _MAMBA_HYBRID_TYPES, "Bamba")
        indices = []
    n = num_layers(cfg)
    bad = [i for i in indices if not 0 <= int(i) < n]
    if bad:
        raise ValueError(f"Bamba attn_layer_indices {bad} are outside 0..{n - 1}")
    attn = {int(i) for i in indices}
    return [FULL if i in attn else MAMBA2 for i in range(n)]


PARSERS = {
    "attention": attention_kinds,
    "gdn": gdn_kinds,
    "nemotron_h": nemotron_kinds,
    "granite": granite_kinds,
    "bamba": bamba_kinds,
}


def layer_kinds(cfg: Any, family: str) -> list[str]:
    """Per-layer kinds of a (text) config of ``family`` (see ``detect_family``)."""
    return PARSERS[family](cfg)
