"""Mixed tensor parallelism for transferred pages: a consumer rank's shard of a page, assembled
from the producer ranks' shards.

Everything follows from the specs' ``TPSplit`` (``core.kv_cache_spec``): an attention page
``[block_size, 2, heads, head_dim]`` is cut along its head axis (KV heads fewer than ranks are
replicated), a state component along its split axis in row blocks (GDN's conv channels
``q | k | v``, Mamba-2's ``x | B | C``, the SSM by heads). For one block of the full axis,
rank ``r`` of ``tp`` holds the full range ``[pick * size, (pick + 1) * size)`` with
``parts = min(units, tp)``, ``size = full / parts``, ``pick = r * parts // tp``. A consumer
rank's range of a block is covered by the producer ranks' ranges (each either equal to or
disjoint from another: parts are aligned), so its bytes are copies of producer bytes, nothing
computed: the reshard is byte-exact. MLA's latent page ``[block_size, latent]`` is replicated
(every rank keeps it whole: one block whose unit is its extent). A spec without a split is not
reshardable: ``why_not`` says so and the caller refuses the transfer.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from pagefold.core.kv_cache_spec import (
    LayerSpec,
    MLASpec,
    StateSpec,
    TPSplit,
    dtype_size,
    is_attention,
)


@dataclass(frozen=True)
class Copy:
    """``length`` entries along the split axis: producer rank ``src_rank``'s ``[src, src +
    length)`` to the consumer's ``[dst, dst + length)`` (per-rank axis coordinates)."""

    src_rank: int
    src: int
    dst: int
    length: int


def rank_range(full: int, unit: int, tp: int, rank: int) -> tuple[int, int]:
    """(start in the full block, extent) that rank ``rank`` of ``tp`` holds of one block."""
    units = full // unit
    parts = min(units, tp)
    if full % unit or tp % parts or units % parts:
        raise ValueError(f"a block of {full} entries in units of {unit} cannot be cut over "
                         f"{tp} ranks")
    size = full // parts
    return rank * parts // tp * size, size


def axis_copies(split: TPSplit, src_tp: int, dst_tp: int, dst_rank: int) -> list[Copy]:
    """The copies that build rank ``dst_rank`` of ``dst_tp``'s axis from ranks of ``src_tp``
    (of a replicated range, the lowest producer rank holding it is read)."""
    copies: list[Copy] = []
    src_base = dst_base = 0
    for full, unit in split.blocks:
        d0, dn = rank_range(full, unit, dst_tp, dst_rank)
        held: dict[int, tuple[int, int]] = {}  # start in the block -> (rank, extent)
        for r in range(src_tp):
            start, n = rank_range(full, unit, src_tp, r)
            held.setdefault(start, (r, n))
        for start, (r, n) in sorted(held.items()):
            lo, hi = max(start, d0), min(start + n, d0 + dn)
            if lo < hi:
                copies.append(Copy(r, src_base + lo - start, dst_base + lo - d0, hi - lo))
        src_base += rank_range(full, unit, src_tp, 0)[1]
        dst_base += dn
    return copies


def rank_extent(split: TPSplit, tp: int) -> int:
    """One rank's extent along ``split.axis`` at ``tp`` ranks."""
    return sum(rank_range(full, unit, tp, 0)[1] for full, unit in split.blocks)


def spec_at(spec: LayerSpec, tp: int) -> LayerSpec:
    """``spec`` (one rank's, reshardable: ``why_not`` is None) as one rank of ``tp`` has it:
    the split axes resized, everything else (dtypes, order, alignment) the same."""
    if isinstance(spec, StateSpec):
        comps = []
        for c in spec.components:
            shape = list(c.shape)
            shape[c.split.axis] = rank_extent(c.split, tp)
            comps.append(dataclasses.replace(c, shape=tuple(shape)))
        return dataclasses.replace(spec, components=tuple(comps))
    if isinstance(spec, MLASpec):
        return dataclasses.replace(spec, latent_dim=rank_extent(spec.split, tp))
    return dataclasses.replace(spec, num_kv_heads=rank_extent(spec.split, tp))


def source_ranks(spec: LayerSpec, src_tp: int, dst_tp: int, dst_rank: int) -> list[int]:
    """The producer ranks whose shards rank ``dst_rank`` reads for pages of ``spec``."""
    splits = [spec.split] if is_attention(spec) else [c.split for c in spec.components]
    return sorted({c.src_rank for s in splits for c in axis_copies(s, src_tp, dst_tp, dst_rank)})


def why_not(spec: LayerSpec, src_tp: int, dst_tp: int) -> str | None:
    """None when pages of ``spec`` can be resharded from ``src_tp`` to ``dst_tp`` ranks, else
    why not (a spec kind or component without a split, a block that does not cut)."""
    if isinstance(spec, StateSpec):
        splits = [(c.name, c.split) for c in spec.components]
    elif is_attention(spec):
        splits = [("latent" if isinstance(spec, MLASpec) else "heads", spec.split)]
    else:
        return f"{type(spec).__name__} pages have no tensor-parallel split"
    for name, split in splits:
        if split is None:
            return f"{spec.manager_kind} component {name!r} has no tensor-parallel split"
        try:
            for r in range(dst_tp):
                axis_copies(split, src_tp, dst_tp, r)
        except ValueError as e:
            return str(e)
    return None


def _apply(src: dict[int, torch.Tensor], dst: torch.Tensor, axis: int,
           copies: list[Copy]) -> None:
    for c in copies:
        dst.narrow(axis, c.dst, c.length).copy_(src[c.src_rank].narrow(axis, c.src, c.length))


def _bytes_axis(t: torch.Tensor, shape: tuple[int, ...], dtype: torch.dtype, axis: int,
                copies: list[Copy]) -> tuple[torch.Tensor, list[Copy]]:
    """``t`` (uint8, ``(n, prod(shape) * size)``) as ``(n, *shape[:-1], shape[-1] * size)``
    uint8, and the copies in that view's units (the last axis counts bytes)."""
    size = dtype_size(dtype)
    view = t.view(t.shape[0], *shape[:-1], shape[-1] * size)  # a view: writes land in ``t``
    if axis == len(shape) - 1:
        copies = [Copy(c.src_rank, c.src * size, c.dst * size, c.length * size) for c in copies]
    return view, copies


def reshard_rows(src_spec: LayerSpec, dst_spec: LayerSpec, block_size: int,
                 src: dict[int, torch.Tensor], dst_page_bytes: int, dst_pages: int,
                 src_tp: int, dst_tp: int, dst_rank: int, states: int = 1) -> torch.Tensor:
    """Rank ``dst_rank``'s rows ``(dst_pages, dst_page_bytes)`` uint8 of one layer's pages,
    from ``src``: producer rank -> its rows ``(P, B)`` uint8 of the same pages (one
    attention block per row, or ``states`` whole states, one after another). Bytes no
    component covers (alignment, page padding) are zero."""
    out = torch.zeros(dst_pages, dst_page_bytes, dtype=torch.uint8)
    if is_attention(src_spec):
        n = dst_pages  # one block per row on both sides
        shape_s, shape_d = src_spec.page_shape(block_size), dst_spec.page_shape(block_size)
        parts = [(0, 0, shape_s, shape_d, src_spec.dtype, src_spec.split)]
        flat_s = {r: t.reshape(n, -1) for r, t in src.items()}
        flat_d = out.reshape(n, -1)
    else:
        flat_s = {r: t.reshape(states, -1) for r, t in src.items()}
        flat_d = out.reshape(states, -1)
        parts = [(so, do, cs.shape, cd.shape, cs.dtype, cs.split)
                 for cs, cd, so, do in zip(src_spec.components, dst_spec.components,
                                           src_spec.offsets, dst_spec.offsets, strict=True)]
    for so, do, shape_s, shape_d, dtype, split in parts:
        nbytes_s = int(torch.Size(shape_s).numel()) * dtype_size(dtype)
        nbytes_d = int(torch.Size(shape_d).numel()) * dtype_size(dtype)
        copies = axis_copies(split, src_tp, dst_tp, dst_rank)
        views = {}
        for r in {c.src_rank for c in copies}:
            views[r], _ = _bytes_axis(flat_s[r][:, so:so + nbytes_s].contiguous(), shape_s, dtype,
                                      split.axis, [])
        dst_view, copies = _bytes_axis(flat_d[:, do:do + nbytes_d], shape_d, dtype,
                                       split.axis, copies)
        _apply(views, dst_view, split.axis + 1, copies)
    return out
