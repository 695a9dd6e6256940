"""The shared cache tensors and each layer's typed view of them.

``layers_per_group`` byte tensors of shape ``(num_blocks, page_bytes)`` back the whole pool.
Layer ``i`` of every group reads and writes row ``b`` of tensor ``i`` for its block ``b``:

* attention layers see the row as ``(block_size, 2, num_kv_heads, head_dim)`` of the KV dtype;
* state layers see a state as the concatenation of its ``pages_per_state`` rows, cut into
  its components at the spec's offsets.

Both views are reinterpretations of whole rows, so a write through one group's view can only
touch the rows (blocks) that group owns: the layout contract that keeps groups apart.
"""

from __future__ import annotations

import torch

from pagefold.core.kv_cache_planner import KVCacheConfig
from pagefold.core.kv_cache_spec import StateSpec, is_attention
from pagefold.executor import huge_pages
from pagefold.layers.attention.kv_quant import KVScales


def wide_rows(t: torch.Tensor) -> torch.Tensor:
    """``t`` (rows, nbytes) uint8 viewed with the widest element that divides a row: row
    gathers and scatters then move 8-byte words (torch copies uint8 rows byte by byte)."""
    for dt in (torch.int64, torch.int32, torch.int16):
        if t.shape[-1] % dt.itemsize == 0:
            return t.view(dt)
    return t


class StateView:
    """Gathers a batch of states from their pages and scatters them back."""

    def __init__(self, raw: torch.Tensor, spec: StateSpec, pages_per_state: int) -> None:
        self.raw = raw  # (num_blocks, page_bytes) uint8
        self.spec = spec
        self.pages = pages_per_state
        self.page_bytes = raw.shape[1]
        # Byte ranges of a state's pages no component covers (alignment, the last page's
        # tail): scatter zeroes just these, so pages stay deterministic without a full memset.
        self.gaps: list[tuple[int, int]] = []
        pos = 0
        for comp, off in sorted(zip(spec.components, spec.offsets), key=lambda co: co[1]):
            if off > pos:
                self.gaps.append((pos, off))
            pos = max(pos, off + comp.nbytes)
        if pos < self.pages * self.page_bytes:
            self.gaps.append((pos, self.pages * self.page_bytes))

    def gather(self, page_ids: torch.Tensor) -> dict[str, torch.Tensor]:
        """page_ids (N, pages_per_state) -> {component: (N, *shape)} (fresh tensors)."""
        n = page_ids.shape[0]
        rows = wide_rows(self.raw).index_select(0, page_ids.reshape(-1))
        flat = rows.view(torch.uint8).view(n, self.pages * self.page_bytes)
        out = {}
        for comp, off in zip(self.spec.components, self.spec.offsets):
            chunk = flat[:, off : off + comp.nbytes]
            out[comp.name] = chunk.view(comp.dtype).view(n, *comp.shape)
        return out

    def scatter(self, page_ids: torch.Tensor, states: dict[str, torch.Tensor]) -> None:
        """Write whole states back to their pages (every component must be given)."""
        n = page_ids.shape[0]
        flat = torch.empty((n, self.pages * self.page_bytes), dtype=torch.uint8,
                           device=self.raw.device)
        for lo, hi in self.gaps:
            flat[:, lo:hi] = 0
        for comp, off in zip(self.spec.components, self.spec.offsets):
            src = states[comp.name].to(comp.dtype).reshape(n, -1).contiguous()
            flat[:, off : off + comp.nbytes] = src.view(torch.uint8)
        wide_rows(self.raw).index_copy_(0, page_ids.reshape(-1),
                                        wide_rows(flat.view(n * self.pages, self.page_bytes)))

    def zeros(self, n: int) -> dict[str, torch.Tensor]:
        return {
            c.name: torch.zeros((n, *c.shape), dtype=c.dtype, device=self.raw.device)
            for c in self.spec.components
        }


class CacheTensors:
    def __init__(self, config: KVCacheConfig, device: torch.device, fill: float | None = None):
        self.config = config
        self.shared = [
            huge_pages.zeros(config.num_blocks, config.page_bytes) if device.type == "cpu"
            else torch.zeros((config.num_blocks, config.page_bytes), dtype=torch.uint8,
                             device=device)
            for _ in range(config.layers_per_group)
        ]
        self.attn: dict[str, torch.Tensor] = {}
        self.state: dict[str, StateView] = {}
        self.layer_group: dict[str, int] = {}
        # FP8 attention layers' encodings, set on the first real batch (or from a checkpoint).
        self.kv_scales: dict[str, KVScales] = {}
        for gi, group in enumerate(config.groups):
            for si, name in enumerate(group.layer_names):
                raw = self.shared[si]
                self.layer_group[name] = gi
                spec = group.spec
                if is_attention(spec):
                    self.attn[name] = raw.view(spec.dtype).view(
                        config.num_blocks, *spec.page_shape(config.block_size)
                    )
                else:
                    self.state[name] = StateView(raw, spec, group.pages_per_state)
        if fill is not None:
            self.fill_attention(fill)

    def fill_attention(self, value: float) -> None:
        """Tests fill fresh caches with NaN so a read of an unwritten slot shows up."""
        for t in self.attn.values():
            if t.dtype.is_floating_point and t.element_size() > 1:
                t.fill_(value)
