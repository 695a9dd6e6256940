"""vLLM's hybrid KV-cache arithmetic (v0.30+), reproduced to explain the numbers in its logs.

pagefold never allocates this layout; the capacity planner uses it to show what vLLM would do
with the same memory. The steps, per TP rank:

1. State page = sum of the state's *unpadded* component bytes (the conv component already
   holds ``kernel - 1 + num_speculative_tokens`` rows). With several state specs, the largest.
2. Attention block = the smallest multiple of ``alignment`` (16) tokens, and at least
   ``block_size``, whose page in one layer holds one state page. The state page is padded up
   to that attention page, so every group has one page size. Without attention layers the page
   is the state page; without state layers the block stays ``block_size``.
3. Layers with equal specs form groups of ``layers_per_group`` layers (the same rule as
   :func:`pagefold.core.kv_cache_planner.group_layers`; vLLM's threshold is also 1.5x).
   ``num_blocks = memory // (layers_per_group * page)``.
4. A request of ``max_model_len`` tokens takes, per group (vLLM sums
   ``cdiv(max_memory_usage_bytes, page)`` over groups): full attention ``cdiv(len, block)``;
   sliding window ``cdiv(min(window - 1 + max_num_batched_tokens, len), block) + 1``; chunked
   local attention ``cdiv(min(chunk + max_num_batched_tokens, len), block)``; a state
   group ``1 + num_speculative_tokens`` blocks, or ``2 + num_speculative_tokens`` with prefix
   caching (``mamba_cache_mode="align"``). vLLM sets ``MambaSpec.num_speculative_blocks`` to the
   number of speculative tokens, one extra state block per draft position, so the note's
   "plus K" is K blocks *per state group*.
5. ``max_concurrency = num_blocks / blocks_per_request`` and
   ``kv_cache_size_tokens = int(max_concurrency * max_model_len)``: a count of max-length
   requests times max_model_len, not of token slots. For a pure-attention model with one group
   and ``max_model_len`` a multiple of the block, it equals ``num_blocks * block``.
"""

from __future__ import annotations

from dataclasses import dataclass

from pagefold.core.kv_cache_planner import group_layers
from pagefold.core.kv_cache_spec import (
    ChunkedLocalAttentionSpec,
    FullAttentionSpec,
    LayerSpec,
    MLASpec,
    SlidingWindowSpec,
    StateSpec,
    cdiv,
    is_attention,
)

VLLM_BLOCK_ALIGNMENT = 16
VLLM_DEFAULT_MAX_NUM_BATCHED_TOKENS = 8192


def spec_kind(spec: LayerSpec) -> str:
    """A short name for logs and reports: full_attention, sliding_window, gdn, mamba2."""
    if isinstance(spec, MLASpec):
        return "mla"
    return spec.kind if isinstance(spec, StateSpec) else spec.manager_kind


@dataclass(frozen=True, slots=True)
class VllmGroup:
    """One vLLM KV-cache group: ``layer_names`` share a spec; ``blocks_per_request`` is what a
    request of max_model_len takes from the shared pool for this group."""

    spec: LayerSpec
    layer_names: tuple[str, ...]
    blocks_per_request: int

    @property
    def kind(self) -> str:
        return spec_kind(self.spec)


@dataclass(frozen=True, slots=True)
class VllmLayout:
    """vLLM's pool for one TP rank. ``attention_block_size`` is None without attention layers;
    ``state_page_bytes`` is 0 without state layers. Invariant: ``page_size_bytes ==
    state_page_bytes + padding_bytes`` when there are state layers."""

    attention_block_size: int | None
    state_page_bytes: int
    page_size_bytes: int
    padding_bytes: int
    layers_per_group: int
    groups: tuple[VllmGroup, ...]
    num_blocks: int
    max_model_len: int
    enable_prefix_caching: bool
    num_speculative_tokens: int
    max_num_batched_tokens: int

    @property
    def blocks_per_request(self) -> int:
        return sum(g.blocks_per_request for g in self.groups)

    @property
    def max_concurrency(self) -> float:
        return self.num_blocks / self.blocks_per_request

    @property
    def kv_cache_size_tokens(self) -> int:
        return int(self.max_concurrency * self.max_model_len)

    def blocks_for_length(self, num_tokens: int) -> int:
        """Blocks one request of ``num_tokens`` tokens takes (vLLM's per-group rule)."""
        return sum(
            _group_blocks(
                g.spec,
                num_tokens,
                self.attention_block_size,
                self.enable_prefix_caching,
                self.num_speculative_tokens,
                self.max_num_batched_tokens,
            )
            for g in self.groups
        )


def vllm_state_page_bytes(layer_specs: dict[str, LayerSpec]) -> int:
    """Unpadded state page (sum of component bytes), the largest over state specs; 0 if none."""
    return max(
        (s.unpadded_bytes for s in layer_specs.values() if isinstance(s, StateSpec)), default=0
    )


def vllm_attention_block_size(
    layer_specs: dict[str, LayerSpec],
    *,
    block_size: int = 16,
    alignment: int = VLLM_BLOCK_ALIGNMENT,
) -> int | None:
    """vLLM's attention block: ``block_size``, raised to the smallest multiple of ``alignment``
    whose one-layer attention page holds one state page. None when there is no attention."""
    per_token = {s.bytes_per_token for s in layer_specs.values() if is_attention(s)}
    if not per_token:
        return None
    if len(per_token) > 1:
        raise ValueError(
            f"attention layers store different bytes per token {sorted(per_token)}; "
            "vLLM's hybrid layout needs one attention page size"
        )
    state = vllm_state_page_bytes(layer_specs)
    if state == 0:
        return block_size
    needed = alignment * cdiv(state, alignment * per_token.pop())
    return max(block_size, needed)


def _group_blocks(
    spec: LayerSpec,
    num_tokens: int,
    block: int | None,
    prefix_caching: bool,
    num_spec: int,
    max_num_batched_tokens: int,
) -> int:
    if isinstance(spec, StateSpec):
        return (2 if prefix_caching else 1) + num_spec
    assert block is not None
    if isinstance(spec, SlidingWindowSpec):
        held = min(spec.window - 1 + max_num_batched_tokens, num_tokens)
        return cdiv(held, block) + 1
    if isinstance(spec, ChunkedLocalAttentionSpec):
        return cdiv(min(spec.chunk + max_num_batched_tokens, num_tokens), block)
    assert isinstance(spec, FullAttentionSpec | MLASpec)
    return cdiv(num_tokens, block)


def plan_vllm(
    layer_specs: dict[str, LayerSpec],
    *,
    memory_bytes: int,
    max_model_len: int,
    enable_prefix_caching: bool,
    num_speculative_tokens: int = 0,
    block_size: int = 16,
    alignment: int = VLLM_BLOCK_ALIGNMENT,
    max_num_batched_tokens: int = VLLM_DEFAULT_MAX_NUM_BATCHED_TOKENS,
) -> VllmLayout:
    """vLLM's layout for ``layer_specs`` (one TP rank) and a per-rank ``memory_bytes`` budget.

    ``layer_specs`` must already carry ``num_speculative_tokens`` in their conv rows (build them
    with the same value); here it adds the speculative state blocks per state group. Does not
    check that one request fits: the caller decides (see ``capacity_report``).
    """
    if not layer_specs:
        raise ValueError("the model declares no cached layers")
    if max_model_len < 1:
        raise ValueError(f"max_model_len must be at least 1, got {max_model_len}")
    block = vllm_attention_block_size(layer_specs, block_size=block_size, alignment=alignment)
    state = vllm_state_page_bytes(layer_specs)
    if block is None:
        page = state
    else:
        attn = next(s for s in layer_specs.values() if is_attention(s))
        page = attn.page_bytes(block)
    size, grouped = group_layers(layer_specs)
    groups = tuple(
        VllmGroup(
            spec=spec,
            layer_names=tuple(names),
            blocks_per_request=_group_blocks(
                spec,
                max_model_len,
                block,
                enable_prefix_caching,
                num_speculative_tokens,
                max_num_batched_tokens,
            ),
        )
        for spec, names in grouped
    )
    return VllmLayout(
        attention_block_size=block,
        state_page_bytes=state,
        page_size_bytes=page,
        padding_bytes=page - state if state else 0,
        layers_per_group=size,
        groups=groups,
        num_blocks=memory_bytes // (size * page),
        max_model_len=max_model_len,
        enable_prefix_caching=enable_prefix_caching,
        num_speculative_tokens=num_speculative_tokens,
        max_num_batched_tokens=max_num_batched_tokens,
    )
