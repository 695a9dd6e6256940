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
from pagefold.csrc import cpu_ops
from pagefold.executor import huge_pages
from pagefold.ops.attention.kv_quant import KVScales
from pagefold.ops.common.capture import PagedOut


def wide_rows(t: torch.Tensor) -> torch.Tensor:
    """``t`` (rows, nbytes) uint8 viewed with the widest element that divides a row: row
    gathers and scatters then move 8-byte words (torch copies uint8 rows byte by byte)."""
    for dt in (torch.int64, torch.int32, torch.int16):
        if t.shape[-1] % dt.itemsize == 0:
            return t.view(dt)
    return t


class StateView:
    """Gathers a batch of states from their pages and writes them (or some components) back.

    A state is the concatenation of its ``pages_per_state`` pages (any block ids); component
    ``c`` is the byte range ``[offset(c), offset(c) + nbytes)`` of it and may cross pages.
    """

    def __init__(self, raw: torch.Tensor, spec: StateSpec, pages_per_state: int) -> None:
        self.raw = raw  # (num_blocks, page_bytes) uint8
        self.spec = spec
        self.pages = pages_per_state
        self.page_bytes = raw.shape[1]
        self._offsets = {c.name: off for c, off in zip(spec.components, spec.offsets)}
        self._names = frozenset(self._offsets)
        # Byte ranges of a state's pages no component covers (alignment, the last page's
        # tail): writes zero just these, so pages stay deterministic without a full memset.
        self.gaps: list[tuple[int, int]] = []
        pos = 0
        for comp, off in sorted(zip(spec.components, spec.offsets), key=lambda co: co[1]):
            if off > pos:
                self.gaps.append((pos, off))
            pos = max(pos, off + comp.nbytes)
        if pos < self.pages * self.page_bytes:
            self.gaps.append((pos, self.pages * self.page_bytes))

    def offset(self, name: str) -> int:
        """Byte offset of component ``name`` in a state's concatenated pages."""
        return self._offsets[name]

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

    def scatter(self, page_ids: torch.Tensor, states: dict[str, torch.Tensor],
                written: tuple[str, ...] = ()) -> None:
        """Write states to their pages (page_ids (N, pages_per_state)): every component in
        ``states`` (cast to its dtype), zeros in the gaps. ``written`` names the components the
        caller stored itself (a kernel capturing into the pages, see ``paged``); together the
        two must cover every component."""
        if set(states) | set(written) != self._names or set(states) & set(written):
            raise ValueError(f"scatter needs each of {sorted(self._names)} once, got states "
                             f"{sorted(states)} and written {sorted(written)}")
        ids = page_ids.to(device=self.raw.device, dtype=torch.int64).contiguous()
        for name, src in states.items():
            self.write_component(ids, name, src)
        for lo, hi in self.gaps:
            self._write_bytes(ids, lo, None, hi - lo)

    def write_component(self, page_ids: torch.Tensor, name: str, src: torch.Tensor) -> None:
        """Component ``name`` of the states at ``page_ids`` := src (N, *shape), cast."""
        comp = self.spec.component(name)
        n = page_ids.shape[0]
        data = src.to(device=self.raw.device, dtype=comp.dtype).reshape(n, -1).contiguous()
        self._write_bytes(page_ids, self._offsets[name], data.view(torch.uint8), comp.nbytes)

    def paged(self, page_ids: torch.Tensor, name: str) -> PagedOut:
        """A capture destination for a kernel: component ``name`` of the states at page_ids."""
        return PagedOut(self, page_ids, name)

    def _write_bytes(self, page_ids: torch.Tensor, off: int, data: torch.Tensor | None,
                     nbytes: int) -> None:
        """Bytes [off, off + nbytes) of each state := its row of data (N, nbytes) uint8, or
        zeros (data None): compiled in one pass where it can, else one ``index_copy_`` per
        page the range touches (on the widest element dividing the range and the page)."""
        ids = page_ids.to(device=self.raw.device, dtype=torch.int64)  # no copy when it is
        if cpu_ops.page_write(self.raw, ids, off, data, nbytes):
            return
        pb, n = self.page_bytes, ids.shape[0]
        if data is None:
            data = torch.zeros((n, nbytes), dtype=torch.uint8, device=self.raw.device)
        width = next(w for w in (8, 4, 2, 1) if pb % w == 0 and off % w == 0 and nbytes % w == 0)
        raw = self.raw.view(_WORD[width])
        words = data.view(_WORD[width])
        end = off + nbytes
        for j in range(off // pb, (end - 1) // pb + 1):
            lo, hi = max(off, j * pb), min(end, (j + 1) * pb)
            dst = raw[:, (lo - j * pb) // width : (hi - j * pb) // width]
            dst.index_copy_(0, ids[:, j], words[:, (lo - off) // width : (hi - off) // width])

    def zeros(self, n: int) -> dict[str, torch.Tensor]:
        return {
            c.name: torch.zeros((n, *c.shape), dtype=c.dtype, device=self.raw.device)
            for c in self.spec.components
        }


_WORD = {8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.uint8}


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
