"""What a layer needs at forward time besides its inputs: its cache view and step metadata."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pagefold.executor.cache_tensors import CacheTensors, StateView
from pagefold.layers.attention.backend import AttentionMetadata, paged_attention


@dataclass(slots=True)
class StateMetadata:
    """Per state group, per step.

    ``page_ids`` (N, pages_per_state) for the N scheduled requests in batch order;
    ``cu_seqlens`` (N+1,) over the flat batch; ``has_initial_state`` (N,) bool: False for a
    request whose first token is in this step (its state starts from zeros).
    ``all_decode``: every request has exactly one token this step (the recurrent fast path).
    ``capture_after`` (M,) / ``capture_pages`` (M, pages_per_state), or None: checkpoints to
    take inside this step, the states right after flat token ``capture_after[m]`` written to
    ``capture_pages[m]`` (see :mod:`pagefold.layers.state_capture`).
    """

    page_ids: torch.Tensor
    cu_seqlens: torch.Tensor
    has_initial_state: torch.Tensor
    all_decode: bool
    any_initial_state: bool
    capture_after: torch.Tensor | None = None
    capture_pages: torch.Tensor | None = None


@dataclass(slots=True)
class ForwardContext:
    cache: CacheTensors
    attn_meta: list[AttentionMetadata | None]
    state_meta: list[StateMetadata | None]

    def attention(self, layer: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                  scale: float) -> torch.Tensor:
        meta = self.attn_meta[self.cache.layer_group[layer]]
        return paged_attention(q, k, v, self.cache.attn[layer], meta, scale)

    def state(self, layer: str) -> tuple[StateView, StateMetadata]:
        return self.cache.state[layer], self.state_meta[self.cache.layer_group[layer]]

    def load_states(self, layer: str) -> dict[str, torch.Tensor]:
        """This step's initial states of ``layer`` (zeros for requests starting fresh)."""
        view, meta = self.state(layer)
        if not meta.any_initial_state:
            return view.zeros(meta.page_ids.shape[0])
        states = view.gather(meta.page_ids)
        if not bool(meta.has_initial_state.all()):
            fresh = ~meta.has_initial_state
            for t in states.values():
                t[fresh] = 0
        return states

    def store_states(self, layer: str, states: dict[str, torch.Tensor]) -> None:
        view, meta = self.state(layer)
        view.scatter(meta.page_ids, states)

    def store_checkpoints(self, layer: str, states: dict[str, torch.Tensor]) -> None:
        """Write captured states (one per ``capture_pages`` row) to their checkpoint pages."""
        view, meta = self.state(layer)
        view.scatter(meta.capture_pages, states)
