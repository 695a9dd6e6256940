"""Turns per-layer specs and a memory budget into the pool the engine builds (pagefold layout).

Invariants of the resulting :class:`KVCacheConfig`:

* Every group's page is ``page_bytes`` bytes. There are ``layers_per_group`` shared tensors of
  ``num_blocks x page_bytes`` bytes; block id ``b`` of group ``g`` is row ``b`` of shared tensor
  ``i`` for the ``i``-th layer of ``g``. Groups draw block ids from one pool.
* Block 0 is the null block: never handed out, used to pad block tables.
* Attention pages hold ``block_size`` tokens. A state spans ``pages_per_state`` whole pages
  (``ceil(state_bytes / page_bytes)``), so its waste is under one page per group.
"""

from __future__ import annotations

import re
from collections import defaultdict
from dataclasses import dataclass, replace

from pagefold.core.kv_cache_spec import LayerSpec, StateSpec, cdiv, dtype_size, is_attention


@dataclass(frozen=True, slots=True)
class CacheGroup:
    spec: LayerSpec
    layer_names: tuple[str, ...]
    pages_per_state: int = 0  # >0 only for StateSpec groups


@dataclass(frozen=True, slots=True)
class KVCacheConfig:
    block_size: int
    page_bytes: int
    layers_per_group: int
    num_blocks: int
    groups: tuple[CacheGroup, ...]

    @property
    def total_bytes(self) -> int:
        return self.layers_per_group * self.num_blocks * self.page_bytes

    def group_of_layer(self) -> dict[str, tuple[int, int]]:
        """layer name -> (group index, slot index in the shared tensors)."""
        out = {}
        for gi, g in enumerate(self.groups):
            for si, name in enumerate(g.layer_names):
                out[name] = (gi, si)
        return out


def group_layers(
    layer_specs: dict[str, LayerSpec],
) -> tuple[int, list[tuple[LayerSpec, list[str]]]]:
    """Group layers with equal specs into groups of equal layer count.

    Group size is the smallest layer count of any kind, unless the largest count is under
    1.5x that, in which case every kind fits in one group of the largest count.
    Returns ``(layers_per_group, [(spec, layer_names), ...])`` in first-seen order.
    """
    by_spec: dict[LayerSpec, list[str]] = defaultdict(list)
    for name, spec in layer_specs.items():
        by_spec[spec].append(name)
    counts = [len(v) for v in by_spec.values()]
    size = min(counts)
    if max(counts) < 1.5 * size:
        size = max(counts)
    groups = []
    for spec, names in by_spec.items():
        for i in range(0, len(names), size):
            groups.append((spec, names[i : i + size]))
    return size, groups


def page_bytes_for(specs: list[LayerSpec], block_size: int) -> int:
    """pagefold's page: one attention page of ``block_size`` tokens.

    Without attention layers, the page is one whole state. Raises if attention layers disagree
    on their page size or a page cannot hold whole state elements.
    """
    attn = {s.page_bytes(block_size) for s in specs if is_attention(s)}
    if len(attn) > 1:
        raise ValueError(
            f"attention layers have different page sizes {sorted(attn)} at block_size "
            f"{block_size}; pagefold needs one page size per pool"
        )
    if attn:
        page = attn.pop()
    else:
        page = max(s.state_bytes for s in specs if isinstance(s, StateSpec))
    for s in specs:
        if isinstance(s, StateSpec):
            widest = max(dtype_size(c.dtype) for c in s.components)
            if page % 16 or page % widest:
                raise ValueError(
                    f"a {s.kind} state ({s.state_bytes} bytes) cannot be split into pages of "
                    f"{page} bytes: the page must be a multiple of 16 bytes; change block_size"
                )
    return page


def plan_pagefold(
    layer_specs: dict[str, LayerSpec], block_size: int, memory_bytes: int
) -> KVCacheConfig:
    if not layer_specs:
        raise ValueError("the model declares no cached layers")
    size, grouped = group_layers(layer_specs)
    page = page_bytes_for(list(layer_specs.values()), block_size)
    groups = tuple(
        CacheGroup(
            spec=spec,
            layer_names=tuple(names),
            pages_per_state=cdiv(spec.state_bytes, page) if isinstance(spec, StateSpec) else 0,
        )
        for spec, names in grouped
    )
    num_blocks = memory_bytes // (size * page)
    return KVCacheConfig(
        block_size=block_size,
        page_bytes=page,
        layers_per_group=size,
        num_blocks=num_blocks,
        groups=groups,
    )


def _layer_index(name: str) -> int:
    m = re.fullmatch(r"layers\.(\d+)(\..+)?", name)  # a layer's own caches: layers.{i}.x
    if m is None:
        raise ValueError(f"cache layer {name!r} belongs to no decoder layer; pipeline "
                         "parallelism splits decoder layers only")
    return int(m[1])


def plan_stages(
    layer_specs: dict[str, LayerSpec], block_size: int, memory_bytes: int,
    stages: list[tuple[int, int]],
) -> tuple[KVCacheConfig, list[KVCacheConfig]]:
    """The pools of pipeline stages holding decoder layers ``[start, end)`` each, with
    ``memory_bytes`` per stage: ``(the scheduler's config, [each stage's config])``.

    Every stage keeps the whole model's groups (same order, spec and page size) with only its
    own layers in them, so one block table per group addresses every stage: block ``b`` of
    group ``g`` is row ``b`` of each stage's tensor for its ``i``-th layer of ``g`` (a group
    may hold none of a stage's layers). A stage has as many shared tensors as its fullest
    group has layers; ``num_blocks`` is the fewest any stage's memory holds, the same on every
    stage and in the scheduler's config (whose groups list every layer)."""
    whole = plan_pagefold(layer_specs, block_size, memory_bytes)
    per_stage = []
    for start, end in stages:
        groups = tuple(replace(g, layer_names=tuple(
            n for n in g.layer_names if start <= _layer_index(n) < end)) for g in whole.groups)
        per_stage.append(groups)
    sizes = [max(len(g.layer_names) for g in groups) for groups in per_stage]
    fits = [memory_bytes // (size * whole.page_bytes) for size in sizes if size]
    num_blocks = min(fits) if fits else whole.num_blocks
    configs = [replace(whole, layers_per_group=size, num_blocks=num_blocks, groups=groups)
               for size, groups in zip(sizes, per_stage)]
    return replace(whole, num_blocks=num_blocks), configs


NUM_NULL_BLOCKS = 1  # block 0, see the module docstring


def usable_blocks(config: KVCacheConfig) -> int:
    """Blocks the allocator can hand out: the pool minus the null block."""
    return max(0, config.num_blocks - NUM_NULL_BLOCKS)


# The engine's token budget per step when none is configured (``EngineCore``): a prefill chunk
# can be this long, which is what a sliding-window group holds at its peak.
DEFAULT_MAX_NUM_BATCHED_TOKENS = 4096


def group_pages_for_request(
    group: CacheGroup,
    block_size: int,
    num_tokens: int,
    *,
    enable_prefix_caching: bool,
    max_num_batched_tokens: int = DEFAULT_MAX_NUM_BATCHED_TOKENS,
) -> int:
    """Pages one sequence of ``num_tokens`` tokens holds in ``group`` at its peak.

    Full attention: ``cdiv(num_tokens, block_size)``. Sliding window: a step computing a chunk
    of ``c`` tokens (``c`` at most ``max_num_batched_tokens`` and ``num_tokens``) reads keys
    back to ``window - 1`` tokens before its first token, so it holds the pages that a span of
    ``window - 1 + c`` tokens can overlap, ``cdiv(window + c - 2, block_size) + 1``, capped by
    the full count (a decode step, ``c = 1``, needs ``cdiv(window - 1, block_size) + 1``).
    Chunked local attention (chunk ``C``): a step's keys start at its first token's chunk
    start, at most ``C - 1`` tokens before it, so the same count with ``window = C``.
    State: ``pages_per_state`` for the running state, and one more state's worth with prefix
    caching (the checkpoint kept for reuse).
    """
    spec = group.spec
    if isinstance(spec, StateSpec):
        return group.pages_per_state * (2 if enable_prefix_caching else 1)
    full = cdiv(num_tokens, block_size)
    window = getattr(spec, "window", None) or getattr(spec, "chunk", None)
    if window is not None:
        chunk = max(1, min(max_num_batched_tokens, num_tokens))
        return min(full, cdiv(window + chunk - 2, block_size) + 1)
    return full


def pages_for_request(
    config: KVCacheConfig,
    num_tokens: int,
    *,
    enable_prefix_caching: bool,
    max_num_batched_tokens: int = DEFAULT_MAX_NUM_BATCHED_TOKENS,
) -> int:
    """Pages (block ids) one sequence of ``num_tokens`` tokens takes from the pool, all groups."""
    return sum(
        group_pages_for_request(
            g,
            config.block_size,
            num_tokens,
            enable_prefix_caching=enable_prefix_caching,
            max_num_batched_tokens=max_num_batched_tokens,
        )
        for g in config.groups
    )
