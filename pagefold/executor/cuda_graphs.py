"""Decode steps replayed from CUDA graphs, one per batch-size bucket, over static buffers.

A decode step (every request has one new token) launches hundreds of small kernels; on a GPU
their launch cost exceeds the work for small batches. :class:`DecodeGraphs` captures the
model forward once per bucket size ``B`` (1, 2, 4, 8, then multiples of 8) over a
**persistent, device-resident batch**: static tensors for the token ids, positions and every
group's metadata (slot mapping, block tables, sequence lengths, window starts, state page ids,
``cu_seqlens``, ``has_initial_state``). A step copies its inputs into the first ``n`` rows and
pads rows ``n..B-1`` so that they touch nothing:

* attention: slot ``-1`` (the Triton K/V write skips it), sequence length 0 (no key is read,
  the output row is zeros);
* states: page id ``-1`` (the Triton conv / GDN / SSD kernels neither read nor write a state
  whose first page is negative), one token each in ``cu_seqlens`` (rows stay aligned).

Correct by construction: the captured work is the same Triton path an eager step runs, on the
same metadata plus padding rows that are inert. Only the Triton kernels honour the padding
conventions, so graphs are used only when :func:`pagefold.kernels.dispatch.use_triton` holds.
On the CPU (tests) ``capture=False`` runs the identical padded step eagerly, which is how the
padding and the static metadata are checked without a GPU.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pagefold.core.kv_cache_planner import KVCacheConfig
from pagefold.core.kv_cache_spec import (
    ChunkedLocalAttentionSpec,
    SlidingWindowSpec,
    StateSpec,
    cdiv,
)
from pagefold.executor.forward_context import ForwardContext, StateMetadata
from pagefold.ops.attention import AttentionMetadata


def capture_sizes(max_batch: int) -> list[int]:
    """Bucket sizes for batches of up to ``max_batch`` rows: 1, 2, 4, then multiples of 8,
    up to the first that holds ``max_batch``."""
    out = []
    for s in [1, 2, 4, *range(8, max(max_batch, 1) + 8, 8)]:
        out.append(s)
        if s >= max_batch:
            break
    return out


def bucket_for(n: int, sizes: list[int]) -> int | None:
    """The smallest bucket holding ``n`` rows, or None (run eagerly)."""
    for s in sizes:
        if s >= n:
            return s
    return None


@dataclass(slots=True)
class _Group:
    """Static metadata of one cache group for a bucket of ``B`` rows."""

    attn: AttentionMetadata | None
    state: StateMetadata | None


class StaticBatch:
    """The persistent decode batch of one bucket: device tensors written in place each step
    (their addresses are what a captured graph reads)."""

    def __init__(self, kv_config: KVCacheConfig, size: int, max_model_len: int,
                 device: torch.device) -> None:
        self.size = size
        i64 = dict(dtype=torch.int64, device=device)
        self.input_ids = torch.zeros(size, **i64)
        self.positions = torch.zeros(size, **i64)
        self.groups: list[_Group] = []
        bs = kv_config.block_size
        width = max(1, cdiv(max_model_len, bs))
        rows = torch.arange(size, **i64)
        for group in kv_config.groups:
            spec = group.spec
            if isinstance(spec, StateSpec):
                self.groups.append(_Group(None, StateMetadata(
                    page_ids=torch.full((size, group.pages_per_state), -1, **i64),
                    cu_seqlens=torch.arange(size + 1, **i64),
                    has_initial_state=torch.zeros(size, dtype=torch.bool, device=device),
                    all_decode=True, any_initial_state=True)))
                continue
            window = spec.window if isinstance(spec, SlidingWindowSpec) else None
            starts = window or isinstance(spec, ChunkedLocalAttentionSpec)  # a first key > 0
            self.groups.append(_Group(AttentionMetadata(
                slot_mapping=torch.full((size,), -1, **i64), decode_tok=rows,
                decode_tables=torch.zeros((size, width), **i64),
                decode_seq_lens=torch.zeros(size, **i64),
                decode_kv_start=torch.zeros(size, **i64) if starts else None,
                block_size=bs, sliding_window=window, all_decode=True), None))

    def fill(self, input_ids: torch.Tensor, positions: torch.Tensor,
             attn_meta: list[AttentionMetadata | None],
             state_meta: list[StateMetadata | None]) -> None:
        """Copy an all-decode step of ``n <= size`` rows in; rows ``n..`` become padding."""
        n = input_ids.shape[0]
        if n > self.size:
            raise ValueError(f"{n} rows do not fit a bucket of {self.size}")
        self.input_ids[:n].copy_(input_ids, non_blocking=True)
        self.input_ids[n:].zero_()
        self.positions[:n].copy_(positions, non_blocking=True)
        self.positions[n:].zero_()
        for g, am, sm in zip(self.groups, attn_meta, state_meta):
            if g.attn is not None:
                a = g.attn
                if am is None or not am.all_decode or am.prefills:
                    raise ValueError("CUDA-graph steps are decode-only")
                a.slot_mapping[:n].copy_(am.slot_mapping, non_blocking=True)
                a.slot_mapping[n:].fill_(-1)
                w = am.decode_tables.shape[1]
                if w > a.decode_tables.shape[1]:
                    raise ValueError("block table wider than max_model_len allows")
                a.decode_tables[:n, :w].copy_(am.decode_tables, non_blocking=True)
                a.decode_tables[:n, w:].zero_()
                a.decode_tables[n:].zero_()
                a.decode_seq_lens[:n].copy_(am.decode_seq_lens, non_blocking=True)
                a.decode_seq_lens[n:].zero_()
                if a.decode_kv_start is not None:
                    a.decode_kv_start[:n].copy_(am.decode_kv_start, non_blocking=True)
                    a.decode_kv_start[n:].zero_()
            else:
                s = g.state
                s.page_ids[:n].copy_(sm.page_ids, non_blocking=True)
                s.page_ids[n:].fill_(-1)
                s.has_initial_state[:n].copy_(sm.has_initial_state, non_blocking=True)
                s.has_initial_state[n:].zero_()
                # cu_seqlens stays arange(size + 1): one token per row, padding included.

    def clear(self) -> None:
        """Every row padding: a forward over the batch then reads and writes no cache."""
        self.input_ids.zero_()
        self.positions.zero_()
        for g in self.groups:
            if g.attn is not None:
                g.attn.slot_mapping.fill_(-1)
                g.attn.decode_seq_lens.zero_()
            else:
                g.state.page_ids.fill_(-1)
                g.state.has_initial_state.zero_()

    def context(self, cache) -> ForwardContext:
        return ForwardContext(cache, [g.attn for g in self.groups],
                              [g.state for g in self.groups])


class DecodeGraphs:
    """Captured decode forwards per bucket; :meth:`run` returns the hidden states of the
    step's rows, or None when the step does not qualify (then the caller runs eagerly).

    ``capture=False`` runs the padded static step eagerly (CPU tests, debugging)."""

    def __init__(self, model: torch.nn.Module, cache, kv_config: KVCacheConfig,
                 max_batch: int, max_model_len: int, device: torch.device,
                 capture: bool | None = None) -> None:
        self.model = model
        self.cache = cache
        self.sizes = capture_sizes(max_batch)
        self.capture = device.type == "cuda" if capture is None else capture
        self.batches = {s: StaticBatch(kv_config, s, max_model_len, device)
                        for s in self.sizes}
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self._pool = None

    def _capture(self, size: int) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
        """Warm up and capture over an all-padding batch: no cache byte changes (warm-up
        forwards really run, so real rows there would advance their states)."""
        sb = self.batches[size]
        sb.clear()
        ctx = sb.context(self.cache)
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):  # warm-up: Triton compiles, allocator settles
            for _ in range(2):
                self.model(sb.input_ids, sb.positions, ctx)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool):
            out = self.model(sb.input_ids, sb.positions, ctx)
        self._pool = graph.pool()
        return graph, out

    def capture_all(self) -> None:
        """Capture every bucket, largest first (smaller ones reuse its memory pool). Padding
        rows write nothing, so capturing over the live pool changes no cache content."""
        if not self.capture:
            return
        for size in sorted(self.sizes, reverse=True):
            self.graphs[size] = self._capture(size)

    @torch.inference_mode()
    def run(self, input_ids: torch.Tensor, positions: torch.Tensor,
            attn_meta: list[AttentionMetadata | None],
            state_meta: list[StateMetadata | None]) -> torch.Tensor | None:
        n = input_ids.shape[0]
        size = bucket_for(n, self.sizes)
        if size is None or any(m is not None and (not m.all_decode or m.prefills)
                               for m in attn_meta) or any(
                                   m is not None and not m.all_decode for m in state_meta):
            return None
        sb = self.batches[size]
        if self.capture and size not in self.graphs:
            self.graphs[size] = self._capture(size)
        sb.fill(input_ids, positions, attn_meta, state_meta)
        if not self.capture:
            return self.model(sb.input_ids, sb.positions, sb.context(self.cache))[:n]
        graph, out = self.graphs[size]
        graph.replay()
        return out[:n]
