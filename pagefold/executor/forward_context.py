"""What a layer needs at forward time besides its inputs: its cache view and step metadata."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from pagefold.executor.cache_tensors import CacheTensors, StateView
from pagefold.ops.attention import AttentionMetadata, paged_attention
from pagefold.ops.attention.kv_quant import KVScales, is_fp8


@dataclass(slots=True)
class StateMetadata:
    """Per state group, per step.

    ``page_ids`` (N, pages_per_state) for the N scheduled requests in batch order;
    ``cu_seqlens`` (N+1,) over the flat batch; ``has_initial_state`` (N,) bool: False for a
    request whose first token is in this step (its state starts from zeros).
    ``all_decode``: every request has exactly one token this step (the recurrent fast path).
    ``capture_after`` (M,) / ``capture_pages`` (M, pages_per_state), or None: checkpoints to
    take inside this step, the states right after flat token ``capture_after[m]`` written to
    ``capture_pages[m]`` (see :mod:`pagefold.ops.common.capture`).
    """

    page_ids: torch.Tensor
    cu_seqlens: torch.Tensor
    has_initial_state: torch.Tensor
    all_decode: bool
    any_initial_state: bool
    # Every request continues a state (``has_initial_state`` all True): the kernels need no
    # fresh flags. False where unknown (a reader then looks at the tensor).
    all_initial_state: bool = False
    # (N,) bool on a speculative verify step: the requests whose chunk is 1 + k decode tokens.
    spec_rows: torch.Tensor | None = None
    capture_after: torch.Tensor | None = None
    capture_pages: torch.Tensor | None = None


@dataclass(slots=True)
class ForwardContext:
    cache: CacheTensors
    attn_meta: list[AttentionMetadata | None]
    state_meta: list[StateMetadata | None]
    # False for warm-up's dummy tokens: FP8 scales are calibrated on the first real batch.
    calibrate: bool = True
    # Speculative verify step: state layers run their verify kernels and leave the state
    # after *every* token here ({layer: {component: (T, ...)}}) instead of storing; the runner
    # commits the state after each request's last accepted token (spec_decode.state_verify).
    spec_states: dict[str, dict[str, torch.Tensor]] | None = None
    # A drafter's chained passes (spec_decode.draft_model): the initial states of state layers
    # given directly ({layer: {component: (N, ...)}}, e.g. the state after the previous
    # draft token) instead of read from their pages.
    initial_states: dict[str, dict[str, torch.Tensor]] | None = None
    # Image embeddings of this step: (flat rows, embeddings) that replace those rows' token
    # embeddings (pagefold.multimodal.encoder_cache); None on a step without image tokens.
    mm_embeds: tuple[torch.Tensor, torch.Tensor] | None = None
    # Some row of the step runs with a LoRA adapter (pagefold.lora): the linears' hooks add
    # their terms, so the native decode driver (whose linears bypass the hooks) is skipped.
    lora_rows: bool = False
    # EAGLE-3 drafting (spec_decode.aux_hidden): the target decoder layers whose *input*
    # hidden state the drafter consumes, in the drafter's order; None (the default, every
    # step without an EAGLE-3 drafter) captures nothing. ``aux_hidden`` holds what the
    # decoder stack captured this forward ({layer index: (T, hidden)}).
    aux_layers: tuple[int, ...] | None = None
    aux_hidden: dict[int, torch.Tensor] = field(default_factory=dict)
    # A decode burst's forward after its first (``core/decode_burst.py``): this context and
    # its metadata tensors are the previous forward's, advanced in place to the next
    # positions (same objects, same addresses), so lookups made from them may be reused.
    burst_step: int = 0

    def attention(self, layer: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                  scale: float) -> torch.Tensor:
        meta = self.attn_meta[self.cache.layer_group[layer]]
        cache = self.cache.attn[layer]
        scales = None
        if is_fp8(cache.dtype):
            scales = self.cache.kv_scales.get(layer)
            if scales is None and self.calibrate:
                scales = self.cache.kv_scales[layer] = KVScales.calibrate(k, v, cache.dtype)
        return paged_attention(q, k, v, cache, meta, scale, scales)

    def state(self, layer: str) -> tuple[StateView, StateMetadata]:
        return self.cache.state[layer], self.state_meta[self.cache.layer_group[layer]]

    def load_states(self, layer: str) -> dict[str, torch.Tensor]:
        """This step's initial states of ``layer`` (zeros for requests starting fresh)."""
        if self.initial_states is not None and layer in self.initial_states:
            return dict(self.initial_states[layer])
        view, meta = self.state(layer)
        if not meta.any_initial_state:
            return view.zeros(meta.page_ids.shape[0])
        states = view.gather(meta.page_ids)
        if not bool(meta.has_initial_state.all()):
            fresh = ~meta.has_initial_state
            for t in states.values():
                t[fresh] = 0
        return states

    def capture_layer_input(self, index: int, x: torch.Tensor,
                            residual: torch.Tensor | None) -> None:
        """Called by a decoder stack before its layer ``index``: keep the hidden state entering
        it when the drafter reads that layer (``x``, plus ``residual`` for the stacks with the
        fused add + norm convention). A copy: the stream may later be updated in place."""
        if self.aux_layers is not None and index in self.aux_layers:
            self.aux_hidden[index] = x.clone() if residual is None else x + residual

    def drafter_hidden(self, hidden: torch.Tensor) -> torch.Tensor:
        """What a hidden-state drafter takes from this target forward: ``hidden`` (the
        model's output) or, with ``aux_layers``, the captured layer inputs concatenated along
        the feature axis in ``aux_layers`` order ((T, len(aux_layers) * hidden))."""
        if self.aux_layers is None:
            return hidden
        return torch.cat([self.aux_hidden[i] for i in self.aux_layers], dim=-1)

    @property
    def verify(self) -> bool:
        """True on a speculative verify step (see ``spec_states``)."""
        return self.spec_states is not None

    def store_token_states(self, layer: str, states: dict[str, torch.Tensor]) -> None:
        """Verify step: keep the per-token states of ``layer`` for the commit."""
        assert self.spec_states is not None
        self.spec_states[layer] = states

    def store_states(self, layer: str, states: dict[str, torch.Tensor]) -> None:
        view, meta = self.state(layer)
        view.scatter(meta.page_ids, states)

    def store_checkpoints(self, layer: str, states: dict[str, torch.Tensor],
                          written: tuple[str, ...] = ()) -> None:
        """Write captured states (one per ``capture_pages`` row) to their checkpoint pages;
        ``written``: the components a kernel stored there itself (``PagedOut``)."""
        view, meta = self.state(layer)
        view.scatter(meta.capture_pages, states, written)
