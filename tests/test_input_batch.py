"""The small decode step's inputs (``input_batch._small_decode``, built from Python lists)
equal the general path's (numpy) for every kind of cache group."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from pagefold.core.kv_cache_planner import CacheGroup, KVCacheConfig
from pagefold.core.kv_cache_spec import (
    ChunkedLocalAttentionSpec,
    FullAttentionSpec,
    SlidingWindowSpec,
    StateComponent,
    StateSpec,
)
from pagefold.executor import input_batch
from pagefold.executor.input_batch import build_inputs

BS = 4
STATE = StateSpec("gdn", (StateComponent("conv", (8, 3), torch.bfloat16),))
CONFIG = KVCacheConfig(BS, 256, 1, 64, (
    CacheGroup(FullAttentionSpec(2, 8, torch.bfloat16), ("a",)),
    CacheGroup(STATE, ("s0",), pages_per_state=3),
    CacheGroup(SlidingWindowSpec(2, 8, torch.bfloat16, 5), ("w",)),
    CacheGroup(STATE, ("s1",), pages_per_state=3),
    CacheGroup(ChunkedLocalAttentionSpec(2, 8, torch.bfloat16, 6), ("c",)),
))


def _same(a, b, where: str) -> None:
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor), where
        assert (a.dtype, a.shape, a.tolist()) == (b.dtype, b.shape, b.tolist()), where
    elif dataclasses.is_dataclass(a):
        assert type(a) is type(b), where
        for f in dataclasses.fields(a):
            _same(getattr(a, f.name), getattr(b, f.name), f"{where}.{f.name}")
    elif isinstance(a, list):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            _same(x, y, f"{where}[{i}]")
    else:
        assert a == b, where


# (position of the new token, its table length in the attention groups, sampled)
@pytest.mark.parametrize("rows", [
    [(9, 3, True)],
    [(0, 1, True), (13, 4, False), (6, 2, True)],  # a fresh state; a row not sampled
    [(4, 2, True), (23, 6, True)],  # tables of two widths (padded with the null block)
])
def test_small_decode_inputs_equal_the_general_path(rows, monkeypatch):
    starts = [p for p, _, _ in rows]
    tokens = [[100 + i] for i in range(len(rows))]
    totals = [p + 1 if sampled else p + 3 for p, _, sampled in rows]
    tables = []
    for g in CONFIG.groups:
        if isinstance(g.spec, StateSpec):
            tables.append([[10 * i + j + 1 for j in range(3)] for i in range(len(rows))])
        else:
            tables.append([[50 + 7 * i + j for j in range(n)] for i, (_, n, _) in
                           enumerate(rows)])
    args = (CONFIG, tokens, starts, [1] * len(rows), totals, tables)
    small = build_inputs(*args)
    monkeypatch.setattr(input_batch, "SMALL_DECODE_ROWS", 0)
    general = build_inputs(*args)
    _same(small, general, "inputs")
    assert small.sample_req_idx == [i for i, r in enumerate(rows) if r[2]]


@pytest.mark.parametrize("starts", [
    [9],
    [3, 11, 7],  # row 0 crosses into its second block; row 2 past the window's reach
    [5, 17],  # row 1 crosses the chunked group's chunk start (18 % 6 == 0)
])
def test_advanced_decode_inputs_equal_the_next_steps_built_anew(starts):
    """A decode burst's later forwards: the inputs advanced in place are the next step's as
    built from scratch, at the same addresses (so lookups made from them stay valid)."""
    n = len(starts)
    tables = []
    for g in CONFIG.groups:
        if isinstance(g.spec, StateSpec):
            tables.append([[10 * i + j + 1 for j in range(3)] for i in range(n)])
        else:  # room for the next position
            tables.append([[50 + 7 * i + j for j in range(s // BS + 2)]
                           for i, s in enumerate(starts)])
    first = build_inputs(CONFIG, [[100 + i] for i in range(n)], starts, [1] * n,
                         [s + 1 for s in starts], tables)
    assert input_batch.can_advance(first, n)
    for m in first.attn_meta:  # views the torch path builds on first use must not survive
        if m is not None:
            m.blockwise()
    ptrs = [t.data_ptr() for t in (first.input_ids, first.positions)] + [
        m.slot_mapping.data_ptr() for m in first.attn_meta if m is not None]
    nxt = [s + 1 for s in starts]
    input_batch.advance_small_decode(first, CONFIG, [200 + i for i in range(n)], nxt, tables)
    fresh = build_inputs(CONFIG, [[200 + i] for i in range(n)], nxt, [1] * n,
                         [s + 1 for s in nxt], tables)
    _same(first, fresh, "advanced")
    assert ptrs == [t.data_ptr() for t in (first.input_ids, first.positions)] + [
        m.slot_mapping.data_ptr() for m in first.attn_meta if m is not None]


def test_inputs_that_cannot_be_advanced_are_refused():
    starts = [9, 2]
    tables = [[[1, 2, 3], [4, 5, 6]] if isinstance(g.spec, StateSpec) else [[1, 2, 3], [4]]
              for g in CONFIG.groups]
    one_unsampled = build_inputs(CONFIG, [[1], [2]], starts, [1, 1], [10, 9], tables)
    assert not input_batch.can_advance(one_unsampled, 2)
    prefill = build_inputs(CONFIG, [[1], [2, 3]], starts, [1, 2], [10, 4], tables)
    assert not input_batch.can_advance(prefill, 2)
    assert input_batch.can_advance(build_inputs(CONFIG, [[1], [2]], starts, [1, 1], [10, 3],
                                                tables), 2)
