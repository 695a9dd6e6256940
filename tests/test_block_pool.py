"""BlockPool, the per-group managers and the all-or-nothing KVCacheManager, with no model."""

from __future__ import annotations

import time

import pytest
import torch

from pagefold.core.block_pool import BlockPool
from pagefold.core.kv_cache_manager import KVCacheManager
from pagefold.core.kv_cache_planner import plan_pagefold
from pagefold.core.kv_cache_spec import (
    ChunkedLocalAttentionSpec,
    FullAttentionSpec,
    SlidingWindowSpec,
    StateComponent,
    StateSpec,
)
from pagefold.core.managers import (
    ChunkedLocalManager,
    FullAttentionManager,
    SlidingWindowManager,
    StateManager,
)
from pagefold.request import Request
from pagefold.sampling_params import SamplingParams

BS = 4
ATTN = FullAttentionSpec(num_kv_heads=2, head_dim=8, dtype=torch.float32)  # 512 B per page
SWA = SlidingWindowSpec(num_kv_heads=2, head_dim=8, dtype=torch.float32, window=6)
# 2 KiB + 32 B of state: 5 pages of 512 B (the last one partly used).
STATE = StateSpec("gdn", (StateComponent("conv", (4, 2), torch.float32),
                          StateComponent("ssm", (2, 16, 16), torch.float32)))


def _config(specs: dict, num_blocks: int):
    page = ATTN.page_bytes(BS)
    probe = plan_pagefold(specs, BS, page)
    return plan_pagefold(specs, BS, num_blocks * probe.layers_per_group * page)


def _req(rid: str, n_prompt: int) -> Request:
    return Request(rid, list(range(10, 10 + n_prompt)), SamplingParams(max_tokens=4))


# ---------------------------------------------------------------------------------- BlockPool
def test_allocate_free_touch_refcounts():
    pool = BlockPool(6)
    assert pool.num_usable == 5 and pool.num_free == 5
    a = pool.allocate(3)
    assert [b.ref_cnt for b in a] == [1, 1, 1] and pool.num_free == 2
    pool.touch(a[:2])  # a second holder
    assert [b.ref_cnt for b in a] == [2, 2, 1]
    pool.free(a)
    assert [b.ref_cnt for b in a] == [1, 1, 0] and pool.num_free == 3
    with pytest.raises(AssertionError, match="still referenced"):
        pool.check_whole()
    pool.free(a[:2])
    assert pool.num_free == 5
    pool.check_whole()
    with pytest.raises(AssertionError, match="freed twice"):
        pool.free(a[:1])


def test_null_block_never_handed_out():
    pool = BlockPool(5)
    got = pool.allocate(4)
    assert 0 not in {b.block_id for b in got}
    with pytest.raises(RuntimeError, match="only 0 free"):
        pool.allocate(1)
    pool.free([pool.null_block, *got, pool.null_block])  # the null block is ignored
    assert pool.null_block.ref_cnt == 1
    pool.check_whole()
    again = pool.allocate(4)
    assert 0 not in {b.block_id for b in again}
    with pytest.raises(ValueError, match="at least 2 blocks"):
        BlockPool(1)


def test_cached_blocks_stay_free_until_evicted():
    pool = BlockPool(6)
    a = pool.allocate(5)
    for i, blk in enumerate(a[:3]):
        pool.cache_block(blk, ("h", i))
    pool.free(list(reversed(a)))
    # Cached content does not keep blocks from counting as free.
    assert pool.num_free == 5
    pool.check_whole()
    assert [pool.lookup(("h", i)) for i in range(3)] == a[:3]
    # Plain free blocks go first: nothing cached is evicted while they last.
    plain = pool.allocate(2)
    assert {b.block_id for b in plain} == {a[3].block_id, a[4].block_id}
    assert pool.num_evictions == 0 and all(pool.lookup(("h", i)) for i in range(3))
    # Then cached blocks are evicted: the content is forgotten and the block handed out.
    got = pool.allocate(1)[0]
    assert got in a[:3] and got.block_hash is None and pool.num_evictions == 1
    assert sum(pool.lookup(("h", i)) is None for i in range(3)) == 1
    # A prefix hit on a free cached block takes it out of the free set; held, it never evicts.
    survivor = next(b for b in a[:3] if b is not got)
    key = survivor.block_hash
    pool.touch([survivor])
    assert survivor.ref_cnt == 1 and pool.num_free == 1
    last = pool.allocate(1)[0]
    assert last is not survivor and pool.lookup(key) is survivor
    with pytest.raises(RuntimeError):
        pool.allocate(1)
    pool.free([*plain, got, survivor, last])
    pool.check_whole()


def test_multi_page_entries_become_evictable_at_their_last_release():
    """Two checkpoints' pages released in one call, interleaved: each entry turns evictable
    once, when its last page is released, and (scores equal) entries are evicted in the order
    they turned evictable; a page still held keeps its whole entry out of eviction."""
    pool = BlockPool(10)
    a, b = pool.allocate(3), pool.allocate(3)
    pool.cache(("ckpt", "a"), a, 48, is_checkpoint=True)
    pool.cache(("ckpt", "b"), b, 48, is_checkpoint=True)
    pool.free([a[0], b[0], b[1], b[2], a[1], a[2]])  # "b" complete before "a"
    assert pool.entry(("ckpt", "a")).evictable and pool.entry(("ckpt", "b")).evictable
    assert pool.num_free == 9
    pool.check_whole()
    taken = pool.allocate(3 + 1)  # the plain blocks, then one whole entry: "b", evictable first
    assert pool.entry(("ckpt", "b")) is None and pool.entry(("ckpt", "a")) is not None

    c = pool.allocate(2)  # evicts "a" (b's pages left over first)
    pool.cache(("ckpt", "c"), c, 32, is_checkpoint=True)
    pool.touch(c[:1])
    pool.free(c)
    assert not pool.entry(("ckpt", "c")).evictable  # c[0] still held
    pool.free(c[:1])
    assert pool.entry(("ckpt", "c")).evictable
    pool.free(taken)
    pool.check_whole()


def test_cache_block_first_writer_wins_and_reset():
    pool = BlockPool(4)
    a, b = pool.allocate(2)
    pool.cache_block(a, "x")
    pool.cache_block(b, "x")
    assert pool.lookup("x") is a and b.block_hash is None
    pool.free([a, b])
    pool.reset_prefix_cache()
    assert pool.lookup("x") is None and a.block_hash is None
    assert pool.num_free == 3
    pool.check_whole()


def test_removal_from_middle_of_free_queue_is_constant_time():
    """touch() on a free block in the middle of a big queue must not scan the queue."""
    n = 200_000
    pool = BlockPool(n)
    middle = [pool.blocks[i] for i in range(n // 2, n // 2 + 5000)]
    t0 = time.perf_counter()
    for blk in middle:
        pool.touch([blk])
    for blk in middle:
        pool.free([blk])
    # Cached free blocks too: a prefix hit takes them out of the eviction order.
    held = pool.allocate(5000)
    for i, blk in enumerate(held):
        pool.cache_block(blk, ("k", i))
    pool.free(held)
    for blk in held:
        pool.touch([blk])
    pool.free(held)
    elapsed = time.perf_counter() - t0
    # A list-based queue needs ~n/2 steps per removal (minutes here); a dict, microseconds.
    assert elapsed < 3.0, elapsed
    pool.check_whole()


# ---------------------------------------------------------------------------------- managers
def test_full_attention_manager_grows_block_by_block():
    cfg = _config({"layers.0": ATTN}, 12)
    kv = KVCacheManager(cfg)
    (m,) = kv.managers
    assert isinstance(m, FullAttentionManager)
    r = _req("a", 9)
    assert kv.blocks_needed(r, 9) == 3
    assert kv.allocate_slots(r, 9)
    assert len(kv.block_ids("a")[0]) == 3
    r.num_computed_tokens = 9
    assert kv.blocks_needed(r, 3) == 0  # tokens 9..11 fit in the third block
    assert kv.blocks_needed(r, 4) == 1
    assert kv.allocate_slots(r, 4) and len(kv.block_ids("a")[0]) == 4
    kv.free(r)
    kv.check_whole()


def test_sliding_window_manager_frees_blocks_outside_window():
    cfg = _config({"layers.0": SWA}, 12)
    kv = KVCacheManager(cfg)
    (m,) = kv.managers
    assert isinstance(m, SlidingWindowManager)
    r = _req("a", 16)
    assert kv.allocate_slots(r, 16)
    ids = kv.block_ids("a")[0]
    assert len(ids) == 4 and kv.pool.num_free == 11 - 4
    r.num_computed_tokens = 16
    # The next query (position 16) reads keys 11..16: blocks 0 and 1 (tokens 0..7) are dead.
    assert kv.blocks_needed(r, 1) == 1 - 2
    assert kv.allocate_slots(r, 1)
    after = kv.block_ids("a")[0]
    assert after[:2] == [0, 0]  # null block keeps logical indices stable
    assert after[2:4] == ids[2:4] and len(after) == 5
    assert kv.pool.num_free == 11 - 3
    kv.free(r)
    kv.check_whole()


def test_chunked_local_manager_frees_blocks_before_the_current_chunk():
    """Chunk 10, blocks of 4: a query at position p reads keys from p - p % 10 on."""
    local = ChunkedLocalAttentionSpec(num_kv_heads=2, head_dim=8, dtype=torch.float32, chunk=10)
    kv = KVCacheManager(_config({"layers.0": local}, 12))
    (m,) = kv.managers
    assert isinstance(m, ChunkedLocalManager)
    r = _req("a", 19)
    assert kv.allocate_slots(r, 19)
    ids = kv.block_ids("a")[0]
    assert len(ids) == 5 and kv.pool.num_free == 11 - 5
    r.num_computed_tokens = 19
    # The next query (19) is in chunk 10..19: block 2 (tokens 8..11) holds keys 10 and 11,
    # blocks 0 and 1 (tokens 0..7) are dead.
    assert kv.blocks_needed(r, 1) == 0 - 2
    assert kv.allocate_slots(r, 1)
    after = kv.block_ids("a")[0]
    assert after[:2] == [0, 0] and after[2:] == ids[2:]
    r.num_computed_tokens = 20
    # Position 20 opens chunk 20..29: every block before token 20 (blocks 2..4) is dead (a
    # sliding window of 10 would still keep blocks 2..4).
    assert kv.blocks_needed(r, 1) == 1 - 3
    assert kv.allocate_slots(r, 1)
    after = kv.block_ids("a")[0]
    assert after[:5] == [0] * 5 and len(after) == 6
    assert kv.pool.num_free == 11 - 1
    kv.free(r)
    kv.check_whole()


def test_state_manager_takes_pages_per_state_once():
    cfg = _config({"layers.0": ATTN, "layers.1": STATE}, 40)
    state_group = cfg.groups[1]
    assert state_group.pages_per_state == 5
    kv = KVCacheManager(cfg)
    assert isinstance(kv.managers[1], StateManager)
    r = _req("a", 5)
    assert kv.blocks_needed(r, 5) == 2 + 5
    assert kv.allocate_slots(r, 5)
    assert len(kv.block_ids("a")[1]) == 5
    r.num_computed_tokens = 5
    assert kv.blocks_needed(r, 100) == 27 - 2  # only attention grows (105 tokens)
    assert kv.allocate_slots(r, 3)
    assert len(kv.block_ids("a")[1]) == 5
    kv.free(r)
    kv.check_whole()


def test_allocation_is_all_or_nothing_across_groups():
    cfg = _config({"layers.0": ATTN, "layers.1": STATE}, 12)  # 11 usable
    kv = KVCacheManager(cfg)
    r = _req("a", 28)  # 7 attention pages + 5 state pages = 12 > 11
    assert not kv.allocate_slots(r, 28)
    assert kv.block_ids("a") == [[], []] and kv.pool.num_free == 11
    assert kv.allocate_slots(r, 24)  # 6 + 5 fits exactly
    assert kv.pool.num_free == 0
    kv.free(r)
    kv.check_whole()


def test_min_blocks_for_counts_every_group():
    cfg = _config({"layers.0": ATTN, "layers.1": STATE}, 40)
    kv = KVCacheManager(cfg)
    assert kv.min_blocks_for(17) == 5 + 5
    kv.check_whole()  # the probe left nothing behind
